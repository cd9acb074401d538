// The quantized product on AVX2 (+FMA, F16C): integer dot products with vpmaddubsw/vpmaddwd, as llama.cpp's AVX2
// kernels (vpdpbusd where AVX-VNNI exists), and the reference's float sums (quantized_core.h) bit for bit.
//
// A group's 32 weights become one register of unsigned bytes, x's group one of signed bytes in the same order:
//  4 bits: two groups' 32 packed bytes at once, low nibbles (even values) in one register and high nibbles (odd
//    values) in another, x's pair of groups stored as [even of A, even of B, odd of A, odd of B];
//  8 bits: the bytes less 128 as signed bytes, their magnitudes times x with their signs (255 * 127 * 2 would
//    overflow vpmaddubsw's int16; 128 * 127 * 2 does not);
//  2, 3, 5, 6 bits: each value's two bytes into a 16-bit lane (vpshufb), shifted by a multiply and packed back to
//    bytes in x's natural order.
// Eight groups' int32 partial sums are summed by one tree of vphaddd into one register (lane g = group g), then
// converted and multiplied in the reference's order: lanes 0-3 and 4-7 are consecutive blocks of 4 groups.
#pragma once

#include <immintrin.h>

#include "quantized_core.h"

namespace akunu::quantized::avx2 {

#define AKUNU_INLINE inline __attribute__((always_inline))  // the hot helpers: GCC left some as calls

constexpr int CHUNK = 8;        // groups whose dot products one tree of vphaddd gives
constexpr int TILE_ROWS = 4;    // rows of x sharing a chunk's unpacked weights in registers
constexpr int PREFETCH = 512;   // bytes ahead along a weight row

// x's rows quantized per group in the order the weights unpack to, padded to whole chunks (and to 16 groups for the
// biases' sums) with zeros, each group's step, zero point term and dx * sum(qx).
struct QuantizedRows : PaddedRows {
  QuantizedRows(const float* x, int rows_, int columns, int bits) : PaddedRows(rows_, columns, CHUNK) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < rows; m++)
      for (int g = 0; g < groups; g++) {
        const float* p = x + size_t(m) * columns + size_t(g) * GROUP;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k] = _mm256_loadu_ps(p + 8 * k)));
        __m128 top = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        top = _mm_max_ps(top, _mm_movehl_ps(top, top));
        top = _mm_max_ss(top, _mm_movehdup_ps(top));
        const float d = _mm_cvtss_f32(top) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i q32[4], total = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
          q32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inverse)));  // round half to even
          total = _mm256_add_epi32(total, q32[k]);
        }
        // int32 -> int8 in order: packs interleave 128-bit lanes, one vpermd puts them back
        const __m256i packed = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q32[0], q32[1]), _mm256_packs_epi32(q32[2], q32[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        alignas(32) int8_t natural[GROUP];
        _mm256_store_si256(reinterpret_cast<__m256i*>(natural), packed);
        int8_t* out = group_values(m, g);
        if (bits == 4) {  // pair (A, B) of groups: [A even, B even, A odd, B odd], 16 values each
          int8_t* pair = out - (g % 2) * GROUP;
          for (int i = 0; i < 16; i++) {
            pair[16 * (g % 2) + i] = natural[2 * i];
            pair[32 + 16 * (g % 2) + i] = natural[2 * i + 1];
          }
        } else {
          std::memcpy(out, natural, GROUP);
        }
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_hadd_epi32(t, t);
        t = _mm_hadd_epi32(t, t);
        set_group(m, g, d, _mm_cvtsi128_si32(t));
      }
  }
};

