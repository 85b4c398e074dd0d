/* y[M, N] = x[M, K] · W[N, K]ᵀ on 4-bit weights in groups of G input columns,
   each group of a column with its own scale d and low value m (W ≈ d·code + m,
   code 0…15), and int8 activations in the same groups, each group of each row
   of x with its own scale, multiplied with AVX512-VNNI's vpdpbusd
   (tandem/i4w.py says why).

   Each group of G values of a row of x is quantized on its own: s = max|x| /
   127 over the group, q = round(x / s), so one large channel costs precision
   in its own group only (as llama.cpp's Q8_0 blocks). A group's dot product
   Σ code·q is exact in int32; the output is Σ_groups s · (d · Σ code·q + m · Σ q)
   + bias, folded over the groups in order in float32. So an output row depends
   on its own row of x only: not on the other rows, on M, on the threads, or on
   how a sequence was split into forwards.

   Packed W: column blocks of 64 (then of 16 for what is left); within a
   block, for each group, for each vector of 16 columns, 320 bytes: 4 × 64
   bytes of codes (for quad j = 0…3 of the group, lane c's 4 bytes hold the
   codes of columns g·G + 8j + i, i = 0…3, in their low nibbles and of
   g·G + 8j + 4 + i in their high nibbles), then the 16 columns' d and their
   16 m in fp16. A block is read once from memory, front to back, for up to
   ROWS rows of x. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define G 32
#define LANES 16
#define WIDE 4
#define BLOCK (WIDE * LANES)
#define UNIT 320 /* bytes of one group of one vector of columns */
#define ROWS 4 /* rows of x a pass: 16 float accumulators, 4 int32 ones and the weights */

/* Four activation bytes broadcast to every lane (memcpy: one load, no aliasing). */
static inline __attribute__((always_inline)) __m512i quad(const int8_t *q) {
    int32_t word;
    memcpy(&word, q, sizeof word);
    return _mm512_set1_epi32(word);
}

int tandem_i4w_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

static inline __attribute__((always_inline)) void block(const int M, const int vecs, const int8_t *xq,
                                                        const float *xsum, const float *xscale, int64_t K,
                                                        const uint8_t *w, const float *bias, float *y, int64_t N,
                                                        int64_t n) {
    const int64_t groups = K / G;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS][WIDE];
    _Pragma("GCC unroll 4") for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
            const uint8_t *unit = w + (g * vecs + v) * UNIT;
            __m512i dot[ROWS];
            _Pragma("GCC unroll 4") for (int m = 0; m < M; m++) dot[m] = _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(unit + 64 * j));
                const __m512i lo = _mm512_and_si512(raw, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                _Pragma("GCC unroll 4") for (int m = 0; m < M; m++) {
                    const int8_t *q = xq + m * K + g * G + 8 * j;
                    dot[m] = _mm512_dpbusd_epi32(dot[m], lo, quad(q));
                    dot[m] = _mm512_dpbusd_epi32(dot[m], hi, quad(q + 4));
                }
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + 256)));
            const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(unit + 288)));
            _Pragma("GCC unroll 4") for (int m = 0; m < M; m++) {
                const float s = xscale[m * groups + g];
                acc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[m][v]);
                acc[m][v] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g] * s), low, acc[m][v]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
        const int64_t c = n + v * LANES;
        const __m512 b = bias ? _mm512_loadu_ps(bias + c) : _mm512_setzero_ps();
        _Pragma("GCC unroll 4") for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * N + c, _mm512_add_ps(acc[m][v], b));
    }
}

#define BLOCKS(M)                                                                                               \
    static void blocks_##M(const int8_t *xq, const float *xsum, const float *xscale, const uint8_t *w,          \
                           const float *bias, float *y, int64_t N, int64_t K, int64_t b0, int64_t b1) {         \
        const int64_t wide = N / BLOCK, wide_bytes = K / G * WIDE * UNIT, narrow_bytes = K / G * UNIT;          \
        for (int64_t b = b0; b < b1; b++) {                                                                     \
            if (b >= wide)                                                                                      \
                block(M, 1, xq, xsum, xscale, K, w + wide * wide_bytes + (b - wide) * narrow_bytes, bias, y, N, \
                      wide * BLOCK + (b - wide) * LANES);                                                       \
            else                                                                                                \
                block(M, WIDE, xq, xsum, xscale, K, w + b * wide_bytes, bias, y, N, b * BLOCK);                 \
        }                                                                                                       \
    }
BLOCKS(1) BLOCKS(2) BLOCKS(3) BLOCKS(4)

static void rows(int M, const int8_t *xq, const float *xsum, const float *xscale, const uint8_t *w,
                 const float *bias, float *y, int64_t N, int64_t K, int64_t b0, int64_t b1) {
    switch (M) {
    case 1: blocks_1(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
    case 2: blocks_2(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
    case 3: blocks_3(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
    default: blocks_4(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
    }
}

/* x [M, K] float32 → xq [M, K] int8, and for each group of each row its scale
   xscale [M, K / G] (max|x| / 127 over the group) and xsum [M, K / G] (Σ q). */
static void quantize(const float *x, int8_t *xq, float *xscale, float *xsum, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / G; g++) {
            const float *part = x + m * K + g * G;
            float amax = 0.0f;
            for (int k = 0; k < G; k++) amax = fmaxf(amax, fabsf(part[k]));
            const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
            int32_t sum = 0;
            for (int k = 0; k < G; k++) {
                float q = nearbyintf(part[k] / s);
                q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                xq[m * K + g * G + k] = (int8_t)q;
                sum += (int32_t)q;
            }
            xscale[m * (K / G) + g] = s;
            xsum[m * (K / G) + g] = (float)sum;
        }
}

/* N % 16 == 0, K % G == 0; any M. scratch: M * (K + 8 * (K / G)) bytes, 4-aligned.
   bias may be NULL. */
void tandem_i4w_linear(const float *x, const uint8_t *w, const float *bias, float *y, uint8_t *scratch, int64_t M,
                       int64_t N, int64_t K, int threads) {
    float *xscale = (float *)scratch, *xsum = xscale + M * (K / G);
    int8_t *xq = (int8_t *)(xsum + M * (K / G));
    quantize(x, xq, xscale, xsum, M, K);
    const int64_t nblocks = N / BLOCK + (N % BLOCK) / LANES;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
        const int now = (int)(M - m0 < ROWS ? M - m0 : ROWS);
        const int8_t *q = xq + m0 * K;
        const float *sums = xsum + m0 * (K / G), *scales = xscale + m0 * (K / G);
        float *out = y + m0 * N;
        if (threads <= 1) {
            rows(now, q, sums, scales, w, bias, out, N, K, 0, nblocks);
            continue;
        }
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            rows(now, q, sums, scales, w, bias, out, N, K, nblocks * t / T, nblocks * (t + 1) / T);
        }
    }
}
