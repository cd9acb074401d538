/* Decode-shaped matrix products for MLX's CPU backend, loaded ahead of OpenBLAS (blas.py).

   MLX computes every Linear layer as cblas_sgemm(x, W^T). For the 1-33 rows of a decode step
   or a verification pass OpenBLAS's sgemm packs all of W first: at one row it runs at a third
   of the memory bandwidth its sgemv reaches, at 9-16 rows at a third of its compute peak, and
   a row's result depends on how many rows share the call. This library defines cblas_sgemm
   itself and routes:
     - x @ W^T with at most SMALL_M rows: 4 x 4 register tiles, each weight row read from
       memory once, the next tile's rows fetched while this one computes (rows_times_wt);
     - x @ B (B not transposed: attention's weights times V) with at most SMALL_M rows: likewise
       (rows_times_b), so that a decode step never wakes OpenBLAS's threads to contend with ours;
     - any other product with one row or one column: OpenBLAS's sgemv;
     - everything else (prefill chunks): OpenBLAS's sgemm, unchanged.
   In both kernels a row's result is the same whatever the row count.
   Plain C with GCC vector extensions; no Python API. Tiles are shared among threads by the pool of
   akunu's fused kernels once they hand it in (one set of helper threads for every CPU kernel), by
   OpenMP until then. */
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define SMALL_M 128 /* up to here at least as fast as OpenBLAS's sgemm; prefill chunks go to it */
#define MR 4       /* rows of x in one register tile */
#define NR 4       /* rows of W in one register tile (MR * NR = 16: one lane_sums) */
#define B_ROWS 8   /* rows of A per pass over B in rows_times_b */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;

/* Called once by blas.py with OpenBLAS's own entry points. */
void akunu_matvec_init(void *sgemm, void *sgemv) {
  real_sgemm = (sgemm_fn)sgemm;
  real_sgemv = (sgemv_fn)sgemv;
}

typedef void (*task_fn)(const void *context, int begin, int end);
typedef void (*runner_fn)(task_fn task, const void *context, int items, int share, int parallel);
static runner_fn runner;

/* Called by kernels.py with its pool's runner: two sets of helper threads would spin on the same cores. */
void akunu_matvec_use_runner(void *run) { runner = (runner_fn)run; }

/* task(context, i, i + 1) for every i < items, on several threads if `parallel`. */
static void parallel_for(task_fn task, const void *context, int items, int parallel) {
  if (runner) {
    runner(task, context, items, items / 16 > 1 ? items / 16 : 1, parallel);
    return;
  }
#pragma omp parallel for schedule(static) if (parallel)
  for (int i = 0; i < items; i++) task(context, i, i + 1);
}

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define CLONES
#endif

/* The lane sums of 16 vectors at once, lane a of the result summing v[a]: the halving tree
   (lane i + lane i + 8, then + 4, then (0 + 2) + (1 + 3)) run on pairs of vectors side by side,
   so it costs 3 operations per sum instead of 8, and every sum is the same tree whichever
   vectors share it. */
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#define FIRST8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define LAST8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define FIRST4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define LAST4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define FIRST2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define LAST2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define EVEN 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define ODD 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
static inline __attribute__((always_inline)) v16 lane_sums(const v16 v[16]) {
  v16 eights[8], fours[4], twos[2];
  for (int i = 0; i < 8; i++) eights[i] = PICK(v[2 * i], v[2 * i + 1], FIRST8) + PICK(v[2 * i], v[2 * i + 1], LAST8);
  for (int i = 0; i < 4; i++) fours[i] = PICK(eights[2 * i], eights[2 * i + 1], FIRST4) + PICK(eights[2 * i], eights[2 * i + 1], LAST4);
  for (int i = 0; i < 2; i++) twos[i] = PICK(fours[2 * i], fours[2 * i + 1], FIRST2) + PICK(fours[2 * i], fours[2 * i + 1], LAST2);
  return PICK(twos[0], twos[1], EVEN) + PICK(twos[0], twos[1], ODD);
}

/* Lines of the next tile of W for a tile to ask into cache as it computes, per_step of them at each
   of its k steps, from line `first` on. Line i is row i / steps of the tile, columns (i % steps) * 16
   on. Without this a tile's rows arrive only when its first row block asks for them, so a tile takes
   its memory time plus its compute time, not the larger of the two: 5 rows took 1.9x a 1-row
   product, and 1.3x with it (akunu bench kernel --float32, 2-core x86 with AVX-512; 9 rows 2.3x -> 1.7x). */
typedef struct {
  const float *W;
  int ldw, steps, lines, per_step, first;
} Prefetch;

