// What the two forward kernels (mma.sync and Hopper wgmma) share outside their main loops: which
// (query block, sequence, head, key split) a CTA computes and which key blocks that covers, and the
// epilogue's writes (one LSE per row, and the output tile from shared to global memory; or, for a
// split-KV launch, the fp32 partial output and LSE of this key split).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/block.h"
#include "kernels/block_info.h"
#include "launch/flash_params.h"
#include "kernels/paged_kv.h"
#include "kernels/row_mod.h"
#include "kernels/softmax.h"
#include "kernels/utils.h"  // copy_to_gmem

namespace flash {

using namespace cute;

template <int kBlockM, int kBlockN, bool kCausal, bool kWindow = false>
struct FwdTile {
    int m_block;      // query block
    int batch_idx;    // sequence
    int head_idx;     // query head
    int head_idx_k;   // its key/value head (MQA/GQA)
    BlockInfo binfo;  // with a split's keys only (see the constructor)
    BlockBounds<kBlockM, kBlockN, kCausal, kWindow> bounds;  // likewise
    BlockRange n_blocks_;  // key blocks [begin, end) of binfo's keys are this CTA's (none when end <= begin)

    // blockIdx.x = split index * (query blocks) + query block index, so the CTAs that share a key range
    // are adjacent and read it from L2 together. Causal query blocks near the end of the sequence visit
    // the most key blocks: they get the lowest indices, so they launch first and the short ones fill
    // the tail of the wave.
    //
    // Split-KV: each split takes an equal share of the key blocks this query block sees, and binfo and
    // bounds then present that share as the whole key sequence (BlockBounds::split_keys).
    __forceinline__ __device__ explicit FwdTile(const FwdParams& params)
        : batch_idx(sequence_of_cta(params)),
          head_idx(blockIdx.z),
          head_idx_k(head_idx / (params.num_heads / params.num_heads_k)),
          binfo(kWindow ? BlockInfo::of_cache(params, batch_idx) : BlockInfo(params, batch_idx)),
          bounds(BlockBounds<kBlockM, kBlockN, kCausal, kWindow>::of_sequence(params, binfo)) {
        if constexpr (kWindow) {
            if (params.gqa_pack > 1) { fold_window_into_keys(params); }
        }
        const int num_m_blocks = int(gridDim.x) / params.num_splits;
        const int split = int(blockIdx.x) / num_m_blocks;
        const int m = int(blockIdx.x) - split * num_m_blocks;
        m_block = kCausal ? num_m_blocks - 1 - m : m;
        n_blocks_ = {bounds.n_block_begin(m_block), bounds.n_block_end(m_block)};
        if (params.num_splits > 1) {
            int first_key;
            n_blocks_ = bounds.split_keys(n_blocks_, split, params.num_splits, first_key);
            binfo.k_start += first_key;
            binfo.seqlen_k -= first_key;
        }
    }

    // The tile of query block m_block_ of sequence `batch`, head `head`, for a kernel that picks its tiles itself
    // (the persistent warp-specialized forward) instead of from its CTA's index; without key splits or a window.
    __forceinline__ __device__ FwdTile(const FwdParams& params, int m_block_, int batch, int head)
        : m_block(m_block_),
          batch_idx(batch),
          head_idx(head),
          head_idx_k(head / (params.num_heads / params.num_heads_k)),
          binfo(params, batch),
          bounds(BlockBounds<kBlockM, kBlockN, kCausal, kWindow>::of_sequence(params, binfo)),
          n_blocks_{bounds.n_block_begin(m_block_), bounds.n_block_end(m_block_)} {
        static_assert(!kWindow, "windows run the variants kernels, which take their tiles from the grid");
    }

    // The variants kernels run packed GQA heads (Plan::gqa_pack) only for one query per head, and without ALiBi
    // or dropout (whose values follow each head's position): every row is then that one query, at position
    // seqlen_k - 1, and sees keys [seqlen_k - 1 - window_left, seqlen_k) (a right edge lies past the last key).
    // The bounds' rule would place row r at position r + seqlen_k - gqa_pack instead, so the window's left edge
    // becomes the start of the keys, and the bounds take both sides as unbounded (left seqlen_k, right seqlen_q
    // put every row's edges past the keys) over what is left.
    __forceinline__ __device__ void fold_window_into_keys(const FwdParams& params) {
        const int first_key = max(0, binfo.seqlen_k - 1 - params.window_left);
        binfo.k_start += first_key;
        binfo.seqlen_k -= first_key;
        bounds = BlockBounds<kBlockM, kBlockN, kCausal, kWindow>(binfo.seqlen_q, binfo.seqlen_k, binfo.seqlen_k,
                                                                 binfo.seqlen_q);
    }

