/* y[M, N] = x[M, K] · W[N, K]ᵀ in float32 arithmetic, W held in bf16 and widened
   exactly in registers (tandem/bf16w.py says why). AVX-512F.

   Packed W: column blocks of 64 (then of 16 for what is left), and within a
   block, for each pair of input columns (k, k+1), one 32-bit word per output
   column: W[n, k] in its low half, W[n, k+1] in its high half. A block is
   read once, front to back, for all M rows of x (at most 8 at a time); each
   output is one float32 accumulator that takes k = 0, 1, 2, … in order, so
   an output row does not depend on the other rows of x, on M, or on the
   number of threads. */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

#define WIDE 4 /* 16-lane vectors in a main block: 64 columns */
#define PREFETCH_BYTES 2048

static inline __attribute__((always_inline)) void block(const int M, const int vecs, const float *x, int64_t K,
                                                        const uint32_t *w, float *y, int64_t N, int64_t n) {
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[8][WIDE];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; p++) {
        const uint32_t *wk = w + p * vecs * 16;
        __m512 even[WIDE], odd[WIDE];
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
            _mm_prefetch((const char *)(wk + v * 16) + PREFETCH_BYTES, _MM_HINT_T0);
            __m512i pair = _mm512_loadu_si512((const void *)(wk + v * 16));
            even[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
            odd[v] = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
        }
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
            const __m512 a = _mm512_set1_ps(x[m * K + 2 * p]), b = _mm512_set1_ps(x[m * K + 2 * p + 1]);
            _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
                acc[m][v] = _mm512_fmadd_ps(a, even[v], acc[m][v]);
                acc[m][v] = _mm512_fmadd_ps(b, odd[v], acc[m][v]);
            }
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) _mm512_storeu_ps(y + m * N + n + v * 16, acc[m][v]);
}

/* Blocks [b0, b1) of the layer: the first N / 64 are 64 wide, the rest 16. */
#define BLOCKS(M)                                                                                        \
    static void blocks_##M(const float *x, const uint32_t *w, float *y, int64_t N, int64_t K, int64_t b0, \
                           int64_t b1) {                                                                 \
        const int64_t wide = N / (WIDE * 16);                                                            \
        for (int64_t b = b0; b < b1; b++) {                                                              \
            if (b < wide)                                                                                \
                block(M, WIDE, x, K, w + b * (K / 2) * WIDE * 16, y, N, b * WIDE * 16);                  \
            else                                                                                         \
                block(M, 1, x, K, w + wide * (K / 2) * WIDE * 16 + (b - wide) * (K / 2) * 16, y, N,      \
                      wide * WIDE * 16 + (b - wide) * 16);                                               \
        }                                                                                                \
    }
BLOCKS(1) BLOCKS(2) BLOCKS(3) BLOCKS(4) BLOCKS(5) BLOCKS(6) BLOCKS(7) BLOCKS(8)

static void rows(int M, const float *x, const uint32_t *w, float *y, int64_t N, int64_t K, int64_t b0, int64_t b1) {
    switch (M) {
    case 1: blocks_1(x, w, y, N, K, b0, b1); break;
    case 2: blocks_2(x, w, y, N, K, b0, b1); break;
    case 3: blocks_3(x, w, y, N, K, b0, b1); break;
    case 4: blocks_4(x, w, y, N, K, b0, b1); break;
    case 5: blocks_5(x, w, y, N, K, b0, b1); break;
    case 6: blocks_6(x, w, y, N, K, b0, b1); break;
    case 7: blocks_7(x, w, y, N, K, b0, b1); break;
    default: blocks_8(x, w, y, N, K, b0, b1); break;
    }
}

/* N % 16 == 0 and K % 2 == 0; any M (8 rows of x a pass over W). */
void tandem_bf16w_linear(const float *x, const uint32_t *w, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t nblocks = N / (WIDE * 16) + (N % (WIDE * 16)) / 16;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int rows_now = (int)(M - m0 < 8 ? M - m0 : 8);
        if (threads <= 1) {
            rows(rows_now, x + m0 * K, w, y + m0 * N, N, K, 0, nblocks);
            continue;
        }
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            rows(rows_now, x + m0 * K, w, y + m0 * N, N, K, nblocks * t / T, nblocks * (t + 1) / T);
        }
    }
}

/* W: bf16 [N, K] row-major → the packed layout above (N * K / 2 words). */
void tandem_bf16w_pack(const uint16_t *W, uint32_t *packed, int64_t N, int64_t K) {
    uint32_t *out = packed;
    for (int64_t n = 0; n < N;) {
        const int64_t width = n + WIDE * 16 <= N && n < N / (WIDE * 16) * (WIDE * 16) ? WIDE * 16 : 16;
        for (int64_t p = 0; p < K / 2; p++)
            for (int64_t c = 0; c < width; c++) {
                const uint16_t *row = W + (n + c) * K;
                *out++ = (uint32_t)row[2 * p] | ((uint32_t)row[2 * p + 1] << 16);
            }
        n += width;
    }
}
