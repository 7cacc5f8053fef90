// Autograd for the forward ops in C++, registered at the Autograd dispatch key: one small library per torch
// minor version, built against that version's (non-stable) headers and loaded only into it
// (flash_attn_cuda/_ops.py). The ops themselves live in the stable-ABI library _C, which has no C++ autograd.
//
// Why it exists: decoding-sized calls are host-bound, and autograd in Python (torch.library.register_autograd,
// which _ops.py uses on a torch this build has no such library for) costs those calls several microseconds
// more, with or without grad (bench/results/perf_log.md, entry 38); here the backward node is recorded without
// leaving C++. The backward ops have no autograd of their own (no double backward, as in flash-attn 2.x). As
// there, the LSE is an output that requires grad but passes no gradient back; marking it non-differentiable
// would trip compiled autograd, which asserts that no output of a C++ function is so marked.
// Python.h first, as Python asks (it sets feature macros the system headers read).
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

namespace flash {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The ops' signatures, as their schemas in csrc/ops.cpp declare them. VARIANTS are the trailing attention-variant
// arguments every one of them takes (window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state).
#define FLASH_ATTN2_VARIANTS int64_t, int64_t, double, const std::optional<at::Tensor>&, double, \
    const std::optional<at::Tensor>&
using FwdSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        double, bool, bool, int64_t, const std::string&,
                                                        FLASH_ATTN2_VARIANTS);
using BwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double, bool, bool, const std::string&, FLASH_ATTN2_VARIANTS);
using VarlenFwdSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
    double, bool, bool, const std::string&, FLASH_ATTN2_VARIANTS);
using VarlenBwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double, bool, bool,
    const std::string&, FLASH_ATTN2_VARIANTS);
#undef FLASH_ATTN2_VARIANTS

// The ops are called through the dispatcher, below autograd, so that whatever implements them for the
// inputs' device runs: the CUDA kernels, the fake implementations under torch.compile, Meta.
template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

const c10::TypedOperatorHandle<FwdSignature>& fwd_op() {
    static const auto op = op_handle<FwdSignature>("flash_attn2::fwd");
    return op;
}

const c10::TypedOperatorHandle<BwdSignature>& bwd_op() {
    static const auto op = op_handle<BwdSignature>("flash_attn2::bwd");
    return op;
}

const c10::TypedOperatorHandle<VarlenFwdSignature>& varlen_fwd_op() {
    static const auto op = op_handle<VarlenFwdSignature>("flash_attn2::varlen_fwd");
    return op;
}

const c10::TypedOperatorHandle<VarlenBwdSignature>& varlen_bwd_op() {
    static const auto op = op_handle<VarlenBwdSignature>("flash_attn2::varlen_bwd");
    return op;
}

bool needs_graph(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
}

// The attention-variant arguments, as both passes take them. The backward gets the forward's: the same window,
// softcap and slopes, and the same rng_state, from which it regenerates the forward's dropout mask.
struct Variants {
    int64_t window_left;
    int64_t window_right;
    double softcap;
    std::optional<at::Tensor> alibi_slopes;
    double dropout_p;
    std::optional<at::Tensor> rng_state;

    // Non-tensor fields to saved_data; the tensors travel with save_for_backward (undefined when absent).
    void save(AutogradContext* ctx) const {
        ctx->saved_data["window_left"] = window_left;
        ctx->saved_data["window_right"] = window_right;
        ctx->saved_data["softcap"] = softcap;
        ctx->saved_data["dropout_p"] = dropout_p;
    }
    static Variants load(AutogradContext* ctx, const at::Tensor& alibi_slopes, const at::Tensor& rng_state) {
        auto optional = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
        return {ctx->saved_data["window_left"].toInt(), ctx->saved_data["window_right"].toInt(),
                ctx->saved_data["softcap"].toDouble(), optional(alibi_slopes), ctx->saved_data["dropout_p"].toDouble(),
                optional(rng_state)};
    }
    at::Tensor saved_alibi() const { return alibi_slopes.value_or(at::Tensor()); }
    at::Tensor saved_rng() const { return rng_state.value_or(at::Tensor()); }
};

// The non-tensor settings both passes share, kept in the context's saved_data. The plan override reaches the
// backward too, so a forced path holds for both passes.
void save_settings(AutogradContext* ctx, double softmax_scale, bool causal, bool deterministic,
                   const std::string& plan_override, const Variants& variants) {
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["plan_override"] = plan_override;
    variants.save(ctx);
}

// The gradient of `out` as the backward kernels read it: contiguous, and zeros when the loss did not use out
// (with materialize_grads off it then arrives undefined).
at::Tensor out_grad(const at::Tensor& grad, const at::Tensor& out) {
    return grad.defined() ? grad.contiguous() : at::zeros_like(out, at::MemoryFormat::Contiguous);
}

// Gradients of the inputs: dq, dk, dv, then none for the `others` other arguments.
variable_list input_grads(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, size_t others) {
    variable_list grads{dq, dk, dv};
    grads.resize(3 + others);
    return grads;
}

// The forward functions' arguments after q, k and v: softmax_scale ... plan_override, then the Variants.
constexpr size_t kFwdOtherArgs = 5 + 1;
constexpr size_t kVarlenFwdOtherArgs = 8 + 1;  // from cu_seqlens_q

