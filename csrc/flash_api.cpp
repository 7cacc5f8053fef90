// Torch binding: op schemas, input validation, FwdParams filling and kernel dispatch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "flash_params.h"
#include "flash_bwd_aux.h"
#include "flash_fwd_combine.h"
#include "fwd_tile_config.h"
#include "kernel_registry.h"

namespace flash {
namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGridZ = 65535;  // heads index the grid's z; batches of any size go in chunks (launch.h)

// Numbers in error messages go through std::to_string rather than a stream: streaming integers from an
// extension built with a newer GCC than the process's libstdc++ crashed on the H200 machine (torch 2.11).
std::string num(int64_t value) { return std::to_string(value); }

std::string shape_str(at::IntArrayRef values) {
    std::string text = "[";
    for (size_t i = 0; i < values.size(); ++i) { text += (i ? ", " : "") + num(values[i]); }
    return text + "]";
}

// The smallest compiled-in kernel head dim that holds head_dim.
int kernel_head_dim(int64_t head_dim) {
    for (int d : kKernelHeadDims) {
        if (head_dim <= d) { return d; }
    }
    return -1;
}

// The kernel moves 16-byte chunks: unit stride on head_dim, the other strides multiples of 8 elements.
void check_layout(const at::Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.stride(3) == 1, name, " must have a contiguous last dimension (stride 1), got stride ",
                      num(t.stride(3)));
    for (int64_t d = 0; d < 3; ++d) {
        TORCH_CHECK_VALUE(t.size(d) <= 1 || t.stride(d) % 8 == 0, name,
                          " must have strides that are multiples of 8 elements, got ", shape_str(t.strides()));
    }
}

// Every check here runs before the device check, so argument errors read the same on any device.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    TORCH_CHECK_VALUE(q.dim() == 4, "q must have shape (batch, seqlen_q, nheads, head_dim), got ", num(q.dim()), " dims");
    TORCH_CHECK_VALUE(k.dim() == 4, "k must have shape (batch, seqlen_k, nheads_k, head_dim), got ", num(k.dim()), " dims");
    TORCH_CHECK_VALUE(v.dim() == 4, "v must have shape (batch, seqlen_k, nheads_k, head_dim), got ", num(v.dim()), " dims");

    const auto dtype = q.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16, "q must be float16 or bfloat16, got ", dtype);
    TORCH_CHECK_TYPE(k.scalar_type() == dtype, "k must have the same dtype as q (", dtype, "), got ", k.scalar_type());
    TORCH_CHECK_TYPE(v.scalar_type() == dtype, "v must have the same dtype as q (", dtype, "), got ", v.scalar_type());

    const int64_t batch = q.size(0);
    const int64_t nheads = q.size(2);
    const int64_t head_dim = q.size(3);
    const int64_t nheads_k = k.size(2);
    TORCH_CHECK_VALUE(k.size(0) == batch, "k must have the same batch size as q (", num(batch), "), got ", num(k.size(0)));
    TORCH_CHECK_VALUE(v.size(0) == batch, "v must have the same batch size as q (", num(batch), "), got ", num(v.size(0)));
    TORCH_CHECK_VALUE(v.size(1) == k.size(1), "v must have the same seqlen_k as k (", num(k.size(1)), "), got ", num(v.size(1)));
    TORCH_CHECK_VALUE(v.size(2) == nheads_k, "v must have the same nheads_k as k (", num(nheads_k), "), got ", num(v.size(2)));
    TORCH_CHECK_VALUE(k.size(3) == head_dim, "k must have the same head_dim as q (", num(head_dim), "), got ", num(k.size(3)));
    TORCH_CHECK_VALUE(v.size(3) == head_dim, "v must have the same head_dim as q (", num(head_dim), "), got ", num(v.size(3)));
    const bool head_dim_ok = head_dim > 0 && head_dim <= kMaxHeadDim && head_dim % 8 == 0;
    TORCH_CHECK_VALUE(head_dim_ok, "head_dim must be a multiple of 8 in [8, 256] (flash_attn_func pads other sizes), got ",
                      num(head_dim));
    const bool heads_ok = nheads_k > 0 && nheads % nheads_k == 0;
    TORCH_CHECK_VALUE(heads_ok, "nheads (", num(nheads), ") must be a multiple of nheads_k (", num(nheads_k), ")");
    TORCH_CHECK_VALUE(batch <= INT32_MAX, "batch must be at most ", num(INT32_MAX), ", got ", num(batch));
    TORCH_CHECK_VALUE(nheads <= kMaxGridZ, "nheads must be at most ", num(kMaxGridZ), ", got ", num(nheads));
    // Block arithmetic on sequence positions is 32-bit; leave room for one block past the end.
    constexpr int64_t kMaxSeqlen = INT32_MAX - 256;
    TORCH_CHECK_VALUE(q.size(1) <= kMaxSeqlen && k.size(1) <= kMaxSeqlen, "seqlen_q and seqlen_k must be at most ",
                      num(kMaxSeqlen));
    check_layout(q, "q");
    check_layout(k, "k");
    check_layout(v, "v");
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& q) {
    TORCH_CHECK_VALUE(t.device() == q.device(), name, " must be on the same device as q (", q.device(), "), got ",
                      t.device());
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                      " must start at a 16-byte aligned address");
}

