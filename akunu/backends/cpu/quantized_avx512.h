// The quantized product on AVX-512 VBMI + VNNI: vpdpbusd integer dot products and bit unpacking with vpermt2b and
// vpmultishiftqb, the reference's float sums (quantized_core.h) bit for bit.
#pragma once

#include <immintrin.h>

#include "quantized_core.h"

namespace akunu::quantized::avx512 {

// Columns go in blocks of 128 (4 groups). A block's weights become two registers of unsigned bytes and
// x's block two registers of signed bytes, both ordered so that int32 lane l of either holds 4 values of
// group l / 4 (a "quad"); two vpdpbusd then leave each group's dot product spread over its 4 lanes. The order:
//  4 bits: the packed bytes themselves, low nibbles in the first register and high nibbles in the second;
//  other widths: chunk c of 8 values (c = 0..15, group c / 4) goes to 64-bit lane c % 2 + 2 * (c / 4) of the
//    first register if c % 4 < 2, else of the second; each lane's 8 values are cut out of the `bits` stream
//    bytes gathered into it (vpermt2b) by vpmultishiftqb, then masked (8 bits: the gathered bytes).
// Each (weight row, group) sum is then one exact int32 (`to_quads` or `group_dots` put the block's 4 rows x
// 4 groups in one register's 16 lanes), so the float work is one convert, multiply and add per 16 such pairs:
//   acc[lane 4n + g] += float(dot) * (dx_g * scale_ng)
// in block order whatever the path, and a row's result does not depend on the rows beside it.
// From a few rows of x on (`fours_from`), the products take fours of rows instead (`fours_tile`): a weight row's block
// is unpacked straight into quad order (16 bytes per quad k, groups 0..3), each weight quad is broadcast to a
// register of 4 rows of x, and lane 4m + g of a sum holds row m's group g: no regrouping per tile, and each
// lane's float steps are the ones above, so the bits are the same.
constexpr int BLOCK = 128;
constexpr int LANES = 16;
constexpr int OUT_BLOCK = 4;   // weight rows taken together: 4 rows x a block's 4 groups fill 16 lanes
constexpr int QUADS = 8;       // quads in a group: its dot product takes 8 vpdpbusd
constexpr int CHUNK = 8;       // blocks of columns unpacked at a time (stays in L1 with x's rows)
constexpr int DIRECT_ROWS = 4; // up to this many rows, weights are used straight from registers
constexpr int ROW_TILE = DIRECT_ROWS;  // rows of x sharing the buffer's weights (wider weights take fours from 3 rows)
constexpr int LONG_ROW = 1024; // bytes: a single row of x reads weight rows this long one after another (`one_row`)
constexpr int PREFETCH = 1024; // bytes ahead along a weight row that a path asks for

struct Layout {
  int bits;
  bool centered;  // the weights' zero point is taken away from each group's dot product (`Weights::zero`)
  __m512i x_pick[2], w_pick[2], shifts, mask, nibble, quad_major, pair_rows[2], pair_quads[2];
  __m512i quad_pick[2], quad_shifts[2];  // `unpack_quads`: a weight row's block in quad order
  __m512i four_pick[2];                   // the same order for a row of x's int8 block (`QuantizedRows`)
  explicit Layout(int b, bool centered_ = false) : bits(b), centered(centered_) {
    // Byte 8L + 4s + t of quad register h holds value t of quad k = 4h + L / 2 of group 2 (L % 2) + s: each 64-bit
    // lane gathers the (at most 4) stream bytes of its two quads, which vpmultishiftqb then cuts the values out of.
    alignas(64) uint8_t quad_picks[2][64], quad_shift[2][64];
    for (int h = 0; h < 2; h++)
      for (int i = 0; i < 64; i++) {
        const int lane = i / 8, slot = (i % 8) / 4, t = i % 4, k = 4 * h + lane / 2, g = 2 * (lane % 2) + slot;
        const int start = (GROUP * g + 4 * k) * b;  // the quad's first bit in the block's stream
        quad_picks[h][i] = uint8_t(std::min(start / 8 + t, 16 * b - 1));  // bytes past the quad's are never used
        quad_shift[h][i] = uint8_t(32 * slot + start % 8 + t * b);
      }
    alignas(64) int32_t four_picks[2][16];
    for (int h = 0; h < 2; h++)
      for (int lane = 0; lane < 16; lane++) four_picks[h][lane] = 8 * (lane % 4) + 4 * h + lane / 4;
    for (int h = 0; h < 2; h++) {
      four_pick[h] = _mm512_load_si512(four_picks[h]);
      quad_pick[h] = _mm512_load_si512(quad_picks[h]);
      quad_shifts[h] = _mm512_load_si512(quad_shift[h]);
    }
    alignas(64) uint8_t x_picks[2][64], w_picks[2][64], shift[64];
    for (int half = 0; half < 2; half++)
      for (int lane = 0; lane < 8; lane++) {
        const int chunk = 4 * (lane / 2) + lane % 2 + 2 * half;
        for (int t = 0; t < 8; t++) {
          const int i = 8 * lane + t;
          x_picks[half][i] = b == 4 ? 8 * (i / 4) + 2 * (i % 4) + half : 8 * chunk + t;
          w_picks[half][i] = b == 8 ? 8 * chunk + t : b * chunk + std::min(t, b - 1);
          shift[i] = (t * b) % 64;
        }
      }
    // Lane indices (g group, j quad, n weight row, each 0..3; bit 4 picks vpermt2d's second source):
    // quad_major: lane 4j + g <- 4g + j; pair_rows[j0]: lane 4g + 2 j1 + n0 <- source n0's 4g + 2 j1 + j0;
    // pair_quads[j1]: lane 4n + g <- source n / 2's 4g + 2 j1 + n % 2.
    alignas(64) int32_t quad_major_[16], pair_rows_[2][16], pair_quads_[2][16];
    for (int g = 0; g < 4; g++)
      for (int j = 0; j < 4; j++) {
        quad_major_[4 * j + g] = 4 * g + j;
        for (int bit = 0; bit < 2; bit++) {
          const int j1 = j / 2, n0 = j % 2, n = j;
          pair_rows_[bit][4 * g + 2 * j1 + n0] = 16 * n0 + 4 * g + 2 * j1 + bit;
          pair_quads_[bit][4 * n + g] = 16 * (n / 2) + 4 * g + 2 * bit + n % 2;
        }
      }
    for (int half = 0; half < 2; half++) {
      x_pick[half] = _mm512_load_si512(x_picks[half]);
      w_pick[half] = _mm512_load_si512(w_picks[half]);
      pair_rows[half] = _mm512_load_si512(pair_rows_[half]);
      pair_quads[half] = _mm512_load_si512(pair_quads_[half]);
    }
    quad_major = _mm512_load_si512(quad_major_);
    shifts = _mm512_load_si512(shift);
    mask = _mm512_set1_epi8(char((1 << b) - 1));
    nibble = _mm512_set1_epi8(0x0f);
  }

