// The quantized product on ARMv8.2-A with the dot product extension: integer dot products with sdot (vdotq_s32),
// as llama.cpp's ARM kernels, and the reference's float sums (quantized_core.h) bit for bit.
//
// A group's 32 weights become two registers of signed bytes, x's group two registers in the same order:
//  4 bits: the 16 packed bytes, low nibbles (even values) in one register and high nibbles (odd values) in the other;
//  2 bits: the 8 packed bytes twice, each half shifted apart: values 4k, 4k + 1 in one register, 4k + 2, 4k + 3 in
//    the other (k = 0..7);
//  8 bits: the bytes minus 128 (sdot multiplies signed bytes only); 128 * sum(qx) is added back as an integer;
//  3, 5, 6 bits: each value's low and high byte picked by table lookups (vqtbl1q_u8), shifted per lane and or-ed,
//    in x's natural order.
// A chunk of 4 groups' int32 sums fold by two vpaddq into one register (lane g = group g of the chunk), which is
// converted and multiplied in the reference's order: its lanes are acc's lanes. Where the compiler targets i8mm,
// pairs of x's rows go against pairs of weight rows with smmla instead (`tile_pairs`), to the same int32 sums.
#pragma once

#include <arm_neon.h>

#include "quantized_core.h"

namespace akunu::quantized::neon {

constexpr int CHUNK = 4;        // groups whose dot products fold into one register of 4 lanes, acc's lanes
constexpr int TILE_ROWS = 4;    // rows of x sharing a chunk's unpacked weights in registers
constexpr int PREFETCH = 512;   // bytes ahead along a weight row

// Position k of a group's unpacked registers (16 per register) holds value order(bits, k) of the group.
inline int order(int bits, int k) {
  if (bits == 4) return k < 16 ? 2 * k : 2 * (k - 16) + 1;
  if (bits == 2) return 4 * (k % 8) + k / 8;
  return k;
}

// x's rows quantized per group in the order the weights unpack to, padded to whole chunks (and to 16 groups for the
// biases' sums) with zeros, each group's step, sum(qx) and dx * sum(qx).
struct QuantizedRows : PaddedRows {
  QuantizedRows(const float* x, int rows_, int columns, int bits) : PaddedRows(rows_, columns, CHUNK) {
    alignas(16) uint8_t picks[GROUP];
    for (int k = 0; k < GROUP; k++) picks[k] = uint8_t(order(bits, k));
    const uint8x16_t pick_low = vld1q_u8(picks), pick_high = vld1q_u8(picks + 16);
    for (int m = 0; m < rows; m++)
      for (int g = 0; g < groups; g++) {
        const float* p = x + size_t(m) * columns + size_t(g) * GROUP;
        float32x4_t v[8], amax = vdupq_n_f32(0.0f);
        for (int k = 0; k < 8; k++) amax = vmaxq_f32(amax, vabsq_f32(v[k] = vld1q_f32(p + 4 * k)));
        const float d = vmaxvq_f32(amax) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        int32x4_t q32[8], total = vdupq_n_s32(0);
        for (int k = 0; k < 8; k++) {
          q32[k] = vcvtnq_s32_f32(vmulq_n_f32(v[k], inverse));  // round half to even
          total = vaddq_s32(total, q32[k]);
        }
        int8x16_t natural[2];
        for (int h = 0; h < 2; h++) {
          const int16x8_t low = vcombine_s16(vqmovn_s32(q32[4 * h]), vqmovn_s32(q32[4 * h + 1]));
          const int16x8_t high = vcombine_s16(vqmovn_s32(q32[4 * h + 2]), vqmovn_s32(q32[4 * h + 3]));
          natural[h] = vcombine_s8(vqmovn_s16(low), vqmovn_s16(high));
        }
        int8_t* out = group_values(m, g);
        const int8x16x2_t table = {{natural[0], natural[1]}};
        vst1q_s8(out, vqtbl2q_s8(table, pick_low));
        vst1q_s8(out + 16, vqtbl2q_s8(table, pick_high));
        set_group(m, g, d, vaddvq_s32(total));
      }
  }
};

// 4 scales or biases from `from` on as float32.
inline float32x4_t load4(const uint8_t* from, Scale type) {
  if (type == Scale::f32) return vld1q_f32(reinterpret_cast<const float*>(from));
  const uint16x4_t h = vld1_u16(reinterpret_cast<const uint16_t*>(from));
  if (type == Scale::f16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
  return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

__attribute__((noinline)) inline float32x4_t load_few(const uint8_t* from, Scale type, int count) {
  alignas(16) uint8_t held[16] = {};
  std::memcpy(held, from, (type == Scale::f32 ? 4 : 2) * size_t(std::max(count, 0)));
  return load4(held, type);
}

// `count` scales or biases from i on as float32, zero past `count` (< 4): read straight from memory unless the
// 4 would pass `size`, the array's length.
inline float32x4_t load4(const void* p, Scale type, size_t i, int count, size_t size) {
  const uint8_t* from = static_cast<const uint8_t*>(p) + i * (type == Scale::f32 ? 4 : 2);
  if (count >= 4) return load4(from, type);
  if (i + 4 > size) return load_few(from, type, count);
  const int32x4_t lanes = {0, 1, 2, 3};
  const uint32x4_t kept = vcltq_s32(lanes, vdupq_n_s32(count));
  return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(load4(from, type)), kept));
}

// How a group of BITS (3, 5 or 6) bits is cut: value 16h + k is read from the 16 bytes at 2 * BITS * h (h = 0, 1),
// its low byte shifted right and its high byte (if it reaches into one; else lookup index 255 gives 0) shifted left.
template <int BITS>
struct Cut {
  uint8x16_t low_pick, high_pick;
  int8x16_t low_shift, high_shift;
  Cut() {
    alignas(16) uint8_t low[16], high[16];
    alignas(16) int8_t right[16], left[16];
    for (int k = 0; k < 16; k++) {
      const int bit = k * BITS, spills = bit % 8 + BITS > 8;
      low[k] = uint8_t(bit / 8);
      high[k] = spills ? uint8_t(bit / 8 + 1) : 255;
      right[k] = int8_t(-(bit % 8));
      left[k] = int8_t(spills ? 8 - bit % 8 : 0);
    }
    low_pick = vld1q_u8(low);
    high_pick = vld1q_u8(high);
    low_shift = vld1q_s8(right);
    high_shift = vld1q_s8(left);
  }
};

template <int BITS>
constexpr int group_bytes = 4 * BITS;

// The two registers of the group at p (4 * BITS bytes; 3, 5, 6 bits read up to 2 * BITS + 16 bytes on), as signed
// bytes in the order `order` gives: unsigned values for BITS < 8, values - 128 for 8 bits.
template <int BITS>
inline void unpack(const uint8_t* p, const Cut<BITS>& cut, int8x16_t* out) {
  if constexpr (BITS == 4) {
    const uint8x16_t v = vld1q_u8(p);
    out[0] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0f)));
    out[1] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
  } else if constexpr (BITS == 8) {
    out[0] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p), vdupq_n_u8(0x80)));
    out[1] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + 16), vdupq_n_u8(0x80)));
  } else if constexpr (BITS == 2) {
    const uint8x8_t v = vld1_u8(p);
    const uint8x16_t twice = vcombine_u8(v, v), three = vdupq_n_u8(3);
    out[0] = vreinterpretq_s8_u8(vandq_u8(vshlq_u8(twice, vcombine_s8(vdup_n_s8(0), vdup_n_s8(-2))), three));
    out[1] = vreinterpretq_s8_u8(vandq_u8(vshlq_u8(twice, vcombine_s8(vdup_n_s8(-4), vdup_n_s8(-6))), three));
  } else {
    for (int h = 0; h < 2; h++) {
      const uint8x16_t bytes = vld1q_u8(p + 2 * BITS * h);
      const uint8x16_t low = vshlq_u8(vqtbl1q_u8(bytes, cut.low_pick), cut.low_shift);
      const uint8x16_t high = vshlq_u8(vqtbl1q_u8(bytes, cut.high_pick), cut.high_shift);
      out[h] = vreinterpretq_s8_u8(vandq_u8(vorrq_u8(low, high), vdupq_n_u8((1 << BITS) - 1)));
    }
  }
}