/* One mr x nr tile of C = x W^T: mr rows of x against nr rows of W, all mr * nr dot products
   in registers, so each loaded vector feeds several FMAs. An output's operations (16-lane
   products summed in order of k, then lane_sums's tree) do not depend on mr or nr. */
static inline __attribute__((always_inline)) void tile_wt(const int mr, const int nr, int K,
                                                          const float *x, int ldx, const float *W,
                                                          int ldw, float *C, int ldc, int add,
                                                          const Prefetch *next) {
  v16 acc[MR * NR] = {{0}}; /* acc[m * NR + n]; a smaller tile leaves the rest 0 */
  int line = next->first;
  for (int k = 0; k < K; k += 16) {
    for (int i = 0; i < next->per_step && line < next->lines; i++, line++)
      __builtin_prefetch(next->W + (size_t)(line / next->steps) * next->ldw + (line % next->steps) * 16);
    v16 w[NR];
    for (int n = 0; n < nr; n++) w[n] = *(const v16 *)(W + (size_t)n * ldw + k);
    for (int m = 0; m < mr; m++) {
      v16 xm = *(const v16 *)(x + (size_t)m * ldx + k);
      for (int n = 0; n < nr; n++) acc[m * NR + n] += xm * w[n];
    }
  }
  v16 sums = lane_sums(acc);
  for (int m = 0; m < mr; m++)
    for (int n = 0; n < nr; n++) C[(size_t)m * ldc + n] = add ? C[(size_t)m * ldc + n] + sums[m * NR + n] : sums[m * NR + n];
}

/* x's rows copied to start on 64-byte lines. MLX's CPU arrays start 24 bytes past one, so each
   16-float load of a row would straddle two lines; x's rows are loaded once per tile of W, and
   from 9 rows on, where the product is bound by compute, those loads slowed it (17 rows: about
   1.2x). The copy holds the same numbers, read in the same order, so no result changes. W is
   left where it is: copying its tiles cost as much as the aligned loads saved. */
static int aligned(const float *rows, int ld) { return (uintptr_t)rows % 64 == 0 && ld % 16 == 0; }

static float *aligned_rows(const float *x, int M, int K, int ldx) {
  float *copy = aligned_alloc(64, (size_t)M * K * sizeof(float)); /* K % 16 == 0: a whole number of lines */
  if (copy)
    for (int m = 0; m < M; m++) memcpy(copy + (size_t)m * K, x + (size_t)m * ldx, (size_t)K * sizeof(float));
  return copy;
}

/* C[m, j] = x[m, :] . W[j, :] for m < M, K a multiple of 16, added to what C holds if `add` (beta = 1:
   MLX's addmm, a residual add in the same node, with the bits of a separate add). Each thread takes
   tiles of NR rows of W and runs every row block of x past them while they sit in L1; the row
   blocks share out the fetching of the next tile. One row is left to the hardware prefetcher:
   there the loop is bound by its loads, and the fetches only add to them (measured slower). */
typedef struct {
  int M, N, K, ldx, ldw, ldc, add;
  const float *x, *W;
  float *C;
} WtProduct;

CLONES static void wt_tiles(const void *context, int begin, int end) {
  const WtProduct *p = context;
  const int M = p->M, N = p->N, K = p->K, ldx = p->ldx, ldw = p->ldw, ldc = p->ldc, add = p->add;
  const int blocks = (M + MR - 1) / MR, steps = K / 16;
  for (int t = begin; t < end; t++) {
    int j = t * NR, nr = N - j < NR ? N - j : NR, next_rows = M == 1 ? 0 : N - j - nr < NR ? N - j - nr : NR;
    Prefetch next = {p->W + (size_t)(j + nr) * ldw, ldw, steps, next_rows * steps, (next_rows + blocks - 1) / blocks, 0};
    const float *Wj = p->W + (size_t)j * ldw;
    for (int m = 0; m < M; m += MR, next.first += next.per_step * steps) {
      int mr = M - m < MR ? M - m : MR;
      const float *xm = p->x + (size_t)m * ldx;
      float *Cmj = p->C + (size_t)m * ldc + j;
      switch (mr * 8 + nr) {
#define CASE(a, b) case a * 8 + b: tile_wt(a, b, K, xm, ldx, Wj, ldw, Cmj, ldc, add, &next); break;
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4) CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4) CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
#undef CASE
      }
    }
  }
}

static void rows_times_wt(int M, int N, int K, const float *x, int ldx, const float *W, int ldw, float *C,
                          int ldc, int add) {
  float *aligned_x = M > 1 && !aligned(x, ldx) ? aligned_rows(x, M, K, ldx) : NULL;
  if (aligned_x) x = aligned_x, ldx = K;
  const WtProduct product = {M, N, K, ldx, ldw, ldc, add, x, W, C};
  parallel_for(wt_tiles, &product, (N + NR - 1) / NR, 1);
  free(aligned_x);
}