// cudaDeviceGetAttribute for the few attributes the ops ask for at every call, queried once per device.
// Returns -1 when the query fails.
int device_attribute(cudaDeviceAttr attr, int device) {
    constexpr cudaDeviceAttr kCachedAttrs[] = {cudaDevAttrComputeCapabilityMajor, cudaDevAttrComputeCapabilityMinor,
                                               cudaDevAttrMultiProcessorCount};
    constexpr int kNumAttrs = sizeof(kCachedAttrs) / sizeof(kCachedAttrs[0]);
    constexpr int kMaxCachedDevices = 64;
    static std::atomic<int> cache[kNumAttrs][kMaxCachedDevices];  // value + 1; 0: not queried yet
    const int slot = int(std::find(kCachedAttrs, kCachedAttrs + kNumAttrs, attr) - kCachedAttrs);
    const bool cached = slot < kNumAttrs && device >= 0 && device < kMaxCachedDevices;
    if (cached) {
        const int stored = cache[slot][device].load(std::memory_order_relaxed);
        if (stored > 0) { return stored - 1; }
    }
    int value = 0;
    if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) { return -1; }
    if (cached) { cache[slot][device].store(value + 1, std::memory_order_relaxed); }
    return value;
}

void check_device(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    TORCH_CHECK_VALUE(q.is_cuda(), "q must be a CUDA tensor, got device ", q.device());
    check_same_device(q, "q", q);
    check_same_device(k, "k", q);
    check_same_device(v, "v", q);
    const int cc_major = device_attribute(cudaDevAttrComputeCapabilityMajor, q.get_device());
    TORCH_CHECK(cc_major >= 0, "could not query the compute capability of ", q.device());
    TORCH_CHECK(cc_major >= 8, "flash_attn_cuda needs an Ampere (sm_80) or newer GPU, got compute capability ", num(cc_major),
                ".x on ", q.device());
}

void check_scale(double softmax_scale) {
    // The kernels take each row's maximum of the unscaled scores, which is the maximum of the scaled
    // ones only for a non-negative scale (flash_attn_func handles a negative scale by negating q).
    // The scale also has to stay finite once it is a float multiplied by log2(e).
    TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(softmax_scale * M_LOG2E)) && softmax_scale >= 0,
                      "softmax_scale must be finite and non-negative, got ", std::to_string(softmax_scale));
}

template <typename Launcher>
Launcher require_launcher(Launcher launcher, const char* pass, const KernelKey& key) {
    TORCH_CHECK(launcher != nullptr, "flash_attn_cuda was built without the kernel ", kernel_name(pass, key),
                "; rebuild with FLASH_ATTN2_HDIMS and FLASH_ATTN2_DTYPES covering it");
    return launcher;
}

KernelKey kernel_key(const at::Tensor& q, bool causal) {
    return {q.scalar_type() == at::kBFloat16, kernel_head_dim(q.size(3)), causal};
}

// A variable-length batch. Its (total, heads, head_dim) tensors travel as (1, total, heads, head_dim) views,
// so the dense checks and strides apply unchanged.
struct Varlen {
    const at::Tensor& cu_seqlens_q;
    const at::Tensor& cu_seqlens_k;
    int64_t max_seqlen_q;
    int64_t max_seqlen_k;

    int64_t batch() const { return cu_seqlens_q.size(0) - 1; }
};

// Checks only what needs no device synchronization: the contents of cu_seqlens are clamped by the kernels.
void check_varlen(const Varlen& varlen, const at::Tensor& q, const at::Tensor& k) {
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{varlen.cu_seqlens_q, "cu_seqlens_q"},
                                  std::pair<const at::Tensor&, const char*>{varlen.cu_seqlens_k, "cu_seqlens_k"}}) {
        TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
        TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) >= 1, name, " must have shape (batch + 1,), got ",
                          shape_str(t.sizes()));
        TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
        TORCH_CHECK_VALUE(t.device() == q.device(), name, " must be on the device of q (", q.device(), "), got ",
                          t.device());
    }
    TORCH_CHECK_VALUE(varlen.cu_seqlens_k.size(0) == varlen.cu_seqlens_q.size(0),
                      "cu_seqlens_k must have the length of cu_seqlens_q (", num(varlen.cu_seqlens_q.size(0)), "), got ",
                      num(varlen.cu_seqlens_k.size(0)));
    TORCH_CHECK_VALUE(varlen.batch() <= INT32_MAX, "batch (len(cu_seqlens_q) - 1) must be at most ", num(INT32_MAX),
                      ", got ", num(varlen.batch()));
    TORCH_CHECK_VALUE(varlen.max_seqlen_q >= 0 && varlen.max_seqlen_q <= q.size(1),
                      "max_seqlen_q must be in [0, total_q = ", num(q.size(1)), "], got ", num(varlen.max_seqlen_q));
    TORCH_CHECK_VALUE(varlen.max_seqlen_k >= 0 && varlen.max_seqlen_k <= k.size(1),
                      "max_seqlen_k must be in [0, total_k = ", num(k.size(1)), "], got ", num(varlen.max_seqlen_k));
}

