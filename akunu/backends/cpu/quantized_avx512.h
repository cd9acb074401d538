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
constexpr int BLOCK = 128;
constexpr int LANES = 16;
constexpr int OUT_BLOCK = 4;   // weight rows taken together: 4 rows x a block's 4 groups fill 16 lanes
constexpr int QUADS = 8;       // quads in a group: its dot product takes 8 vpdpbusd
constexpr int ROW_TILE = 8;    // rows of x sharing a block's weights in registers
constexpr int CHUNK = 8;       // blocks of columns unpacked at a time (stays in L1 with x's rows)
constexpr int DIRECT_ROWS = 4; // up to this many rows, weights are used straight from registers
constexpr int DIRECT_BITS = 5; // wider weights (two loads a block) run faster through the buffer
constexpr int LONG_ROW = 1024; // bytes: a single row of x reads weight rows this long one after another (`one_row`)
constexpr int PREFETCH = 1024; // bytes ahead along a weight row that a path asks for

struct Layout {
  int bits;
  bool centered;  // the weights' zero point is taken away from each group's dot product (`Weights::zero`)
  __m512i x_pick[2], w_pick[2], shifts, mask, nibble, quad_major, pair_rows[2], pair_quads[2];
  explicit Layout(int b, bool centered_ = false) : bits(b), centered(centered_) {
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

// x's rows quantized per group, in the blocks' two orders (`q`: as the weights' registers; `quads`: quad k of
// the block's 4 groups at 16 k, broadcast to every row's lanes), each group's step, sum(qx) and dx * sum(qx).
struct QuantizedRows {
  int rows, blocks, sum_stride;
  Aligned<int8_t> q, quads;
  Aligned<int32_t> totals;
  Aligned<float> steps, sums;
  QuantizedRows(const float* x, int rows_, int columns, const Layout& layout)
      : rows(rows_),
        blocks((columns + BLOCK - 1) / BLOCK),
        sum_stride(blocks * 4 + LANES),
        q(size_t(rows_) * blocks * BLOCK),
        quads(size_t(rows_) * blocks * BLOCK),
        totals(size_t(rows_) * blocks * 4),
        steps(size_t(rows_) * blocks * 4),
        sums(size_t(rows_) * sum_stride) {
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
          const __m512i ordered = _mm512_permutex2var_epi8(low, layout.x_pick[h], high);
          _mm512_store_si512(q.get() + offset + 64 * h, ordered);
          _mm512_store_si512(quads.get() + offset + 64 * h, _mm512_permutexvar_epi32(layout.quad_major, ordered));
        }
      }
  }
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
// time; straight from registers for a few rows of x; else unpacked CHUNK blocks of columns at a time into a buffer
// that stays in L1 with the rows it meets.
void row_block_sums(const QuantizedRows& qx, const Weights& w, const Layout& layout, int first, int count,
                    Unpacked& buffer, __m512* acc) {
  if (qx.rows == 1 && w.row_bytes() >= LONG_ROW) return one_row(qx, w, layout, first, acc);
  if (count == OUT_BLOCK && qx.rows <= DIRECT_ROWS && w.bits <= DIRECT_BITS) {
    switch (qx.rows) {
      case 1: return direct<1>(qx, w, layout, first, acc);
      case 2: return direct<2>(qx, w, layout, first, acc);
      case 3: return direct<3>(qx, w, layout, first, acc);
      default: return direct<4>(qx, w, layout, first, acc);
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
  thread_local Aligned<__m512> acc_held(0);
  thread_local size_t acc_capacity = 0;
  if (size_t(rows) > acc_capacity) {
    acc_capacity = size_t(rows);
    acc_held = Aligned<__m512>(acc_capacity);
  }
  __m512* acc = acc_held.get();
  prefetch_scales(w, begin * OUT_BLOCK);
  for (int row_block = begin; row_block < end; row_block++) {
    const int first = row_block * OUT_BLOCK, count = std::min(OUT_BLOCK, w.outputs - first);
    if (row_block + 1 < end) prefetch_scales(w, first + OUT_BLOCK);  // a row block ahead
    row_block_sums(call.qx, w, call.layout, first, count, *buffer, acc);
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