  // The block of `bytes_left` (or more) stream bytes at p, as the two registers of unsigned values.
  inline void unpack(const uint8_t* p, int64_t bytes_left, __m512i& first, __m512i& second) const {
    const int64_t bytes = std::min<int64_t>(bytes_left, 16 * bits);
    const __m512i low = _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, unsigned(std::min<int64_t>(bytes, 64))), p);
    if (bits == 4) {
      first = _mm512_and_si512(low, nibble);
      second = _mm512_and_si512(_mm512_srli_epi16(low, 4), nibble);
      return;
    }
    const __m512i high =
        bytes > 64 ? _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, unsigned(bytes - 64)), p + 64) : _mm512_setzero_si512();
    first = _mm512_permutex2var_epi8(low, w_pick[0], high);
    second = _mm512_permutex2var_epi8(low, w_pick[1], high);
    if (bits == 8) return;
    first = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, first), mask);
    second = _mm512_and_si512(_mm512_multishift_epi64_epi8(shifts, second), mask);
  }

  // The block of `bytes_left` (or more) stream bytes at p as 8 quads of its 4 groups (16 bytes per quad k: groups
  // 0..3's values 4k..4k + 3), k = 0..3 in the first register: each quad is broadcast as one load (`fours_tile`).
  inline void unpack_quads(const uint8_t* p, int64_t bytes_left, __m512i& first, __m512i& second) const {
    const int64_t bytes = std::min<int64_t>(bytes_left, 16 * bits);
    const __m512i low = _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, unsigned(std::min<int64_t>(bytes, 64))), p);
    if (bits <= 4) {  // the block fits one register
      first = _mm512_permutexvar_epi8(quad_pick[0], low);
      second = _mm512_permutexvar_epi8(quad_pick[1], low);
    } else {
      const __m512i high = bytes > 64 ? _mm512_maskz_loadu_epi8(_bzhi_u64(~0ull, unsigned(bytes - 64)), p + 64)
                                      : _mm512_setzero_si512();
      first = _mm512_permutex2var_epi8(low, quad_pick[0], high);
      second = _mm512_permutex2var_epi8(low, quad_pick[1], high);
    }
    if (bits == 8) return;
    first = _mm512_and_si512(_mm512_multishift_epi64_epi8(quad_shifts[0], first), mask);
    second = _mm512_and_si512(_mm512_multishift_epi64_epi8(quad_shifts[1], second), mask);
  }

  // quads[4h + j] lane 4n + g = rows[n][h] lane 4g + j: quad j of half h of every (row, group) in one register.
  inline void to_quads(const __m512i rows[OUT_BLOCK][2], __m512i* quads) const {
    for (int h = 0; h < 2; h++) {
      __m512i paired[2][2];  // [n / 2][j % 2]
      for (int n1 = 0; n1 < 2; n1++)
        for (int j0 = 0; j0 < 2; j0++)
          paired[n1][j0] = _mm512_permutex2var_epi32(rows[2 * n1][h], pair_rows[j0], rows[2 * n1 + 1][h]);
      for (int j1 = 0; j1 < 2; j1++)
        for (int j0 = 0; j0 < 2; j0++)
          quads[4 * h + 2 * j1 + j0] = _mm512_permutex2var_epi32(paired[0][j0], pair_quads[j1], paired[1][j0]);
    }
  }

  // Lane 4n + g = the sum of dots[n]'s lanes 4g..4g + 3: the exact group dot products `to_quads` also leads to.
  inline __m512i group_dots(const __m512i dots[OUT_BLOCK]) const {
    __m512i pairs[2];
    for (int n1 = 0; n1 < 2; n1++)
      pairs[n1] = _mm512_add_epi32(_mm512_permutex2var_epi32(dots[2 * n1], pair_rows[0], dots[2 * n1 + 1]),
                                   _mm512_permutex2var_epi32(dots[2 * n1], pair_rows[1], dots[2 * n1 + 1]));
    return _mm512_add_epi32(_mm512_permutex2var_epi32(pairs[0], pair_quads[0], pairs[1]),
                            _mm512_permutex2var_epi32(pairs[0], pair_quads[1], pairs[1]));
  }
};

