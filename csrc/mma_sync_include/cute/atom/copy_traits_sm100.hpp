// Empty on purpose: it stands in for CuTe's cute/atom/copy_traits_sm100.hpp in the mma.sync kernel units only (setup.py puts this
// directory ahead of CUTLASS's on their include path; csrc/mma_sync_include/README.md says why).
#pragma once
