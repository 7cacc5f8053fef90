// A thread's partition of a swizzled shared-memory tile for a tiled copy, built from the copy's (thread, value)
// layout and the tile's layout evaluated at a few coordinates, instead of by CuTe's partition algebra.
//
// ThrCopy::partition_S/partition_D compose the copy's (thread, value) layout with the tile's layout and then
// slice it at the thread, which on a swizzled tile decays into a plain layout whose strides the thread's own
// position decides (the swizzle's XOR becomes a +-2^j stride per mode bit). The result is cheap to run, but
// the algebra that finds it is the largest share of the mma.sync backward's compile memory
// (docs/design-notes.md, 'Where a backward kernel's compile memory goes'). The result is simple enough to build
// directly: each mode of the partition is split into digits (its factors of 2, then an odd rest), each digit's
// stride is the offset between the element it steps to and the thread's first element: a compile-time constant
// where every thread of the copy sees the same one (checked at compile time over all threads), else computed per
// thread once (digit_stride). tests/test_smem_partition_cpu.py compares every thread's offsets with CuTe's
// partition for every tile the kernels build ('Shared-memory partitions built without CuTe's partition algebra').
#pragma once

#include <array>
#include <utility>

#include <cute/tensor.hpp>

namespace flash {

using namespace cute;

namespace smem_partition_detail {

inline constexpr int kMaxDigits = 24;

// The digits of a partition of rank kRank (value mode, then one mode per tile mode): mode, size, place value.
struct Digits {
    int count = 0;
    int mode[kMaxDigits] = {};
    int size[kMaxDigits] = {};
    int place[kMaxDigits] = {};
    int first[5] = {};  // first digit of each mode; first[kRank] = count
};

template <class ViewShape>
constexpr Digits make_digits() {
    Digits d;
    constexpr int kRank = decltype(rank(ViewShape{}))::value;
    const std::array<int, kRank> extents = []<int... kMode>(std::integer_sequence<int, kMode...>) {
        return std::array<int, kRank>{int(size<kMode>(ViewShape{}))...};
    }(std::make_integer_sequence<int, kRank>{});
    for (int k = 0; k < kRank; ++k) {
        d.first[k] = d.count;
        int n = extents[k];
        int place = 1;
        while (n % 2 == 0) {
            d.mode[d.count] = k;
            d.size[d.count] = 2;
            d.place[d.count] = place;
            ++d.count;
            n /= 2;
            place *= 2;
        }
        if (n > 1 || d.first[k] == d.count) {  // the odd rest, or a mode of size 1
            d.mode[d.count] = k;
            d.size[d.count] = n;
            d.place[d.count] = place;
            ++d.count;
        }
    }
    d.first[kRank] = d.count;
    return d;
}

// The copy's (thread, value) -> column-major index into its tile (kTileM, kTileN), on the source side (kSource) or
// the destination side: what TiledCopy::get_layoutS_TV/get_layoutD_TV compute as a layout, evaluated at one
// (thread, value) instead, which spares the layout algebra. A thread is (atom thread, atom repeat) and a value
// (the side's atom value, value repeat); the atom's side -> reference layout maps the first two to the reference
// (thread, value) of TiledLayout_TV.
template <bool kSource, class TiledCopy>
struct CopyTileIndex {
    using AtomSide = std::conditional_t<kSource, typename TiledCopy::AtomLayoutSrc, typename TiledCopy::AtomLayoutDst>;
    using SideToRef = decltype(right_inverse(typename TiledCopy::AtomLayoutRef{}).compose(AtomSide{}));
    static constexpr int kAtomThreads = TiledCopy::AtomNumThr::value;
    static constexpr int kAtomRefValues = TiledCopy::AtomNumVal::value;
    static constexpr int kAtomValues = size<1>(AtomSide{});
    static constexpr int kThreads = size<0>(typename TiledCopy::TiledLayout_TV{});
    static constexpr int kValues = kAtomValues * (TiledCopy::TiledNumVal::value / kAtomRefValues);
    static_assert(size<0>(AtomSide{}) == kAtomThreads, "the atom's threads are the reference's");

