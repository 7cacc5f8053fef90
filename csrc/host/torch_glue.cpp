// The AOTI C shim declares its CUDA entry points (the current stream among them) only under USE_CUDA; define it
// before the first include of the shim.
#ifndef USE_CUDA
#define USE_CUDA
#endif
#include "host/torch_glue.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/macros.h>
#include <torch/headeronly/util/shim_utils.h>

#include <stdexcept>

// A failed shim call raises RuntimeError. torch 2.14's headers define STABLE_TORCH_ERROR_CODE_CHECK, which adds
// the shim's own message (e.g. "CUDA out of memory") where the running torch keeps it (2.13 on); with older
// headers, or on torch 2.11 and 2.12, the error names the failed call and libtorch prints the cause to stderr.
// Either way an out-of-memory allocation is a RuntimeError, not torch.OutOfMemoryError: the stable ABI carries
// no exception types.
#ifdef STABLE_TORCH_ERROR_CODE_CHECK
#define FLASH_SHIM_CHECK(call) STABLE_TORCH_ERROR_CODE_CHECK(call)
#else
#define FLASH_SHIM_CHECK(call) TORCH_ERROR_CODE_CHECK(call)
#endif

namespace flash {

void throw_argument_error(const std::string& message) { throw std::invalid_argument(message); }

void throw_runtime_error(const std::string& message) { throw std::runtime_error(message); }

std::string device_str(const Tensor& t) {
    if (t.is_cuda()) { return "cuda:" + num(t.get_device_index()); }
    if (t.is_cpu()) { return "cpu"; }
    int32_t type = 0;
    FLASH_SHIM_CHECK(aoti_torch_get_device_type(t.get(), &type));
    return type == aoti_torch_device_type_meta() ? "meta" : "device type " + num(type);
}

std::string shape_str(const int64_t* values, size_t count) {
    std::string text = "[";
    for (size_t i = 0; i < count; ++i) { text += (i ? ", " : "") + num(values[i]); }
    return text + "]";
}

bool same_device(const Tensor& a, const Tensor& b) {
    int32_t type_a = 0, type_b = 0;
    FLASH_SHIM_CHECK(aoti_torch_get_device_type(a.get(), &type_a));
    FLASH_SHIM_CHECK(aoti_torch_get_device_type(b.get(), &type_b));
    return type_a == type_b && a.get_device_index() == b.get_device_index();
}

namespace {

int32_t shim_dtype(ScalarType dtype) {
    switch (dtype) {
        case ScalarType::Half: return aoti_torch_dtype_float16();
        case ScalarType::BFloat16: return aoti_torch_dtype_bfloat16();
        case ScalarType::Float: return aoti_torch_dtype_float32();
        case ScalarType::Int: return aoti_torch_dtype_int32();
        default: throw_runtime_error(cat("flash_attn_cuda allocates no tensors of dtype ", dtype));
    }
}

}  // namespace

Tensor empty_cuda(const int64_t* sizes, int ndim, ScalarType dtype, int device) {
    int64_t strides[8];
    FLASH_CHECK(ndim <= 8, "empty_cuda: at most 8 dims");
    int64_t stride = 1;
    for (int d = ndim - 1; d >= 0; --d) {
        strides[d] = stride;
        stride *= sizes[d] > 1 ? sizes[d] : 1;
    }
    AtenTensorHandle handle = nullptr;
    FLASH_SHIM_CHECK(aoti_torch_empty_strided(ndim, sizes, strides, shim_dtype(dtype), aoti_torch_device_type_cuda(),
                                              device, &handle));
    return Tensor(handle);
}

Tensor empty_cuda(std::initializer_list<int64_t> sizes, ScalarType dtype, int device) {
    return empty_cuda(sizes.begin(), static_cast<int>(sizes.size()), dtype, device);
}

Tensor empty_like_contiguous(const Tensor& t) {
    const auto sizes = t.sizes();
    return empty_cuda(sizes.data(), static_cast<int>(sizes.size()), t.scalar_type(), t.get_device_index());
}

void zero_async(const Tensor& t, cudaStream_t stream) {
    const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    if (bytes == 0) { return; }
    const cudaError_t err = cudaMemsetAsync(t.data_ptr(), 0, bytes, stream);
    FLASH_CHECK(err == cudaSuccess, "cudaMemsetAsync failed: ", cudaGetErrorString(err));
}

cudaStream_t current_stream(int device) {
    void* stream = nullptr;
    FLASH_SHIM_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
    return static_cast<cudaStream_t>(stream);
}

}  // namespace flash