// `count` (<= 16) scales or biases from i on, as float32 (the rest zero).
inline __m512 load_scales(const void* p, Scale type, size_t i, int count) {
  const __mmask16 keep = __mmask16(_bzhi_u32(0xffffu, unsigned(count)));
  if (type == Scale::f32) return _mm512_maskz_loadu_ps(keep, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(keep, static_cast<const uint16_t*>(p) + i);
  if (type == Scale::f16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane 4n + g: the scale of the block's group g in weight row first + n (zero past `count` rows or the groups).
inline __m512 block_scales(const Weights& w, int first, int count, int block) {
  const int groups = w.groups(), group = 4 * block;
  __m512 scales = _mm512_setzero_ps();
  for (int n = 0; n < count; n++) {
    const __m512 row = load_scales(w.scales, w.type, size_t(first + n) * groups + group, std::min(4, groups - group));
    scales = _mm512_mask_broadcast_f32x4(scales, __mmask16(0xf << (4 * n)), _mm512_castps512_ps128(row));
  }
  return scales;
}

// Rows of x up to which `direct` runs: 4-bit weights (a single load each block row, split in two) stay faster there
// than fours to 5 rows, or 6 with biases, whose fours would be turned back to rows for `finish_rows`.
inline int direct_rows(const Layout& layout) { return layout.bits != 4 ? DIRECT_ROWS : layout.centered ? 5 : 6; }

// From this many rows of x, products run through `fours_tile`.
inline int fours_from(const Layout& layout) { return layout.bits > 4 ? 3 : direct_rows(layout) + 1; }

// x's rows quantized per group, each group's step, sum(qx) and dx * sum(qx), and the int8 values in the order of the
// path that will take them: fours of rows side by side (`four_quads`), or the blocks' two orders (`q`: as the
// weights' registers; `quads`: quad k of the block's 4 groups at 16 k, broadcast to every row's lanes).
struct QuantizedRows {
  int rows, blocks, sum_stride, fours;
  Aligned<int8_t> q, quads, four_quads;
  Aligned<int32_t> totals, four_zeros;
  Aligned<float> steps, sums, four_steps;
  QuantizedRows(const float* x, int rows_, int columns, const Layout& layout)
      : rows(rows_),
        blocks((columns + BLOCK - 1) / BLOCK),
        sum_stride(blocks * 4 + LANES),
        fours(rows_ >= fours_from(layout) ? (rows_ + 3) / 4 : 0),
        q(fours ? 0 : size_t(rows_) * blocks * BLOCK),  // the other paths' orders: fours of rows need neither
        quads(fours ? 0 : size_t(rows_) * blocks * BLOCK),
        four_quads(size_t(fours) * blocks * 4 * BLOCK),
        totals(size_t(rows_) * blocks * 4),
        four_zeros(size_t(fours) * blocks * LANES),
        steps(size_t(rows_) * blocks * 4),
        sums(size_t(rows_) * sum_stride),
        four_steps(size_t(fours) * blocks * LANES) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int m = 0; m < rows; m++)
      for (int b = 0; b < blocks; b++) {
        alignas(64) int8_t natural[BLOCK];
        float* step = steps.get() + (size_t(m) * blocks + b) * 4;
        int32_t* total = totals.get() + (size_t(m) * blocks + b) * 4;
        float* sum = sums.get() + size_t(m) * sum_stride + 4 * b;
        for (int g = 0; g < 4; g++) {
          const int column = b * BLOCK + g * GROUP;
          const int count = std::clamp(columns - column, 0, GROUP);
          const float* p = x + size_t(m) * columns + column;
          const __m512 lo = _mm512_maskz_loadu_ps(__mmask16(_bzhi_u32(0xffffu, unsigned(std::min(count, 16)))), p);
          const __m512 hi =
              _mm512_maskz_loadu_ps(__mmask16(_bzhi_u32(0xffffu, unsigned(std::max(count - 16, 0)))), p + 16);
          const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
          const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
          const __m512 scale = _mm512_set1_ps(inverse);
          const __m512i q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale));
          const __m512i q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
          _mm_store_si128(reinterpret_cast<__m128i*>(natural + g * GROUP), _mm512_cvtepi32_epi8(q_lo));
          _mm_store_si128(reinterpret_cast<__m128i*>(natural + g * GROUP + 16), _mm512_cvtepi32_epi8(q_hi));
          step[g] = d;
          total[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
          sum[g] = d * float(total[g]);
        }
        const __m512i low = _mm512_load_si512(natural), high = _mm512_load_si512(natural + 64);
        const size_t offset = (size_t(m) * blocks + b) * BLOCK;
        for (int h = 0; h < 2; h++) {
          if (!fours) {
            const __m512i ordered = _mm512_permutex2var_epi8(low, layout.x_pick[h], high);
            _mm512_store_si512(q.get() + offset + 64 * h, ordered);
            _mm512_store_si512(quads.get() + offset + 64 * h, _mm512_permutexvar_epi32(layout.quad_major, ordered));
            continue;
          }
          // quads k = 4h..4h + 3 of the row's 4 groups (int32 lane 4k + g <- the natural order's 8g + k), each
          // 16 bytes to its place beside the other rows of its four
          const __m512i by_quad = _mm512_permutex2var_epi32(low, layout.four_pick[h], high);
          int8_t* four = four_quads.get() + ((size_t(m / 4) * blocks + b) * 4 * BLOCK) + 16 * (m % 4) + 4 * 64 * h;
          _mm_store_si128(reinterpret_cast<__m128i*>(four), _mm512_castsi512_si128(by_quad));
          _mm_store_si128(reinterpret_cast<__m128i*>(four + 64), _mm512_extracti32x4_epi32(by_quad, 1));
          _mm_store_si128(reinterpret_cast<__m128i*>(four + 128), _mm512_extracti32x4_epi32(by_quad, 2));
          _mm_store_si128(reinterpret_cast<__m128i*>(four + 192), _mm512_extracti32x4_epi32(by_quad, 3));
        }
      }
    set_fours(layout);
  }

  // In lane 4m + g of each block of each four of rows (`four_quads` holds their quads, quad k at 64 k): the step and
  // -zero * sum(qx) of row 4r + m's group g (where its dot products start), zero past x's rows.
  void set_fours(const Layout& layout) {
    const int zero = layout.centered ? 1 << (layout.bits - 1) : 0;
    for (int r = 0; r < fours; r++)
      for (int b = 0; b < blocks; b++) {
        const size_t at = size_t(r) * blocks + b;
        for (int m = 0; m < 4 && 4 * r + m < rows; m++) {
          const size_t row = size_t(4 * r + m) * blocks + b;
          for (int g = 0; g < 4; g++) {
            four_steps.get()[at * LANES + 4 * m + g] = steps.get()[row * 4 + g];
            four_zeros.get()[at * LANES + 4 * m + g] = -zero * totals.get()[row * 4 + g];
          }
        }
      }
  }
  size_t four_at(int r, int block) const { return size_t(r) * blocks + block; }
  const int8_t* four_quads_at(int r, int block) const { return four_quads.get() + four_at(r, block) * 4 * BLOCK; }
  const float* four_steps_at(int r, int block) const { return four_steps.get() + four_at(r, block) * LANES; }
  const int32_t* four_zeros_at(int r, int block) const { return four_zeros.get() + four_at(r, block) * LANES; }
  const int8_t* q_row(int m) const { return q.get() + size_t(m) * blocks * BLOCK; }
  const int8_t* quads_row(int m) const { return quads.get() + size_t(m) * blocks * BLOCK; }
  const float* steps_row(int m) const { return steps.get() + size_t(m) * blocks * 4; }
  const float* sums_row(int m) const { return sums.get() + size_t(m) * sum_stride; }
  // Lane 4n + g: zero * sum(qx) of row m's group g in `block`, what centered weights take from each dot product.
  __m512i zero_terms(int m, int block, int bits) const {
    const int32_t* t = totals.get() + (size_t(m) * blocks + block) * 4;
    return _mm512_slli_epi32(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t))), bits - 1);
  }
};

