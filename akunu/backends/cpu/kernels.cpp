// Fused decode kernels for MLX's CPU backend: attention, SwiGLU, RMSNorm, and the split of a
// q|k|v product into rotated heads, one MLX primitive each. Attention can read a KV cache's buffers up
// to how far they are filled and write (B * L, H * Dv) rows, and SwiGLU a whole gate|up product, so the
// fused llama layers (fused_layers.py) need no slices, transposes or copies around them. For
// compiled passes (compiled_pass.py) each half of a llama layer is one node, its products
// through the process's cblas_sgemm.
//
// On the CPU every MLX graph node costs 1-3 us, MLX's exp runs one element at a time through libm
// on x86, and MLX's CPU compile cannot fuse a reduction; so a decode layer's attention was a dozen
// nodes (scores, mask, max, three for the exp, sum, weighing, division, reshapes), the split nine,
// SwiGLU four and RMSNorm three. Here each is one node, vectorized with GCC vector extensions.
//
// Every kernel computes a row (one query, one token's activations) from that row alone, in an
// order fixed by the row's own length, so a row gets the same bits whatever rows share its pass:
// a 1-token step and a 16-token verification pass agree exactly on each position they share.
//
// Built on first use by kernels.py (g++, against the installed MLX and nanobind).

#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "pool.h"

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace nb = nanobind;
using namespace mlx::core;
using akunu::Pool;

namespace {

// Lanes of one vector: a register's. GCC splits wider generic vectors through memory (AVX2 code ran from the stack).
#ifdef __AVX512F__
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(W * 4), aligned(4)));

inline vf splat(float x) { return vf{} + x; }

// x in every lane without splat's 0 + x, which GCC keeps as a scalar add before each broadcast (it differs for -0).
inline vf broadcast(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX__)
  return _mm256_set1_ps(x);
#else
  return splat(x);
#endif
}

