// The ops' C++ implementations (fwd.cpp, bwd.cpp, plan_op.cpp), registered in ops.cpp. Autograd of fwd and
// varlen_fwd is not here: the stable ABI has none (csrc/autograd/ and flash_attn_cuda/_ops.py provide it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "host/torch_glue.h"

namespace flash {

std::tuple<Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, double softmax_scale, bool causal,
                               bool deterministic, int64_t num_splits, const std::string& plan_override, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<Tensor>& alibi_slopes, double dropout_p, const std::optional<Tensor>& rng_state);

std::tuple<Tensor, Tensor> varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                                      const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                      double softmax_scale, bool causal, bool deterministic,
                                      const std::string& plan_override, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<Tensor>& alibi_slopes, double dropout_p, const std::optional<Tensor>& rng_state);

// flash_attn_with_kvcache: appends k and v to the caches in place (rotating k, and q, with rotary_cos/sin), then
// attends over the caches. block_table: paged caches.
std::tuple<Tensor, Tensor> fwd_kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                       const std::optional<Tensor>& k, const std::optional<Tensor>& v,
                                       const std::optional<Tensor>& rotary_cos, const std::optional<Tensor>& rotary_sin,
                                       const std::optional<Tensor>& cache_seqlens,
                                       const std::optional<Tensor>& cache_batch_idx,
                                       const std::optional<Tensor>& cache_leftpad,
                                       const std::optional<Tensor>& block_table, double softmax_scale, bool causal,
                                       int64_t window_left, int64_t window_right, double softcap,
                                       bool rotary_interleaved, const std::optional<Tensor>& alibi_slopes,
                                       int64_t num_splits, const std::string& plan_override);

// flash_attn_varlen_func with block_table: varlen queries against paged caches (forward only).
std::tuple<Tensor, Tensor> varlen_fwd_paged(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                            const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                            int64_t max_seqlen_q, int64_t max_seqlen_k, const Tensor& block_table,
                                            double softmax_scale, bool causal, const std::string& plan_override,
                                            int64_t window_left, int64_t window_right, double softcap,
                                            const std::optional<Tensor>& alibi_slopes);

std::tuple<Tensor, Tensor, Tensor> bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& softmax_lse, double softmax_scale, bool causal,
                                       bool deterministic, const std::string& plan_override, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<Tensor>& alibi_slopes, double dropout_p, const std::optional<Tensor>& rng_state);

std::tuple<Tensor, Tensor, Tensor> varlen_bwd(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& out, const Tensor& softmax_lse, const Tensor& cu_seqlens_q,
                                              const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                              double softmax_scale, bool causal, bool deterministic,
                                              const std::string& plan_override, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<Tensor>& alibi_slopes, double dropout_p, const std::optional<Tensor>& rng_state);

// torch.ops.flash_attn2.plan: the plan of one pass for these sizes and variants, as to_string(Plan) writes it.
std::string plan_op(const std::string& pass_name, int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t nheads,
                    int64_t nheads_k, int64_t head_dim, bool causal, bool deterministic, bool varlen,
                    int64_t num_splits, const std::string& plan_override, int64_t arch, int64_t num_sms, bool is_bf16,
                    int64_t window_left, int64_t window_right, bool alibi, bool dropout, double softcap,
                    bool kvcache, bool paged);

}  // namespace flash