// One chunk of blocks of OUT_BLOCK weight rows, unpacked: per block each row's two registers, then the scales.
struct Unpacked {
  alignas(64) __m512i rows[CHUNK][OUT_BLOCK][2];
  alignas(64) float scales[CHUNK][LANES];
};

// Block `block` of weight row `row` as `unpack`'s two registers (zero past the matrix's rows), asking for the
// bytes `ahead` further on.
inline void unpack_block(const Weights& w, const Layout& layout, int row, int block, int64_t ahead, __m512i out[2]) {
  if (row >= w.outputs) {
    out[0] = out[1] = _mm512_setzero_si512();
    return;
  }
  const int64_t row_bytes = int64_t(w.row_bytes()), offset = int64_t(block) * 16 * w.bits;
  const uint8_t* p = w.packed + row * row_bytes + offset;
  _mm_prefetch(reinterpret_cast<const char*>(p) + ahead, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p) + ahead + 64, _MM_HINT_T0);
  layout.unpack(p, row_bytes - offset, out[0], out[1]);
}

void unpack_chunk(const Weights& w, const Layout& layout, int first, int count, int block, int blocks, Unpacked& out) {
  // Row by row along the chunk: long sequential runs (taking the 4 rows block by block is slower at 8 bits).
  for (int n = 0; n < OUT_BLOCK; n++)
    for (int b = 0; b < blocks; b++) unpack_block(w, layout, first + n, block + b, PREFETCH, out.rows[b][n]);
  for (int b = 0; b < blocks; b++) _mm512_store_ps(out.scales[b], block_scales(w, first, count, block + b));
}

// Keeps a loaded vector in a register: otherwise GCC folds the load into every instruction that uses it.
inline __m512i in_register(__m512i v) {
  asm("" : "+v"(v));
  return v;
}

// acc[m] += float(dots of x's row m0 + m with the block's quads) * (dx * scale), for MR rows of x.
template <int MR>
inline void rows_times_quads(const QuantizedRows& x, int m0, int block, const __m512i* quads, __m512 scales,
                             const Layout& layout, __m512* acc) {
  __m512i dots[MR];
  for (int m = 0; m < MR; m++) dots[m] = _mm512_setzero_si512();
  for (int k = 0; k < QUADS; k++) {
    const __m512i weights = in_register(quads[k]);
    for (int m = 0; m < MR; m++) {
      const int8_t* q = x.quads_row(m0 + m) + size_t(block) * BLOCK + 16 * k;
      dots[m] = _mm512_dpbusd_epi32(dots[m], weights, _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(q))));
    }
  }
  for (int m = 0; m < MR; m++) {
    if (layout.centered) dots[m] = _mm512_sub_epi32(dots[m], x.zero_terms(m0 + m, block, layout.bits));
    const __m512 step = _mm512_broadcast_f32x4(_mm_load_ps(x.steps_row(m0 + m) + 4 * block));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]), _mm512_mul_ps(step, scales), acc[m]);
  }
}