    CUTE_HOST_DEVICE static constexpr int at(int t, int v) {
        const int ref = SideToRef{}(t % kAtomThreads, v % kAtomValues);
        return typename TiledCopy::TiledLayout_TV{}(ref % kAtomThreads + kAtomThreads * (t / kAtomThreads),
                                                    ref / kAtomThreads + kAtomRefValues * (v / kAtomValues));
    }
};

// The tile's element offset of (value v of thread t, tile repeats rest_m and rest_n, and index r of a third tensor
// mode), for the copy's (thread, value) -> tile index TV and tile (kTileM, kTileN).
template <class TV, class Layout, int kTileM, int kTileN>
CUTE_HOST_DEVICE constexpr int element_offset(int t, int v, int rest_m, int rest_n, int r) {
    const int idx = TV::at(t, v);
    const int m = idx % kTileM + rest_m * kTileM;
    const int n = idx / kTileM + rest_n * kTileN;
    if constexpr (decltype(rank(Layout{}))::value == 3) {
        return Layout{}(m, n, r);
    } else {
        return Layout{}(m, n);
    }
}

// The offset of thread t's element whose digits are all zero but one, of place value `place` in mode `mode`, set
// to x (its offset with all digits zero: element_offset(t, 0, 0, 0, 0)).
template <class TV, class Layout, int kTileM, int kTileN>
CUTE_HOST_DEVICE constexpr int digit_offset(int t, int mode, int place, int x) {
    int index[4] = {0, 0, 0, 0};
    index[mode] = x * place;
    return element_offset<TV, Layout, kTileM, kTileN>(t, index[0], index[1], index[2], index[3]);
}

// How a digit's stride is found. kStatic: every thread has the same (an odd digit's multiples included), a
// compile-time constant. kXor: every thread's element one step on lies at its first element's offset XOR a
// constant pattern (a step across the bits a swizzle reads or writes), so the stride is two instructions from the
// thread's base. kGeneral: the difference of two offsets, each evaluated at run time.
enum class StrideKind { kStatic, kXor, kGeneral };

struct DigitStride {
    StrideKind kind = StrideKind::kGeneral;
    int value = 0;  // kStatic: the stride; kXor: the pattern
};

// One constant evaluation per digit, which keeps each within the compiler's budget for one.
template <class TV, class Layout, int kTileM, int kTileN, int kThreads>
constexpr DigitStride digit_stride(Digits const& d, int j) {
    if (d.size[j] == 1) { return {StrideKind::kStatic, 0}; }
    auto offset = [&](int t, int x) { return digit_offset<TV, Layout, kTileM, kTileN>(t, d.mode[j], d.place[j], x); };
    const int first = offset(0, 1) - offset(0, 0);
    const int last = d.size[j] - 1;  // an odd digit's last multiple too (the others: the partition's unit test)
    bool same = true;
    for (int t = 1; t < kThreads && same; ++t) {
        same = offset(t, 1) - offset(t, 0) == first && offset(t, last) - offset(t, 0) == last * first;
    }
    if (same) { return {StrideKind::kStatic, first}; }
    if (d.size[j] == 2) {
        const int pattern = offset(0, 1) ^ offset(0, 0);
        bool xor_form = true;
        for (int t = 1; t < kThreads && xor_form; ++t) { xor_form = (offset(t, 0) ^ pattern) == offset(t, 1); }
        if (xor_form) { return {StrideKind::kXor, pattern}; }
    }
    return {StrideKind::kGeneral, 0};
}

// Everything about a partition that does not depend on the thread, as compile-time constants.
template <bool kSource, class TiledCopy, class TileLayout, class ViewShape>
struct Plan {
    using TV = CopyTileIndex<kSource, TiledCopy>;
    static constexpr int kTileM = size<0>(typename TiledCopy::Tiler_MN{});
    static constexpr int kTileN = size<1>(typename TiledCopy::Tiler_MN{});
    static constexpr int kRank = decltype(rank(ViewShape{}))::value;
    static_assert(is_static_v<TileLayout>, "the tile's layout is evaluated at compile time");
    static_assert(decltype(rank(TileLayout{}))::value == kRank - 1 && (kRank == 3 || kRank == 4),
                  "a tile of rank 2 or 3");
    static_assert(size<0>(ViewShape{}) == TV::kValues, "the value mode holds the copy's values per thread");
    static_assert(size<1>(ViewShape{}) * kTileM == size<0>(TileLayout{}) &&
                      size<2>(ViewShape{}) * kTileN == size<1>(TileLayout{}),
                  "the copy's tile divides the tensor");
    static constexpr Digits d = make_digits<ViewShape>();
    template <int kJ>
    static constexpr DigitStride kStride = digit_stride<TV, TileLayout, kTileM, kTileN, TV::kThreads>(d, kJ);