// 8 scales or biases at `from` as float32.
template <Scale TYPE>
AKUNU_INLINE __m256 load8(const uint8_t* from) {
  if constexpr (TYPE == Scale::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(from));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
  if constexpr (TYPE == Scale::f16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <Scale TYPE>
constexpr size_t scale_bytes = TYPE == Scale::f32 ? 4 : 2;

template <Scale TYPE>
__attribute__((noinline)) __m256 load_few(const uint8_t* from, int count) {
  alignas(32) uint8_t held[32] = {};
  std::memcpy(held, from, scale_bytes<TYPE> * size_t(std::max(count, 0)));
  return load8<TYPE>(held);
}

// `count` scales or biases from i on as float32, zero past `count` (< 8): read straight from memory unless the
// 8 would pass `size`, the array's length.
template <Scale TYPE>
AKUNU_INLINE __m256 load8(const void* p, size_t i, int count, size_t size) {
  const uint8_t* from = static_cast<const uint8_t*>(p) + i * scale_bytes<TYPE>;
  if (count >= 8) return load8<TYPE>(from);
  if (i + 8 > size) return load_few<TYPE>(from, count);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_ps(load8<TYPE>(from), _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lanes)));
}

// 16-bit lane k of register r of a group of BITS (2, 3, 5 or 6) bits, in either 128-bit half: value 8r + k of the
// half's 16 (the high half reads 2 * BITS bytes further on), picked as its two bytes and shifted by a multiply.
template <int BITS>
struct Cut {
  __m256i pick[2], multiply;
  Cut() {
    alignas(32) uint8_t picks[2][32];
    alignas(32) uint16_t multipliers[16];
    for (int r = 0; r < 2; r++)
      for (int half = 0; half < 2; half++)
        for (int k = 0; k < 8; k++) {
          const int bit = (8 * r + k) * BITS;
          picks[r][16 * half + 2 * k] = uint8_t(bit / 8);
          picks[r][16 * half + 2 * k + 1] = uint8_t(std::min(bit / 8 + 1, 15));
          multipliers[8 * half + k] = uint16_t(1u << (8 - bit % 8));
        }
    pick[0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(picks[0]));
    pick[1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(picks[1]));
    multiply = _mm256_load_si256(reinterpret_cast<const __m256i*>(multipliers));
  }
};

template <int BITS>
constexpr int group_bytes = 4 * BITS;
template <int BITS>
constexpr int per_register = BITS == 4 ? 2 : 1;  // registers a group takes: 4 bits two groups in two registers

// The register(s) of the group(s) at p: 4 bits two groups (even, odd values), 8 bits one group's bytes, others one
// group's 4 * BITS bytes (readable 2 * BITS + 16 bytes on) as 32 bytes in order.
template <int BITS>
AKUNU_INLINE void unpack(const uint8_t* p, const Cut<BITS>& cut, __m256i* out) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), nibble = _mm256_set1_epi8(0x0f);
    out[0] = _mm256_and_si256(v, nibble);
    out[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  } else if constexpr (BITS == 8) {  // as signed bytes w - 128: exact in vpmaddubsw beside x (see chunk_dots)
    out[0] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(char(0x80)));
  } else {
    const __m256i bytes = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p + 2 * BITS),
                                              reinterpret_cast<const __m128i*>(p));
    const __m256i first = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, cut.pick[0]), cut.multiply), 8);
    const __m256i second = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(bytes, cut.pick[1]), cut.multiply), 8);
    out[0] = _mm256_and_si256(_mm256_packus_epi16(first, second), _mm256_set1_epi8(char((1 << BITS) - 1)));
  }
}

// The bytes of a chunk that would be read past the end of the weights' memory, copied into `held` (zeros after).
__attribute__((noinline)) inline const uint8_t* held_copy(const uint8_t* p, const uint8_t* end, uint8_t* held, size_t bytes) {
  std::memset(held, 0, bytes);
  std::memcpy(held, p, std::min<size_t>(bytes, end - std::min(end, p)));
  return held;
}

// acc + the sums of 4 products of unsigned bytes u with signed bytes s, per int32 lane: one vpdpbusd with AVX-VNNI
// (Intel's client chips), else vpmaddubsw and vpmaddwd (exact: every pair of products here fits int16).
AKUNU_INLINE __m256i unsigned_dot(__m256i acc, __m256i u, __m256i s) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// The exact dot products of G (8, or 4 for a row's last block) groups with x's: lane g = group g of the chunk.
template <int BITS, int G>
AKUNU_INLINE __m256i chunk_dots(const __m256i* w, const int8_t* x) {
  if constexpr (BITS == 4) {  // register pair k: groups 2k, 2k + 1 in lanes 0-3 and 4-7
    __m256i pairs[4];
    for (int k = 0; k < G / 2; k++) {
      const __m256i x_even = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 64 * k));
      const __m256i x_odd = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 64 * k + 32));
