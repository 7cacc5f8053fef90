// Autograd for the forward ops in C++, registered at the Autograd dispatch key: one small library per torch
// minor version, built against that version's (non-stable) headers and loaded only into it
// (flash_attn_cuda/_ops.py). The ops themselves live in the stable-ABI library _C, which has no C++ autograd.
//
// Why it exists: decoding-sized calls are host-bound, and autograd in Python (torch.library.register_autograd,
// which _ops.py uses on a torch this build has no such library for) costs every call several microseconds more,
// with or without grad; here the backward node is recorded without leaving C++.
//
// Nothing here knows an op's arguments: the kernel is boxed, and reads the registered schemas. A forward op's
// gradients come from its backward op (csrc/op_table.py pairs them), whose every argument is `d<output>` (the
// gradient of a forward output), a forward output, or a forward argument of the same name, and whose every output
// `d<name>` is the gradient of the forward argument `<name>`. A new op argument therefore needs no code here.
// The backward ops have no autograd of their own (no double backward, as in flash-attn 2.x). As there, the LSE
// is an output that requires grad but passes no gradient back; marking it non-differentiable would trip compiled
// autograd, which asserts that no output of a C++ function is so marked.
// Python.h first, as Python asks (it sets feature macros the system headers read).
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstddef>
#include <string>
#include <vector>

#include "generated/autograd_pairs.h"