// acc += row m of x times the block's weight rows (registers as `unpack` gives them), each group's quads summed
// as integers (`group_dots`): for one row, cheaper than regrouping the weights into quads first.
inline void row_times_block(const QuantizedRows& x, int m, int block, const __m512i rows[OUT_BLOCK][2], __m512 scales,
                            const Layout& layout, __m512& acc) {
  const int8_t* q = x.q_row(m) + size_t(block) * BLOCK;
  const __m512i x0 = _mm512_load_si512(q), x1 = _mm512_load_si512(q + 64);
  __m512i dots[OUT_BLOCK];
  for (int n = 0; n < OUT_BLOCK; n++)
    dots[n] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), rows[n][0], x0), rows[n][1], x1);
  __m512i sums = layout.group_dots(dots);
  if (layout.centered) sums = _mm512_sub_epi32(sums, x.zero_terms(m, block, layout.bits));
  const __m512 step = _mm512_broadcast_f32x4(_mm_load_ps(x.steps_row(m) + 4 * block));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(step, scales), acc);
}

// acc[m] += MR rows of x from m0 times the block's weight rows: one row as `row_times_block`, more sharing quads.
template <int MR>
inline void rows_times_block(const QuantizedRows& x, int m0, int block, const __m512i rows[OUT_BLOCK][2], __m512 scales,
                             const Layout& layout, __m512* acc) {
  if constexpr (MR == 1) {
    row_times_block(x, m0, block, rows, scales, layout, acc[0]);
  } else {
    __m512i quads[QUADS];
    layout.to_quads(rows, quads);
    rows_times_quads<MR>(x, m0, block, quads, scales, layout, acc);
  }
}

// The chunk's products added to the running sums acc[m] (lane 4n + g) of MR rows of x from m0.
template <int MR>
void tile(const QuantizedRows& x, int m0, const Unpacked& w, const Layout& layout, int block, int blocks, __m512* acc) {
  __m512 a[MR];
  for (int m = 0; m < MR; m++) a[m] = acc[m0 + m];
  for (int b = 0; b < blocks; b++) rows_times_block<MR>(x, m0, block + b, w.rows[b], _mm512_load_ps(w.scales[b]), layout, a);
  for (int m = 0; m < MR; m++) acc[m0 + m] = a[m];
}

// The last `left` (< MR) rows of x from m0, in one tile.
template <int MR>
void last_rows(const QuantizedRows& x, int m0, int left, const Unpacked& w, const Layout& layout, int block, int blocks,
               __m512* acc) {
  if constexpr (MR > 0) {
    if (left == MR) return tile<MR>(x, m0, w, layout, block, blocks, acc);
    last_rows<MR - 1>(x, m0, left, w, layout, block, blocks, acc);
  }
}

void rows_times_chunk(const QuantizedRows& x, const Unpacked& w, const Layout& layout, int block, int blocks, __m512* acc) {
  int m = 0;
  for (; m + ROW_TILE <= x.rows; m += ROW_TILE) tile<ROW_TILE>(x, m, w, layout, block, blocks, acc);
  last_rows<ROW_TILE - 1>(x, m, x.rows - m, w, layout, block, blocks, acc);
}

// One chunk of blocks of OUT_BLOCK weight rows in quad order (`unpack_quads`), and their scales 4 groups at a time.
struct QuadsUnpacked {
  alignas(64) __m512i rows[CHUNK][OUT_BLOCK][2];
  alignas(64) float scales[CHUNK][OUT_BLOCK][4];
};

void unpack_quads_chunk(const Weights& w, const Layout& layout, int first, int block, int blocks, QuadsUnpacked& out) {
  const int64_t row_bytes = int64_t(w.row_bytes());
  const int64_t ahead = std::max<int64_t>(PREFETCH, OUT_BLOCK * row_bytes);  // short rows: the next row block
  const int groups = w.groups();
  for (int n = 0; n < OUT_BLOCK; n++) {
    const int row = first + n;
    for (int b = 0; b < blocks; b++) {
      if (row >= w.outputs) {
        out.rows[b][n][0] = out.rows[b][n][1] = _mm512_setzero_si512();
        _mm_store_ps(out.scales[b][n], _mm_setzero_ps());
        continue;
      }
      const int64_t offset = int64_t(block + b) * 16 * w.bits;
      const uint8_t* p = w.packed + row * row_bytes + offset;
      _mm_prefetch(reinterpret_cast<const char*>(p) + ahead, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + ahead + 64, _MM_HINT_T0);
      layout.unpack_quads(p, row_bytes - offset, out.rows[b][n][0], out.rows[b][n][1]);
      const int group = 4 * (block + b);
      const __m512 scales = load_scales(w.scales, w.type, size_t(row) * groups + group, std::min(4, groups - group));
      _mm_store_ps(out.scales[b][n], _mm512_castps512_ps128(scales));
    }
  }
}

// acc[4(r0 + r) + n] (lane 4m + g: row 4(r0 + r) + m of x, weight row n, group g) += the chunk's products
// for MF fours of rows of x: each weight quad is broadcast once to 4 rows of x, and each row-quad of x meets the
// block's 4 weight rows, with no regrouping. A lane's steps are `row_times_block`'s, so a row's bits are the same.
template <int MF>
void fours_tile(const QuantizedRows& x, int r0, const QuadsUnpacked& w, int block, int blocks, __m512* acc) {
  __m512 a[MF][OUT_BLOCK];
  for (int r = 0; r < MF; r++)
    for (int n = 0; n < OUT_BLOCK; n++) a[r][n] = acc[4 * (r0 + r) + n];
  for (int b = 0; b < blocks; b++) {
    __m512i dots[MF][OUT_BLOCK];
    const int8_t* q[MF];
    for (int r = 0; r < MF; r++) {
      q[r] = x.four_quads_at(r0 + r, block + b);
      const __m512i start = _mm512_load_si512(x.four_zeros_at(r0 + r, block + b));
      for (int n = 0; n < OUT_BLOCK; n++) dots[r][n] = start;
    }
#pragma GCC unroll 8
    for (int k = 0; k < QUADS; k++) {
      __m512i rows[MF];
      for (int r = 0; r < MF; r++) rows[r] = _mm512_load_si512(q[r] + 64 * k);
      for (int n = 0; n < OUT_BLOCK; n++) {
        const __m512i quad =
            _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(&w.rows[b][n][0]) + k));
        for (int r = 0; r < MF; r++) dots[r][n] = _mm512_dpbusd_epi32(dots[r][n], quad, rows[r]);
      }
    }
    for (int r = 0; r < MF; r++) {
      const __m512 steps = _mm512_load_ps(x.four_steps_at(r0 + r, block + b));
      for (int n = 0; n < OUT_BLOCK; n++) {
        const __m512 scales = _mm512_broadcast_f32x4(_mm_load_ps(w.scales[b][n]));
        a[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][n]), _mm512_mul_ps(steps, scales), a[r][n]);
      }
    }
  }
  for (int r = 0; r < MF; r++)
    for (int n = 0; n < OUT_BLOCK; n++) acc[4 * (r0 + r) + n] = a[r][n];
}

