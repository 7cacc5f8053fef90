// What the two forward kernels (mma.sync and Hopper wgmma) share outside their main loops: which
// (query block, sequence, head) a CTA computes, and the epilogue's two writes (one LSE per row, and the
// output tile from shared to global memory).
#pragma once

#include <cute/tensor.hpp>

#include "block_info.h"
#include "flash_params.h"
#include "mask.h"

namespace flash {

using namespace cute;

template <int kBlockM, int kBlockN, bool kCausal>
struct FwdTile {
    int m_block;     // query block
    int batch_idx;   // sequence
    int head_idx;    // query head
    int head_idx_k;  // its key/value head (MQA/GQA)
    BlockInfo binfo;
    CausalMask<kBlockM, kBlockN, kCausal> mask;

    // Causal query blocks near the end of the sequence visit the most key blocks: they get the lowest
    // CTA indices, so they launch first and the short ones fill the tail of the wave.
    __forceinline__ __device__ explicit FwdTile(const FwdParams& params)
        : m_block(kCausal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x)),
          batch_idx(blockIdx.y),
          head_idx(blockIdx.z),
          head_idx_k(head_idx / (params.num_heads / params.num_heads_k)),
          binfo(params, batch_idx),
          mask(binfo.seqlen_q, binfo.seqlen_k) {}

    // False when the query block starts past this sequence's end (varlen grids are sized by the longest).
    __forceinline__ __device__ bool has_rows() const { return m_block * kBlockM < binfo.seqlen_q; }
    __forceinline__ __device__ int q_rows_left() const { return binfo.seqlen_q - m_block * kBlockM; }
    __forceinline__ __device__ int n_block_end() const { return mask.n_block_end(m_block); }

    // lse: the thread's rows; coords_rc: (rows, cols) tile positions of its accumulator values. The thread
    // holding a row's first column writes it.
    template <class LseTensor, class CoordTensor>
    __forceinline__ __device__ void write_lse(const FwdParams& params, const LseTensor& lse,
                                              const CoordTensor& coords_rc) const {
        if (get<1>(coords_rc(0, 0)) != 0) { return; }
        float* lse_row0 = params.lse_ptr + binfo.lse_offset(params, batch_idx, head_idx) + m_block * kBlockM;
        const int rows_left = q_rows_left();
        CUTE_UNROLL
        for (int r = 0; r < size(lse); ++r) {
            const int row = get<0>(coords_rc(r, 0));
            if (row < rows_left) { lse_row0[row] = lse(r); }
        }
    }

    // Copies the (kBlockM, kHeadDim) output tile sO to this block's rows of out with 16 B stores, leaving
    // out rows past the sequence end and columns past head_dim.
    template <class GmemTiledCopyO, class SmemTensor>
    __forceinline__ __device__ void store_o(const FwdParams& params, const SmemTensor& sO, int tidx) const {
        using Element = typename SmemTensor::value_type;
        constexpr int kHeadDim = decltype(size<1>(sO))::value;
        Tensor mO = binfo.o_view<Element>(params, batch_idx, head_idx);  // (seqlen_q, head_dim)
        Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));  // (kBlockM, kHeadDim)
        Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (kBlockM, kHeadDim)
        GmemTiledCopyO gmem_tiled_copy_O;
        auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
        Tensor tOsO = gmem_thr_copy_O.partition_S(sO);    // (CPY, CPY_M, CPY_K)
        Tensor tOgO = gmem_thr_copy_O.partition_D(gO);    // (CPY, CPY_M, CPY_K)
        Tensor tOcO = gmem_thr_copy_O.partition_D(cO);    // (CPY, CPY_M, CPY_K)
        Tensor tOrO = make_tensor<Element>(shape(tOgO));  // (CPY, CPY_M, CPY_K)
        copy(gmem_tiled_copy_O, tOsO, tOrO);
        const int rows_left = q_rows_left();
        CUTE_UNROLL
        for (int m = 0; m < size<1>(tOgO); ++m) {
            if (get<0>(tOcO(0, m, 0)) >= rows_left) { continue; }
            CUTE_UNROLL
            for (int k = 0; k < size<2>(tOgO); ++k) {
                if (get<1>(tOcO(0, m, k)) < params.head_dim) { copy(gmem_tiled_copy_O, tOrO(_, m, k), tOgO(_, m, k)); }
            }
        }
    }
};

}  // namespace flash
