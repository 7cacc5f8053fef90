// `import flash_attn_cuda._C` loads this library, whose static initializers register the ops
// (TORCH_LIBRARY) and kernels; the Python module itself is empty.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
    static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "flash_attn_cuda kernels (see torch.ops.flash_attn2)", -1,
                                     nullptr};
    return PyModule_Create(&module_def);
}