// The running sums of every row of x against OUT_BLOCK weight rows from `first`, through `fours_tile`: 4 per four
// of rows, sums[4r + n] lane 4m + g for row 4r + m of x and weight row first + n.
void fours_sums(const QuantizedRows& qx, const Weights& w, const Layout& layout, int first, QuadsUnpacked& buffer,
                __m512* sums) {
  for (int i = 0; i < 4 * qx.fours; i++) sums[i] = _mm512_setzero_ps();
  for (int block = 0; block < qx.blocks; block += CHUNK) {
    const int blocks = std::min(CHUNK, qx.blocks - block);
    unpack_quads_chunk(w, layout, first, block, blocks, buffer);
    int r = 0;
    for (; r + 2 <= qx.fours; r += 2) fours_tile<2>(qx, r, buffer, block, blocks, sums);
    if (r < qx.fours) fours_tile<1>(qx, r, buffer, block, blocks, sums);
  }
}

// Outputs first..first + count - 1 of every row of x from `fours_sums`, for weights without biases: `finish` adds an
// output's 4 lanes as (a0 + a2) + (a1 + a3), then only zeros, which leave every sum but -0 as it is.
inline void finish_fours(const QuantizedRows& qx, int first, int count, const __m512* sums, float* y,
                         int64_t y_stride) {
  const __mmask8 outputs = __mmask8(_bzhi_u32(0xf, unsigned(count)));
  for (int r = 0; r < qx.fours; r++) {
    __m512 q[OUT_BLOCK];  // lane 4m: the output of row 4r + m and weight row n
    for (int n = 0; n < OUT_BLOCK; n++) {
      const __m512 a = sums[4 * r + n];
      const __m512 pairs = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
      q[n] = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, _MM_SHUFFLE(2, 3, 0, 1)));
    }
    const __m512 low = _mm512_unpacklo_ps(q[0], q[1]), high = _mm512_unpacklo_ps(q[2], q[3]);
    const __m512 out = _mm512_add_ps(_mm512_shuffle_ps(low, high, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_setzero_ps());
    alignas(64) float rows[LANES];
    _mm512_store_ps(rows, out);
    for (int m = 0; m < 4 && 4 * r + m < qx.rows; m++)
      _mm_mask_storeu_ps(y + (4 * r + m) * y_stride + first, outputs, _mm_load_ps(rows + 4 * m));
  }
}

// `fours_sums` in `row_block_sums`' lanes, for `finish`: acc[m] lane 4n + g for row m of x.
inline void fours_to_rows(const QuantizedRows& qx, const __m512* sums, __m512* acc) {
  for (int r = 0; r < qx.fours; r++) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512* s = sums + 4 * r;
    const __m512 t0 = _mm512_shuffle_f32x4(s[0], s[1], 0x44), t1 = _mm512_shuffle_f32x4(s[0], s[1], 0xee);
    const __m512 t2 = _mm512_shuffle_f32x4(s[2], s[3], 0x44), t3 = _mm512_shuffle_f32x4(s[2], s[3], 0xee);
    const __m512 rows[4] = {_mm512_shuffle_f32x4(t0, t2, 0x88), _mm512_shuffle_f32x4(t0, t2, 0xdd),
                            _mm512_shuffle_f32x4(t1, t3, 0x88), _mm512_shuffle_f32x4(t1, t3, 0xdd)};
    for (int m = 0; m < 4 && 4 * r + m < qx.rows; m++) acc[4 * r + m] = rows[m];
  }
}

// For a few rows of x: each block of the OUT_BLOCK weight rows is unpacked into registers and used at once,
// with the same steps per row as `tile`, so the results are the same bits.
template <int MR>
void direct(const QuantizedRows& x, const Weights& w, const Layout& layout, int first, __m512* acc) {
  // A row block ahead: with short rows, PREFETCH bytes on would fall inside the block being read.
  const int64_t ahead = std::max<int64_t>(PREFETCH, OUT_BLOCK * int64_t(w.row_bytes()));
  __m512 a[MR];
  for (int m = 0; m < MR; m++) a[m] = _mm512_setzero_ps();
  for (int b = 0; b < x.blocks; b++) {
    __m512i rows[OUT_BLOCK][2];
    for (int n = 0; n < OUT_BLOCK; n++) unpack_block(w, layout, first + n, b, ahead, rows[n]);
    rows_times_block<MR>(x, 0, b, rows, block_scales(w, first, OUT_BLOCK, b), layout, a);
  }
  for (int m = 0; m < MR; m++) acc[m] = a[m];
}

