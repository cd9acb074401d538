// Products of a few rows of activations with MLX affine-quantized weights, for MLX's CPU backend.
//
// y = x W^T where W is stored as MLX quantizes it (mode "affine", groups of 32 along a row, `bits`
// per value packed little-endian into one bit stream, a scale and bias per group in float32, float16
// or bfloat16), so that W[o, k] = scale * q + bias. Decode steps and verification passes (1-64 rows)
// are bound by reading W, so each weight is read once at its stored width and never widened to float:
//
//   y[m, o] = sum_g scale_g * dx_g * (q_g . qx_g) + bias_g * dx_g * sum(qx_g)
//
// where each group of 32 values of a row of x is quantized to int8 (qx = round(x / dx), dx = max|x| / 127,
// as llama.cpp quantizes activations against its integer kernels) and q_g . qx_g is an exact integer dot
// product (vpdpbusd: unsigned weights times signed activations). The bias term uses the quantized x too,
// so the rounding error is sum(W * (dx * qx - x)): with x's exact sum it would be sum(scale * q * ...), larger.
// A row of x is quantized alone and each (row, output) sum runs in an order fixed by the row length,
// so a row's result does not depend on how many rows share the call: a verification pass gives each
// position the bits a single-token step gives it.
//
// Built on first use by quantized.py with kernels.py's machinery (g++ -march=native).

#include <nanobind/nanobind.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__BMI2__)
#include <immintrin.h>
#define AKUNU_VNNI 1
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace nb = nanobind;
using namespace mlx::core;