// The bytes of a chunk that would be read past the end of the weights' memory, copied into `held` (zeros after).
__attribute__((noinline)) inline const uint8_t* held_copy(const uint8_t* p, const uint8_t* end, uint8_t* held, size_t bytes) {
  std::memset(held, 0, bytes);
  std::memcpy(held, p, std::min<size_t>(bytes, end - std::min(end, p)));
  return held;
}

// The chunk's 4 groups' exact dot products with row m of x (lane g = group g of the chunk), before the zero point.
inline int32x4_t chunk_dots(const int8x16_t* w, const int8_t* x) {
  int32x4_t sums[CHUNK];
  for (int g = 0; g < CHUNK; g++) {
    const int32x4_t first = vdotq_s32(vdupq_n_s32(0), w[2 * g], vld1q_s8(x + GROUP * g));
    sums[g] = vdotq_s32(first, w[2 * g + 1], vld1q_s8(x + GROUP * g + 16));
  }
  return vpaddq_s32(vpaddq_s32(sums[0], sums[1]), vpaddq_s32(sums[2], sums[3]));
}

// acc (lane g: groups g, g + 4, ... of the row) += the chunk's dots times dx * scale, as the reference. `per_total`
// times sum(qx) turns sdot's sums into q . qx - zero * sum(qx): 128 - zero for 8 bits (stored minus 128), else -zero.
inline float32x4_t add_chunk(float32x4_t acc, int32x4_t dots, const float* steps, const int32_t* totals,
                             float32x4_t scales, int per_total) {
  if (per_total) dots = vmlaq_n_s32(dots, vld1q_s32(totals), per_total);  // exact: |128 * sum(qx)| < 2^20
  const float32x4_t factors = vmulq_f32(vld1q_f32(steps), scales);
  return vfmaq_f32(acc, vcvtq_f32_s32(dots), factors);
}

