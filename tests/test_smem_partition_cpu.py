"""The mma.sync backward's shared-memory partitions (csrc/kernels/smem_partition.h) against CuTe's own
ThrCopy::partition_S/partition_D: a host program, compiled with nvcc, compares every thread's offset of every element
of every partition the backward's kernels make (the five GEMMs' ldmatrix sources, the P and dS stores, the dK, dV
and dQ staging, the shared-memory side of the global loads and stores), for every tile of both tile sets at every
head dim, with and without the variants kernel's key-run warp layout, and for the narrow-V kernels. No GPU needed."""

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import load_generator

PROGRAM = r"""
#include <cstdio>
#include <cute/tensor.hpp>
#include "kernels/kernel_traits_bwd.h"
#include "kernels/smem_partition.h"
#include "launch/tile_size.h"
using namespace cute;

int bad = 0;
long checked = 0;

// One partition: CuTe's offset of each element against smem_partition's, for every thread. Mismatches are printed
// (the first few) and counted.
template <bool kSource, class TiledCopy, class SmemTensor, class ViewShape>
void compare(const char* what, const SmemTensor& tile, ViewShape view_shape) {
    const auto* base = raw_pointer_cast(tile.data());
    for (int t = 0; t < int(size<0>(typename TiledCopy::TiledLayout_TV{})); ++t) {
        auto thr = TiledCopy{}.get_thread_slice(t);
        auto ref = [&] {
            if constexpr (kSource) {
                return thr.partition_S(tile);
            } else {
                return thr.partition_D(tile);
            }
        }();
        // The global-memory copies' partitions take their shape from the global tensor's: CuTe's, mode by mode.
        auto shape_of = [&] {
            if constexpr (is_underscore<ViewShape>::value) {
                return product_each(shape(ref));
            } else {
                return view_shape;
            }
        };
        auto ours = [&] {
            if constexpr (kSource) {
                return flash::smem_partition_S<TiledCopy>(tile, t, shape_of());
            } else {
                return flash::smem_partition_D<TiledCopy>(tile, t, shape_of());
            }
        }();
        if (size(ref) != size(ours) || rank(ref) != rank(ours)) {
            if (bad++ < 8) { std::printf("%s: %d elements against %d\n", what, int(size(ref)), int(size(ours))); }
            return;
        }
        for (int i = 0; i < int(size(ref)); ++i) {
            auto coord = idx2crd(i, product_each(shape(ref)));  // the same element of both, mode by mode
            const long a = raw_pointer_cast(&ref(coord)) - base;
            const long b = raw_pointer_cast(&ours(coord)) - base;
            ++checked;
            if (a != b && bad++ < 8) {
                std::printf("%s: thread %d element %d: CuTe %ld, ours %ld\n", what, t, i, a, b);
            }
        }
    }
}

// Every partition flash_bwd_kernel makes, for one traits type, with the S/dP GEMM's plain or key-run warp layout.
template <class T, bool kKeyRuns>
void check_traits() {
    using Elem = typename T::Element;
    using MmaSdP = std::conditional_t<kKeyRuns, typename T::TiledMmaSdPKeyRuns, typename T::TiledMmaSdP>;
    MmaSdP mma_sdp;
    typename T::TiledMmadKV mma_dkv;
    typename T::TiledMmadV mma_dv;
    typename T::TiledMmadQ mma_dq;
    using CopyASdP = decltype(make_tiled_copy_A(typename T::SmemCopyAtom{}, mma_sdp));
    using CopyBSdP = decltype(make_tiled_copy_B(typename T::SmemCopyAtom{}, mma_sdp));
    using StoreSdP = decltype(make_tiled_copy_C(typename T::SmemCopyAtomStore{}, mma_sdp));
    using CopyAdKV = decltype(make_tiled_copy_A(typename T::SmemCopyAtomT{}, mma_dkv));
    using CopyBdKV = decltype(make_tiled_copy_B(typename T::SmemCopyAtomT{}, mma_dkv));
    using CopyAdV = decltype(make_tiled_copy_A(typename T::SmemCopyAtomT{}, mma_dv));
    using CopyBdV = decltype(make_tiled_copy_B(typename T::SmemCopyAtomT{}, mma_dv));
    using CopyAdQ = decltype(make_tiled_copy_A(typename T::SmemCopyAtom{}, mma_dq));
    using CopyBdQ = decltype(make_tiled_copy_B(typename T::SmemCopyAtomT{}, mma_dq));
    using StoredKV = decltype(make_tiled_copy_C(typename T::SmemCopyAtomStore{}, mma_dkv));
    using StoredV = decltype(make_tiled_copy_C(typename T::SmemCopyAtomStore{}, mma_dv));
    static Elem buffer[1];
    auto ptr = make_smem_ptr(buffer);
    auto sQ = make_tensor(ptr, typename T::SmemLayoutQ{});
    auto sdO = make_tensor(ptr, typename T::SmemLayoutdO{});
    auto sK = make_tensor(ptr, typename T::SmemLayoutKV{});
    auto sV = make_tensor(ptr, typename T::SmemLayoutV{});
    auto sP = make_tensor(ptr, typename T::SmemLayoutPdS{});
    auto sQt = make_tensor(ptr, typename T::SmemLayoutQt{});
    auto sdOt = make_tensor(ptr, typename T::SmemLayoutdOt{});
    auto sKt = make_tensor(ptr, typename T::SmemLayoutKt{});
    auto sPt = make_tensor(ptr, typename T::SmemLayoutPdSt{});
    auto sKt_chunks = local_tile(sKt, Shape<Int<T::kDqChunk>, Int<T::kBlockN>>{}, make_coord(_, 0));
    // The register views the kernel copies to and from, as it makes them.
    auto view_d = [](auto copy, auto frag) { return shape(copy.get_thread_slice(0).retile_D(frag)); };
    auto view_s = [](auto copy, auto frag) { return shape(copy.get_thread_slice(0).retile_S(frag)); };
    auto frag_a = [](auto mma, auto tile) { return make_tensor<Elem>(partition_shape_A(mma, shape(tile))); };
    auto frag_b = [](auto mma, auto tile) { return make_tensor<Elem>(partition_shape_B(mma, shape(tile))); };
    auto frag_c = [](auto mma, auto m, auto n) {
        return make_tensor<Elem>(shape(partition_fragment_C(mma, make_shape(m, n))));
    };
    compare<true, CopyASdP>("tSsQ", sQ, view_d(CopyASdP{}, frag_a(mma_sdp, sQ)));
    compare<true, CopyASdP>("tSsdO", sdO, view_d(CopyASdP{}, frag_a(mma_sdp, sdO)));
    compare<true, CopyBSdP>("tSsK", sK, view_d(CopyBSdP{}, frag_b(mma_sdp, sK)));
    compare<true, CopyBSdP>("tSsV", sV, view_d(CopyBSdP{}, frag_b(mma_sdp, sV)));
    compare<true, CopyAdV>("tKVsPt", sPt, view_d(CopyAdV{}, frag_a(mma_dv, sPt)));
    compare<true, CopyAdKV>("tKVsdSt", sPt, view_d(CopyAdKV{}, frag_a(mma_dkv, sPt)));
    compare<true, CopyBdV>("tKVsdOt", sdOt, view_d(CopyBdV{}, frag_b(mma_dv, sdOt)));
    compare<true, CopyBdKV>("tKVsQt", sQt, view_d(CopyBdKV{}, frag_b(mma_dkv, sQt)));
    compare<true, CopyAdQ>("tQsdS", sP, view_d(CopyAdQ{}, frag_a(mma_dq, sP)));
    compare<true, CopyBdQ>("tQsKt", sKt_chunks,
                           append(view_d(CopyBdQ{}, frag_b(mma_dq, sKt_chunks(_, _, 0))),
                                  Int<T::kHeadDim / T::kDqChunk>{}));
    compare<false, StoreSdP>("tPsP", sP, view_s(StoreSdP{}, frag_c(mma_sdp, Int<T::kBlockM>{}, Int<T::kBlockN>{})));
    compare<false, StoredKV>("sdK", sK, view_s(StoredKV{}, frag_c(mma_dkv, Int<T::kBlockN>{}, Int<T::kHeadDim>{})));
    compare<false, StoredV>("sdV", sV, view_s(StoredV{}, frag_c(mma_dv, Int<T::kBlockN>{}, Int<T::kHeadDimV>{})));
    // Global <-> shared: the loads of Q, dO, K and V, the stores of dK and dV.
    compare<false, typename T::GmemTiledCopyLoad>("tQsQ", sQ, _);
    compare<false, typename T::GmemTiledCopyLoadV>("tdOsdO", sdO, _);
    compare<false, typename T::GmemTiledCopyLoad>("tKsK", sK, _);
    compare<false, typename T::GmemTiledCopyLoadV>("tVsV", sV, _);
    compare<true, typename T::GmemTiledCopyStore>("tdKsK", sK, _);
    compare<true, typename T::GmemTiledCopyStoreV>("tdVsV", sV, _);
    // The dQ conversion kernel (dq_accum.h): its staging store per chunk of columns, and the global store.
    using StoredQ = decltype(make_tiled_copy_C(typename T::SmemCopyAtomStore{}, mma_dq));
    auto sdQ_chunks = local_tile(sQ, Shape<Int<T::kBlockM>, Int<T::kDqChunk>>{}, make_coord(0, _));
    compare<false, StoredQ>("tdQsdQ", sdQ_chunks,
                            append(view_s(StoredQ{}, frag_c(mma_dq, Int<T::kBlockM>{}, Int<T::kDqChunk>{})),
                                   Int<T::kHeadDim / T::kDqChunk>{}));
    compare<true, typename T::GmemTiledCopyStore>("tdQsdQ_store", sQ, _);
}

// One kernel's traits, as run_bwd_mma_sync makes them from the tile table.
template <int kHeadDim, bool kCausal, bool kKeyRuns, int kBudget, int kHeadDimV = kHeadDim>
void check_kernel() {
    constexpr flash::TileSet set = flash::tile_set(flash::KernelFamily::kMmaSync, flash::Pass::kBwd, kHeadDim, kBudget);
    if constexpr (set.exists()) {
        constexpr flash::TileShape tile = set.tile_for(kCausal);
        check_traits<flash::BwdKernelTraits<cutlass::bfloat16_t, kHeadDim, tile.block_m, tile.block_n, kBudget,
                                            tile.v_in_regs, kHeadDimV>,
                     kKeyRuns>();
    }
}

template <int kHeadDim, int kBudget>
void check_head_dim() {
    check_kernel<kHeadDim, false, false, kBudget>();
    check_kernel<kHeadDim, true, false, kBudget>();
    check_kernel<kHeadDim, false, true, kBudget>();
    check_kernel<kHeadDim, true, true, kBudget>();
    constexpr flash::NarrowVShape narrow = flash::narrow_v_shape(kHeadDim);
    if constexpr (narrow.exists()) {
        check_kernel<kHeadDim, false, false, kBudget, narrow.head_dim_v>();
        check_kernel<kHeadDim, true, false, kBudget, narrow.head_dim_v>();
    }
}

int main() {
    CHECKS
    std::printf("offsets checked: %ld, mismatches: %d\n", checked, bad);
    return bad != 0 || checked == 0;
}
"""