#ifdef __AVXVNNI__
      pairs[k] = unsigned_dot(unsigned_dot(_mm256_setzero_si256(), w[2 * k], x_even), w[2 * k + 1], x_odd);
#else  // the two halves' int16 pair sums added first: 2 * 15 * 127 * 2 fits int16
      const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * k], x_even), _mm256_maddubs_epi16(w[2 * k + 1], x_odd));
      pairs[k] = _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
#endif
    }
    // [g0 g2 g4 g6 | g1 g3 g5 g7] after the tree ([g0 g2 g0 g2 | g1 g3 g1 g3] for 4); vpermd puts the groups in order
    const __m256i low = _mm256_hadd_epi32(pairs[0], pairs[1]);
    const __m256i tree = _mm256_hadd_epi32(low, G == 8 ? _mm256_hadd_epi32(pairs[2], pairs[3]) : low);
    return _mm256_permutevar8x32_epi32(tree, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  __m256i dots[CHUNK];
  for (int g = 0; g < G; g++) {
    const __m256i xq = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + GROUP * g));
    if constexpr (BITS == 8) {  // |w - 128| <= 128 unsigned times x's signs moved over (|x| <= 127): pairs fit int16
      dots[g] = unsigned_dot(_mm256_setzero_si256(), _mm256_abs_epi8(w[g]), _mm256_sign_epi8(xq, w[g]));
    } else {
      dots[g] = unsigned_dot(_mm256_setzero_si256(), w[g], xq);
    }
  }
  // lane k of the low and high halves: register k's partial sums; the halves added
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]), _mm256_hadd_epi32(dots[2], dots[3]));
  if constexpr (G == 4) return _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[4], dots[5]), _mm256_hadd_epi32(dots[6], dots[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// acc (lane g: groups g, g + 4, ... of the row) += the chunk's dots times dx * scale, block by block as the reference.
template <int BITS, int G>
AKUNU_INLINE __m128 add_chunk(__m128 acc, __m256i dots, const float* steps, const int32_t* totals, __m256 scales, bool centered) {
  // 8 bits' dots are of w - 128 already: the zero point is added back where the weights have none (exact, < 2^22)
  if (centered != (BITS == 8)) {
    const __m256i terms = _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(totals)), BITS - 1);
    dots = BITS == 8 ? _mm256_add_epi32(dots, terms) : _mm256_sub_epi32(dots, terms);
  }
  const __m256 terms = _mm256_cvtepi32_ps(dots);
  const __m256 factors = _mm256_mul_ps(_mm256_loadu_ps(steps), scales);
  acc = _mm_fmadd_ps(_mm256_castps256_ps128(terms), _mm256_castps256_ps128(factors), acc);
  if constexpr (G == 4) return acc;
  return _mm_fmadd_ps(_mm256_extractf128_ps(terms, 1), _mm256_extractf128_ps(factors, 1), acc);
}