// Intrinsics where there are some: GCC tuned for 256-bit moves copies a memcpy'd zmm through the stack in two
// halves, and the whole-register reload then stalls on store forwarding.
inline vf load(const float* p) {
#if defined(__AVX512F__)
  return _mm512_loadu_ps(p);
#elif defined(__AVX__)
  return _mm256_loadu_ps(p);
#else
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

inline void store(float* p, vf v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, v);
#elif defined(__AVX__)
  _mm256_storeu_ps(p, v);
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

// KV caches hold float16 (half the bytes a step reads): W of them widened to float32. Elsewhere MLX's float16_t
// converts (aarch64's __fp16).
inline vf load(const float16_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float b[W];
  for (int i = 0; i < W; i++) b[i] = static_cast<float>(p[i]);
  return load(b);
#endif
}

// x rounded to the nearest float16, ties to even: MLX's astype(float16), so every path stores the same bits.
inline float16_t to_half(float x) {
#ifdef __F16C__
  const uint16_t bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
  float16_t h;
  std::memcpy(&h, &bits, sizeof h);
  return h;
#else
  return static_cast<float16_t>(x);
#endif
}

// n < W elements of p, the rest `fill`.
inline vf load_part(const float* p, int n, float fill) {
  float buffer[W];
  for (int i = 0; i < W; i++) buffer[i] = i < n ? p[i] : fill;
  return load(buffer);
}

inline void store_part(float* p, vf v, int n) {
  float buffer[W];
  store(buffer, v);
  std::memcpy(p, buffer, n * sizeof(float));
}

// Sum of the lanes, always by the same halving tree.
inline float lane_sum(vf v) {
  float b[W];
  store(b, v);
  for (int width = W / 2; width > 0; width /= 2)
    for (int i = 0; i < width; i++) b[i] += b[i + width];
  return b[0];
}

inline float lane_max(vf v) {
  float b[W];
  store(b, v);
  for (int width = W / 2; width > 0; width /= 2)
    for (int i = 0; i < width; i++) b[i] = b[i] > b[i + width] ? b[i] : b[i + width];
  return b[0];
}

// exp(x) for x <= 0, per lane: 2**n * 2**f with the Cephes polynomial MLX's simd::exp uses
// (about 1e-7 relative error); 0 below 2**-126.
inline vf exp_nonpositive(vf x) {
  const float rounder = 12582912.0f;  // 1.5 * 2**23: y + R - R rounds y to an integer
  vf y = x * 1.4426950408889634f;
  vf clamped = y < -126.0f ? splat(-126.0f) : y;
  vf n = (clamped + rounder) - rounder;
  vf f = clamped - n;
  vf p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y < -126.0f ? splat(0.0f) : p * two_n;
}

// Where each row of an array starts: all axes but the last, walked in row-major order.
std::vector<int64_t> row_offsets(const array& a) {
  int64_t rows = a.ndim() ? a.size() / a.shape(-1) : 1;
  std::vector<int64_t> offsets(rows);
  std::vector<int> index(a.ndim() > 0 ? a.ndim() - 1 : 0, 0);
  for (int64_t r = 0; r < rows; r++) {
    int64_t offset = 0;
    for (size_t axis = 0; axis < index.size(); axis++) offset += index[axis] * a.strides()[axis];
    offsets[r] = offset;
    for (int axis = int(index.size()) - 1; axis >= 0; axis--) {
      if (++index[axis] < a.shape(axis)) break;
      index[axis] = 0;
    }
  }
  return offsets;
}

// A row as contiguous floats: the row itself, or a copy of it when its elements are strided.
const float* contiguous_row(const float* row, int64_t stride, int n, std::vector<float>& scratch) {
  if (stride == 1) return row;
  scratch.resize(n);
  for (int i = 0; i < n; i++) scratch[i] = row[i * stride];
  return scratch.data();
}

float dot(const float* a, const float* b, int n) {
  vf acc = splat(0.0f);
  int i = 0;
  for (; i + W <= n; i += W) acc += load(a + i) * load(b + i);
  if (i < n) acc += load_part(a + i, n - i, 0.0f) * load_part(b + i, n - i, 0.0f);
  return lane_sum(acc);
}

// Turns scores[0..n) into exp(score - max) and returns their sum.
float exponentiate(float* scores, int n) {
  vf peak = splat(-INFINITY);
  int i = 0;
  for (; i + W <= n; i += W) {
    vf s = load(scores + i);
    peak = s > peak ? s : peak;
  }
  if (i < n) {
    vf s = load_part(scores + i, n - i, -INFINITY);
    peak = s > peak ? s : peak;
  }
  float m = lane_max(peak);
  vf total = splat(0.0f);
  for (i = 0; i + W <= n; i += W) {
    vf e = exp_nonpositive(load(scores + i) - m);
    store(scores + i, e);
    total += e;
  }
  if (i < n) {
    float e[W];
    store(e, exp_nonpositive(load_part(scores + i, n - i, m) - m));
    for (int lane = n - i; lane < W; lane++) e[lane] = 0.0f;  // lanes past the row add nothing
    std::memcpy(scores + i, e, (n - i) * sizeof(float));
    total += load(e);
  }
  return lane_sum(total);
}

// ---- attention ----------------------------------------------------------------------------------

#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

// The lane sums of W vectors at once (lane a of the result sums v[a]), by the halving tree of
// akunu/_matvec.c: every sum is the same tree whichever vectors share the call.
inline vf lane_sums(const vf v[W]) {
#ifdef __AVX512F__
  vf eights[8], fours[4], twos[2];
  for (int i = 0; i < 8; i++)
    eights[i] = PICK(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                PICK(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; i++)
    fours[i] = PICK(eights[2 * i], eights[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               PICK(eights[2 * i], eights[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; i++)
    twos[i] = PICK(fours[2 * i], fours[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
              PICK(fours[2 * i], fours[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return PICK(twos[0], twos[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PICK(twos[0], twos[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vf fours[4], twos[2];
  for (int i = 0; i < 4; i++)
    fours[i] = PICK(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) + PICK(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; i++)
    twos[i] = PICK(fours[2 * i], fours[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
              PICK(fours[2 * i], fours[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return PICK(twos[0], twos[1], 0, 2, 4, 6, 8, 10, 12, 14) + PICK(twos[0], twos[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// A token tree's pass (drafters/tree.py): row p's parent row, -1 for a row under the prefix alone (parents[p] < p).
// Row p sits at position prefix + depth[p] and sees the prefix and its ancestors: path[p], root first, itself last.
struct PassTree {
  std::vector<int> depth;
  std::vector<std::vector<int>> path;
  bool valid = true;

  explicit PassTree(const array& parents) {
    const int32_t* parent = parents.data<int32_t>();
    const int rows = parents.size();
    depth.resize(rows), path.resize(rows);
    for (int p = 0; p < rows; p++) {
      if (parent[p] < -1 || parent[p] >= p) {
        valid = false;
        return;
      }
      depth[p] = parent[p] < 0 ? 0 : depth[parent[p]] + 1;
      if (parent[p] >= 0) path[p] = path[parent[p]];
      path[p].push_back(p);
    }
  }
};

struct AttentionShape {
  int batch, heads, queries, dims, kv_heads, keys, value_dims;
  bool causal;  // query i of the pass sits at position keys - queries + i and sees keys up to it
  bool rows;    // output (B * L, H * Dv), the layout the output projection reads; else (B, H, L, Dv)
  const PassTree* tree = nullptr;  // causal over a tree instead: the pass's query p sees the prefix and path[p]
};

// The keys one query row sees, in the order a chain would hold them: key slots 0..contiguous-1, then the slots
// contiguous + extra[k] (a tree row's ancestors); n in all.
struct RowKeys {
  int n, contiguous;
  const int* extra;
  int64_t slot(int j) const { return j < contiguous ? j : contiguous + extra[j - contiguous]; }
};

constexpr int ROW_BLOCK = 8;  // query rows that share one read of a KV head's keys and values

// scores[j] = scale * q . key j for W keys `step` elements apart (KV: float or float16_t); the accumulators stay in
// registers.
template <typename KV>
inline void score_block(const float* q, const KV* keys, int64_t step, int dims, float scale, float* scores) {
  vf acc[W] = {};
  for (int d = 0; d < dims; d += W) {
    const vf qd = load(q + d);
    for (int j = 0; j < W; j++) acc[j] += qd * load(keys + j * step + d);
  }
  store(scores, lane_sums(acc) * scale);
}

// A thread's scratch floats, from a cache line on (a vector load across two lines costs two), kept between calls.
struct Scratch {
  std::vector<float> buffer;
  float* get(size_t n) {
    buffer.resize(n + 16);
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
  }
};

// `count` <= W keys `step` apart as float32 rows of `dims` (the same values), zero-padded to W rows: every row of
// a block scores them from this one copy, not converting the float16 again. Float32 caches' whole blocks are read
// in place.
template <typename KV>
const float* keys_as_float(const KV* keys, int64_t step, int count, int dims, Scratch& scratch, int64_t& copy_step) {
  if (std::is_same_v<KV, float> && count == W) {
    copy_step = step;
    return reinterpret_cast<const float*>(keys);
  }
  float* copy = scratch.get(size_t(W) * dims);
  for (int j = 0; j < count; j++)
    for (int d = 0; d < dims; d += W) store(copy + j * dims + d, load(keys + j * step + d));
  std::fill(copy + size_t(count) * dims, copy + size_t(W) * dims, 0.0f);
  copy_step = dims;
  return copy;
}

// For R rows: out_r[d0, d0 + T * W) = sum over j < n_r of weights_r[j] * the value at slot j of row r, added in order
// of j, so a row's result does not depend on the rows beside it (nor on whether its keys sit in a chain or a tree).
// Each value is read once for all the rows that still want it.
template <int R, int T, typename KV>
inline void weigh_tile(float* const* weights, const RowKeys* rows, const KV* values, int64_t step, int d0, float* const* outs) {
  vf acc[R][T] = {};
  int direct = rows[0].contiguous, common = rows[0].n;
  for (int r = 1; r < R; r++) {
    direct = rows[r].contiguous < direct ? rows[r].contiguous : direct;
    common = rows[r].n < common ? rows[r].n : common;
  }
  direct = direct < common ? direct : common;
  int shared = direct;  // past the slots every row reads directly, the slots all rows still have in common
  while (shared < common) {
    bool same = true;
    for (int r = 1; r < R; r++) same = same && rows[r].slot(shared) == rows[0].slot(shared);
    if (!same) break;
    shared++;
  }
  for (int j = 0; j < shared; j++) {
    const KV* row = values + (j < direct ? j : rows[0].slot(j)) * step + d0;
    vf v[T];
    for (int t = 0; t < T; t++) v[t] = load(row + t * W);
    for (int r = 0; r < R; r++) {
      const vf w = broadcast(weights[r][j]);  // weights are exponentials: never -0
      for (int t = 0; t < T; t++) acc[r][t] += w * v[t];
    }
  }
  for (int r = 0; r < R; r++) {
    for (int j = shared; j < rows[r].n; j++) {
      const vf w = broadcast(weights[r][j]);  // weights are exponentials: never -0
      const KV* row = values + rows[r].slot(j) * step + d0;
      for (int t = 0; t < T; t++) acc[r][t] += w * load(row + t * W);
    }
    for (int t = 0; t < T; t++) store(outs[r] + d0 + t * W, acc[r][t]);
  }
}

template <int R, typename KV>
void weigh_rows(float* const* weights, const RowKeys* rows, const KV* values, int64_t step, int dims, float* const* outs) {
  int d0 = 0;
  // R x tiles accumulators and the tiles' values fit the 32 or 16 registers
  constexpr int tiles = W == 16 ? (R > 4 ? 2 : 4) : (R > 4 ? 1 : 2);
  for (; d0 + tiles * W <= dims; d0 += tiles * W) weigh_tile<R, tiles>(weights, rows, values, step, d0, outs);
  for (; d0 < dims; d0 += W) weigh_tile<R, 1>(weights, rows, values, step, d0, outs);
}

// weights[i] @ values for `count` rows, up to 8 at a time: each value is loaded (and widened) once per group.
template <typename KV>
void weigh_values(float* const* weights, const RowKeys* rows, int count, const KV* values, int64_t step, int dims,
                  float* const* outs) {
  for (int i = 0; i < count; i += 8) {
    switch (count - i < 8 ? count - i : 8) {
      case 1: weigh_rows<1>(weights + i, rows + i, values, step, dims, outs + i); break;
      case 2: weigh_rows<2>(weights + i, rows + i, values, step, dims, outs + i); break;
      case 3: weigh_rows<3>(weights + i, rows + i, values, step, dims, outs + i); break;
      case 4: weigh_rows<4>(weights + i, rows + i, values, step, dims, outs + i); break;
      case 5: weigh_rows<5>(weights + i, rows + i, values, step, dims, outs + i); break;
      case 6: weigh_rows<6>(weights + i, rows + i, values, step, dims, outs + i); break;
      case 7: weigh_rows<7>(weights + i, rows + i, values, step, dims, outs + i); break;
      default: weigh_rows<8>(weights + i, rows + i, values, step, dims, outs + i);
    }
  }
}

// A 4-D array's data (KV: float32 or float16) and strides; keys and values get a contiguous copy when their rows are
// strided.
template <typename KV = float>
struct View {
  const KV* data;
  int64_t strides[4];
  std::vector<KV> copy;

  explicit View(const array& a) : data(a.data<KV>()) {
    for (int i = 0; i < 4; i++) strides[i] = a.strides()[i];
  }
  void make_rows_contiguous(const array& a) {
    if (strides[3] == 1) return;
    copy.resize(a.size());
    size_t n = 0;
    for (int i0 = 0; i0 < a.shape(0); i0++)
      for (int i1 = 0; i1 < a.shape(1); i1++)
        for (int i2 = 0; i2 < a.shape(2); i2++)
          for (int i3 = 0; i3 < a.shape(3); i3++)
            copy[n++] = data[i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3]];
    data = copy.data();
    strides[3] = 1, strides[2] = a.shape(3), strides[1] = strides[2] * a.shape(2), strides[0] = strides[1] * a.shape(1);
  }
};

// The scores of a tree row's ancestors' keys (slots prefix + extra[0..count)), gathered W at a time into a copy
// so each gets the bits score_block gives it in a chain.
template <typename KV>
void score_extra(const float* q, const KV* keys, int64_t step, int prefix, const int* extra, int count, int dims,
                 float scale, float* scores) {
  thread_local std::vector<KV> gathered;  // every row of every layer gathers: no allocation each time
  gathered.resize(size_t(W) * dims);
  float block[W];
  for (int g = 0; g < count; g += W) {
    const int n = count - g < W ? count - g : W;
    for (int j = 0; j < n; j++)
      std::memcpy(gathered.data() + j * dims, keys + (prefix + extra[g + j]) * step, dims * sizeof(KV));
    for (int j = n; j < W; j++) std::memset(static_cast<void*>(gathered.data() + j * dims), 0, dims * sizeof(KV));
    score_block(q, gathered.data(), dims, dims, scale, block);
    std::memcpy(scores + g, block, n * sizeof(float));
  }
}

// Rows [first, last) of KV head `kv` in batch `b`; row r is query head kv * repeats + r / queries,
// pass position r % queries. Dims are multiples of W and key and value rows contiguous (checked).
template <typename KV>
void attention_block(const View<>& q, const View<KV>& k, const View<KV>& v, float* out, float scale,
                     const AttentionShape& s, int b, int kv, int first, int last) {
  const int repeats = s.heads / s.kv_heads, count = last - first, prefix = s.keys - s.queries;
  const KV* keys = k.data + b * k.strides[0] + kv * k.strides[1];
  const KV* values = v.data + b * v.strides[0] + kv * v.strides[1];
  thread_local Scratch row_scratch, score_scratch, key_scratch;  // every task of every layer: no allocation each time
  const size_t row_keys = (size_t(s.keys) + W - 1) / W * W;  // each row's scores from a cache line
  float* const rows = row_scratch.get(size_t(count) * s.dims);
  float* const scores = score_scratch.get(count * row_keys);
  RowKeys seen[ROW_BLOCK];
  int widest = 0;
  float* outs[ROW_BLOCK];
  for (int i = 0; i < count; i++) {
    int r = first + i, head = kv * repeats + r / s.queries, position = r % s.queries;
    const float* src = q.data + b * q.strides[0] + head * q.strides[1] + position * q.strides[2];
    for (int d = 0; d < s.dims; d++) rows[i * s.dims + d] = src[d * q.strides[3]];
    if (s.tree) {
      const std::vector<int>& path = s.tree->path[position];
      seen[i] = {prefix + int(path.size()), prefix, path.data()};
    } else {
      const int n = s.causal ? prefix + position + 1 : s.keys;
      seen[i] = {n, n, nullptr};
    }
    widest = seen[i].contiguous > widest ? seen[i].contiguous : widest;
    outs[i] = out + (s.rows ? (int64_t(b) * s.queries + position) * s.heads + head
                            : (int64_t(b) * s.heads + head) * s.queries + position) * s.value_dims;
  }
  for (int j = 0; j < widest; j += W) {  // a block of W keys sits in L1 while every row reads it
    int64_t step;
    const float* block = keys_as_float(keys + j * k.strides[2], k.strides[2], widest - j < W ? widest - j : W, s.dims,
                                       key_scratch, step);
    for (int i = 0; i < count; i++)
      if (j + W <= seen[i].contiguous) {
        score_block(rows + i * s.dims, block, step, s.dims, scale, scores + i * row_keys + j);
      } else if (j < seen[i].contiguous) {  // a score depends on its own key alone: the block's others are dropped
        float tail[W];
        score_block(rows + i * s.dims, block, step, s.dims, scale, tail);
        std::memcpy(scores + i * row_keys + j, tail, (seen[i].contiguous - j) * sizeof(float));
      }
  }
  for (int i = 0; i < count; i++)
    if (seen[i].n > seen[i].contiguous)
      score_extra(rows + i * s.dims, keys, k.strides[2], prefix, seen[i].extra, seen[i].n - seen[i].contiguous,
                  s.dims, scale, scores + i * row_keys + seen[i].contiguous);
  float* weights[ROW_BLOCK];
  float totals[ROW_BLOCK];
  for (int i = 0; i < count; i++) {
    weights[i] = scores + i * row_keys;
    totals[i] = exponentiate(weights[i], seen[i].n);
  }
  weigh_values(weights, seen, count, values, v.strides[2], s.value_dims, outs);
  for (int i = 0; i < count; i++)
    for (int d = 0; d < s.value_dims; d += W) store(outs[i] + d, load(outs[i] + d) / splat(totals[i]));
}

// Pool::run for akunu's other kernel modules (quantized.cpp, _matvec.c), which share the pool through this address.
void run_on_pool(Pool::Task task, const void* context, int items, int share, int parallel) {
  Pool::get().run(task, context, items, share, parallel != 0);
}

template <typename KV>
struct AttentionCall {
  const View<>& q;
  const View<KV>&k, &v;
  float* out;
  float scale;
  AttentionShape shape;
  int rows, blocks;
};

// Tasks [begin, end): task t is block t % blocks of ROW_BLOCK rows of KV head (t / blocks) % kv_heads.
template <typename KV>
void attention_tasks(const void* context, int begin, int end) {
  const AttentionCall<KV>& c = *static_cast<const AttentionCall<KV>*>(context);
  for (int t = begin; t < end; t++) {
    int block = t % c.blocks, kv = (t / c.blocks) % c.shape.kv_heads, b = t / c.blocks / c.shape.kv_heads;
    int first = block * ROW_BLOCK, last = first + ROW_BLOCK < c.rows ? first + ROW_BLOCK : c.rows;
    attention_block(c.q, c.k, c.v, c.out, c.scale, c.shape, b, kv, first, last);
  }
}

// keys: how many of k's and v's first positions to read (a cache buffer holds more than it has filled).
template <typename KV>
void attention_over(const array& q, const array& k, const array& v, array& out, float scale, bool causal, int keys,
                    bool rows_out, const PassTree* tree) {
  AttentionShape s{q.shape(0), q.shape(1), q.shape(2), q.shape(3), k.shape(1), keys, v.shape(3), causal, rows_out, tree};
  const int rows = s.heads / s.kv_heads * s.queries, blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
  const int tasks = s.batch * s.kv_heads * blocks;
  const int64_t work = int64_t(s.batch) * s.heads * s.queries * s.keys * (s.dims + s.value_dims);
  View<> query_view(q);
  View<KV> key_view(k), value_view(v);
  key_view.make_rows_contiguous(k);
  value_view.make_rows_contiguous(v);
  const AttentionCall<KV> call{query_view, key_view, value_view, out.data<float>(), scale, s, rows, blocks};
  Pool::get().run(attention_tasks<KV>, &call, tasks, 1, work > 200000);
}

// Keys and values float16 (a CPU cache's buffers) or float32, both alike (checked). A tree (one per pass, as
// the batch's rows share it) replaces the causal rule.
void attention_kernel(const array& q, const array& k, const array& v, array& out, float scale, bool causal, int keys,
                      bool rows_out, const PassTree* tree = nullptr) {
  if (k.dtype() == float16) return attention_over<float16_t>(q, k, v, out, scale, causal, keys, rows_out, tree);
  attention_over<float>(q, k, v, out, scale, causal, keys, rows_out, tree);
}

// ---- SwiGLU and RMSNorm --------------------------------------------------------------------------

void swiglu_row(const float* g, const float* u, float* dst, int n) {
  for (int i = 0; i < n; i += W) {
    int m = n - i < W ? n - i : W;
    vf gv = load_part(g + i, m, 0.0f), uv = load_part(u + i, m, 0.0f);
    vf e = exp_nonpositive(gv < 0.0f ? gv : -gv);  // exp(-|g|): never overflows
    vf sigmoid = (gv >= 0.0f ? splat(1.0f) : e) / (1.0f + e);
    store_part(dst + i, gv * uv * sigmoid, m);
  }
}

void swiglu_kernel(const array& gate, const array& x, array& out) {
  const int n = gate.shape(-1);
  const auto gate_rows = row_offsets(gate), x_rows = row_offsets(x);
  const int64_t gate_step = gate.strides().back(), x_step = x.strides().back();
  std::vector<float> gate_copy, x_copy;
  for (size_t r = 0; r < gate_rows.size(); r++) {
    const float* g = contiguous_row(gate.data<float>() + gate_rows[r], gate_step, n, gate_copy);
    const float* u = contiguous_row(x.data<float>() + x_rows[r], x_step, n, x_copy);
    swiglu_row(g, u, out.data<float>() + r * n, n);
  }
}

// fn(row, chunk, first, count) for each chunk of `chunk` values of each of `rows` rows of n, on the pool's threads
// from two chunks' worth on.
template <typename F>
void over_chunks(int rows, int n, int chunk, const F& fn) {
  struct Call {
    const F& fn;
    int n, chunk, chunks;
  };
  const Call call{fn, n, chunk, (n + chunk - 1) / chunk};
  const Pool::Task task = [](const void* context, int begin, int end) {
    const Call& c = *static_cast<const Call*>(context);
    for (int t = begin; t < end; t++) {
      const int first = t % c.chunks * c.chunk;
      c.fn(t / c.chunks, t % c.chunks, first, std::min(c.chunk, c.n - first));
    }
  };
  Pool::get().run(task, &call, rows * call.chunks, 1, int64_t(rows) * n >= 2 * chunk);
}

constexpr int SWIGLU_CHUNK = 1024;  // values a task gates: a decode step's 4864 are two threads' work, not one's
static_assert(SWIGLU_CHUNK % W == 0, "chunks of whole vectors");

// Rows (..., 2n) of the stacked gate|up product: gate the first half, up the second. The product's threads wrote
// the two halves, so the reads are other cores' cache lines: both threads read them, in chunks of whole vectors
// (the same per-value steps as one pass over the row).
void swiglu_halves_kernel(const array& gate_up, array& out) {
  const int n = gate_up.shape(-1) / 2;
  const auto rows = row_offsets(gate_up);
  if (gate_up.flags().row_contiguous) {
    const float* in = gate_up.data<float>();
    float* o = out.data<float>();
    return over_chunks(int(rows.size()), n, SWIGLU_CHUNK, [&](int r, int, int first, int count) {
      const float* row = in + int64_t(r) * 2 * n;
      swiglu_row(row + first, row + n + first, o + int64_t(r) * n + first, count);
    });
  }
  std::vector<float> copy;
  for (size_t r = 0; r < rows.size(); r++) {
    const float* row = contiguous_row(gate_up.data<float>() + rows[r], gate_up.strides().back(), 2 * n, copy);
    swiglu_row(row, row + n, out.data<float>() + r * n, n);
  }
}

void rms_norm_kernel(const array& x, const array& weight, float eps, array& out) {
  const int n = x.shape(-1);
  const auto rows = row_offsets(x);
  std::vector<float> x_copy, w_copy;
  const float* w = contiguous_row(weight.data<float>(), weight.strides().back(), n, w_copy);
  float* o = out.data<float>();
  for (size_t r = 0; r < rows.size(); r++) {
    const float* row = contiguous_row(x.data<float>() + rows[r], x.strides().back(), n, x_copy);
    float scale = 1.0f / std::sqrt(dot(row, row, n) / n + eps);
    float* dst = o + r * n;
    for (int i = 0; i < n; i++) dst[i] = w[i] * (row[i] * scale);
  }
}

// ---- the q|k|v product's heads, rotated ------------------------------------------------------------

// Where one kind of head goes: (B, heads, positions, D) at any strides, the pass's rows from `first` on
// (0 for a fresh output; the cache's fill for a KV cache buffer written in place), float32 or float16.
struct HeadsOut {
  char* data;
  int64_t strides[4];
  int first;
  bool half;

  HeadsOut(const array& a, int first_position)
      : data(const_cast<char*>(a.data<char>())), first(first_position), half(a.dtype() == float16) {
    for (int i = 0; i < 4; i++) strides[i] = a.strides()[i];
  }
  void set(int64_t at, float x) const {
    if (half) reinterpret_cast<float16_t*>(data)[at] = to_half(x);
    else reinterpret_cast<float*>(data)[at] = x;
  }
};

// Splits rows (B * L, (H + 2 KV) * D) of the stacked q|k|v product into queries (B, H, L, D), keys
// and values (B, KV, L, D) at `out`, rotating queries and keys: x * cos + partner(x) * sin, the tables'
// rows table_first.. (D wide) laid out like x (rope.py), partner(d) = d ^ 1 when traditional,
// else d +- D/2. No fused multiply-adds here, so the rotation rounds as mx.fast.rope's does. A tree pass's
// row p takes table row table_first + depth[p] (its own position), not table_first + p.
__attribute__((optimize("fp-contract=off"))) void split_heads_kernel(const array& qkv, const array& cos, const array& sin,
                                                                     int table_first, int length, int batch, int heads,
                                                                     int kv_heads, bool traditional, const HeadsOut (&out)[3],
                                                                     const int* depth = nullptr) {
  const int dims = cos.shape(1), half = dims / 2;
  const int64_t qs0 = qkv.strides()[0], qs1 = qkv.strides()[1];
  const int64_t cs0 = cos.strides()[0], cs1 = cos.strides()[1], ss0 = sin.strides()[0], ss1 = sin.strides()[1];
  std::vector<float> x(dims), cp(dims), sp(dims);  // this position's head and tables, contiguous
  for (int b = 0; b < batch; b++)
    for (int p = 0; p < length; p++) {
      const float* row = qkv.data<float>() + (int64_t(b) * length + p) * qs0;
      const int64_t t = table_first + (depth ? depth[p] : p);
      for (int d = 0; d < dims; d++) cp[d] = cos.data<float>()[t * cs0 + d * cs1], sp[d] = sin.data<float>()[t * ss0 + d * ss1];
      for (int h = 0; h < heads + 2 * kv_heads; h++) {
        for (int d = 0; d < dims; d++) x[d] = row[(int64_t(h) * dims + d) * qs1];
        const bool value = h >= heads + kv_heads;
        const HeadsOut& target = out[h < heads ? 0 : value ? 2 : 1];
        const int local = h < heads ? h : value ? h - heads - kv_heads : h - heads;
        const int64_t at = b * target.strides[0] + local * target.strides[1] + int64_t(target.first + p) * target.strides[2];
        const int64_t step = target.strides[3];
        for (int d = 0; d < dims; d++) {
          const int partner = traditional ? d ^ 1 : (d < half ? d + half : d - half);
          target.set(at + d * step, value ? x[d] : x[d] * cp[d] + x[partner] * sp[d]);
        }
      }
    }
}

// The pass's first position, from a one-element int32 array: compiled passes (compiled_pass.py)
// take it as an input, so one traced graph serves every position.
int first_position(const array& offset) { return offset.data<int32_t>()[0]; }

void fill_nan(array& out) {
  float* o = out.data<float>();
  for (size_t i = 0; i < out.size(); i++) o[i] = NAN;
}

// ---- a layer's halves, for compiled passes ------------------------------------------------------

// Each half of a llama layer as one node: a node costs a few microseconds of dispatch on the CPU, and
// a half is otherwise four or five. The products go through the process's cblas_sgemm with the
// arguments MLX's own Matmul and AddMM nodes give it, and the rest through the kernels above, so the
// bits are those of the nodes a half replaces.

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

// The cblas_sgemm MLX's products resolve to (akunu's decode matmuls ahead of OpenBLAS), or null.
sgemm_fn process_sgemm() {
  static const sgemm_fn found = reinterpret_cast<sgemm_fn>(dlsym(RTLD_DEFAULT, "cblas_sgemm"));
  return found;
}

array scratch(Shape shape) {
  array a(std::move(shape), float32, nullptr, {});
  a.set_data(allocator::malloc(a.nbytes()));
  return a;
}

// out = x @ w, plus what out holds if `add`; x contiguous rows. w is read as MLX's CPU matmul reads an
// operand: (K, N) row-major, the transposed view of a row-major (N, K) matrix, or else a contiguous copy.
void product(const array& x, const array& w, array& out, bool add) {
  const int M = x.shape(0), K = x.shape(1), N = w.shape(1);
  const float* b = w.data<float>();
  bool transposed = false;
  int ldb = N;
  array copied = w;
  if (w.strides()[0] == 1 && w.strides()[1] == K) {
    transposed = true, ldb = K;
  } else if (!(w.strides()[0] == N && w.strides()[1] == 1)) {
    copied = scratch({K, N});
    float* dst = copied.data<float>();
    for (int k = 0; k < K; k++)
      for (int n = 0; n < N; n++) dst[int64_t(k) * N + n] = b[k * w.strides()[0] + n * w.strides()[1]];
    b = dst;
  }
  process_sgemm()(101, 111, transposed ? 112 : 111, M, N, K, 1.0f, x.data<float>(), K, b, ldb, add ? 1.0f : 0.0f,
                  out.data<float>(), N);
}

// out = a copy of x's (N, D) rows: the residual the second product adds to, as AddMM copies it.
void copy_rows(const array& x, array& out) {
  const int n = x.shape(-1);
  const auto rows = row_offsets(x);
  for (size_t r = 0; r < rows.size(); r++)
    for (int i = 0; i < n; i++) out.data<float>()[r * n + i] = x.data<float>()[rows[r] + i * x.strides().back()];
}

// x itself when each row's elements are adjacent, else a contiguous copy of its rows.
array unit_stride_rows(const array& x) {
  if (x.strides().back() == 1) return x;
  array copy = scratch(x.shape());
  copy_rows(x, copy);
  return copy;
}

// quantized.cpp's product into rows y_stride floats apart, handed in by quantized.py (`use_quantized_product`).
using RowsProduct = void (*)(const float* x, int rows, int columns, const uint8_t* packed, const void* scales,
                             const void* biases, int scale_type, int outputs, int bits, float* y, int64_t y_stride);
RowsProduct quantized_rows_product = nullptr;

// How a layer half finds a product's weights among its node's inputs: one float32 (K, N) matrix (no bits), or
// quantized parts side by side along the outputs, each packed, scales, biases at its bits, then a bias row if `bias`.
struct Operand {
  std::vector<int> bits;
  bool bias = false;
  int inputs() const { return bits.empty() ? 1 : 3 * int(bits.size()) + int(bias); }
  bool operator==(const Operand& other) const { return bits == other.bits && bias == other.bias; }
};

// out = x @ W + bias + residual, as the eager path's nodes compute it: a float32 matrix adds the residual in its
// sgemm (addmm); quantized parts fill their columns, then the bias and then the residual are added.
void apply(const Operand& op, const array* w, const array& x, const array* residual, array& out) {
  if (op.bits.empty()) {
    if (residual) copy_rows(*residual, out);
    return product(x, w[0], out, residual != nullptr);
  }
  const int rows = x.shape(0), columns = x.shape(1), width = out.shape(1);
  float* y = out.data<float>();
  int column = 0;
  for (size_t part = 0; part < op.bits.size(); part++) {
    const array &packed = w[3 * part], &scales = w[3 * part + 1];
    const int scale_type = scales.dtype() == float32 ? 0 : scales.dtype() == float16 ? 1 : 2;
    const array& biases = w[3 * part + 2];  // empty: centered weights, whose zero point the kernel takes away
    quantized_rows_product(x.data<float>(), rows, columns, packed.data<uint8_t>(), scales.data<void>(),
                           biases.size() ? biases.data<void>() : nullptr, scale_type, packed.shape(0), op.bits[part],
                           y + column, width);
    column += packed.shape(0);
  }
  const float* bias = op.bias ? w[3 * op.bits.size()].data<float>() : nullptr;
  std::vector<const float*> residual_rows;
  const int64_t residual_step = residual ? residual->strides().back() : 0;
  if (residual)
    for (int64_t offset : row_offsets(*residual)) residual_rows.push_back(residual->data<float>() + offset);
  for (int r = 0; r < rows; r++) {
    float* row = y + int64_t(r) * width;
    if (bias)
      for (int i = 0; i < width; i++) row[i] = row[i] + bias[i];
    if (residual)
      for (int i = 0; i < width; i++) row[i] = residual_rows[r][i * residual_step] + row[i];
  }
}

// The width of a product's output rows.
int outputs(const Operand& op, const array* w) {
  if (op.bits.empty()) return w[0].shape(1);
  int total = 0;
  for (size_t part = 0; part < op.bits.size(); part++) total += w[3 * part].shape(0);
  return total;
}

// The rotated heads of the q|k|v product's rows, the keys and values written into the cache's buffers at
// `first`, and causal attention over its first + L positions: rows (B * L, H * hd) at `out`. With a tree, row p
// sits at position first + depth[p] and sees the cache's first `first` positions and its ancestors' rows.
void attend_over_cache(const array& qkv, const array& cos, const array& sin, const array& keys, const array& values,
                       int first, int batch, int heads, int kv_heads, bool traditional, float scale, array& out,
                       const PassTree* tree = nullptr) {
  const int length = qkv.shape(0) / batch;
  array queries = scratch({batch, heads, length, cos.shape(1)});
  const HeadsOut targets[3] = {{queries, 0}, {keys, first}, {values, first}};
  split_heads_kernel(qkv, cos, sin, first, length, batch, heads, kv_heads, traditional, targets,
                     tree ? tree->depth.data() : nullptr);
  attention_kernel(queries, keys, values, out, scale, true, first + length, true, tree);
}

// The tree a pass's parents input gives, or null for a chain; a malformed one is not `valid`.
std::unique_ptr<PassTree> tree_of(const array* parents) {
  return parents ? std::make_unique<PassTree>(*parents) : nullptr;
}

// x + attention(rotated heads of rms_norm(x) @ wqkv, over the cache) @ wo. The pass's keys and values are
// written into the cache's buffers in place at the offset, and the tables read from its row. Writing an
// input breaks MLX's rule that arrays do not change; it is safe here because the buffers are the cache's
// own (dense, written by nothing else) and every reader of the rows written runs after this node on the one
// CPU stream (compiled_pass queues each pass as it is built). Inputs: x, norm weight, the q|k|v product's
// weights, the output projection's, cos, sin, keys, values, offset, and for a tree pass its parents (L,).
void attention_half(const std::vector<array>& in, array& out, float eps, const Operand& wqkv, const Operand& wo,
                    int batch, int heads, int kv_heads, bool traditional, float scale) {
  const array *qkv_weights = &in[2], *o_weights = qkv_weights + wqkv.inputs(), *buffers = o_weights + wo.inputs();
  const array &x = in[0], &cos = buffers[0], &sin = buffers[1], &keys = buffers[2], &values = buffers[3];
  const int first = first_position(buffers[4]), rows = x.shape(0), length = rows / batch;
  const auto tree = tree_of(buffers + 5 < in.data() + in.size() ? buffers + 5 : nullptr);
  if (first < 0 || first + length > keys.shape(2) || first + length > cos.shape(0) || (tree && !tree->valid))
    return fill_nan(out);
  array normed = scratch(x.shape()), qkv = scratch({rows, outputs(wqkv, qkv_weights)});
  array attended = scratch({rows, heads * values.shape(3)});
  rms_norm_kernel(x, in[1], eps, normed);
  apply(wqkv, qkv_weights, normed, nullptr, qkv);
  attend_over_cache(qkv, cos, sin, keys, values, first, batch, heads, kv_heads, traditional, scale, attended, tree.get());
  apply(wo, o_weights, attended, &x, out);
}

// attention_half's middle, for layers whose products are not float32 sgemms (quantized, biased): rows
// (B * L, H * hd) from the q|k|v product's rows, the keys and values written into the cache in place as
// there. Inputs: qkv, cos, sin, keys, values, offset, and for a tree pass its parents.
void attention_rows(const std::vector<array>& in, array& out, int batch, int heads, int kv_heads, bool traditional,
                    float scale) {
  const array &keys = in[3], &values = in[4];
  const int first = first_position(in[5]), length = in[0].shape(0) / batch;
  const auto tree = tree_of(in.size() > 6 ? &in[6] : nullptr);
  if (first < 0 || first + length > keys.shape(2) || first + length > in[1].shape(0) || (tree && !tree->valid))
    return fill_nan(out);
  attend_over_cache(in[0], in[1], in[2], keys, values, first, batch, heads, kv_heads, traditional, scale, out, tree.get());
}

// x + swiglu(rms_norm(x) @ wgate_up) @ wdown. Inputs: x, norm weight, the gate|up product's weights, the down's.
void mlp_half(const std::vector<array>& in, array& out, float eps, const Operand& wgate_up, const Operand& wdown) {
  const array& x = in[0];
  const array *gate_up_weights = &in[2], *down_weights = gate_up_weights + wgate_up.inputs();
  const int rows = x.shape(0), width = outputs(wgate_up, gate_up_weights);
  array normed = scratch(x.shape()), gate_up = scratch({rows, width}), hidden = scratch({rows, width / 2});
  rms_norm_kernel(x, in[1], eps, normed);
  apply(wgate_up, gate_up_weights, normed, nullptr, gate_up);
  swiglu_halves_kernel(gate_up, hidden);
  apply(wdown, down_weights, hidden, &x, out);
}

// One sublayer of a layer stack, as its half's node would run it: the weights are held here, not taken as inputs.
struct Half {
  bool attention;
  float eps;
  Operand first, second;        // q|k|v and the output projection, or gate|up and down
  std::vector<array> weights;   // the norm weight, then first's and second's weights: a half node's inputs after x
  int heads = 0, kv_heads = 0;  // attention only
  bool traditional = false;
  float scale = 0.0f;
};

// A model's sublayers in order, built once and shared by every pass that runs them.
struct Layers {
  std::shared_ptr<const std::vector<Half>> halves;
};

// Halves and Layers reach Python as named capsules, not nanobind classes: a type registers once per process, and
// a second build of this module loaded beside the first (a fresh kernel cache) could not register it again.
constexpr const char* HALF = "akunu.Half";
constexpr const char* LAYERS = "akunu.Layers";

template <typename T>
nb::capsule to_capsule(T value, const char* name) {
  return nb::capsule(new T(std::move(value)), name, [](void* p) noexcept { delete static_cast<T*>(p); });
}

template <typename T>
const T& from_capsule(const nb::capsule& capsule, const char* name) {
  if (!capsule.name() || std::strcmp(capsule.name(), name) != 0)
    throw std::invalid_argument(std::string("expected a capsule ") + name);
  return *static_cast<const T*>(capsule.data());
}

// Every sublayer in turn over x's rows, each half as its own node computes it (the same functions, so the same
// bits), into `out`. Inputs: x, offset, then cos, sin, keys, values for each attention half, then a tree pass's
// parents if `tree`.
void layer_stack(const std::vector<array>& in, array& out, const std::vector<Half>& halves, int batch, bool tree) {
  array current = in[0];
  size_t buffer = 2;
  for (size_t i = 0; i < halves.size(); i++) {
    const Half& half = halves[i];
    array next = i + 1 == halves.size() ? out : scratch(in[0].shape());
    std::vector<array> args{current};
    args.insert(args.end(), half.weights.begin(), half.weights.end());
    if (half.attention) {
      args.insert(args.end(), in.begin() + buffer, in.begin() + buffer + 4);
      args.push_back(in[1]);
      if (tree) args.push_back(in.back());
      buffer += 4;
      attention_half(args, next, half.eps, half.first, half.second, batch, half.heads, half.kv_heads, half.traditional,
                     half.scale);
    } else {
      mlp_half(args, next, half.eps, half.first, half.second);
    }
    current = next;
  }
}

// ---- argmax --------------------------------------------------------------------------------------

constexpr int ARGMAX_CHUNK = 32768;  // values a task scans: a vocabulary's logits are both threads' work

// The first index of the largest value of p[0, n), or of its first NaN (mx.argmax's answer, NaN counting as largest).
struct Best {
  float value;
  int64_t index;
  bool nan;
};

Best chunk_best(const float* p, int n, int64_t first) {
  vi lanes;
  for (int l = 0; l < W; l++) lanes[l] = l;
  vf best = load_part(p, std::min(n, W), -INFINITY);  // lanes past n: -inf at indices past n's, never chosen first
  vi at = lanes, nans = vi{};
  for (int i = 0; i < n; i += W) {
    const vf v = i + W <= n ? load(p + i) : load_part(p + i, n - i, -INFINITY);
    nans |= v != v;
    const vi better = v > best;  // strictly: each lane keeps its first occurrence (a NaN is never better)
    best = better ? v : best;
    at = better ? lanes + i : at;
  }
  float values[W];
  int32_t indices[W], nan_lanes[W];
  std::memcpy(nan_lanes, &nans, sizeof nans);
  if (std::any_of(nan_lanes, nan_lanes + W, [](int32_t lane) { return lane != 0; }))
    for (int k = 0;; k++)  // the first NaN is the answer
      if (std::isnan(p[k])) return {p[k], first + k, true};
  store(values, best);
  std::memcpy(indices, &at, sizeof at);
  Best out{values[0], indices[0], false};
  for (int l = 1; l < W; l++)
    if (values[l] > out.value || (values[l] == out.value && indices[l] < out.index)) out = {values[l], indices[l], false};
  out.index += first;
  return out;
}

// Each row's answer as mx.argmax gives it: chunks in order, the first NaN or else the largest value, ties to the first.
void argmax_kernel(const array& x, array& out) {
  const int n = x.shape(-1);
  const array rows_source = unit_stride_rows(x);
  const auto rows = row_offsets(rows_source);
  const float* data = rows_source.data<float>();
  const int chunks = (n + ARGMAX_CHUNK - 1) / ARGMAX_CHUNK;
  std::vector<Best> bests(rows.size() * chunks);
  over_chunks(int(rows.size()), n, ARGMAX_CHUNK, [&](int r, int chunk, int first, int count) {
    bests[size_t(r) * chunks + chunk] = chunk_best(data + rows[r] + first, count, first);
  });
  for (size_t r = 0; r < rows.size(); r++) {
    Best row = bests[r * chunks];
    for (int c = 1; c < chunks && !row.nan; c++) {
      const Best& next = bests[r * chunks + c];
      if (next.nan || next.value > row.value) row = next;
    }
    out.data<uint32_t>()[r] = uint32_t(row.index);
  }
}

// ---- top k --------------------------------------------------------------------------------------

// Whether any lane of v is greater than t: most blocks of a row's logits are skipped at this one test.
inline bool any_above(vf v, float t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#elif defined(__AVX__)
  return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(t), _CMP_GT_OQ)) != 0;
#else
  float b[W];
  store(b, v);
  return std::any_of(b, b + W, [t](float x) { return x > t; });
#endif
}

// The indices of the k largest of p[0, n), largest first, ties to the lower index (NaNs never chosen while k numbers
// remain): the top k of the next token that Token Recycling keeps after each token a pass was fed.
void top_k_row(const float* p, int n, int k, int32_t* out) {
  std::vector<std::pair<float, int32_t>> best;  // sorted, largest first
  best.reserve(k + 1);
  const auto offer = [&](float value, int32_t index) {
    if (std::isnan(value)) return;
    if (int(best.size()) == k && !(value > best.back().first)) return;
    auto at = best.begin();
    while (at != best.end() && at->first >= value) ++at;  // equal values keep the lower index first
    best.insert(at, {value, index});
    if (int(best.size()) > k) best.pop_back();
  };
  int i = 0;
  for (; i + W <= n; i += W)
    if (int(best.size()) < k || any_above(load(p + i), best.back().first))
      for (int j = 0; j < W; j++) offer(p[i + j], i + j);
  for (; i < n; i++) offer(p[i], i);
  for (int j = 0; j < k; j++) out[j] = j < int(best.size()) ? best[j].second : -1;
}

void top_k_kernel(const array& x, int k, array& out) {
  const int n = x.shape(-1);
  const array rows_source = unit_stride_rows(x);
  const auto rows = row_offsets(rows_source);
  const float* data = rows_source.data<float>();
  for (size_t r = 0; r < rows.size(); r++) top_k_row(data + rows[r], n, k, out.data<int32_t>() + r * k);
}

// ---- MLX primitives -----------------------------------------------------------------------------

using Kernel = std::function<void(const std::vector<array>&, std::vector<array>&)>;

// Float32 outputs, computed by kernel() on the CPU stream as MLX's own CPU primitives are:
// allocated here, the work queued on the stream's encoder with weak copies of the arrays.
class CpuPrimitive : public Primitive {
 public:
  using Primitive::Primitive;
  void eval_cpu(const std::vector<array>& in, std::vector<array>& outputs) override {
    auto& encoder = cpu::get_command_encoder(stream());
    std::vector<array> inputs, outs;
    for (auto& a : in) {
      encoder.set_input_array(a);
      inputs.push_back(array::unsafe_weak_copy(a));
    }
    for (auto& out : outputs) {
      out.set_data(allocator::malloc(out.nbytes()));
      encoder.set_output_array(out);
      outs.push_back(array::unsafe_weak_copy(out));
    }
    // The kernel carries its parameters by value: the primitive may be released before the task runs.
    encoder.dispatch([run = kernel(), inputs = std::move(inputs), outs = std::move(outs)]() mutable { run(inputs, outs); });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error(std::string(name()) + " runs on the CPU only");
  }

 protected:
  virtual Kernel kernel() const = 0;
};

class Attention : public CpuPrimitive {
 public:
  Attention(Stream stream, float scale, bool causal, int keys, bool rows_out)
      : CpuPrimitive(stream), scale_(scale), causal_(causal), keys_(keys), rows_out_(rows_out) {}
  const char* name() const override { return "AkunuAttention"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && keys_ == o.keys_ && rows_out_ == o.rows_out_;
  }

 protected:
  Kernel kernel() const override {
    return [scale = scale_, causal = causal_, keys = keys_, rows = rows_out_](const std::vector<array>& in, std::vector<array>& out) {
      const auto tree = tree_of(in.size() > 3 ? &in[3] : nullptr);  // a tree pass's parents
      if (tree && !tree->valid) return fill_nan(out[0]);
      attention_kernel(in[0], in[1], in[2], out[0], scale, causal, keys, rows, tree.get());
    };
  }

 private:
  float scale_;
  bool causal_;
  int keys_;
  bool rows_out_;
};

class SwiGLU : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "AkunuSwiGLU"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override { return {in[0].shape()}; }  // shapeless traces
  bool is_equivalent(const Primitive&) const override { return true; }

 protected:
  Kernel kernel() const override {
    return [](const std::vector<array>& in, std::vector<array>& out) { swiglu_kernel(in[0], in[1], out[0]); };
  }
};

class SwiGLUHalves : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "AkunuSwiGLUHalves"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override {
    Shape shape = in[0].shape();
    shape.back() /= 2;
    return {shape};
  }
  bool is_equivalent(const Primitive&) const override { return true; }

 protected:
  Kernel kernel() const override {
    return [](const std::vector<array>& in, std::vector<array>& out) { swiglu_halves_kernel(in[0], out[0]); };
  }
};

class TopK : public CpuPrimitive {
 public:
  TopK(Stream stream, int k) : CpuPrimitive(stream), k_(k) {}
  const char* name() const override { return "AkunuTopK"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override {
    Shape shape = in[0].shape();
    shape.back() = k_;
    return {shape};
  }
  bool is_equivalent(const Primitive& other) const override { return k_ == static_cast<const TopK&>(other).k_; }

 protected:
  Kernel kernel() const override {
    return [k = k_](const std::vector<array>& in, std::vector<array>& out) { top_k_kernel(in[0], k, out[0]); };
  }

 private:
  int k_;
};

class Argmax : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "AkunuArgmax"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override {
    return {Shape(in[0].shape().begin(), in[0].shape().end() - 1)};
  }
  bool is_equivalent(const Primitive&) const override { return true; }

 protected:
  Kernel kernel() const override {
    return [](const std::vector<array>& in, std::vector<array>& out) { argmax_kernel(in[0], out[0]); };
  }
};

class RMSNorm : public CpuPrimitive {
 public:
  RMSNorm(Stream stream, float eps) : CpuPrimitive(stream), eps_(eps) {}
  const char* name() const override { return "AkunuRMSNorm"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override { return {in[0].shape()}; }  // shapeless traces
  bool is_equivalent(const Primitive& other) const override { return eps_ == static_cast<const RMSNorm&>(other).eps_; }

 protected:
  Kernel kernel() const override {
    return [eps = eps_](const std::vector<array>& in, std::vector<array>& out) { rms_norm_kernel(in[0], in[1], eps, out[0]); };
  }

 private:
  float eps_;
};

class SplitHeads : public CpuPrimitive {
 public:
  SplitHeads(Stream stream, int batch, int heads, int kv_heads, bool traditional)
      : CpuPrimitive(stream), batch_(batch), heads_(heads), kv_heads_(kv_heads), traditional_(traditional) {}
  const char* name() const override { return "AkunuSplitHeads"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const SplitHeads&>(other);
    return batch_ == o.batch_ && heads_ == o.heads_ && kv_heads_ == o.kv_heads_ && traditional_ == o.traditional_;
  }

 protected:
  Kernel kernel() const override {
    return [b = batch_, h = heads_, kv = kv_heads_, t = traditional_](const std::vector<array>& in, std::vector<array>& out) {
      const HeadsOut targets[3] = {{out[0], 0}, {out[1], 0}, {out[2], 0}};
      split_heads_kernel(in[0], in[1], in[2], 0, in[1].shape(0), b, h, kv, t, targets);
    };
  }

 private:
  int batch_, heads_, kv_heads_;
  bool traditional_;
};

class AttentionHalf : public CpuPrimitive {
 public:
  AttentionHalf(Stream stream, float eps, Operand wqkv, Operand wo, int batch, int heads, int kv_heads, bool traditional, float scale)
      : CpuPrimitive(stream), eps_(eps), wqkv_(std::move(wqkv)), wo_(std::move(wo)), batch_(batch), heads_(heads),
        kv_heads_(kv_heads), traditional_(traditional), scale_(scale) {}
  const char* name() const override { return "AkunuAttentionHalf"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override { return {in[0].shape()}; }  // shapeless traces
  bool is_equivalent(const Primitive&) const override { return false; }  // it writes the cache: never merged

 protected:
  Kernel kernel() const override {
    return [e = eps_, qkv = wqkv_, o = wo_, b = batch_, h = heads_, kv = kv_heads_, t = traditional_, s = scale_](
               const std::vector<array>& in, std::vector<array>& out) { attention_half(in, out[0], e, qkv, o, b, h, kv, t, s); };
  }

 private:
  float eps_;
  Operand wqkv_, wo_;
  int batch_, heads_, kv_heads_;
  bool traditional_;
  float scale_;
};

class AttentionRows : public CpuPrimitive {
 public:
  AttentionRows(Stream stream, int batch, int heads, int kv_heads, bool traditional, float scale)
      : CpuPrimitive(stream), batch_(batch), heads_(heads), kv_heads_(kv_heads), traditional_(traditional), scale_(scale) {}
  const char* name() const override { return "AkunuAttentionRows"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override {
    return {{in[0].shape(0), heads_ * in[1].shape(1)}};
  }
  bool is_equivalent(const Primitive&) const override { return false; }  // it writes the cache: never merged

 protected:
  Kernel kernel() const override {
    return [b = batch_, h = heads_, kv = kv_heads_, t = traditional_, s = scale_](const std::vector<array>& in, std::vector<array>& out) {
      attention_rows(in, out[0], b, h, kv, t, s);
    };
  }

 private:
  int batch_, heads_, kv_heads_;
  bool traditional_;
  float scale_;
};

class MLPHalf : public CpuPrimitive {
 public:
  MLPHalf(Stream stream, float eps, Operand wgate_up, Operand wdown)
      : CpuPrimitive(stream), eps_(eps), wgate_up_(std::move(wgate_up)), wdown_(std::move(wdown)) {}
  const char* name() const override { return "AkunuMLPHalf"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override { return {in[0].shape()}; }  // shapeless traces
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const MLPHalf&>(other);
    return eps_ == o.eps_ && wgate_up_ == o.wgate_up_ && wdown_ == o.wdown_;
  }

 protected:
  Kernel kernel() const override {
    return [e = eps_, gate_up = wgate_up_, down = wdown_](const std::vector<array>& in, std::vector<array>& out) {
      mlp_half(in, out[0], e, gate_up, down);
    };
  }

 private:
  float eps_;
  Operand wgate_up_, wdown_;
};

// A whole pass's layers as one node: one graph node to build and dispatch instead of two a layer.
class LayerStack : public CpuPrimitive {
 public:
  LayerStack(Stream stream, Layers layers, int batch, bool tree)
      : CpuPrimitive(stream), layers_(std::move(layers)), batch_(batch), tree_(tree) {}
  const char* name() const override { return "AkunuLayerStack"; }
  std::vector<Shape> output_shapes(const std::vector<array>& in) override { return {in[0].shape()}; }
  bool is_equivalent(const Primitive&) const override { return false; }  // it writes the cache: never merged

 protected:
  Kernel kernel() const override {
    return [halves = layers_.halves, b = batch_, tree = tree_](const std::vector<array>& in, std::vector<array>& out) {
      layer_stack(in, out[0], *halves, b, tree);
    };
  }

 private:
  Layers layers_;
  int batch_;
  bool tree_;
};

Stream cpu_stream() {
  Stream stream = default_stream(default_device());
  if (stream.device.type != Device::cpu) throw std::invalid_argument("akunu's fused kernels run on the CPU only");
  return stream;
}

void require_float32(const array& a, const char* what) {
  if (a.dtype() != float32) throw std::invalid_argument(std::string(what) + " must be float32");
}

void require_keys_values(const array& keys, const array& values, const char* what) {
  if (keys.dtype() != values.dtype() || (keys.dtype() != float32 && keys.dtype() != float16))
    throw std::invalid_argument(std::string(what) + ": keys and values must both be float32 or both float16");
}

// A tree pass's parents: one int32 per row of the pass (each row's parent row, -1 under the prefix alone).
void require_parents(const std::optional<array>& parents, int length) {
  if (parents && (parents->dtype() != int32 || parents->ndim() != 1 || parents->shape(0) != length))
    throw std::invalid_argument("parents must be one int32 per row of the pass");
}

// keys < 0: all of k's positions; else its first `keys` (a cache buffer and how far it is filled).
array attention(const array& q, const array& k, const array& v, float scale, bool causal, int keys, bool rows_out,
                const std::optional<array>& parents) {
  require_float32(q, "attention inputs");
  require_keys_values(k, v, "attention inputs");
  if (keys < 0) keys = k.ndim() == 4 ? k.shape(2) : 0;
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || k.shape(1) == 0 || q.shape(1) % k.shape(1) ||
      q.shape(3) != k.shape(3) || k.shape(2) != v.shape(2) || k.shape(1) != v.shape(1) ||
      q.shape(0) != k.shape(0) || q.shape(2) > keys || keys > k.shape(2))
    throw std::invalid_argument("attention expects q (B, H, L, D), k (B, KVH, S, D), v (B, KVH, S, Dv), L <= keys <= S");
  if (q.shape(3) % 16 || v.shape(3) % 16) throw std::invalid_argument("attention's head dimensions must be multiples of 16");
  require_parents(parents, q.shape(2));
  Shape shape = rows_out ? Shape{q.shape(0) * q.shape(2), q.shape(1) * v.shape(3)} : Shape{q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  std::vector<array> inputs{q, k, v};
  if (parents) inputs.push_back(*parents);
  return array(shape, float32, std::make_shared<Attention>(cpu_stream(), scale, causal, keys, rows_out), std::move(inputs));
}

array swiglu(const array& gate, const array& x) {
  require_float32(gate, "swiglu inputs");
  require_float32(x, "swiglu inputs");
  if (gate.shape() != x.shape() || gate.ndim() == 0) throw std::invalid_argument("swiglu expects two arrays of one shape");
  return array(gate.shape(), float32, std::make_shared<SwiGLU>(cpu_stream()), {gate, x});
}

array swiglu_halves(const array& gate_up) {
  require_float32(gate_up, "swiglu_halves input");
  if (gate_up.ndim() == 0 || gate_up.shape(-1) % 2) throw std::invalid_argument("swiglu_halves expects rows (..., 2n)");
  Shape shape = gate_up.shape();
  shape.back() /= 2;
  return array(shape, float32, std::make_shared<SwiGLUHalves>(cpu_stream()), {gate_up});
}

array argmax(const array& x) {
  require_float32(x, "argmax input");
  if (x.ndim() == 0 || x.shape(-1) == 0) throw std::invalid_argument("argmax expects x (..., n) with n > 0");
  return array(Shape(x.shape().begin(), x.shape().end() - 1), uint32, std::make_shared<Argmax>(cpu_stream()), {x});
}

array top_k(const array& x, int k) {
  require_float32(x, "top_k input");
  if (x.ndim() == 0 || k < 1 || k > x.shape(-1)) throw std::invalid_argument("top_k expects x (..., n) and 1 <= k <= n");
  Shape shape = x.shape();
  shape.back() = k;
  return array(shape, int32, std::make_shared<TopK>(cpu_stream(), k), {x});
}

array rms_norm(const array& x, const array& weight, float eps) {
  require_float32(x, "rms_norm inputs");
  require_float32(weight, "rms_norm weight");
  if (x.ndim() == 0 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("rms_norm expects x (..., n) and weight (n,)");
  return array(x.shape(), float32, std::make_shared<RMSNorm>(cpu_stream(), eps), {x, weight});
}

std::vector<array> split_heads(const array& qkv, const array& cos, const array& sin, int batch, int heads,
                               int kv_heads, bool traditional) {
  for (auto* a : {&qkv, &cos, &sin}) require_float32(*a, "split_heads inputs");
  if (qkv.ndim() != 2 || cos.ndim() != 2 || cos.shape() != sin.shape() || cos.shape(1) % 2 || batch < 1 ||
      qkv.shape(0) != batch * cos.shape(0) || qkv.shape(1) != (heads + 2 * kv_heads) * cos.shape(1))
    throw std::invalid_argument("split_heads expects qkv (B * L, (H + 2 KV) * D) and tables (L, D)");
  auto inputs = std::vector<array>{qkv, cos, sin};
  const int length = cos.shape(0), dims = cos.shape(1);
  std::vector<Shape> shapes{{batch, heads, length, dims}, {batch, kv_heads, length, dims}, {batch, kv_heads, length, dims}};
  return array::make_arrays(std::move(shapes), {float32, float32, float32},
                            std::make_shared<SplitHeads>(cpu_stream(), batch, heads, kv_heads, traditional), inputs);
}

void require_offset(const array& offset) {
  if (offset.dtype() != int32 || offset.size() != 1) throw std::invalid_argument("offset must be one int32");
}

void require_matrix(const array& w, int rows, const char* what) {
  require_float32(w, what);
  if (w.ndim() != 2 || w.shape(0) != rows) throw std::invalid_argument(std::string(what) + " must be a (" + std::to_string(rows) + ", N) matrix");
}

void require_layer_input(const array& x, const array& norm_weight) {
  require_float32(x, "a layer's rows");
  require_float32(norm_weight, "a norm weight");
  if (x.ndim() != 2 || norm_weight.ndim() != 1 || norm_weight.shape(0) != x.shape(1))
    throw std::invalid_argument("a layer half takes rows (N, D) and a norm weight (D,)");
}

// A quantized operand's weights for rows of `columns` values: parts (packed, scales, biases) at `bits` each, then
// a float32 bias row if one is left over; how many outputs they give.
Operand quantized_operand(const std::vector<array>& w, const std::vector<int>& bits, int columns, const char* what) {
  const std::string name(what);
  if (!quantized_rows_product) throw std::invalid_argument("no quantized kernel is loaded for " + name);
  const size_t parts = bits.size();
  if (parts == 0 || (w.size() != 3 * parts && w.size() != 3 * parts + 1))
    throw std::invalid_argument(name + " takes (packed, scales, biases) per width, then an optional bias");
  int total = 0;
  for (size_t part = 0; part < parts; part++) {
    const array &packed = w[3 * part], &scales = w[3 * part + 1], &biases = w[3 * part + 2];
    const int b = bits[part];
    const auto type = scales.dtype();
    const bool ok = (b >= 2 && b <= 8 && b != 7) && columns % 32 == 0 && packed.dtype() == uint32 &&
                    packed.ndim() == 2 && int64_t(packed.shape(1)) * 32 == int64_t(columns) * b &&
                    (type == float32 || type == float16 || type == bfloat16) && biases.dtype() == type &&
                    scales.ndim() == 2 && (biases.size() == 0 || scales.shape() == biases.shape()) &&
                    scales.shape(0) == packed.shape(0) &&
                    scales.shape(1) * 32 == columns && packed.flags().row_contiguous &&
                    scales.flags().row_contiguous && biases.flags().row_contiguous;
    if (!ok) throw std::invalid_argument(name + ": a part must be weights of `columns` quantized in groups of 32");
    total += packed.shape(0);
  }
  if (w.size() > 3 * parts) {
    const array& bias = w.back();
    require_float32(bias, what);
    if (bias.ndim() != 1 || bias.shape(0) != total || !bias.flags().row_contiguous)
      throw std::invalid_argument(name + ": the bias must be one float32 row of its outputs");
  }
  return Operand{bits, w.size() > 3 * parts};
}

std::vector<array> inputs_of(std::initializer_list<const std::vector<array>*> groups) {
  std::vector<array> all;
  for (auto* group : groups) all.insert(all.end(), group->begin(), group->end());
  return all;
}

int width(const Operand& op, const std::vector<array>& w) { return outputs(op, w.data()); }

// An attention half's tables and cache buffers against its rows x (N, D) and its products' widths.
void check_attention_buffers(const array& x, int qkv_width, int o_width, const array& cos, const array& sin,
                             const array& keys, const array& values, int batch, int heads, int kv_heads) {
  for (auto* a : {&cos, &sin}) require_float32(*a, "attention_half inputs");
  require_keys_values(keys, values, "attention_half inputs");
  const int dims = cos.ndim() == 2 ? cos.shape(1) : 0;
  if (cos.ndim() != 2 || cos.shape() != sin.shape() || dims % 2 || dims % W || batch < 1 || x.shape(0) % batch ||
      qkv_width != (heads + 2 * kv_heads) * dims || keys.ndim() != 4 || keys.shape() != values.shape() ||
      keys.shape(0) != batch || keys.shape(1) != kv_heads || keys.shape(3) != dims || kv_heads < 1 || heads % kv_heads)
    throw std::invalid_argument("attention_half expects q|k|v weights (D, (H + 2 KV) * hd), tables (S', hd) and buffers (B, KV, S, hd)");
  if (o_width != x.shape(1)) throw std::invalid_argument("the output projection must give rows of x's width");
}

array make_attention_half(const array& x, const array& norm_weight, float eps, const Operand& qkv_op,
                          const std::vector<array>& wqkv, const Operand& o_op, const std::vector<array>& wo,
                          const array& cos, const array& sin, const array& keys, const array& values, const array& offset,
                          int batch, int heads, int kv_heads, bool traditional, float scale) {
  check_attention_buffers(x, width(qkv_op, wqkv), width(o_op, wo), cos, sin, keys, values, batch, heads, kv_heads);
  require_offset(offset);
  const std::vector<array> head{x, norm_weight}, tail{cos, sin, keys, values, offset};
  return array(x.shape(), float32,
               std::make_shared<AttentionHalf>(cpu_stream(), eps, qkv_op, o_op, batch, heads, kv_heads, traditional, scale),
               inputs_of({&head, &wqkv, &wo, &tail}));
}

array attention_half_op(const array& x, const array& norm_weight, float eps, const array& wqkv, const array& wo,
                        const array& cos, const array& sin, const array& keys, const array& values, const array& offset,
                        int batch, int heads, int kv_heads, bool traditional, float scale) {
  require_layer_input(x, norm_weight);
  if (!process_sgemm()) throw std::invalid_argument("no cblas_sgemm in this process");
  require_matrix(wqkv, x.shape(1), "the q|k|v weight");
  require_matrix(wo, cos.ndim() == 2 ? heads * cos.shape(1) : -1, "the output projection");
  return make_attention_half(x, norm_weight, eps, Operand{}, {wqkv}, Operand{}, {wo}, cos, sin, keys, values, offset,
                             batch, heads, kv_heads, traditional, scale);
}

array attention_half_quantized_op(const array& x, const array& norm_weight, float eps, const std::vector<array>& wqkv,
                                  const std::vector<int>& qkv_bits, const std::vector<array>& wo,
                                  const std::vector<int>& o_bits, const array& cos, const array& sin, const array& keys,
                                  const array& values, const array& offset, int batch, int heads, int kv_heads,
                                  bool traditional, float scale) {
  require_layer_input(x, norm_weight);
  const Operand qkv_op = quantized_operand(wqkv, qkv_bits, x.shape(1), "the q|k|v weights");
  const Operand o_op = quantized_operand(wo, o_bits, cos.ndim() == 2 ? heads * cos.shape(1) : -1, "the output projection");
  return make_attention_half(x, norm_weight, eps, qkv_op, wqkv, o_op, wo, cos, sin, keys, values, offset, batch, heads,
                             kv_heads, traditional, scale);
}

array attention_rows_op(const array& qkv, const array& cos, const array& sin, const array& keys, const array& values,
                        const array& offset, int batch, int heads, int kv_heads, bool traditional, float scale,
                        const std::optional<array>& parents) {
  for (auto* a : {&qkv, &cos, &sin}) require_float32(*a, "attention_rows inputs");
  require_keys_values(keys, values, "attention_rows inputs");
  require_offset(offset);
  const int dims = cos.ndim() == 2 ? cos.shape(1) : 0;
  if (qkv.ndim() != 2 || cos.ndim() != 2 || cos.shape() != sin.shape() || dims % 2 || dims % W || batch < 1 ||
      qkv.shape(0) % batch || qkv.shape(1) != (heads + 2 * kv_heads) * dims || keys.ndim() != 4 ||
      keys.shape() != values.shape() || keys.shape(0) != batch || keys.shape(1) != kv_heads || keys.shape(3) != dims ||
      kv_heads < 1 || heads % kv_heads)
    throw std::invalid_argument("attention_rows expects q|k|v rows (B * L, (H + 2 KV) * hd), tables (S', hd) and buffers (B, KV, S, hd)");
  require_parents(parents, batch > 0 ? qkv.shape(0) / batch : 0);
  std::vector<array> inputs{qkv, cos, sin, keys, values, offset};
  if (parents) inputs.push_back(*parents);
  return array({qkv.shape(0), heads * dims}, float32,
               std::make_shared<AttentionRows>(cpu_stream(), batch, heads, kv_heads, traditional, scale), std::move(inputs));
}

array make_mlp_half(const array& x, const array& norm_weight, float eps, const Operand& gate_up_op,
                    const std::vector<array>& wgate_up, const Operand& down_op, const std::vector<array>& wdown) {
  if (width(gate_up_op, wgate_up) % 2) throw std::invalid_argument("the gate|up weight must have an even width");
  if (width(down_op, wdown) != x.shape(1)) throw std::invalid_argument("the down projection must give rows of x's width");
  const std::vector<array> head{x, norm_weight};
  return array(x.shape(), float32, std::make_shared<MLPHalf>(cpu_stream(), eps, gate_up_op, down_op),
               inputs_of({&head, &wgate_up, &wdown}));
}

array mlp_half_op(const array& x, const array& norm_weight, float eps, const array& wgate_up, const array& wdown) {
  require_layer_input(x, norm_weight);
  if (!process_sgemm()) throw std::invalid_argument("no cblas_sgemm in this process");
  require_matrix(wgate_up, x.shape(1), "the gate|up weight");
  require_matrix(wdown, wgate_up.shape(1) / 2, "the down projection");
  return make_mlp_half(x, norm_weight, eps, Operand{}, {wgate_up}, Operand{}, {wdown});
}

array mlp_half_quantized_op(const array& x, const array& norm_weight, float eps, const std::vector<array>& wgate_up,
                            const std::vector<int>& gate_up_bits, const std::vector<array>& wdown,
                            const std::vector<int>& down_bits) {
  require_layer_input(x, norm_weight);
  const Operand gate_up_op = quantized_operand(wgate_up, gate_up_bits, x.shape(1), "the gate|up weights");
  const Operand down_op = quantized_operand(wdown, down_bits, width(gate_up_op, wgate_up) / 2, "the down projection");
  return make_mlp_half(x, norm_weight, eps, gate_up_op, wgate_up, down_op, wdown);
}

// A product's operand for a layer stack: one float32 matrix (no bits) of `columns` rows, or quantized parts.
Operand half_operand(const std::vector<array>& w, const std::vector<int>& bits, int columns, const char* what) {
  if (!bits.empty()) return quantized_operand(w, bits, columns, what);
  if (!process_sgemm()) throw std::invalid_argument("no cblas_sgemm in this process");
  if (w.size() != 1) throw std::invalid_argument(std::string(what) + ": one float32 matrix without bits");
  require_matrix(w[0], columns, what);
  return Operand{};
}

Half make_half(bool attention, const array& norm_weight, float eps, const std::vector<array>& first_weights,
               const Operand& first, const std::vector<array>& second_weights, const Operand& second) {
  Half half{attention, eps, first, second, {norm_weight}};
  half.weights.insert(half.weights.end(), first_weights.begin(), first_weights.end());
  half.weights.insert(half.weights.end(), second_weights.begin(), second_weights.end());
  for (const array& a : half.weights)  // held, not inputs: nothing would evaluate them
    if (!a.is_available()) throw std::invalid_argument("a layer stack's weights must be evaluated first");
  return half;
}

nb::capsule attention_half_spec(const array& norm_weight, float eps, const std::vector<array>& wqkv,
                         const std::vector<int>& qkv_bits, const std::vector<array>& wo, const std::vector<int>& o_bits,
                         int heads, int kv_heads, bool traditional, float scale) {
  require_float32(norm_weight, "a norm weight");
  if (norm_weight.ndim() != 1 || kv_heads < 1 || heads % kv_heads) throw std::invalid_argument("attention_half_spec: bad shape");
  const int columns = norm_weight.shape(0);
  const Operand qkv = half_operand(wqkv, qkv_bits, columns, "the q|k|v weights");
  const int qkv_width = width(qkv, wqkv);
  if (qkv_width % (heads + 2 * kv_heads)) throw std::invalid_argument("the q|k|v weights must give whole heads");
  const Operand o = half_operand(wo, o_bits, heads * (qkv_width / (heads + 2 * kv_heads)), "the output projection");
  if (width(o, wo) != columns) throw std::invalid_argument("the output projection must give rows of x's width");
  Half half = make_half(true, norm_weight, eps, wqkv, qkv, wo, o);
  half.heads = heads, half.kv_heads = kv_heads, half.traditional = traditional, half.scale = scale;
  return to_capsule(std::move(half), HALF);
}

nb::capsule mlp_half_spec(const array& norm_weight, float eps, const std::vector<array>& wgate_up,
                   const std::vector<int>& gate_up_bits, const std::vector<array>& wdown, const std::vector<int>& down_bits) {
  require_float32(norm_weight, "a norm weight");
  if (norm_weight.ndim() != 1) throw std::invalid_argument("mlp_half_spec: the norm weight must be (D,)");
  const int columns = norm_weight.shape(0);
  const Operand gate_up = half_operand(wgate_up, gate_up_bits, columns, "the gate|up weights");
  if (width(gate_up, wgate_up) % 2) throw std::invalid_argument("the gate|up weight must have an even width");
  const Operand down = half_operand(wdown, down_bits, width(gate_up, wgate_up) / 2, "the down projection");
  if (width(down, wdown) != columns) throw std::invalid_argument("the down projection must give rows of x's width");
  return to_capsule(make_half(false, norm_weight, eps, wgate_up, gate_up, wdown, down), HALF);
}

nb::capsule layers_of(const std::vector<nb::capsule>& halves) {
  auto all = std::make_shared<std::vector<Half>>();
  for (const auto& half : halves) all->push_back(from_capsule<Half>(half, HALF));
  if (all->empty()) throw std::invalid_argument("layers takes at least one half");
  return to_capsule(Layers{std::move(all)}, LAYERS);
}

// x (N, D) through every half of `layers`; `buffers` holds cos, sin, keys, values for each attention half.
array layer_stack_op(const array& x, const array& offset, const nb::capsule& capsule, const std::vector<array>& buffers,
                     int batch, const std::optional<array>& parents) {
  const Layers& layers = from_capsule<Layers>(capsule, LAYERS);
  require_float32(x, "a layer's rows");
  require_offset(offset);
  const auto& halves = *layers.halves;
  if (x.ndim() != 2 || halves.empty()) throw std::invalid_argument("layer_stack takes rows (N, D) and some halves");
  size_t buffer = 0;
  for (const Half& half : halves) {
    if (half.weights[0].shape(0) != x.shape(1)) throw std::invalid_argument("a half's norm weight must match x's width");
    if (!half.attention) continue;
    if (buffer + 4 > buffers.size()) throw std::invalid_argument("layer_stack needs cos, sin, keys, values per attention half");
    const array* w = half.weights.data() + 1;
    check_attention_buffers(x, outputs(half.first, w), outputs(half.second, w + half.first.inputs()), buffers[buffer],
                            buffers[buffer + 1], buffers[buffer + 2], buffers[buffer + 3], batch, half.heads, half.kv_heads);
    buffer += 4;
  }
  if (buffer != buffers.size()) throw std::invalid_argument("layer_stack takes cos, sin, keys, values per attention half");
  require_parents(parents, batch > 0 ? x.shape(0) / batch : 0);
  std::vector<array> inputs{x, offset};
  inputs.insert(inputs.end(), buffers.begin(), buffers.end());
  if (parents) inputs.push_back(*parents);
  return array(x.shape(), float32, std::make_shared<LayerStack>(cpu_stream(), layers, batch, parents.has_value()),
               std::move(inputs));
}

}  // namespace

NB_MODULE(akunu_cpu_kernels, m) {
  m.def("layers", &layers_of, nb::arg("halves"), "a model's halves in order (attention_half_spec, mlp_half_spec), for layer_stack");
  m.def("attention_half_spec", &attention_half_spec, nb::arg("norm_weight"), nb::arg("eps"), nb::arg("wqkv"),
        nb::arg("qkv_bits"), nb::arg("wo"), nb::arg("o_bits"), nb::arg("heads"), nb::arg("kv_heads"),
        nb::arg("traditional"), nb::arg("scale"),
        "an attention half for layer_stack: weights as attention_half_quantized takes them, or one float32 matrix "
        "each with no bits; evaluated, and held by it");
  m.def("mlp_half_spec", &mlp_half_spec, nb::arg("norm_weight"), nb::arg("eps"), nb::arg("wgate_up"),
        nb::arg("gate_up_bits"), nb::arg("wdown"), nb::arg("down_bits"), "an MLP half for layer_stack, as attention_half_spec");
  m.def("layer_stack", &layer_stack_op, nb::arg("x"), nb::arg("offset"), nb::arg("layers"), nb::arg("buffers"),
        nb::arg("batch"), nb::arg("parents") = nb::none(),
        "x's rows through every half of `layers` in order, one node; `buffers` holds cos, sin, keys, values for each "
        "attention half, whose keys and values are written in place as attention_half writes them; `parents` (int32, "
        "one per row, -1 or an earlier row) makes it a tree pass: row p at offset + its depth, seeing the cache's "
        "first offset positions and its ancestors' rows");
  m.doc() = "akunu's fused CPU decode kernels (akunu/backends/cpu/kernels.cpp)";
  m.def("pool_runner_address", []() { return reinterpret_cast<uintptr_t>(&run_on_pool); },
        "the address of a C function that runs a parallel loop on this module's pool (for quantized.cpp, _matvec.c)");
  m.def("attention", &attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("causal"),
        nb::arg("keys") = -1, nb::arg("rows") = false, nb::arg("parents") = nb::none(),
        "softmax(scale * q @ k^T, causal from the last query) @ v: q (B, H, L, D), k (B, KVH, S, D), v (B, KVH, S, Dv) "
        "(k and v float32 or float16), "
        "over k's and v's first `keys` positions (all if negative); (B, H, L, Dv), or (B * L, H * Dv) if `rows`. "
        "`parents` (int32 (L,): each query's parent query, -1 or an earlier one) replaces the causal rule by a tree's: "
        "query p sees the first keys - L positions and the keys of its ancestors and itself");
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"), "silu(gate) * x");
  m.def("swiglu_halves", &swiglu_halves, nb::arg("gate_up"), "silu(gate) * up for rows (..., 2n) holding gate | up");
  m.def("split_heads", &split_heads, nb::arg("qkv"), nb::arg("cos"), nb::arg("sin"), nb::arg("batch"),
        nb::arg("heads"), nb::arg("kv_heads"), nb::arg("traditional"),
        "queries, keys, values (B, heads, L, D) from the q|k|v product, queries and keys rotated");
  m.def("attention_half", &attention_half_op, nb::arg("x"), nb::arg("norm_weight"), nb::arg("eps"), nb::arg("wqkv"),
        nb::arg("wo"), nb::arg("cos"), nb::arg("sin"), nb::arg("keys"), nb::arg("values"), nb::arg("offset"),
        nb::arg("batch"), nb::arg("heads"), nb::arg("kv_heads"), nb::arg("traditional"), nb::arg("scale"),
        "x + causal attention over the cache's first offset + L positions of the rotated heads of rms_norm(x) @ wqkv, "
        "times wo: one node; the pass's keys and values written into the cache buffers (B, KV, S, hd) in place");
  m.def("attention_rows", &attention_rows_op, nb::arg("qkv"), nb::arg("cos"), nb::arg("sin"), nb::arg("keys"),
        nb::arg("values"), nb::arg("offset"), nb::arg("batch"), nb::arg("heads"), nb::arg("kv_heads"),
        nb::arg("traditional"), nb::arg("scale"), nb::arg("parents") = nb::none(),
        "attention_half's middle (a tree pass with `parents`, as layer_stack): causal attention rows (B * L, H * hd) of the q|k|v product's rotated heads over the "
        "cache's first offset + L positions, the pass's keys and values written into the buffers in place");
  m.def("attention_half_quantized", &attention_half_quantized_op, nb::arg("x"), nb::arg("norm_weight"), nb::arg("eps"),
        nb::arg("wqkv"), nb::arg("qkv_bits"), nb::arg("wo"), nb::arg("o_bits"), nb::arg("cos"), nb::arg("sin"),
        nb::arg("keys"), nb::arg("values"), nb::arg("offset"), nb::arg("batch"), nb::arg("heads"), nb::arg("kv_heads"),
        nb::arg("traditional"), nb::arg("scale"),
        "attention_half with quantized products: each weight list holds (packed, scales, biases) per entry of its "
        "bits, side by side along the outputs, then an optional float32 bias (quantized.py's kernel, one node)");
  m.def("mlp_half_quantized", &mlp_half_quantized_op, nb::arg("x"), nb::arg("norm_weight"), nb::arg("eps"),
        nb::arg("wgate_up"), nb::arg("gate_up_bits"), nb::arg("wdown"), nb::arg("down_bits"),
        "mlp_half with quantized products, the weights given as attention_half_quantized's");
  m.def("use_quantized_product", [](uintptr_t address) { quantized_rows_product = reinterpret_cast<RowsProduct>(address); },
        nb::arg("address"), "multiply quantized weights with the C function at `address` (quantized.cpp's rows_product)");
  m.def("mlp_half", &mlp_half_op, nb::arg("x"), nb::arg("norm_weight"), nb::arg("eps"), nb::arg("wgate_up"), nb::arg("wdown"),
        "x + swiglu_halves(rms_norm(x) @ wgate_up) @ wdown, one node");
  m.def("has_products", []() { return process_sgemm() != nullptr; }, "whether the layer halves can call cblas_sgemm here");
  m.def("argmax", &argmax, nb::arg("x"), "each row's index of its largest value (or first NaN), as mx.argmax over the last axis");
  m.def("top_k", &top_k, nb::arg("x"), nb::arg("k"),
        "each row's k largest values' indices (int32), largest first, ties to the lower index, over the last axis");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"), "weight * x / sqrt(mean(x^2) + eps)");
}
