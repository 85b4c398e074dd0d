/* y[M, N] = x[M, K] · W[N, K]ᵀ in float32 arithmetic, W held in bf16 and widened
   exactly in registers (tandem/bf16w.py says why). Built for AVX-512F, or for
   AVX2 + FMA where the CPU has no AVX-512 (the compiler's flags pick which).

   Packed W: column blocks of BLOCK (64 with AVX-512, 16 with AVX2), then of
   LANES (16 or 8) for what is left, and within a block, for each pair of
   input columns (k, k+1), one 32-bit word per output column: W[n, k] in its
   low half, W[n, k+1] in its high half. A block is read once from memory,
   front to back, for all M rows of x (at most 8 at a time); each output is
   one float32 accumulator that takes k = 0, 1, 2, … in order, so an output
   row does not depend on the other rows of x, on M, on the number of
   threads, or on which of the two builds computed it. */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

/* How far ahead of its loads a pass prefetches the weights, by the rows of x it
   takes: a pass over more rows spends longer on each line, so it must ask for
   the next ones sooner. All the default target's linear layers, one pinned
   thread, a 2-core Zen 5 VM, medians of 5 (2026-11-29; bench/RESULTS.md):
   1 / 2 / 3 / 4 / 5 / 6 rows 80.2 / 82.3 / 86.0 / 89.3 / 95.8 / 99.6 ms 2 KB ahead
   (until then), 77.8 / 78.2 / 80.0 / 80.0 / 81.0 / 82.0 ms as below. 8 KB ahead
   for all cost one row 1-2 ms (7 once, the other core streaming memory); 4 KB
   ahead for all cost six rows 7-11 ms. The AVX2 build, on the same
   VM: 1 / 4 / 6 rows 102.7 / 154.1 / 227.1 ms 2 KB ahead, 90.8 / 107.6 / 214.7
   8 KB ahead; 16 and 32 KB ahead were no faster than 8 in either build. */
#ifdef __AVX512F__
#define PREFETCH_BYTES(M) ((M) <= 3 ? 4096 : 8192)
#else
#define PREFETCH_BYTES(M) 8192
#endif

#ifdef __AVX512F__
#define LANES 16
#define WIDE 4 /* vectors in a main block: 64 columns */
#define WIDE_ROWS 8 /* rows of x a pass over a main block takes whole */
#define ONE_VECTOR_ROWS 9 /* never: with 32 registers every vector's widened weights stay live */
typedef __m512 vec;
typedef __m512i ivec;
#define VZERO() _mm512_setzero_ps()
#define VSET1(f) _mm512_set1_ps(f)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define ILOAD(p) _mm512_loadu_si512((const void *)(p))
#define EVEN(pair) _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16))
#define ODD(pair) _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)))
#else
#define LANES 8
#define WIDE 2
/* 16 registers: 6 rows × 2 accumulators, one vector's weights and a broadcast
   fit when a pair's weights are widened one vector at a time. With 4 rows a
   pass (as before 2026-11-26) a verify of 5 or 6 tokens took two passes of 5
   or 6 accumulators, each FMA waiting on the one before it: all the default
   target's linear layers took 447 / 436 ms for 5 / 6 rows against 275-283
   for 1-4, one thread on a Zen 3 VM. */
#define WIDE_ROWS 6
#define ONE_VECTOR_ROWS 5 /* from 5 rows on; fewer run faster with all the weights widened first */
typedef __m256 vec;
typedef __m256i ivec;
#define VZERO() _mm256_setzero_ps()
#define VSET1(f) _mm256_set1_ps(f)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define ILOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define EVEN(pair) _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16))
#define ODD(pair) _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32((int)0xFFFF0000u)))
#endif
#define BLOCK (WIDE * LANES)

/* `vecs` vectors of output columns, from `w` on, where a pair of input columns
   takes `stride` words of the block (vecs * LANES, or more when a pass takes
   part of a block: the rest of each pair's words are then read from cache). */