// Outputs o0..o0 + 3 from their acc: each output's biases' terms on v's 16 lanes (two registers, acc in lanes
// 4n..4n + 3), then the reference's reduction of the four together. Rows past the matrix repeat its last row.
template <Scale TYPE>
inline __m128 finish4(const Weights& w, int o0, const float* sums, const __m128 acc[4]) {
  const int groups = w.groups();
  const size_t size = size_t(w.outputs) * groups;
  __m256 low[4], high[4];
  for (int n = 0; n < 4; n++) {
    const __m256 placed = n % 2 ? _mm256_insertf128_ps(_mm256_setzero_ps(), acc[n], 1) : _mm256_zextps128_ps256(acc[n]);
    low[n] = n < 2 ? placed : _mm256_setzero_ps();
    high[n] = n < 2 ? _mm256_setzero_ps() : placed;
  }
  for (int g = 0; w.biases && g < groups; g += 16) {
    const __m256 sums_low = _mm256_loadu_ps(sums + g), sums_high = _mm256_loadu_ps(sums + g + 8);
    for (int n = 0; n < 4; n++) {
      const size_t at = size_t(std::min(o0 + n, w.outputs - 1)) * groups + g;
      low[n] = _mm256_fmadd_ps(load8<TYPE>(w.biases, at, groups - g, size), sums_low, low[n]);
      high[n] = _mm256_fmadd_ps(load8<TYPE>(w.biases, at + 8, std::max(groups - g - 8, 0), size), sums_high, high[n]);
    }
  }
  // per 128-bit lane and output n: s = (v0 + v2) + (v1 + v3), the four outputs side by side (as AVX-512's sum_each)
  const auto lanes = [](const __m256 v[4]) {
    const __m256 a = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    const __m256 b = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    return _mm256_add_ps(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m256 pairs = _mm256_add_ps(lanes(low), lanes(high));  // [s0 + s2 | s1 + s3] of each output
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

struct ProductCall {
  const QuantizedRows& x;
  const Weights& w;
  float* y;
  int64_t y_stride;
};

// Row m's quantized x, steps and zero point terms, from a chunk's first group on.
struct RowView {
  const int8_t* q;
  const float* steps;
  const int32_t* totals;
};

// One step of G groups (8, or 4 for a row's last block) of a weight row (at p) for MR rows of x: unpacked once,
// then each row's dots added to its acc.
template <int BITS, int G, int MR>
AKUNU_INLINE void rows_times_chunk(const uint8_t* p, const Cut<BITS>& cut, __m256 scales, const RowView* rows, int group,
                             bool centered, __m128* acc) {
  __m256i w[CHUNK];
  for (int g = 0; g < G; g += per_register<BITS>) unpack<BITS>(p + g * group_bytes<BITS>, cut, w + g);
  for (int m = 0; m < MR; m++) {
    const __m256i dots = chunk_dots<BITS, G>(w, rows[m].q + size_t(group) * GROUP);
    acc[m] = add_chunk<BITS, G>(acc[m], dots, rows[m].steps + group, rows[m].totals + group, scales, centered);
  }
}

// Rows [m0, m0 + MR) of x against the block of weight rows o0..o0 + 3 (rows past the matrix repeat its last row, not
// stored): each weight row read once, start to end, chunk by chunk. Groups past a row's end are read from the next
// row's memory (x's padding zeros make their products zero); a chunk that would read past the weights' memory is
// read from a copy.
template <int BITS, Scale TYPE, int MR>
void block_rows(const ProductCall& call, const Cut<BITS>& cut, int o0, int m0) {
  constexpr int chunk_bytes = CHUNK * group_bytes<BITS>;
  const QuantizedRows& x = call.x;
  const Weights w = call.w;  // a copy: the compiler keeps its fields in registers across the stores below
  const int groups = x.groups, chunks = x.chunks, last = w.outputs - 1;
  const bool short_tail = groups % CHUNK != 0 && groups % CHUNK <= 4;  // the last chunk is one block of 4 groups
  const int full = short_tail ? chunks - 1 : chunks;
  const size_t scale_count = size_t(w.outputs) * groups;
  const uint8_t *end = w.end(), *last_safe = end - chunk_bytes - 16;
  const bool centered = w.zero() != 0;
  RowView rows[MR];
  for (int m = 0; m < MR; m++) rows[m] = {x.q_row(m0 + m), x.steps_row(m0 + m), x.totals_row(m0 + m)};
  alignas(32) uint8_t held[chunk_bytes + 32];
  __m128 acc[MR][4];
  for (int n = 0; n < 4; n++) {
    const int o = std::min(o0 + n, last);
    const uint8_t* row = w.packed + size_t(o) * w.row_bytes();
    const size_t first_scale = size_t(o) * groups;
    __m128 a[MR];
    for (int m = 0; m < MR; m++) a[m] = _mm_setzero_ps();
    for (int c = 0; c < chunks; c++) {
      const uint8_t* p = row + c * chunk_bytes;
      for (int ahead = 0; ahead < chunk_bytes; ahead += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + ahead, _MM_HINT_T0);
      if (p > last_safe) p = held_copy(p, end, held, sizeof(held));
      const int group = c * CHUNK;
      const __m256 scales = load8<TYPE>(w.scales, first_scale + group, groups - group, scale_count);
      if (c < full) rows_times_chunk<BITS, CHUNK, MR>(p, cut, scales, rows, group, centered, a);
      else rows_times_chunk<BITS, 4, MR>(p, cut, scales, rows, group, centered, a);
    }
    for (int m = 0; m < MR; m++) acc[m][n] = a[m];
  }
  const int count = std::min(4, w.outputs - o0);
  for (int m = 0; m < MR; m++) {
    alignas(16) float out[4];
    _mm_store_ps(out, finish4<TYPE>(w, o0, x.sums_row(m0 + m), acc[m]));
    std::memcpy(call.y + (m0 + m) * call.y_stride + o0, out, sizeof(float) * count);
  }
}

// Blocks [begin, end) of 4 weight rows: their outputs for every row of x, TILE_ROWS rows of x at a time; up to
// ONE_TILE rows in a single tile, as a second tile would unpack every chunk again.
template <int BITS, Scale TYPE>
void product_blocks(const void* context, int begin, int end) {
  constexpr int ONE_TILE = 6;
  const ProductCall& call = *static_cast<const ProductCall*>(context);
  const Cut<BITS> cut;
  const int rows = call.x.rows, tile = rows <= ONE_TILE ? rows : TILE_ROWS;
  for (int block = begin; block < end; block++)
    for (int m = 0; m < rows; m += tile) {
      switch (std::min(tile, rows - m)) {
        case 6: block_rows<BITS, TYPE, 6>(call, cut, 4 * block, m); break;
        case 5: block_rows<BITS, TYPE, 5>(call, cut, 4 * block, m); break;
        case 4: block_rows<BITS, TYPE, 4>(call, cut, 4 * block, m); break;
        case 3: block_rows<BITS, TYPE, 3>(call, cut, 4 * block, m); break;
        case 2: block_rows<BITS, TYPE, 2>(call, cut, 4 * block, m); break;
        default: block_rows<BITS, TYPE, 1>(call, cut, 4 * block, m); break;
      }
    }
}

// ---- Several rows of x: a chunk's weights transposed once, then every row multiplied without horizontal sums ----
//
// Eight weight rows' chunk of groups is unpacked and transposed (8x8 int32) so that lane n of quads[g][p] holds
// quad p (4 values, in x's order) of group g of output o0 + n. A row of x then meets it with one broadcast 4 bytes of
// its own per quad: lane n sums output n's group g as an exact int32, and the float sums take each lane as its
// output's acc[g % 4] (quantized_core.h), in group order. Rows share the transposition; no row sums across lanes.
#ifdef __AVXVNNI__
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// Rows of x from which products take the transposed path: below, `block_rows`' tiles (one for up to 6 rows) cost
// less than the transposition. Without VNNI, 4 bits' few ops a dot product leave it little to save (even at about 24
// rows).
constexpr int wide_from(int bits) { return bits <= 4 ? (VNNI ? 12 : 24) : bits == 8 ? (VNNI ? 5 : 8) : 7; }
constexpr int WIDE = 8;        // weight rows transposed together: one register's int32 lanes

// 8 bits without VNNI multiply |w - 128| by x's signs moved over (see chunk_dots), with w - 128 in quads.
template <int BITS>
constexpr bool signed_eight = BITS == 8 && !VNNI;

struct Transposed {
  alignas(32) __m256i quads[CHUNK][8];
  alignas(32) __m256i magnitudes[CHUNK][8];  // |w - 128| for `signed_eight`
  alignas(32) __m256 scales[CHUNK];          // lane n: output o0 + n's scale of the group (zero past the groups)
};

// r[n] lane p -> r[p] lane n for 8 registers of 8 int32 lanes.
AKUNU_INLINE void transpose8(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int k = 0; k < 4; k++) {
    t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 2; k++) {  // u[4k + j]: quads j and j + 4 of outputs 4k..4k + 3
    u[4 * k] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int j = 0; j < 4; j++) {
    r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    r[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// Where quad p of group g of a row of x is, in QuantizedRows' order (4 bits: pairs of groups, even values then odd).
template <int BITS>
constexpr int quad_offset(int g, int p) {
  if constexpr (BITS == 4) return 64 * (g / 2) + 16 * (g % 2) + (p < 4 ? 4 * p : 32 + 4 * (p - 4));
  return GROUP * g + 4 * p;
}

// The chunk of groups from `group` of weight rows o0..o0 + 7 (rows past the matrix repeat its last row), transposed.
template <int BITS, Scale TYPE>
AKUNU_INLINE void transpose_chunk(const Weights& w, const Cut<BITS>& cut, int o0, int group, Transposed& out) {
  constexpr int chunk_bytes = CHUNK * group_bytes<BITS>;
  const int groups = w.groups(), last = w.outputs - 1;
  const uint8_t *end = w.end(), *last_safe = end - chunk_bytes - 16;
  const size_t scale_count = size_t(w.outputs) * groups;
  alignas(32) uint8_t held[chunk_bytes + 32];
  __m256i values[CHUNK][WIDE];  // [group][output]
  __m256i scales[WIDE];
  for (int n = 0; n < WIDE; n++) {
    const int o = std::min(o0 + n, last);
    const uint8_t* p = w.packed + size_t(o) * w.row_bytes() + size_t(group / CHUNK) * chunk_bytes;
    for (int ahead = 0; ahead < chunk_bytes; ahead += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + ahead, _MM_HINT_T0);
    if (p > last_safe) p = held_copy(p, end, held, sizeof(held));
    __m256i r[CHUNK];
    for (int g = 0; g < CHUNK; g += per_register<BITS>) unpack<BITS>(p + g * group_bytes<BITS>, cut, r + g);
    for (int g = 0; g < CHUNK; g++) {
      if constexpr (BITS == 4)  // group g's even values then odd ones, as x's quads
        values[g][n] = g % 2 ? _mm256_permute2x128_si256(r[g - 1], r[g], 0x31) : _mm256_permute2x128_si256(r[g], r[g + 1], 0x20);
      else if constexpr (BITS == 8 && VNNI)
        values[g][n] = _mm256_xor_si256(r[g], _mm256_set1_epi8(char(0x80)));  // back to the stored bytes
      else
        values[g][n] = r[g];
    }
    scales[n] = _mm256_castps_si256(load8<TYPE>(w.scales, size_t(o) * groups + group, groups - group, scale_count));
  }
  for (int g = 0; g < CHUNK; g++) {
    transpose8(values[g]);
    for (int p = 0; p < 8; p++) {
      _mm256_store_si256(&out.quads[g][p], values[g][p]);
      if constexpr (signed_eight<BITS>) _mm256_store_si256(&out.magnitudes[g][p], _mm256_abs_epi8(values[g][p]));
    }
  }
  transpose8(scales);
  for (int g = 0; g < CHUNK; g++) out.scales[g] = _mm256_castsi256_ps(scales[g]);
}

// Lane n: output o0 + n's exact dot product of group g with x's (quads at xq), its zero point not yet taken away.
template <int BITS>
AKUNU_INLINE __m256i wide_dot(const Transposed& t, int g, const int8_t* xq) {  // g a constant once unrolled
  const auto x = [&](int p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + quad_offset<BITS>(g, p))); };
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (VNNI) {
    __m256i dot = _mm256_setzero_si256();
    for (int p = 0; p < 8; p++) dot = _mm256_dpbusd_avx_epi32(dot, t.quads[g][p], x(p));
    return dot;
  } else if constexpr (BITS == 8) {  // |w - 128| * 127 * 2 fits int16, two such do not
    __m256i dot = _mm256_setzero_si256();
    for (int p = 0; p < 8; p++)
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(t.magnitudes[g][p], _mm256_sign_epi8(x(p), t.quads[g][p])), ones));
    return dot;
  } else {  // int16 pair sums added while they fit: (2^BITS - 1) * 127 * 2 per vpmaddubsw
    constexpr int fit = BITS <= 4 ? 8 : BITS == 5 ? 4 : 2;
    __m256i dot = _mm256_setzero_si256();
    for (int p = 0; p < 8; p += fit) {
      __m256i pairs = _mm256_maddubs_epi16(t.quads[g][p], x(p));
      for (int k = 1; k < fit; k++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(t.quads[g][p + k], x(p + k)));
      dot = _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, ones));
    }
    return dot;
  }
}

