// Products of a few rows of activations with MLX affine-quantized weights, for MLX's CPU backend: the MLX primitives
// over the path this build has (quantized_core.h says what every path computes, and in which order).
//
// Decode steps and verification passes (1-256 rows) are bound by reading W, so each weight is read once at its
// stored width and never widened to float; x is quantized to int8 per group of 32 and multiplied as integers.
// The bias term uses the quantized x too, so the rounding error is sum(W * (dx * qx - x)): with x's exact sum it
// would be sum(scale * q * ...), larger.
//
// Built on first use by quantized.py with kernels.py's machinery, for one instruction set (AKUNU_CPU_ISA):
// avx512 (VBMI + VNNI), avx2 (+ FMA, F16C), neon (ARMv8.2 dot product), or the scalar reference.

#include <nanobind/nanobind.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "quantized_core.h"

#if defined(AKUNU_ISA_SCALAR)
#define AKUNU_PATH "scalar"
#elif defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__BMI2__)
#include "quantized_avx512.h"
#define AKUNU_PATH "avx512"
#define AKUNU_AVX512 1
namespace PATH = akunu::quantized::avx512;
#define AKUNU_VECTOR_PATH 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quantized_avx2.h"
#ifdef __AVXVNNI__
#define AKUNU_PATH "avxvnni"
#else
#define AKUNU_PATH "avx2"
#endif
#define AKUNU_AVX2 1
namespace PATH = akunu::quantized::avx2;
#define AKUNU_VECTOR_PATH 1
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include "quantized_neon.h"
#define AKUNU_PATH "neon"
namespace PATH = akunu::quantized::neon;
#define AKUNU_VECTOR_PATH 1
#else
#define AKUNU_PATH "scalar"
#endif

#if defined(AKUNU_ISA_REQUIRED)  // a build for a named instruction set that this compiler's flags do not give
static_assert(std::string_view(AKUNU_PATH) == AKUNU_ISA_REQUIRED, "the compiler's flags lack this instruction set");
#endif

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

namespace nb = nanobind;
using namespace mlx::core;
using namespace akunu::quantized;

namespace {

void quantized_product(const float* x, int rows, const Weights& w, float* y, int64_t y_stride) {
#ifdef AKUNU_VECTOR_PATH
  PATH::product(x, rows, w, y, y_stride);
#else
  product_scalar(x, rows, w, y, y_stride);
#endif
}

// One group's 32 values as unsigned integers (4 * bits bytes at p): values[i] = bits i*b.. of the stream.
inline void unpack_group(const uint8_t* p, int bits, int32_t* values) {
#ifdef AKUNU_AVX512
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
#ifdef AKUNU_AVX2
  akunu::quantized::avx2::dequantize_rows(w, begin, end, out);
#else
  int32_t values[GROUP];
  for (int o = begin; o < end; o++)
    for (int g = 0; g < w.groups(); g++) {
      unpack_group(w.packed + size_t(o) * w.row_bytes() + size_t(g) * 4 * w.bits, w.bits, values);
      const float scale = w.scale(o, g), bias = w.bias(o, g);
      float* row = out + size_t(o) * w.columns + g * GROUP;
      for (int i = 0; i < GROUP; i++) row[i] = std::fma(float(values[i]), scale, bias);
    }
#endif
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
      product_scalar(in[0].data<float>(), int(in[0].size() / w.columns), w, out.data<float>(), w.outputs);
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
        nb::arg("biases"), nb::arg("bits"), "quantized_product's arithmetic in plain scalar code (the reference every path equals)");
  m.def("dequantize", &dequantize_op, nb::arg("packed"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"),
        "the float32 matrix the weights hold");
  m.def("use_pool", [](uintptr_t address) {
          runner = reinterpret_cast<Runner>(address);
          pool_threads = std::max(omp_get_max_threads(), 1);  // the pool's helpers and the caller (pool.h)
        }, nb::arg("runner_address"),
        "run parallel loops through the C function at `runner_address` (the fused kernels' `pool_runner_address()`)");
  m.def("rows_product_address", []() { return reinterpret_cast<uintptr_t>(&rows_product); },
        "the address of a C function computing a product into rows of a wider output (kernels.cpp's layer halves)");
  m.attr("path") = AKUNU_PATH;  // the instruction set the products run on
}
