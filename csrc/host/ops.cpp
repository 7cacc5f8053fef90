// Op schemas and their registration, through the stable ABI (STABLE_TORCH_LIBRARY): the library then loads into
// any torch from 2.11 on. The CPU registrations exist to reject CPU tensors with a message that names the argument.
// plan and compiled_kernels take no tensors; CompositeExplicitAutograd serves every device and none. Autograd comes
// from csrc/autograd/ or Python, and the fake implementations from Python (flash_attn_cuda/_ops.py).
#include <torch/csrc/stable/library.h>

#include "launch/kernel_registry.h"
#include "host/ops.h"

STABLE_TORCH_LIBRARY(flash_attn2, m) {
    m.def("fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, bool deterministic=False, "
          "int num_splits=0, str plan_override=\"\", "
          "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor out, Tensor softmax_lse)");
    m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, float softmax_scale, "
          "bool causal, bool deterministic=False, str plan_override=\"\", "
          "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)");
    m.def("varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
          "int max_seqlen_k, float softmax_scale, bool causal, bool deterministic=False, str plan_override=\"\", "
          "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor out, Tensor softmax_lse)");
    m.def("varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
          "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
          "bool causal, bool deterministic=False, str plan_override=\"\", "
          "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)");
    m.def("plan(str pass_name, int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_k, int head_dim, "
          "bool causal=False, bool deterministic=False, bool varlen=False, int num_splits=0, "
          "str plan_override=\"\", int arch=-1, int num_sms=-1, bool is_bf16=True, int window_left=-1, "
          "int window_right=-1, bool alibi=False, bool dropout=False, float softcap=0.0, bool kvcache=False, "
          "bool paged=False) -> str");
    m.def("fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, Tensor? v=None, "
          "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? cache_seqlens=None, Tensor? cache_batch_idx=None, "
          "Tensor? cache_leftpad=None, Tensor? block_table=None, float softmax_scale=1.0, bool causal=False, "
          "int window_left=-1, int window_right=-1, float softcap=0.0, bool rotary_interleaved=True, "
          "Tensor? alibi_slopes=None, int num_splits=0, str plan_override=\"\") -> (Tensor out, Tensor softmax_lse)");
    m.def("varlen_fwd_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
          "int max_seqlen_q, int max_seqlen_k, Tensor block_table, float softmax_scale, bool causal, "
          "str plan_override=\"\", int window_left=-1, int window_right=-1, float softcap=0.0, "
          "Tensor? alibi_slopes=None) -> (Tensor out, Tensor softmax_lse)");
    m.def("compiled_kernels() -> str[]");
}

STABLE_TORCH_LIBRARY_IMPL(flash_attn2, CUDA, m) {
    m.impl("fwd", TORCH_BOX(&flash::fwd));
    m.impl("fwd_kvcache", TORCH_BOX(&flash::fwd_kvcache));
    m.impl("varlen_fwd_paged", TORCH_BOX(&flash::varlen_fwd_paged));
    m.impl("bwd", TORCH_BOX(&flash::bwd));
    m.impl("varlen_fwd", TORCH_BOX(&flash::varlen_fwd));
    m.impl("varlen_bwd", TORCH_BOX(&flash::varlen_bwd));
}

STABLE_TORCH_LIBRARY_IMPL(flash_attn2, CPU, m) {
    m.impl("fwd", TORCH_BOX(&flash::fwd));
    m.impl("fwd_kvcache", TORCH_BOX(&flash::fwd_kvcache));
    m.impl("varlen_fwd_paged", TORCH_BOX(&flash::varlen_fwd_paged));
    m.impl("bwd", TORCH_BOX(&flash::bwd));
    m.impl("varlen_fwd", TORCH_BOX(&flash::varlen_fwd));
    m.impl("varlen_bwd", TORCH_BOX(&flash::varlen_bwd));
}

STABLE_TORCH_LIBRARY_IMPL(flash_attn2, CompositeExplicitAutograd, m) {
    m.impl("plan", TORCH_BOX(&flash::plan_op));
    m.impl("compiled_kernels", TORCH_BOX(&flash::compiled_kernels));
}