namespace {

constexpr int GROUP = 32;
constexpr size_t PARALLEL_FROM = size_t(1) << 18;  // weights: smaller matrices are not worth waking a second thread

using Task = void (*)(const void* context, int begin, int end);
using Runner = void (*)(Task task, const void* context, int items, int share, int parallel);
Runner runner = nullptr;  // the fused kernels' pool, handed in by quantized.py (`use_pool`)

// task over items [0, items), shared with the pool's helpers if `parallel`: one set of helper threads for every kernel.
void parallel_for(Task task, const void* context, int items, int share, bool parallel) {
  if (runner) return runner(task, context, items, share, parallel);
  task(context, 0, items);
}

enum class Scale { f32, f16, bf16 };

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: exact in float32
    float value = std::ldexp(float(mantissa), -24);
    std::memcpy(&bits, &value, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

float to_float(const void* p, Scale type, size_t i) {
  if (type == Scale::f32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (type == Scale::f16) return half_to_float(h);
  const uint32_t bits = uint32_t(h) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

struct Weights {
  const uint8_t* packed;
  const void* scales;
  const void* biases;  // null: each bias is -zero() * its scale, a zero point the kernel takes away as an integer
  Scale type;
  int outputs, columns, bits;
  size_t row_bytes() const { return size_t(columns) * bits / 8; }
  int groups() const { return columns / GROUP; }
  int zero() const { return biases ? 0 : 1 << (bits - 1); }
  float scale(int row, int group) const { return to_float(scales, type, size_t(row) * groups() + group); }
  float bias(int row, int group) const {
    return biases ? to_float(biases, type, size_t(row) * groups() + group) : -float(zero()) * scale(row, group);
  }
};

template <typename T>
struct Aligned {
  std::unique_ptr<T, decltype(&std::free)> data{nullptr, &std::free};
  explicit Aligned(size_t count) {
    const size_t bytes = (std::max<size_t>(count, 1) * sizeof(T) + 63) / 64 * 64;
    data.reset(static_cast<T*>(std::aligned_alloc(64, bytes)));
    if (!data) throw std::bad_alloc();
    std::memset(data.get(), 0, bytes);
  }
  T* get() const { return data.get(); }
};

// The 32 values of one group (4 * bits bytes at p) as unsigned integers, values[i] = bits i*b.. of the stream.
inline void unpack_scalar(const uint8_t* p, int bits, int32_t* values) {
  const uint32_t mask = (1u << bits) - 1;
  for (int i = 0; i < GROUP; i++) {
    const int bit = i * bits;
    const uint32_t pair = p[bit / 8] | (bit / 8 + 1 < 4 * bits ? uint32_t(p[bit / 8 + 1]) << 8 : 0u);
    values[i] = (pair >> (bit % 8)) & mask;
  }
}

// Each group of 32 values of x's rows as int8 with its step dx (qx = round(x / dx)) and dx * sum(qx).
inline void quantize_group_scalar(const float* x, int8_t* q, float* step, float* sum) {
  float amax = 0.0f;
  for (int i = 0; i < GROUP; i++) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  int total = 0;
  for (int i = 0; i < GROUP; i++) total += q[i] = int8_t(std::nearbyint(x[i] * inverse));
  *step = d;
  *sum = d * float(total);
}

// Reference arithmetic, used where AVX-512 VNNI/VBMI is missing: the same sums, in column order.
// y's rows are `y_stride` floats apart (a part of a stacked product writes its columns of wider rows).
void quantized_product_scalar(const float* x, int rows, const Weights& w, float* y, int64_t y_stride) {
  const int groups = w.groups();
  std::vector<int8_t> q(size_t(w.columns));
  std::vector<float> steps(groups), sums(groups);
  std::vector<int32_t> values(GROUP);
  for (int m = 0; m < rows; m++) {
    const float* row = x + size_t(m) * w.columns;
    for (int g = 0; g < groups; g++) quantize_group_scalar(row + g * GROUP, q.data() + g * GROUP, &steps[g], &sums[g]);
#pragma omp parallel for schedule(static) firstprivate(values) if (size_t(w.outputs) * w.columns >= PARALLEL_FROM)
    for (int o = 0; o < w.outputs; o++) {
      float acc = 0.0f;
      for (int g = 0; g < groups; g++) {
        unpack_scalar(w.packed + size_t(o) * w.row_bytes() + size_t(g) * 4 * w.bits, w.bits, values.data());
        int32_t dot = 0;
        for (int i = 0; i < GROUP; i++) dot += values[i] * q[g * GROUP + i];
        acc = std::fma(w.scale(o, g) * steps[g], float(dot), acc);
        acc = std::fma(w.bias(o, g), sums[g], acc);
      }
      y[m * y_stride + o] = acc;
    }
  }
}

#ifdef AKUNU_VNNI
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
constexpr int SHARE = 8;       // blocks of weight rows a thread takes at a time, at least
constexpr int STEPS = 64;      // a product's row blocks are taken about this many steps at a time (`Ranges`)

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
    for (int m = 0; m < rows; m++)
      _mm_mask_storeu_ps(call.y + m * call.y_stride + first, outputs, finish(w, first, count, call.qx.sums_row(m), acc[m]));
  }
}

// A product's row blocks in one range per thread. Each thread takes steps from the front of its own range, then from
// the back of the others': the thread done first waits for one step of another's at most, and a range whose thread
// the OS has descheduled is finished by the others. A thread reads its own range front to back, cold once.
struct Ranges {
  static constexpr int MOST = 64;  // ranges held in place: a product's call allocates nothing
  const ProductCall& call;
  int count, step;
  mutable std::atomic<uint64_t> ranges[MOST];  // front << 32 | back, in blocks of weight rows

  Ranges(const ProductCall& call_, int blocks, int threads)
      : call(call_), count(std::clamp(threads, 1, MOST)), step(std::max(SHARE, (blocks + STEPS - 1) / STEPS)) {
    for (int r = 0; r < count; r++)
      ranges[r].store((uint64_t(int64_t(blocks) * r / count) << 32) | uint64_t(int64_t(blocks) * (r + 1) / count));
  }

  // The next step from the front (or back) of range r, as [begin, end); false once the range is empty.
  bool take(int r, bool front, int& begin, int& end) const {
    uint64_t range = ranges[r].load();
    for (;;) {
      const int first = int(range >> 32), last = int(range & 0xffffffffu);
      if (first >= last) return false;
      begin = front ? first : std::max(first, last - step);
      end = front ? std::min(last, first + step) : last;
      const uint64_t left = front ? (uint64_t(end) << 32) | uint64_t(last) : (uint64_t(first) << 32) | uint64_t(begin);
      if (ranges[r].compare_exchange_weak(range, left)) return true;
    }
  }
};

void product_ranges(const void* context, int begin, int end) {
  const Ranges& ranges = *static_cast<const Ranges*>(context);
  for (int r = begin; r < end; r++) {
    int first, last;
    while (ranges.take(r, true, first, last)) product_rows(&ranges.call, first, last);
    for (int other = 1; other < ranges.count; other++)
      while (ranges.take((r + other) % ranges.count, false, first, last)) product_rows(&ranges.call, first, last);
  }
}

// x's rows quantized once, then blocks of OUT_BLOCK weight rows shared among threads; each weight read once.
void quantized_product(const float* x, int rows, const Weights& w, float* y, int64_t y_stride) {
  const Layout layout(w.bits, w.zero() != 0);
  const QuantizedRows qx(x, rows, w.columns, layout);
  const ProductCall call{qx, w, layout, y, y_stride};
  const bool parallel = size_t(w.outputs) * w.columns >= PARALLEL_FROM;
  const int blocks = (w.outputs + OUT_BLOCK - 1) / OUT_BLOCK;
  if (!parallel || blocks < 4 * SHARE) return parallel_for(product_rows, &call, blocks, SHARE, parallel);
  const int threads = std::max(omp_get_max_threads(), 1);  // the pool's helpers and the caller
  const Ranges ranges(call, blocks, threads);
  parallel_for(product_ranges, &ranges, ranges.count, 1, parallel);
}
#else
void quantized_product(const float* x, int rows, const Weights& w, float* y, int64_t y_stride) {
  quantized_product_scalar(x, rows, w, y, y_stride);
}
#endif

// One group's 32 values as unsigned integers (4 * bits bytes at p): values[i] = bits i*b.. of the stream.
inline void unpack_group(const uint8_t* p, int bits, int32_t* values) {
#ifdef AKUNU_VNNI
  if (bits != 8) {
    alignas(32) uint8_t pick[32], shift[32];
    for (int i = 0; i < 32; i++) {
      pick[i] = bits * (i / 8) + std::min(i % 8, bits - 1);
      shift[i] = (i % 8) * bits;
    }
    const __m256i data = _mm256_maskz_loadu_epi8(_bzhi_u32(~0u, 4 * bits), p);
    const __m256i gathered = _mm256_permutexvar_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(pick)), data);
    const __m256i cut = _mm256_multishift_epi64_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(shift)), gathered);
    alignas(32) uint8_t bytes[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), _mm256_and_si256(cut, _mm256_set1_epi8(char((1 << bits) - 1))));
    for (int i = 0; i < GROUP; i++) values[i] = bytes[i];
    return;
  }
