// Products of a few rows of activations with MLX affine-quantized weights, for MLX's CPU backend.
//
// y = x W^T where W is stored as MLX quantizes it (mode "affine", groups of 32 along a row, `bits`
// per value packed little-endian into one bit stream, float32 scale and bias per group), so that
// W[o, k] = scale * q + bias. MLX's own CPU quantized_matmul reads those weights at about 1 GB/s;
// decode steps and verification passes (1-33 rows) are bound by reading W, so here each block of
// weight rows is read once at its stored width, unpacked to float32 into a small buffer, and
// multiplied with every row of x from there.
//
// scale * q is exact in float32 for every GGUF type akunu maps onto this format, so the unpacked
// weight is the dequantized weight bit for bit. Each (row, output) dot product runs in an order
// fixed by the row length alone (16 lanes across the row, then the same halving tree), so a row's
// result does not depend on how many rows share the call: a verification pass gives each position
// the bits a single-token step gives it.
//
// Built on first use by quantized.py with kernels.py's machinery (g++ -march=native).

#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AKUNU_VBMI 1
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
constexpr int LANES = 16;
constexpr int OUT_BLOCK = 4;  // weight rows unpacked together (one register tile's width)
constexpr int ROW_TILE = 4;   // rows of x in one register tile
constexpr int CHUNK = 1024;   // columns unpacked at a time (a multiple of GROUP)
constexpr size_t PARALLEL_FROM = size_t(1) << 18;  // weights: smaller matrices are not worth waking a second thread
typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Keeps a loaded vector in a register: otherwise GCC folds the load into every FMA that uses it,
// loading each x vector once per weight row instead of once per tile.
inline vf in_register(vf v) {
  asm("" : "+v"(v));
  return v;
}

inline float lane_sum(vf v) {
  float b[LANES];
  std::memcpy(b, &v, sizeof b);
  for (int width = LANES / 2; width > 0; width /= 2)
    for (int i = 0; i < width; i++) b[i] += b[i + width];
  return b[0];
}

// The 32 values of one group (4 * bits bytes at p) as unsigned integers, values[i] = bits i*b.. of the stream.
inline void unpack_scalar(const uint8_t* p, int bits, int32_t* values) {
  const uint32_t mask = (1u << bits) - 1;
  for (int i = 0; i < GROUP; i++) {
    const int bit = i * bits;
    const uint32_t pair = p[bit / 8] | (bit / 8 + 1 < 4 * bits ? uint32_t(p[bit / 8 + 1]) << 8 : 0u);
    values[i] = (pair >> (bit % 8)) & mask;
  }
}

#ifdef AKUNU_VBMI
inline vf as_vf(__m512 v) {
  vf out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

// Unpacks one group of 32 values and returns scale * q + bias for them, in two vectors of 16.
//  8 bits: bytes widened to int32 and converted.
//  2-5 bits: each int32 lane gets the two stream bytes holding its value, shifted into its low bits; the
//    group's 32 possible weights (scale * q + bias) form a table those low 5 bits index (vpermt2ps, which
//    ignores the higher bits, so no mask is needed; below 5 bits the table repeats).
//  6 bits: 16-bit lanes, masked, widened and converted.
// Loads are masked to the group's bytes, so the last group of a buffer never reads past it.
struct Unpacker {
  int bits;
  __m512i pick_lo, pick_hi, shift_lo, shift_hi, pick16, shift16, mask16;
  __m512 levels_lo, levels_hi;
  __mmask32 bytes;
  explicit Unpacker(int b) : bits(b) {
    alignas(64) uint8_t picks[2][64], pick_words[64];
    alignas(64) uint32_t shifts[2][16];
    alignas(64) uint16_t word_shifts[32];
    alignas(64) float levels[32];
    for (int i = 0; i < GROUP; i++) {
      const int bit = i * bits, first = bit / 8, second = first + 1 < 4 * bits ? first + 1 : first;
      for (int j = 0; j < 4; j++) picks[i / LANES][4 * (i % LANES) + j] = j == 0 ? first : second;
      shifts[i / LANES][i % LANES] = bit % 8;
      pick_words[2 * i] = first;
      pick_words[2 * i + 1] = second;
      word_shifts[i] = bit % 8;
      levels[i] = float(i & ((1 << std::min(bits, 5)) - 1));
    }
    pick_lo = _mm512_load_si512(picks[0]);
    pick_hi = _mm512_load_si512(picks[1]);
    shift_lo = _mm512_load_si512(shifts[0]);
    shift_hi = _mm512_load_si512(shifts[1]);
    pick16 = _mm512_load_si512(pick_words);
    shift16 = _mm512_load_si512(word_shifts);
    mask16 = _mm512_set1_epi16((1 << bits) - 1);
    levels_lo = _mm512_load_ps(levels);
    levels_hi = _mm512_load_ps(levels + LANES);
    bytes = bits == 8 ? ~__mmask32(0) : (__mmask32(1) << (4 * bits)) - 1;
  }
  inline void operator()(const uint8_t* p, float scale, float bias, vf& lo, vf& hi) const {
    const __m512 s = _mm512_set1_ps(scale), b = _mm512_set1_ps(bias);
    if (bits == 8) {
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
      lo = as_vf(_mm512_fmadd_ps(q0, s, b));
      hi = as_vf(_mm512_fmadd_ps(q1, s, b));
      return;
    }
    const __m512i data = _mm512_zextsi256_si512(_mm256_maskz_loadu_epi8(bytes, p));
    if (bits <= 5) {
      const __m512 table_lo = _mm512_fmadd_ps(levels_lo, s, b), table_hi = _mm512_fmadd_ps(levels_hi, s, b);
      const __m512i index_lo = _mm512_srlv_epi32(_mm512_permutexvar_epi8(pick_lo, data), shift_lo);
      const __m512i index_hi = _mm512_srlv_epi32(_mm512_permutexvar_epi8(pick_hi, data), shift_hi);
      lo = as_vf(_mm512_permutex2var_ps(table_lo, index_lo, table_hi));
      hi = as_vf(_mm512_permutex2var_ps(table_lo, index_hi, table_hi));
      return;
    }
    const __m512i words = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi8(pick16, data), shift16), mask16);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1)));
    lo = as_vf(_mm512_fmadd_ps(q0, s, b));
    hi = as_vf(_mm512_fmadd_ps(q1, s, b));
  }
};
#else
struct Unpacker {
  int bits;
  explicit Unpacker(int b) : bits(b) {}
  inline void operator()(const uint8_t* p, float scale, float bias, vf& lo, vf& hi) const {
    int32_t values[GROUP];
    unpack_scalar(p, bits, values);
    for (int i = 0; i < LANES; i++) {
      lo[i] = __builtin_fmaf(float(values[i]), scale, bias);
      hi[i] = __builtin_fmaf(float(values[LANES + i]), scale, bias);
    }
  }
};
#endif

