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

#include <string>
#include <tuple>

namespace flash {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The ops' signatures, as their schemas in csrc/ops.cpp declare them.
using FwdSignature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        double, bool, bool, int64_t, const std::string&);
using BwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double, bool, bool, const std::string&);
using VarlenFwdSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
    double, bool, bool, const std::string&);
using VarlenBwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double, bool, bool,
    const std::string&);

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

// The non-tensor settings both passes share, kept in the context's saved_data. The plan override reaches the
// backward too, so a forced path holds for both passes.
void save_settings(AutogradContext* ctx, double softmax_scale, bool causal, bool deterministic,
                   const std::string& plan_override) {
    ctx->saved_data["softmax_scale"] = softmax_scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["deterministic"] = deterministic;
    ctx->saved_data["plan_override"] = plan_override;
}

// The gradient of `out` as the backward kernels read it: contiguous, and zeros when the loss did not use out
// (with materialize_grads off it then arrives undefined).
at::Tensor out_grad(const at::Tensor& grad, const at::Tensor& out) {
    return grad.defined() ? grad.contiguous() : at::zeros_like(out, at::MemoryFormat::Contiguous);
}

struct FwdFunction : public torch::autograd::Function<FwdFunction> {
    static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double softmax_scale, bool causal, bool deterministic, int64_t num_splits,
                                 const std::string& plan_override) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        auto [out, lse] = fwd_op().call(q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override);
        ctx->save_for_backward({q, k, v, out, lse});
        save_settings(ctx, softmax_scale, causal, deterministic, plan_override);
        ctx->set_materialize_grads(false);  // the LSE's gradient is ignored: no zeros are made for it
        return {out, lse};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const variable_list saved = ctx->get_saved_variables();
        auto [dq, dk, dv] = bwd_op().call(out_grad(grads[0], saved[3]), saved[0], saved[1], saved[2], saved[3],
                                          saved[4], ctx->saved_data["softmax_scale"].toDouble(),
                                          ctx->saved_data["causal"].toBool(),
                                          ctx->saved_data["deterministic"].toBool(),
                                          ctx->saved_data["plan_override"].toStringRef());
        return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

struct VarlenFwdFunction : public torch::autograd::Function<VarlenFwdFunction> {
    static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                 int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic,
                                 const std::string& plan_override) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        auto [out, lse] = varlen_fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               softmax_scale, causal, deterministic, plan_override);
        ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k});
        save_settings(ctx, softmax_scale, causal, deterministic, plan_override);
        ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
        ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
        ctx->set_materialize_grads(false);
        return {out, lse};
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const variable_list saved = ctx->get_saved_variables();
        auto [dq, dk, dv] = varlen_bwd_op().call(
            out_grad(grads[0], saved[3]), saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6],
            ctx->saved_data["max_seqlen_q"].toInt(), ctx->saved_data["max_seqlen_k"].toInt(),
            ctx->saved_data["softmax_scale"].toDouble(), ctx->saved_data["causal"].toBool(),
            ctx->saved_data["deterministic"].toBool(), ctx->saved_data["plan_override"].toStringRef());
        return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
                at::Tensor(), at::Tensor()};
    }
};

std::tuple<at::Tensor, at::Tensor> fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double softmax_scale, bool causal, bool deterministic,
                                                int64_t num_splits, const std::string& plan_override) {
    if (!needs_graph(q, k, v)) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        return fwd_op().call(q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override);
    }
    const variable_list outputs =
        FwdFunction::apply(q, k, v, softmax_scale, causal, deterministic, num_splits, plan_override);
    return {outputs[0], outputs[1]};
}

std::tuple<at::Tensor, at::Tensor> varlen_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                       int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                       double softmax_scale, bool causal, bool deterministic,
                                                       const std::string& plan_override) {
    if (!needs_graph(q, k, v)) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        return varlen_fwd_op().call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    causal, deterministic, plan_override);
    }
    const variable_list outputs =
        VarlenFwdFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                 causal, deterministic, plan_override);
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