// Output o from acc: the biases' terms and the reduction of the reference (v's 16 lanes in 4 registers).
inline float finish(const Weights& w, int o, const float* sums, float32x4_t acc) {
  const int groups = w.groups(), n = o % 4;
  float32x4_t v[4];
  for (int lane = 0; lane < 4; lane++) v[lane] = lane == n ? acc : vdupq_n_f32(0.0f);
  const size_t at = size_t(o) * groups, size = size_t(w.outputs) * groups;
  for (int g = 0; w.biases && g < groups; g += 16)
    for (int lane = 0; lane < 4; lane++) {
      const int first = g + 4 * lane;
      const float32x4_t biases = load4(w.biases, w.type, at + first, std::max(groups - first, 0), size);
      v[lane] = vfmaq_f32(v[lane], biases, vld1q_f32(sums + first));
    }
  // s_L = (v[4L] + v[4L + 2]) + (v[4L + 1] + v[4L + 3]) for the 4 registers at once, then (s0 + s2) + (s1 + s3)
  const float32x4_t even = vpaddq_f32(vuzp1q_f32(v[0], v[1]), vuzp1q_f32(v[2], v[3]));  // v[4L] + v[4L + 2]
  const float32x4_t odd = vpaddq_f32(vuzp2q_f32(v[0], v[1]), vuzp2q_f32(v[2], v[3]));   // v[4L + 1] + v[4L + 3]
  const float32x4_t s = vaddq_f32(even, odd);
  return vpadds_f32(vget_low_f32(vaddq_f32(s, vextq_f32(s, s, 2))));
}

struct ProductCall {
  const QuantizedRows& x;
  const Weights& w;
  float* y;
  int64_t y_stride;
};

// Rows [m0, m0 + MR) of x against weight row o, chunk by chunk, each chunk unpacked once for the MR rows. Groups
// past the row's end are read from the next row's memory (x's padding zeros make their products zero); a chunk that
// would read past the weights' memory is read from a copy.
template <int BITS, int MR>
inline void tile(const ProductCall& call, const Cut<BITS>& cut, int o, int m0) {
  constexpr int chunk_bytes = CHUNK * group_bytes<BITS>;
  const QuantizedRows& x = call.x;
  const int groups = x.groups, chunks = x.chunks;
  const int per_total = (BITS == 8 ? 128 : 0) - call.w.zero();
  const Scale type = call.w.type;
  const size_t scale_count = size_t(call.w.outputs) * groups, first_scale = size_t(o) * groups;
  const void* scales = call.w.scales;
  const uint8_t* row = call.w.packed + size_t(o) * call.w.row_bytes();
  const uint8_t *end = call.w.end(), *last_safe = end - chunk_bytes - 16;
  const int8_t* q[MR];
  const float* steps[MR];
  const int32_t* totals[MR];
  float32x4_t acc[MR];
  for (int m = 0; m < MR; m++) {
    q[m] = x.q_row(m0 + m);
    steps[m] = x.steps_row(m0 + m);
    totals[m] = x.totals_row(m0 + m);
    acc[m] = vdupq_n_f32(0.0f);
  }
  alignas(16) uint8_t held[chunk_bytes + 32];
  for (int c = 0; c < chunks; c++) {
    const uint8_t* p = row + c * chunk_bytes;
    __builtin_prefetch(p + PREFETCH);
    if constexpr (chunk_bytes > 64) __builtin_prefetch(p + PREFETCH + 64);
    if (p > last_safe) p = held_copy(p, end, held, sizeof(held));
    int8x16_t w[2 * CHUNK];
    for (int g = 0; g < CHUNK; g++) unpack<BITS>(p + g * group_bytes<BITS>, cut, w + 2 * g);
    const float32x4_t chunk_scales = load4(scales, type, first_scale + c * CHUNK, groups - c * CHUNK, scale_count);
    for (int m = 0; m < MR; m++) {
      const int32x4_t dots = chunk_dots(w, q[m] + size_t(c) * CHUNK * GROUP);
      acc[m] = add_chunk(acc[m], dots, steps[m] + c * CHUNK, totals[m] + c * CHUNK, chunk_scales, per_total);
    }
  }
  for (int m = 0; m < MR; m++) call.y[(m0 + m) * call.y_stride + o] = finish(call.w, o, x.sums_row(m0 + m), acc[m]);
}

