// Empty on purpose: it stands in for CuTe's cute/atom/mma_traits_sm90_gmma.hpp in the mma.sync kernel units only (setup.py puts this
// directory ahead of CUTLASS's on their include path; csrc/mma_sync_include/README.md says why).
#pragma once
