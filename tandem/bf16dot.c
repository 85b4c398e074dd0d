/* y[M, N] = x[M, K] · W[N, K]ᵀ with both factors in bf16 and float32 sums, on
   AVX512-BF16's dot product (vdpbf16ps); tandem/bf16w.py says why.

   W is packed as tandem/bf16w.c's AVX-512 build packs it (64-column blocks,
   then 16-column ones; within a block, one 32-bit word per output column for
   each pair of input columns (k, k+1), W[n, k] in its low half). x is rounded
   to bf16 (to nearest even) 8 rows at a time into pairs in the same order
   (xb[m, p] = x[m, 2p] | x[m, 2p+1] << 16).
   Each output is one float32 accumulator that takes p = 0, 1, 2, … in order,
   each step adding the two exact products of a pair, so an output row does
   not depend on the other rows of x, on M or on the number of threads. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define WIDE 4 /* vectors in a main block: 64 columns */
#define BLOCK (WIDE * LANES)
#define PREFETCH_BYTES 2048

static inline __attribute__((always_inline)) void block(const int M, const int vecs, const int64_t stride,
                                                        const uint32_t *xb, int64_t P, const uint32_t *w, float *y,
                                                        int64_t N, int64_t n) {
    __m512 acc[8][WIDE];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        const uint32_t *wp = w + p * stride;
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
            _mm_prefetch((const char *)(wp + v * LANES) + PREFETCH_BYTES, _MM_HINT_T0); /* one a cache line */
            const __m512bh weights = (__m512bh)_mm512_loadu_si512((const void *)(wp + v * LANES));
            _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
                acc[m][v] = _mm512_dpbf16_ps(acc[m][v], (__m512bh)_mm512_set1_epi32((int)xb[m * P + p]), weights);
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) _mm512_storeu_ps(y + m * N + n + v * LANES, acc[m][v]);
}

/* Blocks [b0, b1) of the layer: the first N / BLOCK are BLOCK wide, the rest LANES. */
#define BLOCKS(M)                                                                                             \
    static void blocks_##M(const uint32_t *xb, const uint32_t *w, float *y, int64_t N, int64_t P, int64_t b0, \
                           int64_t b1) {                                                                      \
        const int64_t wide = N / BLOCK;                                                                       \
        for (int64_t b = b0; b < b1; b++) {                                                                   \
            if (b >= wide)                                                                                    \
                block(M, 1, LANES, xb, P, w + wide * P * BLOCK + (b - wide) * P * LANES, y, N,                \
                      wide * BLOCK + (b - wide) * LANES);                                                     \
            else                                                                                              \
                block(M, WIDE, BLOCK, xb, P, w + b * P * BLOCK, y, N, b * BLOCK);                             \
        }                                                                                                     \
    }
BLOCKS(1) BLOCKS(2) BLOCKS(3) BLOCKS(4) BLOCKS(5) BLOCKS(6) BLOCKS(7) BLOCKS(8)

static void rows(int M, const uint32_t *xb, const uint32_t *w, float *y, int64_t N, int64_t P, int64_t b0,
                 int64_t b1) {
    switch (M) {
    case 1: blocks_1(xb, w, y, N, P, b0, b1); break;
    case 2: blocks_2(xb, w, y, N, P, b0, b1); break;
    case 3: blocks_3(xb, w, y, N, P, b0, b1); break;
    case 4: blocks_4(xb, w, y, N, P, b0, b1); break;
    case 5: blocks_5(xb, w, y, N, P, b0, b1); break;
    case 6: blocks_6(xb, w, y, N, P, b0, b1); break;
    case 7: blocks_7(xb, w, y, N, P, b0, b1); break;
    default: blocks_8(xb, w, y, N, P, b0, b1); break;
    }
}

/* n floats (n even) → n bf16 values, rounded to nearest even, as n / 2 pairs. */
static void to_bf16(const float *x, int64_t n, uint32_t *pairs) {
    uint16_t *out = (uint16_t *)pairs;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        _mm512_storeu_si512((void *)(out + i), (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16),
                                                                              _mm512_loadu_ps(x + i)));
    for (; i < n; i++) { /* as the instruction rounds a finite value */
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        out[i] = (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
}

/* N % 16 == 0 and K % 2 == 0; any M (8 rows of x a pass over W). */
void tandem_bf16dot_linear(const float *x, const uint32_t *w, float *y, int64_t M, int64_t N, int64_t K,
                           int threads) {
    const int64_t P = K / 2, nblocks = N / BLOCK + (N % BLOCK) / LANES;
    uint32_t *xb = malloc((size_t)(8 * P) * sizeof(uint32_t));
    if (xb == NULL)
        abort();
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int rows_now = (int)(M - m0 < 8 ? M - m0 : 8);
        to_bf16(x + m0 * K, rows_now * K, xb);
        if (threads <= 1) {
            rows(rows_now, xb, w, y + m0 * N, N, P, 0, nblocks);
            continue;
        }
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            rows(rows_now, xb, w, y + m0 * N, N, P, nblocks * t / T, nblocks * (t + 1) / T);
        }
    }
    free(xb);
}