static inline __attribute__((always_inline)) void block(const int M, const int vecs, const int64_t stride,
                                                        const float *x, int64_t K, const uint32_t *w, float *y,
                                                        int64_t N, int64_t n) {
    vec acc[8][WIDE];
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) acc[m][v] = VZERO();
    for (int64_t p = 0; p < K / 2; p++) {
        const uint32_t *wk = w + p * stride;
        if (M >= ONE_VECTOR_ROWS && vecs == WIDE) { /* the same FMAs in the same order for each accumulator */
            _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
                if (v * LANES * 4 % 64 == 0)
                    _mm_prefetch((const char *)(wk + v * LANES) + PREFETCH_BYTES(M), _MM_HINT_T0);
                const ivec pair = ILOAD(wk + v * LANES);
                const vec even = EVEN(pair);
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
                    acc[m][v] = VFMA(VSET1(x[m * K + 2 * p]), even, acc[m][v]);
                const vec odd = ODD(pair);
                _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
                    acc[m][v] = VFMA(VSET1(x[m * K + 2 * p + 1]), odd, acc[m][v]);
            }
            continue;
        }
        vec even[WIDE], odd[WIDE];
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
            if (v * LANES * 4 % 64 == 0) /* one prefetch a cache line */
                _mm_prefetch((const char *)(wk + v * LANES) + PREFETCH_BYTES(M), _MM_HINT_T0);
            const ivec pair = ILOAD(wk + v * LANES);
            even[v] = EVEN(pair);
            odd[v] = ODD(pair);
        }
        _Pragma("GCC unroll 8") for (int m = 0; m < M; m++) {
            const vec a = VSET1(x[m * K + 2 * p]), b = VSET1(x[m * K + 2 * p + 1]);
            _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
                acc[m][v] = VFMA(a, even[v], acc[m][v]);
                acc[m][v] = VFMA(b, odd[v], acc[m][v]);
            }
        }
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) VSTORE(y + m * N + n + v * LANES, acc[m][v]);
}

/* Blocks [b0, b1) of the layer: the first N / BLOCK are BLOCK wide, the rest LANES.
   Above WIDE_ROWS rows (AVX2: 6) the accumulators do not fit the registers
   beside a block's weights: a main block then takes a pass of one vector per
   vector, each after the first over a block already in cache. */
#define BLOCKS(M)                                                                                         \
    static void blocks_##M(const float *x, const uint32_t *w, float *y, int64_t N, int64_t K, int64_t b0, \
                           int64_t b1) {                                                                  \
        const int64_t wide = N / BLOCK;                                                                   \
        for (int64_t b = b0; b < b1; b++) {                                                               \
            if (b >= wide)                                                                                \
                block(M, 1, LANES, x, K, w + wide * (K / 2) * BLOCK + (b - wide) * (K / 2) * LANES, y, N, \
                      wide * BLOCK + (b - wide) * LANES);                                                 \
            else if (M <= WIDE_ROWS)                                                                      \
                block(M, WIDE, BLOCK, x, K, w + b * (K / 2) * BLOCK, y, N, b * BLOCK);                    \
            else                                                                                          \
                for (int v = 0; v < WIDE; v++)                                                            \
                    block(M, 1, BLOCK, x, K, w + b * (K / 2) * BLOCK + v * LANES, y, N,                   \
                          b * BLOCK + v * LANES);                                                         \
        }                                                                                                 \
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

/* N % LANES == 0 and K % 2 == 0; any M (8 rows of x a pass over W). */
void tandem_bf16w_linear(const float *x, const uint32_t *w, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t nblocks = N / BLOCK + (N % BLOCK) / LANES;
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
        const int64_t width = n + BLOCK <= N && n < N / BLOCK * BLOCK ? BLOCK : LANES;
        for (int64_t p = 0; p < K / 2; p++)
            for (int64_t c = 0; c < width; c++) {
                const uint16_t *row = W + (n + c) * K;
                *out++ = (uint32_t)row[2 * p] | ((uint32_t)row[2 * p + 1] << 16);
            }
        n += width;
    }
}