    // Key split of this CTA, in [0, params.num_splits). Recomputed in the epilogue rather than kept in a
    // register through the main loop.
    __forceinline__ __device__ static int split_idx(const FwdParams& params) {
        return int(blockIdx.x) / (int(gridDim.x) / params.num_splits);
    }

    // False when the query block starts past this sequence's end (varlen grids are sized by the longest).
    __forceinline__ __device__ bool has_rows() const { return m_block * kBlockM < binfo.seqlen_q; }
    __forceinline__ __device__ int q_rows_left() const { return binfo.seqlen_q - m_block * kBlockM; }
    // The key blocks of binfo's keys that this CTA visits, [n_block_begin(), n_block_end()).
    __forceinline__ __device__ int n_block_begin() const { return n_blocks_.begin; }
    __forceinline__ __device__ int n_block_end() const { return n_blocks_.end; }
    // True for a split-KV launch: the epilogue writes partials (write_partial) instead of out and lse.
    __forceinline__ __device__ static bool is_split(const FwdParams& params) { return params.num_splits > 1; }

    // Folds the call's learnable sink (row_mod.h) into the finished rows: acc_o_rc the thread's normalized output
    // as (rows, cols), lse its rows' LSE, coords_rc the tile positions of acc_o_rc's values. Nothing without a
    // sink, and nothing in a split-KV CTA, whose split's LSE leaves without it: the sink joins once, at the
    // combine. One uniform branch, after finalize (OnlineSoftmax::fold_row_terms says why).
    template <class AccTensor, class LseTensor, class CoordTensor>
    __forceinline__ __device__ void fold_row_mod(const FwdParams& params, AccTensor& acc_o_rc, LseTensor& lse,
                                                 const CoordTensor& coords_rc) const {
        if (params.learnable_sink_ptr == nullptr || is_split(params)) { return; }
        constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
        OnlineSoftmax<kRows>::fold_row_terms(acc_o_rc, lse, LearnableSink{params.learnable_sink_ptr},
                                             [&](int r) { return query_head(params, get<0>(coords_rc(r, 0))); });
    }
    // The query head of the tile's row `row`: head_idx, or under GQA packing (FwdParams::gqa_pack) the row's own
    // head. Rows past the packed sequence (whose results are never written) take its last head, so that no read
    // leaves the sink tensor.
    __forceinline__ __device__ int query_head(const FwdParams& params, int row) const {
        if (params.gqa_pack == 1) { return head_idx; }
        return head_idx * params.gqa_pack + min(m_block * kBlockM + row, binfo.seqlen_q - 1);
    }