    CUTE_HOST_DEVICE static int base(int t) { return element_offset<TV, TileLayout, kTileM, kTileN>(t, 0, 0, 0, 0); }

    // Digit kJ's stride for thread t, whose first element is at `base`.
    template <int kJ>
    CUTE_HOST_DEVICE static auto stride(int t, int base) {
        constexpr DigitStride kS = kStride<kJ>;
        if constexpr (kS.kind == StrideKind::kStatic) {
            return Int<kS.value>{};
        } else if constexpr (kS.kind == StrideKind::kXor) {
            return (base ^ kS.value) - base;
        } else {
            return digit_offset<TV, TileLayout, kTileM, kTileN>(t, d.mode[kJ], d.place[kJ], 1) - base;
        }
    }

    // Mode kMode's digits as one layout: nested where the mode has several digits; the value mode coalesced where
    // its strides are all static (the copy atom reads it as one vector).
    template <int kMode>
    CUTE_HOST_DEVICE static auto mode_layout(int t, int base) {
        constexpr int kFirst = d.first[kMode];
        constexpr int kCount = d.first[kMode + 1] - kFirst;
        auto digits = [t, base]<int... kI>(std::integer_sequence<int, kI...>) {
            return make_layout(make_layout(Int<d.size[kFirst + kI]>{}, stride<kFirst + kI>(t, base))...);
        }(std::make_integer_sequence<int, kCount>{});
        if constexpr (kCount == 1) {
            return layout<0>(digits);
        } else if constexpr (kMode == 0 && is_static_v<decltype(digits)>) {
            return coalesce(digits);
        } else {
            return digits;
        }
    }

    CUTE_HOST_DEVICE static auto thread_layout(int t, int base) {
        return [t, base]<int... kMode>(std::integer_sequence<int, kMode...>) {
            return make_layout(mode_layout<kMode>(t, base)...);
        }(std::make_integer_sequence<int, kRank>{});
    }
};

}  // namespace smem_partition_detail

// Thread tidx's (CPY, CPY_M, CPY_N[, a third mode]) partition of the shared-memory tensor `tile` for TiledCopy, the
// source side (kSource) or the destination side: the same offsets as ThrCopy::partition_S/D, in a layout of shape
// ViewShape (the register view's, from retile_D/retile_S, with the third mode appended) whose modes are split into
// digits. Requires a tile of rank 2 or 3 with a static layout, the copy's tile dividing its first two modes.
template <bool kSource, class TiledCopy, class SmemTensor, class ViewShape>
CUTE_HOST_DEVICE auto smem_partition(const SmemTensor& tile, int tidx, ViewShape) {
    using P = smem_partition_detail::Plan<kSource, TiledCopy, typename SmemTensor::layout_type, ViewShape>;
    const int base = P::base(tidx);
    return make_tensor(tile.data() + base, P::thread_layout(tidx, base));
}

namespace smem_partition_detail {
// A register view given as the register tensor or as its shape: its shape.
template <class View>
CUTE_HOST_DEVICE auto view_shape(const View& view) {
    if constexpr (is_tensor<View>::value) {
        return shape(view);
    } else {
        return view;
    }
}
}  // namespace smem_partition_detail

// Source side (ThrCopy::partition_S) and destination side (ThrCopy::partition_D), the register view given as the
// register tensor or its shape.
template <class TiledCopy, class SmemTensor, class View>
CUTE_HOST_DEVICE auto smem_partition_S(const SmemTensor& tile, int tidx, const View& view) {
    return smem_partition<true, TiledCopy>(tile, tidx, smem_partition_detail::view_shape(view));
}
template <class TiledCopy, class SmemTensor, class View>
CUTE_HOST_DEVICE auto smem_partition_D(const SmemTensor& tile, int tidx, const View& view) {
    return smem_partition<false, TiledCopy>(tile, tidx, smem_partition_detail::view_shape(view));
}

}  // namespace flash