struct Weights {
  const uint8_t* packed;
  const float* scales;
  const float* biases;
  int outputs, columns, bits;
  size_t row_bytes() const { return size_t(columns) * bits / 8; }
};

// Columns [column, column + width) of rows [first, first + count) of W as float32, `width` apart in out.
void unpack_rows(const Weights& w, const Unpacker& unpack, int first, int count, int column, int width, float* out) {
  const int groups = w.columns / GROUP;
  for (int r = 0; r < count; r++) {
    const uint8_t* p = w.packed + size_t(first + r) * w.row_bytes() + size_t(column / GROUP) * 4 * w.bits;
    const float* scales = w.scales + size_t(first + r) * groups + column / GROUP;
    const float* biases = w.biases + size_t(first + r) * groups + column / GROUP;
    float* row = out + size_t(r) * width;
    for (int g = 0; g < width / GROUP; g++, p += 4 * w.bits) {
      vf lo, hi;
      unpack(p, scales[g], biases[g], lo, hi);  // scale * q is exact: one rounding, as llama.cpp's
      std::memcpy(row + g * GROUP, &lo, sizeof lo);
      std::memcpy(row + g * GROUP + LANES, &hi, sizeof hi);
    }
  }
}

// Adds x[m] * w[n] lane-wise over `width` columns to the running sums acc[m][n] of a tile of MR rows
// and NR unpacked weight rows (sums start at zero on the first chunk). A sum's additions run in column
// order whatever the tile, so a row's result does not depend on its neighbours.
template <int MR, int NR>
void tile(const float* x, int x_apart, const float* w, int width, vf* acc, bool first_chunk) {
  vf a[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) a[m][n] = first_chunk ? vf{} : acc[m * OUT_BLOCK + n];
  for (int k = 0; k < width; k += LANES) {
    vf wv[NR];
    for (int n = 0; n < NR; n++) wv[n] = in_register(load(w + size_t(n) * width + k));
    for (int m = 0; m < MR; m++) {
      const vf xv = in_register(load(x + size_t(m) * x_apart + k));
      for (int n = 0; n < NR; n++) a[m][n] += xv * wv[n];
    }
  }
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) acc[m * OUT_BLOCK + n] = a[m][n];
}

template <int NR>
void rows_times_chunk(const float* x, int rows, int columns, const float* w, int width, vf* acc, bool first_chunk) {
  int m = 0;
  for (; m + ROW_TILE <= rows; m += ROW_TILE)
    tile<ROW_TILE, NR>(x + size_t(m) * columns, columns, w, width, acc + m * OUT_BLOCK, first_chunk);
  for (; m < rows; m++) tile<1, NR>(x + size_t(m) * columns, columns, w, width, acc + m * OUT_BLOCK, first_chunk);
}

// x copied to start on a 64-byte line (rows stay on lines: columns is a multiple of 32), or null if it
// does already or has one row. MLX's arrays start 24 bytes past a line, so every load of x would straddle two.
float* line_aligned(const float* x, int rows, int columns) {
  if (rows == 1 || reinterpret_cast<uintptr_t>(x) % 64 == 0) return nullptr;
  const size_t bytes = size_t(rows) * columns * sizeof(float);
  float* copy = static_cast<float*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
  if (copy) std::memcpy(copy, x, bytes);
  return copy;
}