// acc[j] (lane n: output o0 + n's acc[j]) += G groups of row m of x (a chunk's first G, G = 4 or 8) against `t`.
// Groups past the matrix's are zeros in x and in the scales: they add nothing.
template <int BITS, int G>
AKUNU_INLINE void row_times_transposed(const QuantizedRows& x, int m, int group, const Transposed& t, bool centered,
                                       __m256* acc) {
  const int8_t* xq = x.q_row(m) + size_t(group) * GROUP;
  const float* steps = x.steps_row(m) + group;
  const int32_t* totals = x.totals_row(m) + group;
  __m256 a[4] = {acc[0], acc[1], acc[2], acc[3]};
#pragma GCC unroll 8
  for (int g = 0; g < G; g++) {
    __m256i dot = wide_dot<BITS>(t, g, xq);
    if (centered != signed_eight<BITS>) {  // signed 8 bits' dots are of w - 128: the zero point added back
      const __m256i term = _mm256_slli_epi32(_mm256_set1_epi32(totals[g]), BITS - 1);
      dot = signed_eight<BITS> ? _mm256_add_epi32(dot, term) : _mm256_sub_epi32(dot, term);
    }
    const __m256 factor = _mm256_mul_ps(_mm256_set1_ps(steps[g]), t.scales[g]);
    a[g % 4] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), factor, a[g % 4]);
  }
  for (int j = 0; j < 4; j++) acc[j] = a[j];
}