#endif
  unpack_scalar(p, bits, values);
}

// Rows [begin, end) of the whole matrix as float32, scale * q + bias with one rounding.
void dequantize_rows(const void* context, int begin, int end) {
  const auto& [w, out] = *static_cast<const std::pair<const Weights&, float*>*>(context);
  int32_t values[GROUP];
  for (int o = begin; o < end; o++)
    for (int g = 0; g < w.groups(); g++) {
      unpack_group(w.packed + size_t(o) * w.row_bytes() + size_t(g) * 4 * w.bits, w.bits, values);
      const float scale = w.scale(o, g), bias = w.bias(o, g);
      float* row = out + size_t(o) * w.columns + g * GROUP;
      for (int i = 0; i < GROUP; i++) row[i] = std::fma(float(values[i]), scale, bias);
    }
}

// The whole matrix as float32 (for prefill: one float32 GEMM).
void dequantize_all(const Weights& w, float* out) {
  const std::pair<const Weights&, float*> context{w, out};
  parallel_for(dequantize_rows, &context, w.outputs, 16, size_t(w.outputs) * w.columns >= PARALLEL_FROM);
}

// For kernels.cpp's layer halves (one node a sublayer): y = x W^T for x's contiguous (rows, columns) and
// weights of `outputs` rows, scale_type 0/1/2 = float32/float16/bfloat16 (biases null: centered weights); y's rows
// y_stride floats apart.
void rows_product(const float* x, int rows, int columns, const uint8_t* packed, const void* scales,
                  const void* biases, int scale_type, int outputs, int bits, float* y, int64_t y_stride) {
  const Scale type = scale_type == 0 ? Scale::f32 : scale_type == 1 ? Scale::f16 : Scale::bf16;
  quantized_product(x, rows, Weights{packed, scales, biases, type, outputs, columns, bits}, y, y_stride);
}

// ---- MLX primitives -----------------------------------------------------------------------------

Weights weights_of(const std::vector<array>& in, int bits) {
  const array& packed = in[1];
  const Scale type = in[2].dtype() == float32 ? Scale::f32 : in[2].dtype() == float16 ? Scale::f16 : Scale::bf16;
  const void* biases = in[3].size() ? in[3].data<void>() : nullptr;  // none: centered weights (`Weights::zero`)
  return {packed.data<uint8_t>(), in[2].data<void>(), biases, type, int(packed.shape(0)),
          int(packed.shape(1) * 32 / bits), bits};
}

class CpuPrimitive : public Primitive {
 public:
  CpuPrimitive(Stream stream, int bits) : Primitive(stream), bits_(bits) {}
  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    std::vector<array> inputs;
    for (auto& a : in) {
      encoder.set_input_array(a);
      inputs.push_back(array::unsafe_weak_copy(a));
    }
    array& out = outputs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
    encoder.dispatch([this_bits = bits_, run = runner(), inputs = std::move(inputs), out = array::unsafe_weak_copy(out)]() mutable {
      run(inputs, out, this_bits);
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }
  bool is_equivalent(const Primitive& other) const override {
    return bits_ == static_cast<const CpuPrimitive&>(other).bits_ && std::string(name()) == other.name();
  }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override {  // x's rows times the weights' outputs
    Shape shape = in[0].shape();
    shape.back() = in[1].shape(0);
    return {shape};
  }

 protected:
  using Runner = void (*)(const std::vector<array>&, array&, int);
  virtual Runner runner() const = 0;
  int bits_;
};

class QuantizedProduct : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "AkunuQuantizedProduct"; }

 protected:
  Runner runner() const override {
    return [](const std::vector<array>& in, array& out, int bits) {
      const Weights w = weights_of(in, bits);
      quantized_product(in[0].data<float>(), int(in[0].size() / w.columns), w, out.data<float>(), w.outputs);
    };
  }
};

