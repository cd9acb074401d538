// What every path of akunu's quantized product shares: the weights' layout, activations quantized to int8, the
// reference arithmetic in plain C++ and the order of its float sums, which each instruction set's path keeps bit
// for bit. No MLX here: the ARM64 check cross-compiles this header with the NEON path alone.
//
// y = x W^T where W is stored as MLX quantizes it (mode "affine", groups of 32 along a row, `bits` per value packed
// little-endian into one bit stream, a scale and bias per group in float32, float16 or bfloat16). Each group of 32
// values of a row of x is quantized to int8 (qx = round(x / dx), dx = max|x| / 127, as llama.cpp quantizes
// activations for its integer kernels); q_g . qx_g is an exact integer dot product. For output o (n = o % 4):
//
//   acc[g % 4] = fma(float(q_g . qx_g - zero * sum(qx_g)), dx_g * scale_og, acc[g % 4])    groups g in order
//   v[16] = 0, v[4n + j] = acc[j];  v[g % 16] = fma(bias_og, dx_g * sum(qx_g), v[g % 16])   groups g in order
//   s_L = (v[4L] + v[4L + 2]) + (v[4L + 1] + v[4L + 3]);  y = (s_0 + s_2) + (s_1 + s_3)
//
// That order is the one the AVX-512 path's registers give (lanes 4n + g hold 4 weight rows' group sums), so a row's
// result depends only on the row and on o % 4, never on the rows beside it or on how threads share the outputs:
// a verification pass gives each position the bits a single-token step gives it.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace akunu::quantized {

constexpr int GROUP = 32;
constexpr size_t PARALLEL_FROM = size_t(1) << 18;  // weights: smaller matrices are not worth waking a second thread
constexpr int SHARE = 8;   // blocks of 4 weight rows a thread takes at a time, at least
constexpr int STEPS = 64;  // a product's row blocks are taken about this many steps at a time (`Ranges`)

using Task = void (*)(const void* context, int begin, int end);
using Runner = void (*)(Task task, const void* context, int items, int share, int parallel);
inline Runner runner = nullptr;  // the fused kernels' pool, handed in by quantized.py (`use_pool`)
inline int pool_threads = 1;     // the pool's helpers and the caller

// task over items [0, items), shared with the pool's helpers if `parallel`: one set of helper threads for every kernel.
inline void parallel_for(Task task, const void* context, int items, int share, bool parallel) {
  if (runner) return runner(task, context, items, share, parallel);
  task(context, 0, items);
}

enum class Scale { f32, f16, bf16 };

