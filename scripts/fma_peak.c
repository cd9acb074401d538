/* This CPU's float32 FMA peak, to judge scripts/kernel_rows.py's GFLOP/s against (x86 with AVX-512).

       gcc -O3 -mavx512f -pthread scripts/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak

   Each thread runs 12 independent chains of 16-lane FMAs in registers, enough to keep two FMA
   pipes busy through their latency, with no memory traffic: no kernel that loads its operands
   can go faster. */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

#define ROUNDS 100000000L
#define CHAINS 12 /* a0 .. a11 */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define EACH(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECLARE(i) __m512 a##i = _mm512_set1_ps((float)i);
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, b, c);
#define PIN(i) "+v"(a##i),
#define SUM(i) _mm512_reduce_add_ps(a##i) +

/* Named variables, not an array: GCC keeps an array of vectors on the stack (a third of the speed). */
static void *chains(void *result) {
  __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-8f);
  EACH(DECLARE)
  for (long n = 0; n < ROUNDS; n++) {
    EACH(STEP)
    __asm__ volatile("" : EACH(PIN) "+v"(b));  /* keeps the loop from being folded away */
  }
  *(float *)result = EACH(SUM) 0.f;
  return NULL;
}

int main(void) {
  float results[2];
  for (int threads = 1; threads <= 2; threads++) {
    pthread_t ids[2];
    double start = now();
    for (int t = 0; t < threads; t++) pthread_create(&ids[t], NULL, chains, &results[t]);
    for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
    double flops = threads * (double)ROUNDS * CHAINS * 16 * 2;
    printf("%d thread%s: %.0f GFLOP/s\n", threads, threads > 1 ? "s" : "", flops / (now() - start) / 1e9);
  }
  return 0;
}
