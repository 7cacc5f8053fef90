// What the host code takes from libtorch, all through the LibTorch stable ABI (torch/csrc/stable, torch/headeronly
// and the AOTI C shim), so that one build loads into every torch from 2.11 on: tensors, allocation, the current
// CUDA stream, the device guard, and the errors the ops raise.
//
// Errors: FLASH_CHECK_ARG throws std::invalid_argument, which reaches Python as ValueError; FLASH_CHECK throws
// std::runtime_error (RuntimeError). The stable ABI has no TypeError, so a wrong dtype is a ValueError too.
#pragma once

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

namespace flash {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Numbers in messages go through std::to_string rather than a stream: streaming integers from an extension built
// with a newer GCC than the process's libstdc++ crashed on the H200 machine (torch 2.11).
inline std::string num(int64_t value) { return std::to_string(value); }

inline std::string to_text(const char* text) { return text; }
inline std::string to_text(const std::string& text) { return text; }
inline std::string to_text(ScalarType dtype) { return torch::headeronly::toString(dtype); }
template <typename Int, typename = std::enable_if_t<std::is_integral_v<Int> && !std::is_same_v<Int, bool>>>
std::string to_text(Int value) {
    return num(static_cast<int64_t>(value));
}

// The pieces of a message, concatenated.
template <typename... Pieces>
std::string cat(const Pieces&... pieces) {
    std::string text;
    ((text += to_text(pieces)), ...);
    return text;
}

[[noreturn]] void throw_argument_error(const std::string& message);
[[noreturn]] void throw_runtime_error(const std::string& message);

#define FLASH_CHECK_ARG(cond, ...)                                                 \
    do {                                                                           \
        if (!(cond)) { ::flash::throw_argument_error(::flash::cat(__VA_ARGS__)); } \
    } while (0)

#define FLASH_CHECK(cond, ...)                                                    \
    do {                                                                          \
        if (!(cond)) { ::flash::throw_runtime_error(::flash::cat(__VA_ARGS__)); } \
    } while (0)

// "cuda:0", "cpu", "meta": the device of `t` as torch prints it.
std::string device_str(const Tensor& t);
// "[2, 3]".
std::string shape_str(const int64_t* values, size_t count);
inline std::string shape_str(torch::headeronly::IntHeaderOnlyArrayRef values) {
    return shape_str(values.data(), values.size());
}

bool same_device(const Tensor& a, const Tensor& b);

// A new contiguous tensor on CUDA device `device`, uninitialized.
Tensor empty_cuda(std::initializer_list<int64_t> sizes, ScalarType dtype, int device);
Tensor empty_cuda(const int64_t* sizes, int ndim, ScalarType dtype, int device);
// A new contiguous tensor like `t` (shape, dtype and device), uninitialized.
Tensor empty_like_contiguous(const Tensor& t);
// Zeroes a contiguous tensor on `stream`: one memset, no dispatcher call.
void zero_async(const Tensor& t, cudaStream_t stream);

// The stream torch calls current on `device` (a cudaStream_t, not the stable ABI's stream id).
cudaStream_t current_stream(int device);

using DeviceGuard = torch::stable::accelerator::DeviceGuard;

}  // namespace flash