// Weight rows o0..o0 + 7 for every row of x: chunk by chunk, transposed once, then each row's acc (4 a row).
template <int BITS, Scale TYPE>
void wide_block(const ProductCall& call, const Cut<BITS>& cut, int o0, __m256* acc) {
  const QuantizedRows& x = call.x;
  const Weights w = call.w;
  const int groups = x.groups, rows = x.rows;
  const bool centered = w.zero() != 0;
  alignas(32) Transposed t;
  for (int m = 0; m < 4 * rows; m++) acc[m] = _mm256_setzero_ps();
  for (int group = 0; group < groups; group += CHUNK) {
    transpose_chunk<BITS, TYPE>(w, cut, o0, group, t);
    if (groups - group > 4)
      for (int m = 0; m < rows; m++) row_times_transposed<BITS, CHUNK>(x, m, group, t, centered, acc + 4 * m);
    else
      for (int m = 0; m < rows; m++) row_times_transposed<BITS, 4>(x, m, group, t, centered, acc + 4 * m);
  }
  for (int m = 0; m < rows; m++)
    for (int half = 0; half < 2; half++) {
      const int first = o0 + 4 * half;
      if (first >= w.outputs) break;
      __m128 out[4];  // out[n] lane j: acc[j] of output first + n
      for (int j = 0; j < 4; j++)
        out[j] = half ? _mm256_extractf128_ps(acc[4 * m + j], 1) : _mm256_castps256_ps128(acc[4 * m + j]);
      _MM_TRANSPOSE4_PS(out[0], out[1], out[2], out[3]);
      alignas(16) float sums[4];
      _mm_store_ps(sums, finish4<TYPE>(w, first, x.sums_row(m), out));
      std::memcpy(call.y + m * call.y_stride + first, sums, sizeof(float) * std::min(4, w.outputs - first));
    }
}