#if defined(__ARM_FEATURE_MATMUL_INT8)
// Weight rows o, o1 against pairs of x's rows with smmla (vmmlaq_s32), each operand 8 bytes of either row: a group's
// 4 smmla leave its 4 dot products in one register, [m.o, m.o1, m1.o, m1.o1]. A chunk's 4 such registers are
// transposed to one register per (x row, weight row), lane g = group g, and summed on as `tile` sums them.
template <int BITS, int PAIRS>
inline void tile_pairs(const ProductCall& call, const Cut<BITS>& cut, int o, int o1, int m0) {
  constexpr int chunk_bytes = CHUNK * group_bytes<BITS>;
  const QuantizedRows& x = call.x;
  const int groups = x.groups, chunks = x.chunks, outputs[2] = {o, o1};
  const int per_total = (BITS == 8 ? 128 : 0) - call.w.zero();
  const size_t scale_count = size_t(call.w.outputs) * groups;
  const uint8_t *end = call.w.end(), *last_safe = end - chunk_bytes - 16;
  float32x4_t acc[2 * PAIRS][2];  // [x row][weight row]
  for (auto& pair : acc) pair[0] = pair[1] = vdupq_n_f32(0.0f);
  alignas(16) uint8_t held[2][chunk_bytes + 32];
  for (int c = 0; c < chunks; c++) {
    int8x16_t w[2][2 * CHUNK];
    float32x4_t chunk_scales[2];
    for (int r = 0; r < 2; r++) {
      const uint8_t* p = call.w.packed + size_t(outputs[r]) * call.w.row_bytes() + c * chunk_bytes;
      __builtin_prefetch(p + PREFETCH);
      if constexpr (chunk_bytes > 64) __builtin_prefetch(p + PREFETCH + 64);
      if (p > last_safe) p = held_copy(p, end, held[r], sizeof(held[r]));
      for (int g = 0; g < CHUNK; g++) unpack<BITS>(p + g * group_bytes<BITS>, cut, w[r] + 2 * g);
      chunk_scales[r] = load4(call.w.scales, call.w.type, size_t(outputs[r]) * groups + c * CHUNK, groups - c * CHUNK,
                              scale_count);
    }
    int8x16_t both[4 * CHUNK];  // 8 bytes of row o, then the same 8 of row o1
    for (int k = 0; k < 2 * CHUNK; k++) {
      const int64x2_t first = vreinterpretq_s64_s8(w[0][k]), second = vreinterpretq_s64_s8(w[1][k]);
      both[2 * k] = vreinterpretq_s8_s64(vzip1q_s64(first, second));
      both[2 * k + 1] = vreinterpretq_s8_s64(vzip2q_s64(first, second));
    }
    for (int pair = 0; pair < PAIRS; pair++) {
      const int m = m0 + 2 * pair;
      const int8_t *xm = x.q_row(m) + size_t(c) * CHUNK * GROUP, *xm1 = x.q_row(m + 1) + size_t(c) * CHUNK * GROUP;
      int32x4_t dots[CHUNK];
      for (int g = 0; g < CHUNK; g++) {
        dots[g] = vdupq_n_s32(0);
        for (int k = 2 * g; k < 2 * g + 2; k++) {
          const int64x2_t first = vreinterpretq_s64_s8(vld1q_s8(xm + 16 * k));
          const int64x2_t second = vreinterpretq_s64_s8(vld1q_s8(xm1 + 16 * k));
          dots[g] = vmmlaq_s32(dots[g], vreinterpretq_s8_s64(vzip1q_s64(first, second)), both[2 * k]);
          dots[g] = vmmlaq_s32(dots[g], vreinterpretq_s8_s64(vzip2q_s64(first, second)), both[2 * k + 1]);
        }
      }
      // 4 x 4 transpose: lane j of dots[g] -> lane g of by_product[j]
      const int64x2_t low_even = vreinterpretq_s64_s32(vtrn1q_s32(dots[0], dots[1]));
      const int64x2_t low_odd = vreinterpretq_s64_s32(vtrn2q_s32(dots[0], dots[1]));
      const int64x2_t high_even = vreinterpretq_s64_s32(vtrn1q_s32(dots[2], dots[3]));
      const int64x2_t high_odd = vreinterpretq_s64_s32(vtrn2q_s32(dots[2], dots[3]));
      const int32x4_t by_product[4] = {vreinterpretq_s32_s64(vzip1q_s64(low_even, high_even)),   // m . o
                                       vreinterpretq_s32_s64(vzip1q_s64(low_odd, high_odd)),     // m . o1
                                       vreinterpretq_s32_s64(vzip2q_s64(low_even, high_even)),   // m1 . o
                                       vreinterpretq_s32_s64(vzip2q_s64(low_odd, high_odd))};    // m1 . o1
      for (int i = 0; i < 2; i++)
        for (int r = 0; r < 2; r++)
          acc[2 * pair + i][r] = add_chunk(acc[2 * pair + i][r], by_product[2 * i + r], x.steps_row(m + i) + c * CHUNK,
                                           x.totals_row(m + i) + c * CHUNK, chunk_scales[r], per_total);
    }
  }
  for (int m = 0; m < 2 * PAIRS; m++)
    for (int r = 0; r < (o1 != o ? 2 : 1); r++)
      call.y[(m0 + m) * call.y_stride + outputs[r]] = finish(call.w, outputs[r], x.sums_row(m0 + m), acc[m][r]);
}