class ScalarProduct : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "AkunuQuantizedProductScalar"; }

 protected:
  Runner runner() const override {
    return [](const std::vector<array>& in, array& out, int bits) {
      const Weights w = weights_of(in, bits);
      quantized_product_scalar(in[0].data<float>(), int(in[0].size() / w.columns), w, out.data<float>(), w.outputs);
    };
  }
};

class Dequantize : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "AkunuDequantize"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override { return {{in[1].shape(0), in[2].shape(1) * GROUP}}; }

 protected:
  Runner runner() const override {
    return [](const std::vector<array>& in, array& out, int bits) { dequantize_all(weights_of(in, bits), out.data<float>()); };
  }
};

Stream cpu_stream() {
  Stream stream = default_stream(default_device());
  if (stream.device.type != Device::cpu) throw std::invalid_argument("akunu's quantized kernels run on the CPU only");
  return stream;
}

void check_weights(const array& packed, const array& scales, const array& biases, int bits) {
  if (bits < 2 || bits > 8 || bits == 7) throw std::invalid_argument("bits must be 2, 3, 4, 5, 6 or 8");
  const auto scale_type = scales.dtype();
  if (packed.dtype() != uint32 || biases.dtype() != scale_type ||
      (scale_type != float32 && scale_type != float16 && scale_type != bfloat16))
    throw std::invalid_argument("expected uint32 packed weights with float32, float16 or bfloat16 scales and biases alike");
  const bool centered = biases.size() == 0;  // every bias -2^(bits - 1) times its scale, left to the kernel
  if (packed.ndim() != 2 || scales.ndim() != 2 || (!centered && scales.shape() != biases.shape()) ||
      scales.shape(0) != packed.shape(0) ||
      int64_t(packed.shape(1)) * 32 != int64_t(scales.shape(1)) * GROUP * bits)
    throw std::invalid_argument("weights must be one matrix quantized in groups of 32");
  for (auto* a : {&packed, &scales, &biases})
    if (!a->flags().row_contiguous) throw std::invalid_argument("weights must be row-contiguous");
}

// x (..., K) float32 row-contiguous; packed (N, K * bits / 32) uint32; scales, biases (N, K / 32).
template <typename Product>
array product_op(const array& x, const array& packed, const array& scales, const array& biases, int bits) {
  check_weights(packed, scales, biases, bits);
  if (x.dtype() != float32 || x.ndim() == 0 || x.shape(-1) != scales.shape(1) * GROUP)
    throw std::invalid_argument("x must be float32 (..., K) with K the weights' columns");
  if (!x.flags().row_contiguous) throw std::invalid_argument("x must be row-contiguous");
  Shape shape = x.shape();
  shape.back() = packed.shape(0);
  return array(shape, float32, std::make_shared<Product>(cpu_stream(), bits), {x, packed, scales, biases});
}

array dequantize_op(const array& packed, const array& scales, const array& biases, int bits) {
  check_weights(packed, scales, biases, bits);
  array dummy = array(0.0f);  // keeps weights_of's input positions
  return array({packed.shape(0), scales.shape(1) * GROUP}, float32, std::make_shared<Dequantize>(cpu_stream(), bits),
               {dummy, packed, scales, biases});
}

}  // namespace

NB_MODULE(akunu_quantized_kernels, m) {
  m.doc() = "akunu's CPU products over MLX affine-quantized weights (group size 32)";
  m.def("quantized_product", &product_op<QuantizedProduct>, nb::arg("x"), nb::arg("packed"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("bits"), "x @ dequantize(packed, scales, biases).T over int8-quantized rows of x");
  m.def("scalar_product", &product_op<ScalarProduct>, nb::arg("x"), nb::arg("packed"), nb::arg("scales"),
        nb::arg("biases"), nb::arg("bits"), "quantized_product's arithmetic in plain scalar code (the fallback)");
  m.def("dequantize", &dequantize_op, nb::arg("packed"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"),
        "the float32 matrix the weights hold");
  m.def("use_pool", [](uintptr_t address) { runner = reinterpret_cast<Runner>(address); }, nb::arg("runner_address"),
        "run parallel loops through the C function at `runner_address` (the fused kernels' `pool_runner_address()`)");
  m.def("rows_product_address", []() { return reinterpret_cast<uintptr_t>(&rows_product); },
        "the address of a C function computing a product into rows of a wider output (kernels.cpp's layer halves)");
  m.def("vectorized", []() {
#ifdef AKUNU_VNNI
    return true;
#else
    return false;
#endif
  });
}