// One row of x against weight row `row` (zero past the matrix): lane g sums group g of every block, in the order and
// with the steps `row_times_block` gives lane 4n + g, so the results are the same bits. The row is read start to end:
// four long rows read side by side are four streams, which the memory system serves at half the speed of one.
inline __m128 row_sums(const QuantizedRows& x, const Weights& w, const Layout& layout, int row) {
  __m128 acc = _mm_setzero_ps();
  if (row >= w.outputs) return acc;
  const int groups = w.groups();
  const int8_t* q = x.q_row(0);
  for (int b = 0; b < x.blocks; b += OUT_BLOCK) {
    const int count = std::min(OUT_BLOCK, x.blocks - b);
    __m512i dots[OUT_BLOCK];
    for (int k = 0; k < OUT_BLOCK; k++) {
      dots[k] = _mm512_setzero_si512();
      if (k >= count) continue;
      __m512i weights[2];
      unpack_block(w, layout, row, b + k, PREFETCH, weights);
      const int8_t* xq = q + size_t(b + k) * BLOCK;
      dots[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[k], weights[0], _mm512_load_si512(xq)), weights[1],
                                    _mm512_load_si512(xq + 64));
    }
    __m512i sums = layout.group_dots(dots);  // lane 4k + g: group g of block b + k
    const __mmask16 lanes = __mmask16(_bzhi_u32(0xffffu, unsigned(4 * count)));
    if (layout.centered)
      sums = _mm512_sub_epi32(sums, _mm512_slli_epi32(_mm512_maskz_loadu_epi32(lanes, x.totals.get() + 4 * b), layout.bits - 1));
    const int left = std::clamp(groups - 4 * b, 0, LANES);
    const __m512 scales = load_scales(w.scales, w.type, size_t(row) * groups + 4 * b, left);
    alignas(64) float terms[LANES], factors[LANES];
    _mm512_store_ps(terms, _mm512_cvtepi32_ps(sums));
    _mm512_store_ps(factors, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x.steps_row(0) + 4 * b), scales));
    for (int k = 0; k < count; k++)  // block by block, as one lane of row_times_block adds them
      acc = _mm_fmadd_ps(_mm_load_ps(terms + 4 * k), _mm_load_ps(factors + 4 * k), acc);
  }
  return acc;
}

// One row of x against OUT_BLOCK long weight rows, each read whole in turn (`row_sums`), in `row_times_block`'s lanes.
inline void one_row(const QuantizedRows& x, const Weights& w, const Layout& layout, int first, __m512* acc) {
  __m512 a = _mm512_setzero_ps();
  for (int n = 0; n < OUT_BLOCK; n++) a = _mm512_mask_broadcast_f32x4(a, __mmask16(0xf << (4 * n)), row_sums(x, w, layout, first + n));
  acc[0] = a;
}

// [sum t[0], .., sum t[3]]: four vectors' lanes summed together, pairs first (a fourth of four reductions' work).
inline __m128 sum_each(const __m512 t[OUT_BLOCK]) {
  // per 128-bit lane: a = [t0, t1, t0, t1] partial sums, b the same of t2 and t3, then c = [t0, t1, t2, t3]
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(t[2], t[3]), _mm512_unpackhi_ps(t[2], t[3]));
  const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// Outputs first..first + count - 1 of a row: each weight row n's 4 lanes of acc plus
// sum_g bias_ng * dx_g * sum(qx_g) (none for centered weights), 16 groups at a time, the four totals then reduced together.
// Rows past `count` repeat the last row: their totals are not stored.
inline __m128 finish(const Weights& w, int first, int count, const float* sums, const __m512& acc) {
  const int groups = w.groups();
  size_t at[OUT_BLOCK];
  __m512 total[OUT_BLOCK];
  for (int n = 0; n < OUT_BLOCK; n++) {
    at[n] = size_t(first + std::min(n, count - 1)) * groups;
    total[n] = _mm512_maskz_mov_ps(__mmask16(0xf << (4 * n)), acc);
  }
  for (int g = 0; w.biases && g < groups; g += LANES) {
    const __m512 sum = _mm512_loadu_ps(sums + g);  // padded past the groups: the biases' zeros meet it
    const int left = std::min(LANES, groups - g);
    for (int n = 0; n < OUT_BLOCK; n++)
      total[n] = _mm512_fmadd_ps(load_scales(w.biases, w.type, at[n] + g, left), sum, total[n]);
  }
  return sum_each(total);
}

// `finish` for FINISH_ROWS rows of x from m0 at once: each 16 groups' biases converted once for all of them.
constexpr int FINISH_ROWS = 4;
inline void finish_rows(const Weights& w, int first, int count, const QuantizedRows& qx, int m0, const __m512* acc,
                        __m128* out) {
  const int groups = w.groups();
  size_t at[OUT_BLOCK];
  __m512 total[FINISH_ROWS][OUT_BLOCK];
  for (int n = 0; n < OUT_BLOCK; n++) {
    at[n] = size_t(first + std::min(n, count - 1)) * groups;
    for (int r = 0; r < FINISH_ROWS; r++) total[r][n] = _mm512_maskz_mov_ps(__mmask16(0xf << (4 * n)), acc[r]);
  }
  for (int g = 0; g < groups; g += LANES) {
    const int left = std::min(LANES, groups - g);
    __m512 biases[OUT_BLOCK];
    for (int n = 0; n < OUT_BLOCK; n++) biases[n] = load_scales(w.biases, w.type, at[n] + g, left);
    for (int r = 0; r < FINISH_ROWS; r++) {
      const __m512 sum = _mm512_loadu_ps(qx.sums_row(m0 + r) + g);
      for (int n = 0; n < OUT_BLOCK; n++) total[r][n] = _mm512_fmadd_ps(biases[n], sum, total[r][n]);
    }
  }
  for (int r = 0; r < FINISH_ROWS; r++) out[r] = sum_each(total[r]);
}