def cutlass_include():
    if os.environ.get("CUTLASS_PATH"):
        return Path(os.environ["CUTLASS_PATH"]) / "include"
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "source" / "include"


def head_dim_groups():
    """The head dims in groups of two, one host program each (about 5 GiB and 80 s of compile for two); one empty
    group where the tests stand without csrc/ (the test then skips)."""
    try:
        dims = list(load_generator().HEAD_DIMS)
    except pytest.skip.Exception:
        return [()]
    return [tuple(dims[i : i + 2]) for i in range(0, len(dims), 2)]


@pytest.mark.parametrize("head_dims", head_dim_groups(), ids=lambda dims: "hdim" + "_".join(map(str, dims)))
def test_smem_partitions_are_cutes(tmp_path, head_dims):
    generator = load_generator()  # skips where no csrc/ stands next to the tests
    nvcc = shutil.which("nvcc") or shutil.which(str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/nvcc"))
    include = cutlass_include()
    if nvcc is None or include is None or not (include / "cute" / "tensor.hpp").is_file():
        pytest.skip("needs nvcc and the CUTLASS headers")
    checks = "".join(
        f"check_head_dim<{head_dim}, flash::{budget}>();\n    "
        for head_dim in head_dims
        for budget in ("kSmem163KiB", "kSmem99KiB")
    )
    source = tmp_path / "smem_partition.cu"
    source.write_text(PROGRAM.replace("CHECKS", checks))
    binary = tmp_path / "smem_partition"
    build = subprocess.run(
        [
            nvcc,
            "-std=c++20",
            "--expt-relaxed-constexpr",
            f"-I{generator.CSRC}",
            f"-I{include}",
            str(source),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "mismatches: 0" in run.stdout, run.stdout[-4000:]
