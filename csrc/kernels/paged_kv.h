// Where the key rows of one key block of a paged KV cache lie. A sequence's keys fill its pages in block-table
// order, page_size rows each (FwdParams, "KV caches"); row r is row r % page_size of page
// block_table[b][r / page_size]. The table's entries are clamped to the cache's pages, so a bad entry reads a
// wrong page but never leaves the cache.
//
// A thread's rows of a key block lie on up to kBlockN / 16 + 1 pages (page sizes are multiples of 16). Rather
// than each thread reading the table for each of its rows, one load by every lane of a warp fetches all of the
// block's table entries at once, and each row then takes its page from the lane holding it with a shuffle. The
// copies of a block then wait on one table read instead of one per row, which serialized decoding's loads.
#pragma once

#include "launch/flash_params.h"

namespace flash {

template <int kBlockN>
struct PagedKeyBlock {
    static_assert(kBlockN / 16 + 1 <= 32, "a key block's table entries must fit one per lane of a warp");

    struct Slot {
        int page;     // index into the cache's pages
        int in_page;  // row inside that page
    };

    int lane_page;        // page of the block's table entry number `lane` (0 for lanes past the block's entries)
    int first_offset;     // position of the block's first row in its page
    int page_size;
    float inv_page_size;  // 1 / page_size, to find a row's entry without an integer division

    // b: the sequence; first_row: the block's first row of the sequence; rows: the block's rows below the
    // sequence end (which never runs past the table's pages, k_capacity). Every lane of the warp must call it.
    __forceinline__ __device__ PagedKeyBlock(const FwdParams& params, int b, int first_row, int rows)
        : page_size(params.page_size), inv_page_size(1.0f / float(params.page_size)) {
        const int first_entry = first_row / page_size;
        first_offset = first_row - first_entry * page_size;
        const int entries = rows > 0 ? (first_offset + rows - 1) / page_size + 1 : 0;
        const int lane = int(threadIdx.x % 32);
        lane_page = 0;
        if (lane < entries) {
            const int page = params.block_table_ptr[b * params.block_table_batch_stride + first_entry + lane];
            lane_page = min(max(page, 0), params.num_pages - 1);
        }
    }

    // row: a row of the block, counted from its first row. Every lane of the warp must call it together (a
    // shuffle); the slot of a row at or past the block's `rows` is meaningless.
    __forceinline__ __device__ Slot locate(int row) const {
        // first_offset + row < page_size + kBlockN, so the quotient is small and the float estimate is off by
        // at most one either way; the two corrections make it exact.
        const int offset = first_offset + row;
        int entry = __float2int_rz(float(offset) * inv_page_size);
        int in_page = offset - entry * page_size;
        if (in_page >= page_size) {
            in_page -= page_size;
            ++entry;
        }
        if (in_page < 0) {
            in_page += page_size;
            --entry;
        }
        return {__shfl_sync(0xffffffffu, lane_page, entry & 31), in_page};
    }
};

}  // namespace flash