// Blocks of OUT_BLOCK weight rows, each unpacked CHUNK columns at a time into a buffer that stays in L1
// with the chunk of x's rows it meets; every block's weights are read from memory once.
void quantized_product(const float* x, int rows, const Weights& w, float* y) {
  const std::unique_ptr<float, decltype(&std::free)> copy(line_aligned(x, rows, w.columns), &std::free);
  if (copy) x = copy.get();
  const Unpacker unpack(w.bits);
  const int blocks = (w.outputs + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel if (size_t(w.outputs) * w.columns >= PARALLEL_FROM)
  {
    std::vector<float> buffer(size_t(OUT_BLOCK) * CHUNK);
    std::vector<vf> acc(size_t(rows) * OUT_BLOCK);
#pragma omp for schedule(static)
    for (int block = 0; block < blocks; block++) {
      const int first = block * OUT_BLOCK, count = std::min(OUT_BLOCK, w.outputs - first);
      for (int column = 0; column < w.columns; column += CHUNK) {
        const int width = std::min(CHUNK, w.columns - column);
        unpack_rows(w, unpack, first, count, column, width, buffer.data());
        const float* xc = x + column;
        switch (count) {
          case 4: rows_times_chunk<4>(xc, rows, w.columns, buffer.data(), width, acc.data(), column == 0); break;
          case 3: rows_times_chunk<3>(xc, rows, w.columns, buffer.data(), width, acc.data(), column == 0); break;
          case 2: rows_times_chunk<2>(xc, rows, w.columns, buffer.data(), width, acc.data(), column == 0); break;
          default: rows_times_chunk<1>(xc, rows, w.columns, buffer.data(), width, acc.data(), column == 0); break;
        }
      }
      for (int m = 0; m < rows; m++)
        for (int n = 0; n < count; n++) y[size_t(m) * w.outputs + first + n] = lane_sum(acc[m * OUT_BLOCK + n]);
    }
  }
}

// The whole matrix as float32 (for prefill: one float32 GEMM instead of MLX's quantized one).
void dequantize_all(const Weights& w, float* out) {
  const Unpacker unpack(w.bits);
  const int blocks = (w.outputs + 63) / 64;
#pragma omp parallel for schedule(static) if (size_t(w.outputs) * w.columns >= PARALLEL_FROM)
  for (int block = 0; block < blocks; block++) {
    const int first = block * 64, count = std::min(64, w.outputs - first);
    unpack_rows(w, unpack, first, count, 0, w.columns, out + size_t(first) * w.columns);
  }
}

// ---- MLX primitives -----------------------------------------------------------------------------

Weights weights_of(const std::vector<array>& in, int bits) {
  const array& packed = in[1];
  return {packed.data<uint8_t>(), in[2].data<float>(), in[3].data<float>(), int(packed.shape(0)),
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
      quantized_product(in[0].data<float>(), int(in[0].size() / w.columns), w, out.data<float>());
    };
  }
};

class Dequantize : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "AkunuDequantize"; }

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
  if (packed.dtype() != uint32 || scales.dtype() != float32 || biases.dtype() != float32)
    throw std::invalid_argument("expected uint32 packed weights with float32 scales and biases");
  if (packed.ndim() != 2 || scales.ndim() != 2 || scales.shape() != biases.shape() || scales.shape(0) != packed.shape(0) ||
      int64_t(packed.shape(1)) * 32 != int64_t(scales.shape(1)) * GROUP * bits)
    throw std::invalid_argument("weights must be one matrix quantized in groups of 32");
  for (auto* a : {&packed, &scales, &biases})
    if (!a->flags().row_contiguous) throw std::invalid_argument("weights must be row-contiguous");
}

// x (..., K) float32 row-contiguous; packed (N, K * bits / 32) uint32; scales, biases (N, K / 32) float32.
array quantized_product_op(const array& x, const array& packed, const array& scales, const array& biases, int bits) {
  check_weights(packed, scales, biases, bits);
  if (x.dtype() != float32 || x.ndim() == 0 || x.shape(-1) != scales.shape(1) * GROUP)
    throw std::invalid_argument("x must be float32 (..., K) with K the weights' columns");
  if (!x.flags().row_contiguous) throw std::invalid_argument("x must be row-contiguous");
  Shape shape = x.shape();
  shape.back() = packed.shape(0);
  return array(shape, float32, std::make_shared<QuantizedProduct>(cpu_stream(), bits), {x, packed, scales, biases});
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
  m.def("quantized_product", &quantized_product_op, nb::arg("x"), nb::arg("packed"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("bits"), "x @ dequantize(packed, scales, biases).T, each row computed alone");
  m.def("dequantize", &dequantize_op, nb::arg("packed"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"),
        "the float32 matrix the weights hold");
  m.def("vectorized_unpack", []() {
#ifdef AKUNU_VBMI
    return true;
#else
    return false;
#endif
  });
}