namespace flash {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Stack = std::vector<c10::IValue>;

// Where one argument of the backward op comes from.
struct Source {
    enum Kind { kOutputGrad, kOutput, kInput } kind;
    size_t index;  // the forward output or argument
};

// A forward op, its backward op, and how the backward's arguments and outputs map onto the forward's.
struct Pairing {
    c10::OperatorHandle fwd;
    c10::OperatorHandle bwd;
    std::vector<size_t> differentiable;  // forward arguments with a gradient, in the backward's output order
    std::vector<Source> sources;         // one per backward argument
    std::vector<bool> saved_input;       // per forward argument: the backward reads it
};

// Tensor and Tensor? arguments travel through save_for_backward, the others through saved_data.
bool is_tensor(const c10::Argument& arg) {
    const c10::TypePtr& type = arg.type();
    if (type->kind() == c10::TypeKind::OptionalType) {
        return type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType;
    }
    return type->kind() == c10::TypeKind::TensorType;
}

// saved_data's keys of the pairing index and of the differentiable arguments the call gave; no argument has
// these names.
constexpr const char* kPairingKey = "flash_attn2 pairing";
constexpr const char* kGivenKey = "flash_attn2 given";

// The positions in pairing.differentiable of the arguments this call gave: an optional tensor left out (None)
// cannot be a node input, whose metadata needs a device, and gets no gradient.
std::vector<int64_t> given_differentiable(const Pairing& pairing, const Stack& args, size_t first) {
    std::vector<int64_t> given;
    for (size_t r = 0; r < pairing.differentiable.size(); ++r) {
        const c10::IValue& value = args[first + pairing.differentiable[r]];
        if (value.isTensor() && value.toTensor().defined()) { given.push_back(static_cast<int64_t>(r)); }
    }
    return given;
}

size_t index_of(const std::vector<c10::Argument>& args, const std::string& name) {
    for (size_t i = 0; i < args.size(); ++i) {
        if (args[i].name() == name) { return i; }
    }
    return args.size();
}

Pairing make_pairing(const char* fwd_name, const char* bwd_name) {
    auto& dispatcher = c10::Dispatcher::singleton();
    Pairing p{dispatcher.findSchemaOrThrow(fwd_name, ""), dispatcher.findSchemaOrThrow(bwd_name, ""), {}, {}, {}};
    const auto& inputs = p.fwd.schema().arguments();
    const auto& outputs = p.fwd.schema().returns();
    p.saved_input.assign(inputs.size(), false);
    for (const c10::Argument& arg : p.bwd.schema().arguments()) {
        const std::string& name = arg.name();
        const size_t grad_of = name.size() > 1 && name[0] == 'd' ? index_of(outputs, name.substr(1)) : outputs.size();
        if (grad_of < outputs.size()) {
            p.sources.push_back({Source::kOutputGrad, grad_of});
        } else if (const size_t out = index_of(outputs, name); out < outputs.size()) {
            p.sources.push_back({Source::kOutput, out});
        } else {
            const size_t in = index_of(inputs, name);
            TORCH_CHECK(in < inputs.size(), bwd_name, "'s argument ", name, " is neither an output nor an argument of ",
                        fwd_name);
            p.sources.push_back({Source::kInput, in});
            p.saved_input[in] = true;
        }
    }
    for (const c10::Argument& ret : p.bwd.schema().returns()) {
        const std::string& name = ret.name();
        const size_t in = name.size() > 1 && name[0] == 'd' ? index_of(inputs, name.substr(1)) : inputs.size();
        TORCH_CHECK(in < inputs.size(), bwd_name, "'s output ", name, " is the gradient of no argument of ", fwd_name);
        p.differentiable.push_back(in);
    }
    return p;
}

// The pairings of generated/autograd_pairs.h, made from the schemas on first use (the op library registers
// them before this one loads).
const std::vector<Pairing>& pairings() {
    static const std::vector<Pairing> all = [] {
        std::vector<Pairing> made;
        for (const auto& [fwd, bwd] : kAutogradPairs) { made.push_back(make_pairing(fwd, bwd)); }
        return made;
    }();
    return all;
}

size_t pairing_index(const c10::OperatorHandle& op) {
    const auto& all = pairings();
    for (size_t i = 0; i < all.size(); ++i) {
        if (all[i].fwd == op) { return i; }
    }
    TORCH_CHECK(false, "flash_attn_cuda autograd: ", op.schema().name(), " has no backward op");
}

// A gradient of a forward output as the backward kernels read it: contiguous, and zeros when the loss did not
// use that output (with materialize_grads off it then arrives undefined).
at::Tensor output_grad(const at::Tensor& grad, const at::Tensor& output) {
    return grad.defined() ? grad.contiguous() : at::zeros_like(output, at::MemoryFormat::Contiguous);
}

struct FwdFunction : public torch::autograd::Function<FwdFunction> {
    // differentiable: the forward arguments of pairing.differentiable that the call gave (the node's inputs);
    // args: every argument.
    static variable_list forward(AutogradContext* ctx, at::TensorList differentiable, size_t pairing_at, Stack args) {
        (void)differentiable;  // the node's inputs; args holds them too
        const Pairing& pairing = pairings()[pairing_at];
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        Stack stack = args;
        pairing.fwd.callBoxed(stack);
        variable_list outputs;
        outputs.reserve(stack.size());
        for (const c10::IValue& value : stack) { outputs.push_back(value.toTensor()); }
        // The backward's tensors travel through save_for_backward (undefined for an absent optional), everything
        // else through saved_data under the argument's name.
        variable_list to_save = outputs;
        const auto& schema_args = pairing.fwd.schema().arguments();
        for (size_t i = 0; i < args.size(); ++i) {
            if (!pairing.saved_input[i]) { continue; }
            if (is_tensor(schema_args[i])) {
                to_save.push_back(args[i].isTensor() ? args[i].toTensor() : at::Tensor());
            } else {
                ctx->saved_data[schema_args[i].name()] = args[i];
            }
        }
        ctx->save_for_backward(std::move(to_save));
        ctx->saved_data[kPairingKey] = static_cast<int64_t>(pairing_at);
        ctx->saved_data[kGivenKey] = given_differentiable(pairing, args, 0);
        ctx->set_materialize_grads(false);  // gradients of unused outputs (the LSE's) are not made as zeros
        return outputs;
    }

