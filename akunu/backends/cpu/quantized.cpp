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
#include <cstring>
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
constexpr size_t PARALLEL_FROM = size_t(1) << 18;  // weights: smaller matrices are not worth waking a second thread
typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
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
// Per bit width: for 16-bit lane i, the two stream bytes holding value i, and its shift within them.
struct Unpacker {
  __m512i pick, shift, mask;
  __mmask32 bytes;
  explicit Unpacker(int bits) {
    alignas(64) uint8_t pick_bytes[64];
    alignas(64) uint16_t shifts[32];
    for (int i = 0; i < GROUP; i++) {
      const int bit = i * bits;
      pick_bytes[2 * i] = bit / 8;
      pick_bytes[2 * i + 1] = bit / 8 + 1 < 4 * bits ? bit / 8 + 1 : bit / 8;  // the last value needs no byte past the group
      shifts[i] = bit % 8;
    }
    pick = _mm512_load_si512(pick_bytes);
    shift = _mm512_load_si512(shifts);
    mask = _mm512_set1_epi16((1 << bits) - 1);
    bytes = bits == 8 ? ~__mmask32(0) : (__mmask32(1) << (4 * bits)) - 1;
  }
  // Masked load: never reads past the group, so the last group of a buffer cannot fault.
  inline void operator()(const uint8_t* p, vf& lo, vf& hi) const {
    const __m512i data = _mm512_zextsi256_si512(_mm256_maskz_loadu_epi8(bytes, p));
    const __m512i words = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi8(pick, data), shift), mask);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1)));
    std::memcpy(&lo, &a, sizeof lo);
    std::memcpy(&hi, &b, sizeof hi);
  }
};
#else
struct Unpacker {
  int bits;
  explicit Unpacker(int b) : bits(b) {}
  inline void operator()(const uint8_t* p, vf& lo, vf& hi) const {
    int32_t values[GROUP];
    unpack_scalar(p, bits, values);
    for (int i = 0; i < LANES; i++) {
      lo[i] = float(values[i]);
      hi[i] = float(values[LANES + i]);
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

// Rows [first, first + count) of W as float32, `columns` apart in out.
void unpack_rows(const Weights& w, const Unpacker& unpack, int first, int count, float* out) {
  const int groups = w.columns / GROUP;
  for (int r = 0; r < count; r++) {
    const uint8_t* p = w.packed + size_t(first + r) * w.row_bytes();
    const float* scales = w.scales + size_t(first + r) * groups;
    const float* biases = w.biases + size_t(first + r) * groups;
    float* row = out + size_t(r) * w.columns;
    for (int g = 0; g < groups; g++, p += 4 * w.bits) {
      vf lo, hi;
      unpack(p, lo, hi);
      const vf s = vf{} + scales[g], b = vf{} + biases[g];
      const vf a = lo * s + b, c = hi * s + b;  // scale * q is exact: one rounding, as llama.cpp's
      std::memcpy(row + g * GROUP, &a, sizeof a);
      std::memcpy(row + g * GROUP + LANES, &c, sizeof c);
    }
  }
}

// y[m, o] = x[m] . w[o] for a tile of MR rows and NR unpacked weight rows, all MR * NR sums in registers.
template <int MR, int NR>
void tile(const float* x, int rows_apart, const float* w, int columns, float* y, int y_apart) {
  vf acc[MR][NR] = {};
  for (int k = 0; k < columns; k += LANES) {
    vf wv[NR];
    for (int n = 0; n < NR; n++) wv[n] = load(w + size_t(n) * columns + k);
    for (int m = 0; m < MR; m++) {
      const vf xv = load(x + size_t(m) * rows_apart + k);
      for (int n = 0; n < NR; n++) acc[m][n] += xv * wv[n];
    }
  }
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) y[size_t(m) * y_apart + n] = lane_sum(acc[m][n]);
}

template <int NR>
void rows_times_block(const float* x, int rows, const float* w, int columns, float* y, int outputs) {
  int m = 0;
  for (; m + ROW_TILE <= rows; m += ROW_TILE) tile<ROW_TILE, NR>(x + size_t(m) * columns, columns, w, columns, y + size_t(m) * outputs, outputs);
  for (; m < rows; m++) tile<1, NR>(x + size_t(m) * columns, columns, w, columns, y + size_t(m) * outputs, outputs);
}

void quantized_product(const float* x, int rows, const Weights& w, float* y) {
  const Unpacker unpack(w.bits);
  const int blocks = (w.outputs + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel if (size_t(w.outputs) * w.columns >= PARALLEL_FROM)
  {
    std::vector<float> buffer(size_t(OUT_BLOCK) * w.columns);
#pragma omp for schedule(static)
    for (int block = 0; block < blocks; block++) {
      const int first = block * OUT_BLOCK, count = std::min(OUT_BLOCK, w.outputs - first);
      unpack_rows(w, unpack, first, count, buffer.data());
      float* out = y + first;
      switch (count) {
        case 4: rows_times_block<4>(x, rows, buffer.data(), w.columns, out, w.outputs); break;
        case 3: rows_times_block<3>(x, rows, buffer.data(), w.columns, out, w.outputs); break;
        case 2: rows_times_block<2>(x, rows, buffer.data(), w.columns, out, w.outputs); break;
        default: rows_times_block<1>(x, rows, buffer.data(), w.columns, out, w.outputs); break;
      }
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
    unpack_rows(w, unpack, first, count, out + size_t(first) * w.columns);
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
