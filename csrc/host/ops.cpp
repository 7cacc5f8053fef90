// The ops that need no file of their own. Every op's schema and registration is generated from csrc/op_table.py
// (csrc/generated/ops_registration.cpp); the attention ops are in fwd.cpp and bwd.cpp, the plan op in plan_op.cpp.
#include "generated/ops.h"
#include "launch/kernel_registry.h"

namespace flash {

std::vector<std::string> compiled_kernels_op(const CompiledKernelsArgs& /*no arguments*/) { return compiled_kernels(); }

}  // namespace flash