// Blocks [begin, end) of 8 weight rows: their outputs for every row of x.
template <int BITS, Scale TYPE>
void wide_blocks(const void* context, int begin, int end) {
  const ProductCall& call = *static_cast<const ProductCall*>(context);
  const Cut<BITS> cut;
  thread_local Aligned<float> held(0);  // a thread's sums outlive the call (claimed thousands of times a step)
  thread_local size_t capacity = 0;
  if (size_t(4 * call.x.rows) > capacity) {
    capacity = size_t(4 * call.x.rows);
    held = Aligned<float>(8 * capacity);
  }
  __m256* acc = reinterpret_cast<__m256*>(held.get());
  for (int block = begin; block < end; block++) wide_block<BITS, TYPE>(call, cut, WIDE * block, acc);
}

template <Scale TYPE>
Task by_bits(int bits, bool wide) {
  if (wide)
    return bits == 2   ? wide_blocks<2, TYPE>
           : bits == 3 ? wide_blocks<3, TYPE>
           : bits == 4 ? wide_blocks<4, TYPE>
           : bits == 5 ? wide_blocks<5, TYPE>
           : bits == 6 ? wide_blocks<6, TYPE>
                       : wide_blocks<8, TYPE>;
  return bits == 2   ? product_blocks<2, TYPE>
         : bits == 3 ? product_blocks<3, TYPE>
         : bits == 4 ? product_blocks<4, TYPE>
         : bits == 5 ? product_blocks<5, TYPE>
         : bits == 6 ? product_blocks<6, TYPE>
                     : product_blocks<8, TYPE>;
}