    static variable_list backward(AutogradContext* ctx, variable_list grads) {
        const Pairing& pairing = pairings()[static_cast<size_t>(ctx->saved_data[kPairingKey].toInt())];
        const variable_list saved = ctx->get_saved_variables();
        const size_t num_outputs = pairing.fwd.schema().returns().size();
        const auto& schema_args = pairing.fwd.schema().arguments();
        // Saved tensor arguments follow the outputs, in argument order.
        std::vector<size_t> saved_at(schema_args.size(), 0);
        for (size_t i = 0, next = num_outputs; i < schema_args.size(); ++i) {
            if (pairing.saved_input[i] && is_tensor(schema_args[i])) { saved_at[i] = next++; }
        }
        Stack stack;
        stack.reserve(pairing.sources.size());
        for (const Source& source : pairing.sources) {
            if (source.kind == Source::kOutputGrad) {
                stack.emplace_back(output_grad(grads[source.index], saved[source.index]));
            } else if (source.kind == Source::kOutput) {
                stack.emplace_back(saved[source.index]);
            } else if (is_tensor(schema_args[source.index])) {
                const at::Tensor& t = saved[saved_at[source.index]];
                stack.push_back(t.defined() ? c10::IValue(t) : c10::IValue());
            } else {
                stack.push_back(ctx->saved_data[schema_args[source.index].name()]);
            }
        }
        pairing.bwd.callBoxed(stack);
        // One gradient per node input (the differentiable tensors the call gave), then none for the two other
        // arguments. For an optional argument left out, the backward op returns a placeholder (a schema has no
        // optional returns), which goes nowhere.
        const std::vector<int64_t> given = ctx->saved_data[kGivenKey].toIntVector();
        variable_list result(given.size() + 2);
        for (size_t n = 0; n < given.size(); ++n) { result[n] = stack[static_cast<size_t>(given[n])].toTensor(); }
        return result;
    }
};

// The Autograd kernel of every paired forward op: below autograd when no differentiable argument requires grad,
// else through FwdFunction, which records the backward node.
void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet /*keys*/, Stack* stack) {
    const size_t pairing_at = pairing_index(op);
    const Pairing& pairing = pairings()[pairing_at];
    const size_t num_args = op.schema().arguments().size();
    const size_t first = stack->size() - num_args;
    bool needs_graph = false;
    std::vector<at::Tensor> differentiable;
    if (at::GradMode::is_enabled()) {
        for (int64_t r : given_differentiable(pairing, *stack, first)) {
            const at::Tensor& t = (*stack)[first + pairing.differentiable[static_cast<size_t>(r)]].toTensor();
            differentiable.push_back(t);
            needs_graph = needs_graph || t.requires_grad();
        }
    }
    if (!needs_graph) {
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        op.callBoxed(stack);
        return;
    }
    Stack args(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
    stack->resize(first);
    const variable_list outputs = FwdFunction::apply(at::TensorList(differentiable), pairing_at, std::move(args));
    for (const at::Tensor& output : outputs) { stack->emplace_back(output); }
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_IMPL(flash_attn2, Autograd, m) {
    for (const auto& [fwd, bwd] : flash::kAutogradPairs) {
        (void)bwd;
        // "flash_attn2::fwd" -> "fwd": the library's namespace is implied here.
        m.impl(std::string(fwd).substr(std::string("flash_attn2::").size()).c_str(),
               torch::CppFunction::makeFromBoxedFunction<&flash::autograd_kernel>());
    }
}

// The Python module: `import flash_attn_cuda._autograd_torch<major>_<minor>` runs the registration above. Its
// name comes from setup.py (FLASH_ATTN2_AUTOGRAD_MODULE); limited API only, as _C.
#define FLASH_ATTN2_CONCAT_(a, b) a##b
#define FLASH_ATTN2_CONCAT(a, b) FLASH_ATTN2_CONCAT_(a, b)
#define FLASH_ATTN2_STR_(a) #a
#define FLASH_ATTN2_STR(a) FLASH_ATTN2_STR_(a)

PyMODINIT_FUNC FLASH_ATTN2_CONCAT(PyInit_, FLASH_ATTN2_AUTOGRAD_MODULE)(void) {
    static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, FLASH_ATTN2_STR(FLASH_ATTN2_AUTOGRAD_MODULE),
                                     "C++ autograd of the forward ops of torch.ops.flash_attn2", -1, nullptr};
    return PyModule_Create(&module_def);
}