    // The CTA's query block and its key/value sequence in global memory, as (gQ, gK, gV): gQ (kBlockM,
    // kHeadDim), gK (kBlockN, kHeadDim, n) and gV (kBlockN, kHeadDimV, n). Tiles may run past seqlen or head_dim;
    // those positions are predicated.
    template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
    __forceinline__ __device__ auto gmem_qkv(const FwdParams& params) const {
        Tensor mQ = binfo.q_view<Element>(params, batch_idx, head_idx);    // (seqlen_q, head_dim)
        Tensor mK = binfo.k_view<Element>(params, binfo.k_batch, head_idx_k);  // (seqlen_k, head_dim)
        Tensor mV = binfo.v_view<Element>(params, binfo.k_batch, head_idx_k);  // (seqlen_k, head_dim)
        return make_tuple(local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0)),
                          local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0)),
                          local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, 0)));
    }

    // Loads key block n_block of K, V or both from a paged cache into shared memory with cp.async, as copy_zfill
    // would from a dense one: tile rows >= rows_left and columns >= head_dim read as zeros. Each row finds its page
    // through PagedKeyBlock, so a block may span any number of pages of any multiple of 16 rows, in any order;
    // loading K and V together finds each row's page once. like: the thread's (CPY, CPY_N, CPY_K) partition of one
    // dense block, whose CPY mode (8 contiguous elements) the chunks reuse; coords: the tile positions of that
    // partition; dst_k, dst_v: the thread's partitions of the shared-memory stages (the one not loaded is unused).
    // Every thread of the CTA calls it (warp shuffles).
    // kUnrolled: unroll the row loop, which turns the shared-memory addresses into constants but keeps every row's
    // pointers live at once; for kernels with registers to spare.
    template <bool kLoadK, bool kLoadV, bool kUnrolled, class TiledCopy, class LikeTensor, class DstK, class DstV,
              class CoordTensor>
    __forceinline__ __device__ void copy_paged(const FwdParams& params, const TiledCopy& tiled_copy,
                                               const LikeTensor& like, DstK& dst_k, DstV& dst_v,
                                               const CoordTensor& coords, int n_block) const {
        static_assert(kLoadK || kLoadV);
        using Element = typename DstK::value_type;
        const int rows_left = binfo.seqlen_k - n_block * kBlockN;
        const PagedKeyBlock<kBlockN> block(params, batch_idx, binfo.k_start + n_block * kBlockN,
                                           min(rows_left, kBlockN));
        const Element* k_head = static_cast<const Element*>(params.k_ptr) + head_idx_k * params.k_head_stride;
        const Element* v_head = static_cast<const Element*>(params.v_ptr) + head_idx_k * params.v_head_stride;
        constexpr int kRows = decltype(size<1>(like))::value;
#pragma unroll(kUnrolled ? kRows : 1)
        for (int m = 0; m < kRows; ++m) {
            const int row = get<0>(coords(0, m, 0));
            const bool row_ok = row < rows_left;
            const typename PagedKeyBlock<kBlockN>::Slot slot = block.locate(row);
            // Pages and rows are never negative: as unsigned 32-bit factors they cost one wide multiply each.
            const uint64_t page = uint32_t(slot.page);
            const uint64_t in_page = uint32_t(slot.in_page);
            // Rows past the end read nothing (zero fill) and keep the head's pointer, not one from a table entry
            // the block did not fetch.
            const Element* k_row = row_ok ? k_head + (page * params.k_batch_stride + in_page * params.k_row_stride)
                                          : k_head;
            const Element* v_row = row_ok ? v_head + (page * params.v_batch_stride + in_page * params.v_row_stride)
                                          : v_head;
            CUTE_UNROLL
            for (int k = 0; k < size<2>(like); ++k) {
                const int col = get<1>(coords(0, m, k));
                const bool ok = row_ok && col < params.head_dim;
                if constexpr (kLoadK) {
                    Tensor src = make_tensor(make_gmem_ptr(k_row + col), like(_, m, k).layout());  // (CPY)
                    copy(tiled_copy.with(ok), src, dst_k(_, m, k));
                }
                if constexpr (kLoadV) {
                    Tensor src = make_tensor(make_gmem_ptr(v_row + col), like(_, m, k).layout());  // (CPY)
                    copy(tiled_copy.with(ok), src, dst_v(_, m, k));
                }
            }
        }
    }

    // The epilogue of both forward kernels, once the output accumulator is normalized. acc_o_rc: the thread's
    // output accumulator as (rows, cols); coords_rc: the tile positions of its values; lse: the thread's rows;
    // sO: the (kBlockM, kHeadDim) staging tile in shared memory (Q's buffer); stage_o(): writes the thread's
    // output values (converted to the element type) into sO, the one step the two kernels do differently. A
    // split-KV CTA writes its fp32 partials instead.
    template <class GmemTiledCopyO, class AccTensor, class CoordTensor, class LseTensor, class SmemTensor, class StageO>
    __forceinline__ __device__ void epilogue(const FwdParams& params, const AccTensor& acc_o_rc,
                                             const CoordTensor& coords_rc, const LseTensor& lse, const SmemTensor& sO,
                                             StageO stage_o, int tidx) const {
        cp_async_wait<0>();  // Q may still be in flight when no key block was visited.
        if (is_split(params)) {
            write_partial(params, acc_o_rc, coords_rc, lse);
            return;
        }
        __syncthreads();  // every warp has finished reading Q, whose buffer sO reuses
        stage_o();
        write_lse(params, lse, coords_rc);
        __syncthreads();
        store_o<GmemTiledCopyO>(params, sO, tidx);
    }

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

    // Split-KV epilogue. acc_o_rc: the thread's output accumulator as (rows, cols), already divided by this
    // split's row sums; coords_rc: the tile positions of its values; lse: the thread's rows. Writes fp32
    // partials to this split's slice of o_accum and lse_accum. Both accumulator layouts (mma.sync and wgmma)
    // hold pairs of adjacent columns in adjacent col indices, stored as one 8-byte write. A row that saw no
    // key in this split (finalize returned LSE +inf and output 0) gets LSE -inf: weight 0 in the combine.
    template <class AccTensor, class CoordTensor, class LseTensor>
    __forceinline__ __device__ void write_partial(const FwdParams& params, const AccTensor& acc_o_rc,
                                                  const CoordTensor& coords_rc, const LseTensor& lse) const {
        static_assert(decltype(size<1>(acc_o_rc))::value % 2 == 0);
        const index_t row0 = ((index_t(split_idx(params)) * params.batch + batch_idx) * params.num_heads + head_idx) *
                                 index_t(params.seqlen_q) +
                             m_block * kBlockM;
        const int rows_left = q_rows_left();
        const bool writes_lse = get<1>(coords_rc(0, 0)) == 0;  // the thread holding each row's first column
        // One 64-bit base and 32-bit offsets inside the tile keep the address arithmetic light while all
        // of acc_o is live.
        float* o_tile = params.o_accum_ptr + row0 * params.head_dim;
        float* lse_tile = params.lse_accum_ptr + row0;
        CUTE_UNROLL
        for (int r = 0; r < size<0>(acc_o_rc); ++r) {
            const int row = get<0>(coords_rc(r, 0));
            if (row >= rows_left) { continue; }
            CUTE_UNROLL
            for (int c = 0; c < size<1>(acc_o_rc); c += 2) {
                const int col = get<1>(coords_rc(r, c));
                if (col < params.head_dim) {
                    *reinterpret_cast<float2*>(o_tile + row * params.head_dim + col) = make_float2(acc_o_rc(r, c),
                                                                                                   acc_o_rc(r, c + 1));
                }
            }
            if (writes_lse) { lse_tile[row] = lse(r) == INFINITY ? -INFINITY : lse(r); }
        }
    }

    // Copies the (kBlockM, kHeadDim) output tile sO (kHeadDim: V's) to this block's rows of out with 16 B stores,
    // leaving out rows past the sequence end and columns past head_dim_v.
    template <class GmemTiledCopyO, class SmemTensor>
    __forceinline__ __device__ void store_o(const FwdParams& params, const SmemTensor& sO, int tidx) const {
        store_o_rows<GmemTiledCopyO, kBlockM>(params, sO, 0, tidx);
    }
    // The same for rows [part * kRows, (part + 1) * kRows) of the tile only, by the threads of one tiled copy.
    template <class GmemTiledCopyO, int kRows, class SmemTensor>
    __forceinline__ __device__ void store_o_rows(const FwdParams& params, const SmemTensor& sO, int part,
                                                 int tidx) const {
        static_assert(kBlockM % kRows == 0);
        using Element = typename SmemTensor::value_type;
        constexpr int kHeadDim = decltype(size<1>(sO))::value;
        Tensor mO = binfo.o_view<Element>(params, batch_idx, head_idx);  // (seqlen_q, head_dim)
        Tensor gO = local_tile(mO, Shape<Int<kRows>, Int<kHeadDim>>{},
                               make_coord(m_block * (kBlockM / kRows) + part, 0));  // (kRows, kHeadDim)
        Tensor sO_rows = local_tile(sO, Shape<Int<kRows>, Int<kHeadDim>>{}, make_coord(part, 0));  // (kRows, kHeadDim)
        Tensor cO = make_identity_tensor(Shape<Int<kRows>, Int<kHeadDim>>{});  // (kRows, kHeadDim)
        GmemTiledCopyO gmem_tiled_copy_O;
        auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
        copy_to_gmem(gmem_tiled_copy_O, gmem_thr_copy_O.partition_S(sO_rows), gmem_thr_copy_O.partition_D(gO),
                     gmem_thr_copy_O.partition_D(cO), q_rows_left() - part * kRows, params.head_dim_v);
    }
};

}  // namespace flash