// Running sums acc[m] of one block of OUT_BLOCK weight rows: for one row of x against long rows, a weight row at a
// time; straight from registers for the rows of x that do not take fours; for a matrix's last, partial block,
// unpacked CHUNK blocks of columns at a time into a buffer that stays in L1 with the rows it meets.
void row_block_sums(const QuantizedRows& qx, const Weights& w, const Layout& layout, int first, int count,
                    Unpacked& buffer, __m512* acc) {
  if (qx.rows == 1 && w.row_bytes() >= LONG_ROW) return one_row(qx, w, layout, first, acc);
  if (count == OUT_BLOCK && qx.rows <= direct_rows(layout)) {
    switch (qx.rows) {
      case 1: return direct<1>(qx, w, layout, first, acc);
      case 2: return direct<2>(qx, w, layout, first, acc);
      case 3: return direct<3>(qx, w, layout, first, acc);
      case 4: return direct<4>(qx, w, layout, first, acc);
      case 5: return direct<5>(qx, w, layout, first, acc);
      case 6: return direct<6>(qx, w, layout, first, acc);
      default: break;  // the buffered path below takes any count
    }
  }
  for (int m = 0; m < qx.rows; m++) acc[m] = _mm512_setzero_ps();
  for (int block = 0; block < qx.blocks; block += CHUNK) {
    const int blocks = std::min(CHUNK, qx.blocks - block);
    unpack_chunk(w, layout, first, count, block, blocks, buffer);
    rows_times_chunk(qx, buffer, layout, block, blocks, acc);
  }
}

// Asks for the scales and biases of the OUT_BLOCK weight rows from `first`: eight short streams beside the weights'
// that the hardware does not run ahead on (the biases' loads stalled a step's finishing sums).
inline void prefetch_scales(const Weights& w, int first) {
  if (first >= w.outputs) return;
  const size_t size = w.type == Scale::f32 ? 4 : 2, groups = size_t(w.groups());
  const size_t begin = size_t(first) * groups * size, end = size_t(std::min(first + OUT_BLOCK, w.outputs)) * groups * size;
  for (const void* base : {w.scales, w.biases}) {
    if (!base) continue;
    const uintptr_t start = reinterpret_cast<uintptr_t>(base) + begin, stop = reinterpret_cast<uintptr_t>(base) + end;
    for (uintptr_t line = start & ~uintptr_t(63); line < stop; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
}

struct ProductCall {
  const QuantizedRows& qx;
  const Weights& w;
  const Layout& layout;
  float* y;
  int64_t y_stride;
};

// Blocks [begin, end) of OUT_BLOCK weight rows: their outputs for every row of x.
void product_rows(const void* context, int begin, int end) {
  const ProductCall& call = *static_cast<const ProductCall*>(context);
  const Weights& w = call.w;
  const int rows = call.qx.rows;
  // A thread's buffers outlive the call: a step claims shares of rows thousands of times (malloc showed in profiles).
  thread_local std::unique_ptr<Unpacked> buffer(new Unpacked);  // not value-initialized: every use writes it first
  thread_local std::unique_ptr<QuadsUnpacked> quads_buffer(new QuadsUnpacked);
  thread_local Aligned<__m512> acc_held(0);
  thread_local size_t acc_capacity = 0;
  if (size_t(rows + 3) * 2 > acc_capacity) {  // acc, then four_sums' 4 per four of rows
    acc_capacity = size_t(rows + 3) * 2;
    acc_held = Aligned<__m512>(acc_capacity);
  }
  __m512* acc = acc_held.get();
  __m512* four_sums = acc + rows + 3;
  prefetch_scales(w, begin * OUT_BLOCK);
  for (int row_block = begin; row_block < end; row_block++) {
    const int first = row_block * OUT_BLOCK, count = std::min(OUT_BLOCK, w.outputs - first);
    if (row_block + 1 < end) prefetch_scales(w, first + OUT_BLOCK);  // a row block ahead
    if (!call.qx.fours) {
      row_block_sums(call.qx, w, call.layout, first, count, *buffer, acc);
    } else {
      fours_sums(call.qx, w, call.layout, first, *quads_buffer, four_sums);
      if (!w.biases) {
        finish_fours(call.qx, first, count, four_sums, call.y, call.y_stride);
        continue;
      }
      fours_to_rows(call.qx, four_sums, acc);
    }
    const __mmask8 outputs = __mmask8(_bzhi_u32(0xf, unsigned(count)));
    int m = 0;
    for (; w.biases && m + FINISH_ROWS <= rows; m += FINISH_ROWS) {
      __m128 out[FINISH_ROWS];
      finish_rows(w, first, count, call.qx, m, acc + m, out);
      for (int r = 0; r < FINISH_ROWS; r++) _mm_mask_storeu_ps(call.y + (m + r) * call.y_stride + first, outputs, out[r]);
    }
    for (; m < rows; m++)
      _mm_mask_storeu_ps(call.y + m * call.y_stride + first, outputs, finish(w, first, count, call.qx.sums_row(m), acc[m]));
  }
}

// x's rows quantized once, then blocks of OUT_BLOCK weight rows shared among threads; each weight read once.
void product(const float* x, int rows, const Weights& w, float* y, int64_t y_stride) {
  const Layout layout(w.bits, w.zero() != 0);
  const QuantizedRows qx(x, rows, w.columns, layout);
  const ProductCall call{qx, w, layout, y, y_stride};
  share_blocks(product_rows, &call, (w.outputs + OUT_BLOCK - 1) / OUT_BLOCK, w);
}

}  // namespace akunu::quantized::avx512