inline void product(const float* x, int rows, const Weights& w, float* y, int64_t y_stride) {
  const QuantizedRows qx(x, rows, w.columns, w.bits);
  const ProductCall call{qx, w, y, y_stride};
  const bool wide = rows >= wide_from(w.bits);
  const Task task = w.type == Scale::f16 ? by_bits<Scale::f16>(w.bits, wide)
                    : w.type == Scale::bf16 ? by_bits<Scale::bf16>(w.bits, wide)
                                            : by_bits<Scale::f32>(w.bits, wide);
  const int per_block = wide ? WIDE : 4;
  share_blocks(task, &call, (w.outputs + per_block - 1) / per_block, w);
}

// Rows [begin, end) of the weights as float32, scale * q + bias with one rounding (for prefill's float32 product).
// A group within 2 * BITS + 16 bytes of the weights' end is read from a copy.
template <int BITS>
void dequantize_rows(const Weights& w, int begin, int end, float* out) {
  const Cut<BITS> cut;
  const uint8_t* last = w.end() - 2 * BITS - 16;
  for (int o = begin; o < end; o++)
    for (int g = 0; g < w.groups(); g++) {
      const uint8_t* p = w.packed + size_t(o) * w.row_bytes() + size_t(g) * group_bytes<BITS>;
      alignas(32) uint8_t held[64];
      if (p > last) p = held_copy(p, w.end(), held, sizeof(held));
      __m256i q;
      if constexpr (BITS == 4) {  // byte j holds values 2j (low nibble) and 2j + 1
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), nibble = _mm_set1_epi8(0x0f);
        const __m128i low = _mm_and_si128(packed, nibble), high = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
        q = _mm256_set_m128i(_mm_unpackhi_epi8(low, high), _mm_unpacklo_epi8(low, high));
      } else if constexpr (BITS == 8) {
        q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      } else {
        unpack<BITS>(p, cut, &q);
      }
      const __m256 scale = _mm256_set1_ps(w.scale(o, g)), bias = _mm256_set1_ps(w.bias(o, g));
      float* row = out + size_t(o) * w.columns + size_t(g) * GROUP;
      for (int k = 0; k < 4; k++) {
        const __m128i bytes = k < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
        const __m256i values = _mm256_cvtepu8_epi32(k % 2 ? _mm_srli_si128(bytes, 8) : bytes);
        _mm256_storeu_ps(row + 8 * k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(values), scale, bias));
      }
    }
}

inline void dequantize_rows(const Weights& w, int begin, int end, float* out) {
  switch (w.bits) {
    case 2: return dequantize_rows<2>(w, begin, end, out);
    case 3: return dequantize_rows<3>(w, begin, end, out);
    case 4: return dequantize_rows<4>(w, begin, end, out);
    case 5: return dequantize_rows<5>(w, begin, end, out);
    case 6: return dequantize_rows<6>(w, begin, end, out);
    default: return dequantize_rows<8>(w, begin, end, out);
  }
}

#undef AKUNU_INLINE

}  // namespace akunu::quantized::avx2
