/* Decode-shaped matrix products for MLX's CPU backend, loaded ahead of OpenBLAS (akunu/_blas.py).

   MLX computes every Linear layer as cblas_sgemm(x, W^T). For the 1-8 rows of a decode step
   or a verification pass OpenBLAS's sgemm packs all of W first and runs at a third of the
   memory bandwidth its sgemv reaches. This library defines cblas_sgemm itself and routes:
     - x @ W^T with at most SMALL_M rows: a kernel that streams W once (rows_times_wt);
     - x @ B (B not transposed: attention's weights times V) with at most SMALL_M rows: likewise
       (rows_times_b), so that a decode step never wakes OpenBLAS's threads to contend with ours;
     - any other product with one row or one column: OpenBLAS's sgemv;
     - everything else (prefill, wide passes): OpenBLAS's sgemm, unchanged.
   Plain C with GCC vector extensions and OpenMP; no Python API. */
#include <stdlib.h>
#include <string.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
#define SMALL_M 8 /* measured: past 8 rows OpenBLAS's sgemm is as fast */
#define BLOCK 4   /* rows of x sharing one read of a row of W */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;

/* Called once by akunu/_blas.py with OpenBLAS's own entry points. */
void akunu_matvec_init(void *sgemm, void *sgemv) {
  real_sgemm = (sgemm_fn)sgemm;
  real_sgemv = (sgemv_fn)sgemv;
}

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define CLONES
#endif

/* C[m, j] = x[m, :] . W[j, :] for m < M, K a multiple of 16. Every C[m, j] is the same
   sequence of operations whatever M is, so a row's result does not depend on its batch. */
CLONES static void rows_times_wt(int M, int N, int K, const float *x, int ldx,
                                 const float *W, int ldw, float *C, int ldc) {
  int padded = (M + BLOCK - 1) / BLOCK * BLOCK;
  float *xs = calloc((size_t)padded * K, sizeof(float)); /* zero rows pad the last block */
  if (!xs) {
    real_sgemm(ROW_MAJOR, NO_TRANS, TRANS, M, N, K, 1.f, x, ldx, W, ldw, 0.f, C, ldc);
    return;
  }
  for (int m = 0; m < M; m++) memcpy(xs + (size_t)m * K, x + (size_t)m * ldx, K * sizeof(float));
#pragma omp parallel for schedule(static)
  for (int j = 0; j < N; j++) {
    const float *w = W + (size_t)j * ldw;
    for (int m0 = 0; m0 < padded; m0 += BLOCK) {
      v16 acc[BLOCK] = {0};
      for (int k = 0; k < K; k += 16) {
        v16 wk = *(const v16 *)(w + k);
        for (int b = 0; b < BLOCK; b++) acc[b] += *(const v16 *)(xs + (size_t)(m0 + b) * K + k) * wk;
      }
      for (int b = 0; b < BLOCK && m0 + b < M; b++) {
        float s = 0.f;
        for (int i = 0; i < 16; i++) s += acc[b][i];
        C[(size_t)(m0 + b) * ldc + j] = s;
      }
    }
  }
  free(xs);
}

/* C[m, :] = sum over k of A[m, k] B[k, :] for m < M, B row-major (K x N, not transposed): the
   attention's weights times V. Rows of B are streamed whole, 64 columns at a time, and added into
   M accumulators in order of k, so C[m, n] does not depend on M either. */
static inline __attribute__((always_inline)) void group_times_b(const int M, int K, const float *A,
                                                                int lda, int a_t, const float *B,
                                                                int ldb, int n0, int width,
                                                                float *C, int ldc) {
  v16 acc[SMALL_M][4] = {{{0}}}; /* M is a constant in each caller below: these stay in registers */
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

CLONES static void rows_times_b(int M, int N, int K, const float *A, int lda, int a_t,
                                const float *B, int ldb, float *C, int ldc) {
  int groups = (N + 63) / 64;
#pragma omp parallel for schedule(static) if (groups > 1 && (long)K * N >= 65536)
  for (int g = 0; g < groups; g++) {
    int n0 = g * 64, width = N - n0 < 64 ? N - n0 : 64;
    switch (M) {
#define CASE(m) case m: group_times_b(m, K, A, lda, a_t, B, ldb, n0, width, C, ldc); break;
      CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    }
  }
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
  } else if (M <= SMALL_M && !a_t && b_t && K % 16 == 0 && alpha == 1.f && beta == 0.f) {
    rows_times_wt(M, N, K, A, lda, B, ldb, C, ldc);
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
