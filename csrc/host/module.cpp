// `import flash_attn_cuda._C` loads this library, whose static initializers register the ops
// (STABLE_TORCH_LIBRARY) and kernels; the Python module itself is empty, and uses only the limited API
// (Py_LIMITED_API), so one build imports into every CPython from 3.10 on.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
    static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "flash_attn_cuda kernels (see torch.ops.flash_attn2)",
                                     -1, nullptr};
    return PyModule_Create(&module_def);
}