struct FwdFunction : public torch::autograd::Function<FwdFunction> {
    static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double softmax_scale, bool causal, bool deterministic, int64_t num_splits,
                                 const std::string& plan_override, const Variants& variants) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        auto [out, lse] = fwd_op().call(q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override,
                                        variants.window_left, variants.window_right, variants.softcap,
                                        variants.alibi_slopes, variants.dropout_p, variants.rng_state);
        ctx->save_for_backward({q, k, v, out, lse, variants.saved_alibi(), variants.saved_rng()});
        save_settings(ctx, softmax_scale, causal, deterministic, plan_override, variants);
        ctx->set_materialize_grads(false);  // the LSE's gradient is ignored: no zeros are made for it
        return {out, lse};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const variable_list saved = ctx->get_saved_variables();
        const Variants variants = Variants::load(ctx, saved[5], saved[6]);
        auto [dq, dk, dv] = bwd_op().call(out_grad(grads[0], saved[3]), saved[0], saved[1], saved[2], saved[3],
                                          saved[4], ctx->saved_data["softmax_scale"].toDouble(),
                                          ctx->saved_data["causal"].toBool(),
                                          ctx->saved_data["deterministic"].toBool(),
                                          ctx->saved_data["plan_override"].toStringRef(), variants.window_left,
                                          variants.window_right, variants.softcap, variants.alibi_slopes,
                                          variants.dropout_p, variants.rng_state);
        return input_grads(dq, dk, dv, kFwdOtherArgs);
    }
};

struct VarlenFwdFunction : public torch::autograd::Function<VarlenFwdFunction> {
    static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                 int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic,
                                 const std::string& plan_override, const Variants& variants) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        auto [out, lse] = varlen_fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               softmax_scale, causal, deterministic, plan_override,
                                               variants.window_left, variants.window_right, variants.softcap,
                                               variants.alibi_slopes, variants.dropout_p, variants.rng_state);
        ctx->save_for_backward(
            {q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, variants.saved_alibi(), variants.saved_rng()});
        save_settings(ctx, softmax_scale, causal, deterministic, plan_override, variants);
        ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
        ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
        ctx->set_materialize_grads(false);
        return {out, lse};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const variable_list saved = ctx->get_saved_variables();
        const Variants variants = Variants::load(ctx, saved[7], saved[8]);
        auto [dq, dk, dv] = varlen_bwd_op().call(
            out_grad(grads[0], saved[3]), saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6],
            ctx->saved_data["max_seqlen_q"].toInt(), ctx->saved_data["max_seqlen_k"].toInt(),
            ctx->saved_data["softmax_scale"].toDouble(), ctx->saved_data["causal"].toBool(),
            ctx->saved_data["deterministic"].toBool(), ctx->saved_data["plan_override"].toStringRef(),
            variants.window_left, variants.window_right, variants.softcap, variants.alibi_slopes, variants.dropout_p,
            variants.rng_state);
        return input_grads(dq, dk, dv, kVarlenFwdOtherArgs);
    }
};

std::tuple<at::Tensor, at::Tensor> fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double softmax_scale, bool causal, bool deterministic,
                                                int64_t num_splits, const std::string& plan_override,
                                                int64_t window_left, int64_t window_right, double softcap,
                                                const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                                                const std::optional<at::Tensor>& rng_state) {
    if (!needs_graph(q, k, v)) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        return fwd_op().call(q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override, window_left,
                             window_right, softcap, alibi_slopes, dropout_p, rng_state);
    }
    const Variants variants{window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state};
    const variable_list outputs =
        FwdFunction::apply(q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override, variants);
    return {outputs[0], outputs[1]};
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                       int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                       double softmax_scale, bool causal, bool deterministic,
                                                       const std::string& plan_override, int64_t window_left,
                                                       int64_t window_right, double softcap,
                                                       const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                                                       const std::optional<at::Tensor>& rng_state) {
    if (!needs_graph(q, k, v)) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        return varlen_fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    causal, deterministic, plan_override, window_left, window_right, softcap,
                                    alibi_slopes, dropout_p, rng_state);
    }
    const Variants variants{window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state};
    const variable_list outputs =
        VarlenFwdFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                 causal, deterministic, plan_override, variants);
    return {outputs[0], outputs[1]};
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_IMPL(flash_attn2, Autograd, m) {
    m.impl("fwd", &flash::fwd_autograd);
    m.impl("varlen_fwd", &flash::varlen_fwd_autograd);
}

// The Python module: `import flash_attn_cuda._autograd_torch<major>_<minor>` runs the registration above. Its
// name comes from setup.py (FLASH_ATTN2_AUTOGRAD_MODULE); limited API only, as _C.
#define FLASH_ATTN2_CONCAT_(a, b) a##b
#define FLASH_ATTN2_CONCAT(a, b) FLASH_ATTN2_CONCAT_(a, b)
#define FLASH_ATTN2_STR_(a) #a
#define FLASH_ATTN2_STR(a) FLASH_ATTN2_STR_(a)

PyMODINIT_FUNC FLASH_ATTN2_CONCAT(PyInit_, FLASH_ATTN2_AUTOGRAD_MODULE)(void) {
    static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, FLASH_ATTN2_STR(FLASH_ATTN2_AUTOGRAD_MODULE),
                                     "C++ autograd of torch.ops.flash_attn2.fwd and varlen_fwd", -1, nullptr};
    return PyModule_Create(&module_def);
}