inline float half_to_float(uint16_t h) {
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

inline float to_float(const void* p, Scale type, size_t i) {
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
  const uint8_t* end() const { return packed + size_t(outputs) * row_bytes(); }
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

// One group of 32 values of a row of x as int8 (qx = round-half-even(x / dx)), its step dx and sum(qx).
inline void quantize_group_scalar(const float* x, int8_t* q, float* step, int32_t* total) {
  float amax = 0.0f;
  for (int i = 0; i < GROUP; i++) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  int sum = 0;
  for (int i = 0; i < GROUP; i++) sum += q[i] = int8_t(std::nearbyint(x[i] * inverse));
  *step = d;
  *total = sum;
}

// x's rows quantized per group for a vector path whose chunks hold `chunk` groups: the int8 values padded to whole
// chunks, each group's step, sum(qx) and dx * sum(qx) padded past the biases' last 16 groups; zeros past the groups.
struct PaddedRows {
  int rows, groups, chunks, padded;
  size_t row_values;
  Aligned<int8_t> q;
  Aligned<float> steps, sums;
  Aligned<int32_t> totals;

  PaddedRows(int rows_, int columns, int chunk)
      : rows(rows_),
        groups(columns / GROUP),
        chunks((groups + chunk - 1) / chunk),
        padded((groups + 15) / 16 * 16 + 16),
        row_values(size_t(chunks) * chunk * GROUP),
        q(size_t(rows_) * row_values),
        steps(size_t(rows_) * padded),
        sums(size_t(rows_) * padded),
        totals(size_t(rows_) * padded) {}

  int8_t* group_values(int m, int g) { return q.get() + size_t(m) * row_values + size_t(g) * GROUP; }
  void set_group(int m, int g, float step, int32_t total) {  // dx * sum(qx): one float32 product, as the reference's
    const size_t at = size_t(m) * padded + g;
    steps.get()[at] = step;
    totals.get()[at] = total;
    sums.get()[at] = step * float(total);
  }
  const int8_t* q_row(int m) const { return q.get() + size_t(m) * row_values; }
  const float* steps_row(int m) const { return steps.get() + size_t(m) * padded; }
  const float* sums_row(int m) const { return sums.get() + size_t(m) * padded; }
  const int32_t* totals_row(int m) const { return totals.get() + size_t(m) * padded; }
};

// The reduction every path ends on, from an output's v[16] (see the top of this file).
inline float sum_lanes(const float v[16]) {
  float s[4];
  for (int lane = 0; lane < 4; lane++) s[lane] = (v[4 * lane] + v[4 * lane + 2]) + (v[4 * lane + 1] + v[4 * lane + 3]);
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// The reference: one output's sum from its groups' exact dot products (zero point taken away), in the order above.
inline float reference_output(const Weights& w, int o, const int32_t* dots, const float* steps, const float* sums) {
  const int groups = w.groups();
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, v[16] = {};
  for (int g = 0; g < groups; g++) acc[g % 4] = std::fma(float(dots[g]), steps[g] * w.scale(o, g), acc[g % 4]);
  for (int j = 0; j < 4; j++) v[4 * (o % 4) + j] = acc[j];
  for (int g = 0; w.biases && g < groups; g++) v[g % 16] = std::fma(w.bias(o, g), sums[g], v[g % 16]);
  return sum_lanes(v);
}

// Reference arithmetic in plain scalar code: the path of CPUs without a vector path, and what every path must equal.
// y's rows are `y_stride` floats apart (a part of a stacked product writes its columns of wider rows).
struct ScalarCall {
  const float* x;
  int rows;
  const Weights& w;
  float* y;
  int64_t y_stride;
  const int8_t* q;
  const float *steps, *sums;
  const int32_t* totals;
};

inline void scalar_outputs(const void* context, int begin, int end) {
  const ScalarCall& call = *static_cast<const ScalarCall*>(context);
  const Weights& w = call.w;
  const int groups = w.groups();
  std::unique_ptr<int32_t[]> dots(new int32_t[std::max(groups, 1)]);
  int32_t values[GROUP];
  for (int o = begin; o < end; o++)
    for (int m = 0; m < call.rows; m++) {
      const size_t at = size_t(m) * groups;
      for (int g = 0; g < groups; g++) {
        unpack_scalar(w.packed + size_t(o) * w.row_bytes() + size_t(g) * 4 * w.bits, w.bits, values);
        int32_t dot = 0;
        for (int i = 0; i < GROUP; i++) dot += values[i] * call.q[(at + g) * GROUP + i];
        dots[g] = dot - w.zero() * call.totals[at + g];
      }
      call.y[m * call.y_stride + o] = reference_output(w, o, dots.get(), call.steps + at, call.sums + at);
    }
}

inline void product_scalar(const float* x, int rows, const Weights& w, float* y, int64_t y_stride) {
  const size_t groups = size_t(w.groups()), cells = size_t(rows) * groups;
  std::unique_ptr<int8_t[]> q(new int8_t[std::max<size_t>(cells, 1) * GROUP]);
  std::unique_ptr<float[]> steps(new float[std::max<size_t>(cells, 1)]), sums(new float[std::max<size_t>(cells, 1)]);
  std::unique_ptr<int32_t[]> totals(new int32_t[std::max<size_t>(cells, 1)]);
  for (size_t cell = 0; cell < cells; cell++) {
    const size_t m = cell / groups, g = cell % groups;
    quantize_group_scalar(x + m * w.columns + g * GROUP, q.get() + cell * GROUP, &steps[cell], &totals[cell]);
    sums[cell] = steps[cell] * float(totals[cell]);
  }
  const ScalarCall call{x, rows, w, y, y_stride, q.get(), steps.get(), sums.get(), totals.get()};
  parallel_for(scalar_outputs, &call, w.outputs, 4 * SHARE, size_t(w.outputs) * w.columns >= PARALLEL_FROM);
}

// A product's blocks of weight rows in one range per thread. Each thread takes steps from the front of its own range,
// then from the back of the others': the thread done first waits for one step of another's at most, and a range whose
// thread the OS has descheduled is finished by the others. A thread reads its own range front to back, cold once.
struct Ranges {
  static constexpr int MOST = 64;  // ranges held in place: a product's call allocates nothing
  Task blocks_task;                // runs blocks [begin, end) of the product
  const void* call;
  int count, step;
  mutable std::atomic<uint64_t> ranges[MOST];  // front << 32 | back, in blocks of weight rows

  Ranges(Task task, const void* call_, int blocks, int threads)
      : blocks_task(task), call(call_), count(std::clamp(threads, 1, MOST)),
        step(std::max(SHARE, (blocks + STEPS - 1) / STEPS)) {
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

  static void run(const void* context, int begin, int end) {
    const Ranges& ranges = *static_cast<const Ranges*>(context);
    for (int r = begin; r < end; r++) {
      int first, last;
      while (ranges.take(r, true, first, last)) ranges.blocks_task(ranges.call, first, last);
      for (int other = 1; other < ranges.count; other++)
        while (ranges.take((r + other) % ranges.count, false, first, last)) ranges.blocks_task(ranges.call, first, last);
    }
  }
};

// Blocks [0, blocks) of a product through `task`: on the calling thread for small weights, else shared by ranges.
inline void share_blocks(Task task, const void* call, int blocks, const Weights& w) {
  const bool parallel = size_t(w.outputs) * w.columns >= PARALLEL_FROM;
  if (!parallel || blocks < 4 * SHARE) return parallel_for(task, call, blocks, SHARE, parallel);
  const Ranges ranges(task, call, blocks, pool_threads);
  parallel_for(Ranges::run, &ranges, ranges.count, 1, parallel);
}

}  // namespace akunu::quantized