void check_varlen_rank(const at::Tensor& t, const char* name, const char* shape) {
    TORCH_CHECK_VALUE(t.dim() == 3, name, " must have shape ", shape, ", got ", num(t.dim()), " dims");
}

// The kernels use up to 163 KiB of shared memory per block (what sm_80 and sm_90 allow); GPUs with less,
// such as sm_86, sm_89 and sm_120, fail at launch for the larger tiles. Say so rather than only relaying CUDA's
// "invalid argument".
void check_launch(cudaError_t err, const char* op, int device) {
    if (err == cudaSuccess) { return; }
    std::string hint;
    int optin_bytes = 0;
    if (cudaDeviceGetAttribute(&optin_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
        optin_bytes < 163 * 1024) {
        hint = " (this GPU allows " + num(optin_bytes / 1024) +
               " KiB of shared memory per block; the kernels are tuned for the 163 KiB of sm_80 and sm_90)";
    }
    TORCH_CHECK(false, op, " kernel launch failed: ", cudaGetErrorString(err), hint);
}

// Hopper GPUs run the warpgroup-MMA kernels (where the build has them, see flash_fwd_launch.h and
// flash_bwd_launch.h). FLASH_ATTN2_DISABLE_WGMMA=1 forces the mma.sync kernels, to compare the two in one process.
bool use_wgmma(int device) {
    const char* disable = std::getenv("FLASH_ATTN2_DISABLE_WGMMA");
    return device_attribute(cudaDevAttrComputeCapabilityMajor, device) == 9 &&
           device_attribute(cudaDevAttrComputeCapabilityMinor, device) == 0 &&
           !(disable != nullptr && std::string(disable) == "1");
}

// Multiprocessors of `device` (at least 1), for the split-KV heuristic.
int multiprocessor_count(int device) {
    return std::max(device_attribute(cudaDevAttrMultiProcessorCount, device), 1);
}

// Test and benchmark switches: 1 when the variable `name` is "1", 0 when "0", -1 when unset or anything else
// (the default choice).
int env_switch(const char* name) {
    const char* text = std::getenv(name);
    const std::string value(text == nullptr ? "" : text);
    return value == "1" ? 1 : value == "0" ? 0 : -1;
}

// Test and benchmark counts: the integer in the variable `name`, in [0, max]; 0 when unset or empty.
int env_count(const char* name, int max) {
    const char* text = std::getenv(name);
    if (text == nullptr || *text == '\0') { return 0; }
    char* end = nullptr;
    const long value = std::strtol(text, &end, 10);
    TORCH_CHECK_VALUE(*end == '\0' && value >= 0 && value <= max, name, " must be an integer in [0, ", num(max),
                      "], got '", text, "'");
    return static_cast<int>(value);
}

// FLASH_ATTN2_FWD_SHORT_KEYS=1 runs the short-key Hopper forward tile (FwdSm90ShortKeysTileConfig) at every
// seqlen_k, =0 never, for tests and benchmarks; unset or anything else: up to kFwdShortKeysMax(Causal) keys.
bool fwd_short_key_tiles(int seqlen_k, bool causal) {
    const int forced = env_switch("FLASH_ATTN2_FWD_SHORT_KEYS");
    return forced == 1 || (forced == -1 && seqlen_k <= (causal ? kFwdShortKeysMaxCausal : kFwdShortKeysMax));
}

constexpr int kMaxAutoSplits = 64;     // the heuristic's cap
constexpr int kMaxForcedSplits = 128;  // FLASH_ATTN2_NUM_SPLITS's cap (run_fwd_combine takes at most 128)
// The heuristic splits only seqlen_k >= kMinKeysToSplit, into splits of at least kMinKeysPerSplit keys. Below
// 1024 keys the kernel time a split saves is under the host time its partials and combine launch cost (perf
// log 18); at 1024 causal keys and 1-4 heads, 4 splits take 23 us of GPU time to 12 (perf log 22).
constexpr int kMinKeysToSplit = 1024;
constexpr int kMinKeysPerSplit = 256;

// FLASH_ATTN2_NUM_SPLITS=n (n >= 1) forces n key splits on every dense forward, for tests and benchmarks;
// unset, empty or 0 lets choose_num_splits decide.
int forced_num_splits() { return env_count("FLASH_ATTN2_NUM_SPLITS", kMaxForcedSplits); }

// Split-KV heuristic. The forward grid has one CTA per (query block, sequence, head), each streaming all of
// its keys; when that grid is smaller than the GPU, SMs idle (decode and short-query shapes). Splitting the
// keys num_splits ways multiplies the CTAs and divides each one's key blocks, at the price of an fp32 partial
// per split and a combine kernel. Model: `slots` CTAs (SMs x CTAs resident per SM) run at once and a CTA costs
// its number of key blocks, so num_splits = s takes ceil(ctas * s / slots) waves of ceil(n_blocks / s) blocks.
// No split once the grid fills 80% of the slots; otherwise the smallest s whose time is within 5% of the best,
// with at least kMinKeysPerSplit keys per split, s <= kMaxAutoSplits, and no split below kMinKeysToSplit keys.
// Causal query blocks differ in cost, which the model ignores; their splits share only the keys each block
// sees (FwdTile).
int choose_num_splits(int64_t ctas, int64_t seqlen_k, const FwdBlockShape& shape, int64_t slots) {
    if (ctas <= 0 || ctas * 5 >= slots * 4 || seqlen_k < kMinKeysToSplit) { return 1; }
    const int64_t n_blocks = (seqlen_k + shape.block_n - 1) / shape.block_n;
    const int64_t max_splits = std::min<int64_t>({kMaxAutoSplits, seqlen_k / kMinKeysPerSplit, n_blocks});
    auto time = [&](int64_t splits) {
        return (ctas * splits + slots - 1) / slots * ((n_blocks + splits - 1) / splits);
    };
    int64_t best_time = time(1);
    for (int64_t splits = 2; splits <= max_splits; ++splits) { best_time = std::min(best_time, time(splits)); }
    for (int64_t splits = 1; splits <= max_splits; ++splits) {
        if (time(splits) * 20 <= best_time * 21) { return static_cast<int>(splits); }
    }
    return 1;
}

// num_splits for a dense forward whose params are filled in (after any GQA packing).
int fwd_num_splits(const FwdParams& params, int kernel_head_dim, bool causal, int device) {
    const FwdBlockShape shape = fwd_block_shape(kernel_head_dim, causal, params.use_wgmma, params.short_key_tiles);
    const int64_t m_blocks = (int64_t(params.seqlen_q) + shape.block_m - 1) / shape.block_m;
    int splits = forced_num_splits();
    if (splits == 0) {
        const int64_t ctas = m_blocks * params.batch * params.num_heads;
        splits = choose_num_splits(ctas, params.seqlen_k, shape, int64_t(multiprocessor_count(device)) * shape.ctas_per_sm);
    }
    // The launch grid's x is query blocks (at least 64 rows each) times splits.
    const int64_t max_for_grid = std::max<int64_t>(1, INT32_MAX / ((int64_t(params.seqlen_q) + 63) / 64));
    return static_cast<int>(std::min<int64_t>(splits, max_for_grid));
}

// FLASH_ATTN2_GQA_WALK=1 makes every GQA/MQA backward that can (Hopper, not deterministic) walk whole groups
// per CTA, =0 none, for tests and benchmarks; unset or anything else leaves it to the grid size (bwd_impl).
int forced_gqa_walk() { return env_switch("FLASH_ATTN2_GQA_WALK"); }

// FLASH_ATTN2_BWD_SHORT_QUERIES=1 runs the Hopper backward's 16-row query tile (head dim 128) at every
// seqlen_q, =0 never, for tests and benchmarks; unset or anything else: at seqlen_q <= kBwdShortQueriesMax,
// where a 64-row tile would compute mostly padding.
constexpr int kBwdShortQueriesMax = 16;
bool bwd_short_query_tiles(int64_t seqlen_q) {
    const int forced = env_switch("FLASH_ATTN2_BWD_SHORT_QUERIES");
    return forced == 1 || (forced == -1 && seqlen_q <= kBwdShortQueriesMax);
}

constexpr int kMaxAutoKeyBlocks = 16;     // choose_key_blocks_per_cta's cap
constexpr int kMaxForcedKeyBlocks = 128;  // FLASH_ATTN2_BWD_KEY_BLOCKS's cap

// FLASH_ATTN2_BWD_KEY_BLOCKS=n (n >= 1) forces n key blocks per CTA on every backward that runs the Hopper
// kernel of head dims <= 128, for tests and benchmarks; unset, empty or 0 lets choose_key_blocks_per_cta decide.
int forced_key_blocks_per_cta() { return env_count("FLASH_ATTN2_BWD_KEY_BLOCKS", kMaxForcedKeyBlocks); }

// Key blocks per CTA of the Hopper backward of head dims <= 128. With at most two query-block steps per key
// block (short queries against long keys) a CTA's time goes mostly to loading K and V and storing dK and dV,
// one after the other, and the grid runs many waves of such CTAs. A CTA that walks j consecutive key blocks
// loads the next one's K and V while it computes and stores the current one. Model: `slots` CTAs run at once
// and a CTA costs j + 1 key-block times (its first load is not hidden); the smallest j of least time, up to
// kMaxAutoKeyBlocks, that still leaves two waves of CTAs. That cap came after one wave at j = 8 measured
// slower on bench_skinny's GQA decode row; a later A/B put most of that loss on the loop code instead, so the
// cap is unproven (perf log 28, 29). Longer queries keep one key block per CTA: their steps hide the loads.
int choose_key_blocks_per_cta(int64_t n_blocks, int64_t ctas_per_key_block, int64_t steps_per_key_block,
                              int64_t slots) {
    if (steps_per_key_block > 2 || n_blocks <= 1) { return 1; }
    auto time = [&](int64_t j) { return ((n_blocks + j - 1) / j * ctas_per_key_block + slots - 1) / slots * (j + 1); };
    const int64_t max_j = std::min<int64_t>({kMaxAutoKeyBlocks, n_blocks, n_blocks * ctas_per_key_block / (2 * slots)});
    int64_t best = 1;
    for (int64_t j = 2; j <= max_j; ++j) {
        if (time(j) < time(best)) { best = j; }
    }
    return static_cast<int>(best);
}

// Everything both passes read: inputs, output, LSE, sizes, the scale and, for varlen, the sequence bounds.
void set_fwd_params(FwdParams& params, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, double softmax_scale, const Varlen* varlen) {
    params.q_ptr = q.data_ptr();
    params.k_ptr = k.data_ptr();
    params.v_ptr = v.data_ptr();
    params.o_ptr = out.data_ptr();
    params.lse_ptr = lse.data_ptr<float>();
    params.q_batch_stride = q.stride(0);
    params.q_row_stride = q.stride(1);
    params.q_head_stride = q.stride(2);
    params.k_batch_stride = k.stride(0);
    params.k_row_stride = k.stride(1);
    params.k_head_stride = k.stride(2);
    params.v_batch_stride = v.stride(0);
    params.v_row_stride = v.stride(1);
    params.v_head_stride = v.stride(2);
    params.o_batch_stride = out.stride(0);
    params.o_row_stride = out.stride(1);
    params.o_head_stride = out.stride(2);
    params.batch = static_cast<int>(q.size(0));
    params.seqlen_q = static_cast<int>(q.size(1));
    params.seqlen_k = static_cast<int>(k.size(1));
    params.total_q = static_cast<int>(q.size(1));
    params.total_k = static_cast<int>(k.size(1));
    params.num_heads = static_cast<int>(q.size(2));
    params.num_heads_k = static_cast<int>(k.size(2));
    params.head_dim = static_cast<int>(q.size(3));
    params.lse_batch_stride = lse.dim() == 3 ? lse.stride(0) : 0;
    params.lse_head_stride = lse.stride(-2);
    if (varlen != nullptr) {
        params.cu_seqlens_q = varlen->cu_seqlens_q.data_ptr<int>();
        params.cu_seqlens_k = varlen->cu_seqlens_k.data_ptr<int>();
        params.batch = static_cast<int>(varlen->batch());
        params.seqlen_q = static_cast<int>(varlen->max_seqlen_q);
        params.seqlen_k = static_cast<int>(varlen->max_seqlen_k);
        params.q_batch_stride = params.k_batch_stride = params.v_batch_stride = params.o_batch_stride = 0;
    }
    params.use_wgmma = use_wgmma(q.get_device());
    params.num_splits = 1;
    params.softmax_scale = static_cast<float>(softmax_scale);
    // A zero or denormal scale would turn masked scores into NaN (-inf * 0); the smallest normal float
    // keeps them at -inf, and every other exp2 argument still rounds to the same value (0).
    params.softmax_scale_log2 = std::max(static_cast<float>(softmax_scale * M_LOG2E), FLT_MIN);
}

// The LSE of (batch, seqlen_q, nheads, d) inputs is (batch, nheads, seqlen_q); of varlen ones (nheads, total_q).
std::vector<int64_t> lse_shape(const at::Tensor& q, const Varlen* varlen) {
    if (varlen != nullptr) { return {q.size(2), q.size(1)}; }
    return {q.size(0), q.size(2), q.size(1)};
}

// With a single query row the bottom-right aligned causal mask lets it see every key: run the non-causal
// kernel instead when the build has it (which also allows packing GQA heads, see pack_gqa).
template <typename Find>
bool causal_is_noop(const at::Tensor& q, bool causal, const Varlen* varlen, Find find) {
    return causal && varlen == nullptr && q.size(1) == 1 && find(kernel_key(q, false)) != nullptr;
}

// A dense seqlen_q == 1 problem with GQA/MQA (and no causal mask) runs with the `group` query heads that share
// a key/value head as `group` query rows of one head, so each CTA reads its key/value head once for the
// whole group, and the backward gets dK/dV per key/value head directly. Returns group, or 1: no packing.
int64_t gqa_pack_group(const at::Tensor& q, const at::Tensor& k, bool causal, const Varlen* varlen) {
    const bool pack = varlen == nullptr && !causal && q.size(1) == 1 && q.size(2) > k.size(2);
    return pack ? q.size(2) / k.size(2) : 1;
}

// (batch, 1, nheads, d) -> (batch, group, nheads / group, d): a pure stride change (row stride = the head
// stride, head stride = group * the head stride), so outputs written through the view land in place.
at::Tensor pack_gqa(const at::Tensor& t, int64_t group) {
    if (group == 1) { return t; }
    return t.as_strided({t.size(0), group, t.size(2) / group, t.size(3)},
                        {t.stride(0), t.stride(2), group * t.stride(2), t.stride(3)}, t.storage_offset());
}

// (batch, nheads, 1) contiguous is the same memory as (batch, nheads / group, group).
at::Tensor pack_gqa_lse(const at::Tensor& lse, int64_t group) {
    if (group == 1) { return lse; }
    return lse.view({lse.size(0), lse.size(1) / group, group});
}

// q, k, v are 4-D (varlen: (1, total, heads, head_dim) views); returns out in q's 4-D shape and the LSE.
std::tuple<at::Tensor, at::Tensor> fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            double softmax_scale, bool causal, const Varlen* varlen) {
    check_qkv(q, k, v);
    if (varlen != nullptr) { check_varlen(*varlen, q, k); }
    check_scale(softmax_scale);
    check_device(q, k, v);
    if (causal_is_noop(q, causal, varlen, find_fwd_launcher)) { causal = false; }
    const KernelKey key = kernel_key(q, causal);
    const FwdLauncher launcher = require_launcher(find_fwd_launcher(key), "fwd", key);

    const c10::cuda::CUDAGuard device_guard(q.device());
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty(lse_shape(q, varlen), q.options().dtype(at::kFloat));
    if (out.numel() == 0) { return {out, lse}; }
    if (varlen != nullptr && (varlen->batch() == 0 || varlen->max_seqlen_q == 0)) {
        // No query row belongs to a sequence: nothing to compute, and no grid to launch.
        return {out.zero_(), lse.fill_(INFINITY)};
    }

    const int64_t group = gqa_pack_group(q, k, causal, varlen);
    FwdParams params{};
    set_fwd_params(params, pack_gqa(q, group), k, v, pack_gqa(out, group), pack_gqa_lse(lse, group), softmax_scale,
                   varlen);
    params.short_key_tiles = params.use_wgmma && fwd_short_key_tiles(params.seqlen_k, causal);
    // Split-KV partials (dense batches only; varlen launches stay unsplit).
    at::Tensor accum;
    if (varlen == nullptr) { params.num_splits = fwd_num_splits(params, key.head_dim, causal, q.get_device()); }
    if (params.num_splits > 1) {
        // One allocation for both partials (each allocation is host time in a host-bound call): o_accum
        // (splits, rows, head_dim), then lse_accum (splits, rows), 16-byte aligned as head_dim % 8 == 0.
        const int64_t splits = params.num_splits, rows = int64_t(params.batch) * params.num_heads * params.seqlen_q;
        accum = at::empty({splits * rows * (params.head_dim + 1)}, q.options().dtype(at::kFloat));
        params.o_accum_ptr = accum.data_ptr<float>();
        params.lse_accum_ptr = params.o_accum_ptr + splits * rows * params.head_dim;
    }
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cudaError_t err = launcher(params, stream);
    if (err == cudaSuccess && params.num_splits > 1) { err = run_fwd_combine(params, key.is_bf16, stream); }
    check_launch(err, "flash_attn2::fwd", q.get_device());
    return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       double softmax_scale, bool causal, bool /*deterministic: backward only*/) {
    return fwd_impl(q, k, v, softmax_scale, causal, nullptr);
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                              int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                                              bool causal, bool /*deterministic: backward only*/) {
    check_varlen_rank(q, "q", "(total_q, nheads, head_dim)");
    check_varlen_rank(k, "k", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(v, "v", "(total_k, nheads_k, head_dim)");
    const Varlen varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
    auto [out, lse] = fwd_impl(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale, causal, &varlen);
    return {out.squeeze(0), lse};
}

// dout and out must match q's shape and dtype; lse is the forward's fp32 output.
void check_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                      const Varlen* varlen) {
    TORCH_CHECK_VALUE(dout.sizes() == q.sizes(), "dout must have the shape of q ", shape_str(q.sizes()), ", got ",
                      shape_str(dout.sizes()));
    TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "out must have the shape of q ", shape_str(q.sizes()), ", got ",
                      shape_str(out.sizes()));
    TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type(), "dout must have the dtype of q (", q.scalar_type(),
                     "), got ", dout.scalar_type());
    TORCH_CHECK_TYPE(out.scalar_type() == q.scalar_type(), "out must have the dtype of q (", q.scalar_type(),
                     "), got ", out.scalar_type());
    TORCH_CHECK_TYPE(lse.scalar_type() == at::kFloat, "softmax_lse must be float32, got ", lse.scalar_type());
    const std::vector<int64_t> expected_lse = lse_shape(q, varlen);
    TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef(expected_lse), "softmax_lse must have shape ",
                      shape_str(expected_lse), ", got ", shape_str(lse.sizes()));
    check_layout(dout, "dout");
    check_layout(out, "out");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_impl(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                        const at::Tensor& softmax_lse, double softmax_scale,
                                                        bool causal, bool deterministic, const Varlen* varlen) {
    check_qkv(q, k, v);
    if (varlen != nullptr) { check_varlen(*varlen, q, k); }
    check_bwd_inputs(dout, q, out, softmax_lse, varlen);
    check_scale(softmax_scale);
    check_device(q, k, v);
    check_same_device(dout, "dout", q);
    check_same_device(out, "out", q);
    TORCH_CHECK_VALUE(softmax_lse.device() == q.device(), "softmax_lse must be on the device of q");
    if (causal_is_noop(q, causal, varlen, find_bwd_launcher)) { causal = false; }
    const KernelKey key = kernel_key(q, causal);
    const BwdLauncher launcher = require_launcher(find_bwd_launcher(key), "bwd", key);

    const c10::cuda::CUDAGuard device_guard(q.device());
    // The kernels see q, dout, out, dq and the LSE through GQA-packed views (group 1: unchanged); sizes below
    // are the kernels'. Packed, there is no GQA left: dK and dV come out per key/value head.
    const int64_t group = gqa_pack_group(q, k, causal, varlen);
    const at::Tensor q_k = pack_gqa(q, group);
    const int64_t batch = varlen != nullptr ? varlen->batch() : q_k.size(0);
    const int64_t seqlen_q = varlen != nullptr ? varlen->max_seqlen_q : q_k.size(1);
    const int64_t nheads = q_k.size(2), head_dim = q.size(3), nheads_k = k.size(2);
    const bool nothing_to_do = q.numel() == 0 || k.numel() == 0 ||
                               (varlen != nullptr && (batch == 0 || seqlen_q == 0 || varlen->max_seqlen_k == 0));
    // Gradients are always returned contiguous (the fake implementations promise as much).
    auto zeros = [](const at::Tensor& t) { return at::zeros(t.sizes(), t.options()); };
    if (nothing_to_do) { return {zeros(q), zeros(k), zeros(v)}; }
    const at::Tensor lse = pack_gqa_lse(softmax_lse.contiguous(), group);
    const auto fp32 = q.options().dtype(at::kFloat);
    at::Tensor dsum = at::empty(lse.sizes(), fp32);
    // Each sequence owns whole query blocks of dq_accum rows (see BwdParams::dq_accum_ptr).
    const int64_t dq_accum_seqlen = varlen != nullptr ? q.size(1) + batch * kBwdMaxBlockM
                                                      : (seqlen_q + kBwdMaxBlockM - 1) / kBwdMaxBlockM * kBwdMaxBlockM;
    TORCH_CHECK_VALUE(dq_accum_seqlen <= INT32_MAX, "total_q + 128 * batch must fit in 32 bits, got ",
                      num(dq_accum_seqlen));
    at::Tensor dq_accum = varlen != nullptr ? at::zeros({nheads, dq_accum_seqlen, key.head_dim}, fp32)
                                            : at::zeros({batch, nheads, dq_accum_seqlen, key.head_dim}, fp32);
    // Varlen rows outside every sequence are never written by the kernels; zero them so that a padded
    // (static-shape) buffer gets zero gradients there rather than uninitialized memory.
    auto allocate = [&](at::IntArrayRef sizes, const at::TensorOptions& options) {
        return varlen != nullptr ? at::zeros(sizes, options) : at::empty(sizes, options);
    };
    at::Tensor dq = allocate(q.sizes(), q.options());
    const at::Tensor dq_k = pack_gqa(dq, group);
    // GQA/MQA: on Hopper one CTA walks every query head of its key/value head, summing dK and dV in
    // registers, as long as that grid (group times smaller) still gives every SM a CTA. Otherwise one dK/dV
    // slice per query head, summed afterwards from fp32 slices so that each gradient is rounded once.
    const bool grouped = nheads != nheads_k;
    const int64_t seqlen_k = varlen != nullptr ? varlen->max_seqlen_k : k.size(1);
    const int device = q.get_device();
    const int forced_walk = forced_gqa_walk();
    const bool walk_groups =
        grouped && !deterministic && use_wgmma(device) && has_sm90_bwd_kernels() && forced_walk != 0 &&
        (forced_walk == 1 ||
         (seqlen_k + bwd_sm90_block_n(key.head_dim) - 1) / bwd_sm90_block_n(key.head_dim) * batch * nheads_k >=
             multiprocessor_count(device));
    const int64_t heads_per_cta = walk_groups ? nheads / nheads_k : 1;
    const bool fp32_slices = grouped && !walk_groups;
    const auto dkv_options = fp32_slices ? fp32 : q.options();
    at::Tensor dk_heads = allocate({k.size(0), k.size(1), nheads / heads_per_cta, head_dim}, dkv_options);
    at::Tensor dv_heads = allocate({k.size(0), k.size(1), nheads / heads_per_cta, head_dim}, dkv_options);
    at::Tensor dq_semaphore;
    if (deterministic) {
        dq_semaphore = at::zeros({batch, nheads, (seqlen_q + kBwdMinBlockM - 1) / kBwdMinBlockM}, q.options().dtype(at::kInt));
    }

    BwdParams params{};
    set_fwd_params(params, q_k, k, v, pack_gqa(out, group), lse, softmax_scale, varlen);
    const at::Tensor dout_k = pack_gqa(dout, group);
    params.do_ptr = dout_k.data_ptr();
    params.do_batch_stride = varlen != nullptr ? 0 : dout_k.stride(0);
    params.do_row_stride = dout_k.stride(1);
    params.do_head_stride = dout_k.stride(2);
    params.dsum_ptr = dsum.data_ptr<float>();
    params.dq_accum_ptr = dq_accum.data_ptr<float>();
    params.dq_ptr = dq_k.data_ptr();
    params.dq_batch_stride = varlen != nullptr ? 0 : dq_k.stride(0);
    params.dq_row_stride = dq_k.stride(1);
    params.dq_head_stride = dq_k.stride(2);
    params.dk_ptr = dk_heads.data_ptr();
    params.dv_ptr = dv_heads.data_ptr();
    params.dk_batch_stride = varlen != nullptr ? 0 : dk_heads.stride(0);
    params.dk_row_stride = dk_heads.stride(1);
    params.dk_head_stride = dk_heads.stride(2);
    params.dkv_fp32 = fp32_slices;
    params.heads_per_cta = static_cast<int>(heads_per_cta);
    params.key_blocks_per_cta = 1;
    params.short_query_tiles = bwd_short_query_tiles(params.seqlen_q);
    if (!deterministic && use_wgmma(device) && has_sm90_bwd_kernels() && bwd_sm90_walks_key_blocks(key.head_dim)) {
        int key_blocks = forced_key_blocks_per_cta();
        if (key_blocks == 0) {
            const int64_t block_n = bwd_sm90_block_n(key.head_dim);
            const int64_t block_m = bwd_sm90_block_m(key.head_dim, params.short_query_tiles);
            key_blocks = choose_key_blocks_per_cta(
                (params.seqlen_k + block_n - 1) / block_n, int64_t(params.batch) * (params.num_heads / heads_per_cta),
                heads_per_cta * ((params.seqlen_q + block_m - 1) / block_m), multiprocessor_count(device));
        }
        params.key_blocks_per_cta = key_blocks;
    }
    params.dq_semaphore_ptr = deterministic ? dq_semaphore.data_ptr<int>() : nullptr;
    params.dq_accum_seqlen = static_cast<int>(dq_accum_seqlen);
    params.dq_accum_head_dim = key.head_dim;
    params.deterministic = deterministic;
    const bool is_bf16 = key.is_bf16;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    cudaError_t err = run_bwd_dot_do_o(params, is_bf16, stream);
    if (err == cudaSuccess) { err = launcher(params, stream); }
    if (err == cudaSuccess) { err = run_bwd_convert_dq(params, is_bf16, stream); }
    check_launch(err, "flash_attn2::bwd", device);

    if (!fp32_slices) { return {dq, dk_heads, dv_heads}; }
    const int64_t heads_per_kv = nheads / nheads_k;
    auto sum_group = [&](const at::Tensor& heads) {
        return heads.view({k.size(0), k.size(1), nheads_k, heads_per_kv, head_dim}).sum(3, false, at::kFloat).to(q.scalar_type());
    };
    return {dq, sum_group(dk_heads), sum_group(dv_heads)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& out,
                                                   const at::Tensor& softmax_lse, double softmax_scale, bool causal,
                                                   bool deterministic) {
    return bwd_impl(dout, q, k, v, out, softmax_lse, softmax_scale, causal, deterministic, nullptr);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic) {
    check_varlen_rank(q, "q", "(total_q, nheads, head_dim)");
    check_varlen_rank(k, "k", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(v, "v", "(total_k, nheads_k, head_dim)");
    check_varlen_rank(dout, "dout", "(total_q, nheads, head_dim)");
    check_varlen_rank(out, "out", "(total_q, nheads, head_dim)");
    const Varlen varlen{cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
    auto [dq, dk, dv] = bwd_impl(dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                                 softmax_lse, softmax_scale, causal, deterministic, &varlen);
    return {dq.squeeze(0), dk.squeeze(0), dv.squeeze(0)};
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY(flash_attn2, m) {
    m.def("fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, bool deterministic=False) -> "
          "(Tensor out, Tensor softmax_lse)");
    m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, float softmax_scale, "
          "bool causal, bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)");
    m.def("varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
          "int max_seqlen_k, float softmax_scale, bool causal, bool deterministic=False) -> "
          "(Tensor out, Tensor softmax_lse)");
    m.def("varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
          "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
          "bool causal, bool deterministic=False) -> (Tensor dq, Tensor dk, Tensor dv)");
    m.def("compiled_kernels() -> str[]", [] { return flash::compiled_kernels(); });
}

// The CPU registrations only exist to reject CPU tensors with a message that names the argument.
TORCH_LIBRARY_IMPL(flash_attn2, CUDA, m) {
    m.impl("fwd", &flash::fwd);
    m.impl("bwd", &flash::bwd);
    m.impl("varlen_fwd", &flash::varlen_fwd);
    m.impl("varlen_bwd", &flash::varlen_bwd);
}
TORCH_LIBRARY_IMPL(flash_attn2, CPU, m) {
    m.impl("fwd", &flash::fwd);
    m.impl("bwd", &flash::bwd);
    m.impl("varlen_fwd", &flash::varlen_fwd);
    m.impl("varlen_bwd", &flash::varlen_bwd);
}
