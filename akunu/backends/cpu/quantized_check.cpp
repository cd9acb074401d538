// The quantized product's vector path against the scalar reference, without MLX or Python: every width, scale
// type, zero point and row count on random weights, bit for bit. Built for another CPU (the ARM64 path under
// qemu-user) or for this one by tests/test_quantized_paths.py; `--time` times one product instead.
//
//   g++ -O2 -std=c++20 -march=... -ffp-contract=off quantized_check.cpp -o check && ./check   (prints the path)

#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "quantized_core.h"

#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__BMI2__)
#include "quantized_avx512.h"
namespace path = akunu::quantized::avx512;
constexpr const char* NAME = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "quantized_avx2.h"
namespace path = akunu::quantized::avx2;
#ifdef __AVXVNNI__
constexpr const char* NAME = "avxvnni";
#else
constexpr const char* NAME = "avx2";
#endif
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include "quantized_neon.h"
namespace path = akunu::quantized::neon;
constexpr const char* NAME = "neon";
#else
#error "no vector path for these compiler flags"
#endif

using namespace akunu::quantized;

namespace {

uint16_t to_half(float value) {  // round to nearest even, normal values only (the scales here)
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t sign = (bits >> 16) & 0x8000;
  int exponent = int((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = bits & 0x7fffff;
  if (exponent <= 0) return uint16_t(sign);
  uint32_t half = (uint32_t(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
  return uint16_t(sign | half);
}

struct Case {
  int bits, outputs, columns, rows;
  Scale type;
  bool centered;
};

// Random weights of the case's shape (values, scales, biases) and x, then the path's and the reference's products.
bool check(const Case& c, std::mt19937& random) {
  const int groups = c.columns / GROUP;
  std::vector<uint8_t> packed(size_t(c.outputs) * c.columns * c.bits / 8);
  for (auto& byte : packed) byte = uint8_t(random());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t count = size_t(c.outputs) * groups, size = c.type == Scale::f32 ? 4 : 2;
  std::vector<uint8_t> scales(count * size), biases(c.centered ? 0 : count * size);
  for (size_t i = 0; i < count; i++)
    for (auto* array : {&scales, &biases}) {
      if (array->empty()) continue;
      const float value = normal(random) * 0.01f;
      if (c.type == Scale::f32) std::memcpy(array->data() + 4 * i, &value, 4);
      else {
        uint16_t h = to_half(value);
        if (c.type == Scale::bf16) {
          uint32_t bits;
          std::memcpy(&bits, &value, 4);
          h = uint16_t(bits >> 16);
        }
        std::memcpy(array->data() + 2 * i, &h, 2);
      }
    }
  std::vector<float> x(size_t(c.rows) * c.columns);
  for (auto& value : x) value = normal(random);
  if (c.rows > 1) std::fill(x.begin() + c.columns, x.begin() + c.columns + GROUP, 0.0f);  // a group of zeros
  const Weights w{packed.data(), scales.data(), c.centered ? nullptr : biases.data(), c.type, c.outputs, c.columns,
                  c.bits};
  std::vector<float> got(size_t(c.rows) * c.outputs), expected(got.size());
  path::product(x.data(), c.rows, w, got.data(), c.outputs);
  product_scalar(x.data(), c.rows, w, expected.data(), c.outputs);
  if (std::memcmp(got.data(), expected.data(), got.size() * 4) == 0) return true;
  for (size_t i = 0; i < got.size(); i++)
    if (std::memcmp(&got[i], &expected[i], 4) != 0) {
      std::printf("MISMATCH bits %d type %d centered %d %dx%d rows %d: y[%zu] = %.9g, reference %.9g\n", c.bits,
                  int(c.type), int(c.centered), c.outputs, c.columns, c.rows, i, got[i], expected[i]);
      break;
    }
  return false;
}

double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + t.tv_nsec * 1e-9;
}

int time_products(int bits, int rows, int outputs, int columns, int repetitions) {
  std::mt19937 random(1);
  std::vector<uint8_t> packed(size_t(outputs) * columns * bits / 8);
  for (auto& byte : packed) byte = uint8_t(random());
  std::vector<uint16_t> scales(size_t(outputs) * columns / GROUP, to_half(0.01f)), biases(scales);
  std::vector<float> x(size_t(rows) * columns, 0.5f), y(size_t(rows) * outputs);
  const Weights w{packed.data(), scales.data(), biases.data(), Scale::f16, outputs, columns, bits};
  path::product(x.data(), rows, w, y.data(), outputs);
  const double start = cpu_seconds();  // the thread's own time: steady while other processes share the cores
  for (int r = 0; r < repetitions; r++) path::product(x.data(), rows, w, y.data(), outputs);
  const double seconds = (cpu_seconds() - start) / repetitions;
  std::printf("%s bits %d rows %d %dx%d: %.1f us, %.2f GB/s of packed weights, %.1f GMAC/s\n", NAME, bits, rows,
              outputs, columns, seconds * 1e6, packed.size() / seconds / 1e9, double(rows) * outputs * columns / seconds / 1e9);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--time") {  // --time BITS ROWS [OUTPUTS COLUMNS REPETITIONS]
    const int bits = argc > 2 ? std::atoi(argv[2]) : 4, rows = argc > 3 ? std::atoi(argv[3]) : 1;
    return time_products(bits, rows, argc > 4 ? std::atoi(argv[4]) : 4864, argc > 5 ? std::atoi(argv[5]) : 896,
                         argc > 6 ? std::atoi(argv[6]) : 200);
  }
  std::mt19937 random(0);
  int cases = 0, failed = 0;
  for (int bits : {2, 3, 4, 5, 6, 8})
    for (Scale type : {Scale::f32, Scale::f16, Scale::bf16})
      for (bool centered : {false, true})
        for (int columns : {32, 288, 896, 4128})
          for (int rows : {1, 2, 3, 4, 5, 6, 7, 9, 33}) {
            const int outputs = columns >= 4096 ? 9 : 37;  // partial blocks of 4 outputs, shapes at the memory's end
            failed += !check(Case{bits, outputs, columns, rows, type, centered}, random);
            cases++;
          }
  std::printf("%s: %d of %d cases equal the reference bit for bit\n", NAME, cases - failed, cases);
  return failed ? 1 : 0;
}