/* C[m, :] = sum over k of A[m, k] B[k, :] for m < M, B row-major (K x N, not transposed): the
   attention's weights times V. Rows of B are streamed whole, 64 columns at a time, and added into
   M accumulators in order of k, so C[m, n] does not depend on M either. */
static inline __attribute__((always_inline)) void group_times_b(const int M, int K, const float *A,
                                                                int lda, int a_t, const float *B,
                                                                int ldb, int n0, int width,
                                                                float *C, int ldc) {
  v16 acc[B_ROWS][4] = {{{0}}}; /* M is a constant in each caller below: these stay in registers */
  for (int k = 0; k < K; k++) {
    const float *b = B + (size_t)k * ldb + n0;
    v16 bk[4] = {{0}};
    if (width == 64)
      for (int j = 0; j < 4; j++) bk[j] = *(const v16 *)(b + 16 * j);
    else
      for (int i = 0; i < width; i++) bk[i / 16][i % 16] = b[i];
    for (int m = 0; m < M; m++) {
      float a = A[a_t ? (size_t)k * lda + m : (size_t)m * lda + k];
      for (int j = 0; j < 4; j++) acc[m][j] += a * bk[j];
    }
  }
  for (int m = 0; m < M; m++)
    for (int i = 0; i < width; i++) C[(size_t)m * ldc + n0 + i] = acc[m][i / 16][i % 16];
}

typedef struct {
  int M, N, K, lda, a_t, ldb, ldc, chunks;
  const float *A, *B;
  float *C;
} BProduct;

CLONES static void b_groups(const void *context, int begin, int end) {
  const BProduct *p = context;
  for (int i = begin; i < end; i++) {
    int g = i / p->chunks, c = i % p->chunks;
    int n0 = g * 64, width = p->N - n0 < 64 ? p->N - n0 : 64, m = c * B_ROWS;
    const float *Am = p->A + (p->a_t ? (size_t)m : (size_t)m * p->lda);
    float *Cm = p->C + (size_t)m * p->ldc;
    switch (p->M - m < B_ROWS ? p->M - m : B_ROWS) {
#define CASE(r) case r: group_times_b(r, p->K, Am, p->lda, p->a_t, p->B, p->ldb, n0, width, Cm, p->ldc); break;
      CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
  }
}

static void rows_times_b(int M, int N, int K, const float *A, int lda, int a_t, const float *B, int ldb,
                         float *C, int ldc) {
  int groups = (N + 63) / 64, chunks = (M + B_ROWS - 1) / B_ROWS;
  const BProduct product = {M, N, K, lda, a_t, ldb, ldc, chunks, A, B, C};
  parallel_for(b_groups, &product, groups * chunks, groups * chunks > 1 && (long)M * K * N >= 65536);
}

static void zero(float *y, int n, int inc) {
  for (int i = 0; i < n; i++) y[(size_t)i * inc] = 0.f;
}

void cblas_sgemm(int order, int trans_a, int trans_b, int M, int N, int K, float alpha,
                 const float *A, int lda, const float *B, int ldb, float beta, float *C,
                 int ldc) {
  int a_t = trans_a != NO_TRANS, b_t = trans_b != NO_TRANS;
  if (order != ROW_MAJOR || M <= 0 || N <= 0 || K <= 0) {
    real_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else if (M <= SMALL_M && !a_t && b_t && K % 16 == 0 && alpha == 1.f && (beta == 0.f || beta == 1.f)) {
    rows_times_wt(M, N, K, A, lda, B, ldb, C, ldc, beta == 1.f);
  } else if (M <= SMALL_M && !b_t && alpha == 1.f && beta == 0.f) {
    rows_times_b(M, N, K, A, lda, a_t, B, ldb, C, ldc);
  } else if (M == 1) { /* C[0, :] = op(B)^T a */
    if (beta == 0.f) zero(C, N, 1); /* C may hold NaNs; sgemv's beta = 0 must not see them */
    real_sgemv(ROW_MAJOR, b_t ? NO_TRANS : TRANS, b_t ? N : K, b_t ? K : N, alpha, B, ldb, A,
               a_t ? lda : 1, beta, C, 1);
  } else if (N == 1) { /* C[:, 0] = op(A) b */
    if (beta == 0.f) zero(C, M, ldc);
    real_sgemv(ROW_MAJOR, a_t ? TRANS : NO_TRANS, a_t ? K : M, a_t ? M : K, alpha, A, lda, B,
               b_t ? 1 : ldb, beta, C, ldc);
  } else {
    real_sgemm(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}
