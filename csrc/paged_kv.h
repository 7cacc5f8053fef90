// Where a key row of a paged KV cache lies. A sequence's keys fill its pages in block-table order, page_size rows
// each (FwdParams, "KV caches"); row r is row r % page_size of page block_table[b][r / page_size]. The table's
// entries are clamped to the cache's pages, so a bad entry reads a wrong page but never leaves the cache.
#pragma once

#include "flash_params.h"

namespace flash {

struct PagedRows {
    struct Slot {
        int page;  // index into the cache's pages
        int row;   // row inside that page
    };

    const int* table;  // the sequence's row of block_table_ptr
    int page_size;
    int last_page;

    __forceinline__ __device__ PagedRows(const FwdParams& params, int b)
        : table(params.block_table_ptr + b * params.block_table_batch_stride),
          page_size(params.page_size),
          last_page(params.num_pages - 1) {}

    // row: a key row of the sequence, below its length (which never exceeds the table's pages, k_capacity).
    __forceinline__ __device__ Slot locate(int row) const {
        const int entry = row / page_size;
        return {min(max(table[entry], 0), last_page), row - entry * page_size};
    }
};

}  // namespace flash