// Blocks [begin, end) of 4 weight rows: their outputs for every row of x, two weight rows at a time with smmla
// (the last row of an odd count paired with itself), an odd row of x by `tile`.
template <int BITS>
void product_blocks(const void* context, int begin, int end) {
  const ProductCall& call = *static_cast<const ProductCall*>(context);
  const Cut<BITS> cut;
  const int rows = call.x.rows;
  for (int o = 4 * begin; o < std::min(4 * end, call.w.outputs); o += 2) {
    const int o1 = o + 1 < call.w.outputs ? o + 1 : o;
    int m = 0;
    for (; m + TILE_ROWS <= rows; m += TILE_ROWS) tile_pairs<BITS, TILE_ROWS / 2>(call, cut, o, o1, m);
    if (rows - m >= 2) {
      tile_pairs<BITS, 1>(call, cut, o, o1, m);
      m += 2;
    }
    if (m < rows) {
      tile<BITS, 1>(call, cut, o, m);
      if (o1 != o) tile<BITS, 1>(call, cut, o1, m);
    }
  }
}
#else
// Blocks [begin, end) of 4 weight rows: their outputs for every row of x.
template <int BITS>
void product_blocks(const void* context, int begin, int end) {
  const ProductCall& call = *static_cast<const ProductCall*>(context);
  const Cut<BITS> cut;
  const int rows = call.x.rows;
  for (int o = 4 * begin; o < std::min(4 * end, call.w.outputs); o++) {
    int m = 0;
    for (; m + TILE_ROWS <= rows; m += TILE_ROWS) tile<BITS, TILE_ROWS>(call, cut, o, m);
    switch (rows - m) {
      case 3: tile<BITS, 3>(call, cut, o, m); break;
      case 2: tile<BITS, 2>(call, cut, o, m); break;
      case 1: tile<BITS, 1>(call, cut, o, m); break;
      default: break;
    }
  }
}
#endif

inline void product(const float* x, int rows, const Weights& w, float* y, int64_t y_stride) {
  const QuantizedRows qx(x, rows, w.columns, w.bits);
  const ProductCall call{qx, w, y, y_stride};
  const Task task = w.bits == 2   ? product_blocks<2>
                    : w.bits == 3 ? product_blocks<3>
                    : w.bits == 4 ? product_blocks<4>
                    : w.bits == 5 ? product_blocks<5>
                    : w.bits == 6 ? product_blocks<6>
                                  : product_blocks<8>;
  share_blocks(task, &call, (w.outputs + 3) / 4, w);
}

}  // namespace akunu::quantized::neon
