/* y[M, N] = x[M, K] · W[N, K]ᵀ on 4-bit weights in groups of G input columns,
   each group of a column with its own scale d and low value m (W ≈ d·code + m,
   code 0…15), and int8 activations in the same groups, each group of each row
   of x with its own scale, multiplied in int32 exactly: with AVX512-VNNI's
   vpdpbusd, or where the CPU has no AVX512-VNNI with AVX2's vpmaddubsw and
   vpmaddwd (tandem/i4w.py says why, and which build a CPU gets).

   Each group of G values of a row of x is quantized on its own: s = max|x| /
   127 over the group, q = round(x / s), so one large channel costs precision
   in its own group only (as llama.cpp's Q8_0 blocks). A group's dot product
   Σ code·q is exact in int32; the output is Σ_groups s · (d · Σ code·q + m · Σ q)
   + bias, folded over the groups in order in float32, with the same operations
   in both builds. So an output row depends on its own row of x only: not on
   the other rows, on M, on the threads, on how a sequence was split into
   forwards, or on which build computed it.

   Packed W (one layout for both builds): column blocks of 64 (then of 16 for
   what is left); within a block, for each group, for each unit of 16 columns,
   320 bytes: 4 × 64 bytes of codes (for quad j = 0…3 of the group, lane c's 4
   bytes hold the codes of columns g·G + 8j + i, i = 0…3, in their low nibbles
   and of g·G + 8j + 4 + i in their high nibbles), then the 16 columns' d and
   their 16 m in fp16. The AVX-512 build reads a block once from memory, front
   to back, for up to ROWS rows of x (4 in the AVX-512 build, 2 in the AVX2 one). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define G 32
#define UNIT_LANES 16 /* columns of a unit of the packed layout */
#define WIDE 4
#define BLOCK (WIDE * UNIT_LANES)
#define UNIT 320 /* bytes of one group of one unit of columns */
/* Both builds prefetch the weights this many groups ahead. The AVX-512 build had
   none until 2026-11-29: all of the default draft's layers and its 32k head, one
   pinned thread, a 2-core Zen 5 VM, medians of 15, 1 / 2 / 3 / 4 rows 7.57 / 8.10 /
   8.75 / 8.64 ms with it against 7.70 / 8.65 / 9.77 / 10.08 without (2, 8 and 16
   groups ahead: no faster than 4). */
#define PREFETCH_GROUPS 4

/* Four activation bytes as one int32 (memcpy: one load, no aliasing). */
static inline __attribute__((always_inline)) int32_t word4(const int8_t *q) {
    int32_t word;
    memcpy(&word, q, sizeof word);
    return word;
}

#ifdef __AVX512F__
#define ROWS 4 /* rows of x a pass: 16 float accumulators, 4 int32 ones and the weights */

int tandem_i4w_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

/* `vecs` units of columns from w on, over all groups, for M ≤ ROWS rows. */
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
        for (int64_t line = 0; line < vecs * UNIT; line += 64) /* a prefetch never faults, past the end neither */
            _mm_prefetch((const char *)(w + (g + PREFETCH_GROUPS) * vecs * UNIT + line), _MM_HINT_T0);
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
                    dot[m] = _mm512_dpbusd_epi32(dot[m], lo, _mm512_set1_epi32(word4(q)));
                    dot[m] = _mm512_dpbusd_epi32(dot[m], hi, _mm512_set1_epi32(word4(q + 4)));
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
        const int64_t c = n + v * UNIT_LANES;
        const __m512 b = bias ? _mm512_loadu_ps(bias + c) : _mm512_setzero_ps();
        _Pragma("GCC unroll 4") for (int m = 0; m < M; m++) _mm512_storeu_ps(y + m * N + c, _mm512_add_ps(acc[m][v], b));
    }
}
#else
/* AVX2: 16 registers. A unit of 16 columns is two vectors of 8; up to 2 rows
   of x at a time. */
#define ROWS 2

int tandem_i4w_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* A column block for M ≤ ROWS rows of x, read front to back: group by group,
   each group's units of 16 columns one after another, with a prefetch a few
   groups ahead. vpmaddubsw multiplies the codes (0…15, unsigned) by the
   activations (-127…127) and adds neighbouring pairs into int16; a group's 8
   such sums per int16 lane are at most 8 · 2 · 15 · 127 = 30480 in magnitude,
   so they neither saturate nor wrap, and vpmaddwd by ones then gives the same
   int32 per column as the AVX-512 build's vpdpbusd. A block's accumulators
   (2 rows × 4 units × 2 vectors) outnumber the registers; the compiler keeps
   some in L1, which costs less than reading the weights twice.
   Until 2026-11-28 this build took a block's units one after another, each
   over all of its groups: strided passes over the block. On a 2-core Zen 1
   EPYC VM (each 256-bit operation there two 128-bit ones; one pinned thread,
   all of the default draft's layers and its 32k head, 242 MB of distinct
   weights, best of 6–8) those took 44–56 ms for one row and 93–96 ms for two;
   this order takes 30–32 ms and 45 ms (35 ms for one row without the prefetch,
   alike 2, 4, 8 or 16 groups ahead), while a torch sum read as many bytes in
   18.5 ms. On a Zen 3 VM, bound by its memory, one row had measured alike in
   both orders. Per column the same operations in the same order: the same bits. */
static inline __attribute__((always_inline)) void stream(const int M, const int vecs, const int8_t *xq, const float *xsum,
                                                         const float *xscale, int64_t K, const uint8_t *w,
                                                         const float *bias, float *y, int64_t N, int64_t n) {
    const int64_t groups = K / G, step = vecs * UNIT;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS][WIDE][2];
    _Pragma("GCC unroll 2") for (int m = 0; m < M; m++)
    _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) acc[m][v][0] = acc[m][v][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = w + g * step;
        for (int64_t line = 0; line < step; line += 64)  /* a prefetch never faults, past the end neither */
            _mm_prefetch((const char *)(group + PREFETCH_GROUPS * step + line), _MM_HINT_T0);
        _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
            const uint8_t *unit = group + v * UNIT;
            __m256i dot[ROWS][2];
            _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
                _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(unit + 64 * j + 32 * half));
                    const __m256i lo = _mm256_and_si256(raw, low4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) {
                        const int8_t *q = xq + m * K + g * G + 8 * j;
                        dot[m][half] = _mm256_add_epi16(dot[m][half], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(word4(q))));
                        dot[m][half] = _mm256_add_epi16(dot[m][half], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(word4(q + 4))));
                    }
                }
            }
            _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 256 + 16 * half)));
                const __m256 low = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(unit + 288 + 16 * half)));
                _Pragma("GCC unroll 2") for (int m = 0; m < M; m++) {
                    const float s = xscale[m * groups + g];
                    const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m][half], ones));
                    acc[m][v][half] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(s)), acc[m][v][half]);
                    acc[m][v][half] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[m * groups + g] * s), low, acc[m][v][half]);
                }
            }
        }
    }
    _Pragma("GCC unroll 2") for (int m = 0; m < M; m++)
    _Pragma("GCC unroll 4") for (int v = 0; v < vecs; v++) {
        _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {
            const int64_t c = n + v * UNIT_LANES + 8 * half;
            const __m256 b = bias ? _mm256_loadu_ps(bias + c) : _mm256_setzero_ps();
            _mm256_storeu_ps(y + m * N + c, _mm256_add_ps(acc[m][v][half], b));
        }
    }
}

static inline __attribute__((always_inline)) void block(const int M, const int vecs, const int8_t *xq,
                                                        const float *xsum, const float *xscale, int64_t K,
                                                        const uint8_t *w, const float *bias, float *y, int64_t N,
                                                        int64_t n) {
    /* M and vecs as constants in each call, so that the loops over them unroll */
    if (M == 1) {
        if (vecs == WIDE)
            stream(1, WIDE, xq, xsum, xscale, K, w, bias, y, N, n);
        else
            stream(1, 1, xq, xsum, xscale, K, w, bias, y, N, n);
    } else {
        if (vecs == WIDE)
            stream(2, WIDE, xq, xsum, xscale, K, w, bias, y, N, n);
        else
            stream(2, 1, xq, xsum, xscale, K, w, bias, y, N, n);
    }
}
#endif

#define BLOCKS(M)                                                                                               \
    static void blocks_##M(const int8_t *xq, const float *xsum, const float *xscale, const uint8_t *w,          \
                           const float *bias, float *y, int64_t N, int64_t K, int64_t b0, int64_t b1) {         \
        const int64_t wide = N / BLOCK, wide_bytes = K / G * WIDE * UNIT, narrow_bytes = K / G * UNIT;          \
        for (int64_t b = b0; b < b1; b++) {                                                                     \
            if (b >= wide)                                                                                      \
                block(M, 1, xq, xsum, xscale, K, w + wide * wide_bytes + (b - wide) * narrow_bytes, bias, y, N, \
                      wide * BLOCK + (b - wide) * UNIT_LANES);                                                  \
            else                                                                                                \
                block(M, WIDE, xq, xsum, xscale, K, w + b * wide_bytes, bias, y, N, b * BLOCK);                 \
        }                                                                                                       \
    }
BLOCKS(1) BLOCKS(2)
#if ROWS == 4
BLOCKS(3) BLOCKS(4)
#endif

static void rows(int M, const int8_t *xq, const float *xsum, const float *xscale, const uint8_t *w,
                 const float *bias, float *y, int64_t N, int64_t K, int64_t b0, int64_t b1) {
    switch (M) {
    case 1: blocks_1(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
#if ROWS == 4
    case 2: blocks_2(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
    case 3: blocks_3(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
    default: blocks_4(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
#else
    default: blocks_2(xq, xsum, xscale, w, bias, y, N, K, b0, b1); break;
#endif
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
    const int64_t nblocks = N / BLOCK + (N % BLOCK) / UNIT_LANES;
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

/* ---- The draft's decoder layers for a few tokens in one call (tandem.lean) ----
   A draft step of the default draft spends about 10 ms in the layers above and,
   on a one-thread VM, 7-10 ms more in the Python and aten calls around them
   (about 40 small ops a layer). This runs a Llama-family layer stack
   (RMSNorm, rotary, grouped-query attention, gated SiLU MLP) on the i4w
   layers in C. Every row is computed on its own, as in the kernel above: its
   attention reads the positions up to its own, so a token's hidden state does
   not depend on how many tokens were fed with it. Not bit-equal to the aten
   path (another softmax and exp), which only the draft's agreement can feel:
   the target verifies every token. */

/* Vectors of VL floats for the layers' own arithmetic: 16 with AVX-512, 8 with
   AVX2. Sums across a vector's lanes are taken in another order in the two
   builds, so the layers are not bit-equal between them (the linear layers are). */
#ifdef __AVX512F__
#define VL 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET1(f) _mm512_set1_ps(f)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VDIV(a, b) _mm512_div_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(v) _mm512_reduce_add_ps(v)
typedef __mmask16 vmask;
static inline vmask tail(int64_t left) { return left >= 16 ? (vmask)0xFFFF : (vmask)((1u << left) - 1); }
#define VLOAD_TAIL(m, p) _mm512_maskz_loadu_ps(m, p) /* zeros past the tail */
#define VSTORE_TAIL(m, p, v) _mm512_mask_storeu_ps(p, m, v)
#define VKEEP(m, v) _mm512_maskz_mov_ps(m, v)

/* e^x for x ≤ 88, the float32 polynomial of Cephes' expf (relative error about 1e-7). */
static inline vf vexp(vf x) {
    x = _mm512_max_ps(_mm512_min_ps(x, VSET1(88.0f)), VSET1(-103.0f));
    const vf n = _mm512_roundscale_ps(VMUL(x, VSET1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
#define VL 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET1(f) _mm256_set1_ps(f)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float VSUM(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
typedef __m256i vmask; /* all ones in the lanes kept */
static inline vmask tail(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define VLOAD_TAIL(m, p) _mm256_maskload_ps(p, m)
#define VSTORE_TAIL(m, p, v) _mm256_maskstore_ps(p, m, v)
#define VKEEP(m, v) _mm256_and_ps(_mm256_castsi256_ps(m), v)

/* e^x for x ≤ 88, as above; below -87 (where 2^n would leave the normal floats
   this build can scale by) it gives e^-87, about 1.6e-38. */
static inline vf vexp(vf x) {
    x = _mm256_max_ps(_mm256_min_ps(x, VSET1(88.0f)), VSET1(-87.0f));
    const vf n = _mm256_round_ps(VMUL(x, VSET1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    x = VFMA(VSUB(VZERO(), n), VSET1(0.693359375f), x);
    x = VFMA(VSUB(VZERO(), n), VSET1(-2.12194440e-4f), x);
    vf y = VSET1(1.9875691500e-4f);
    y = VFMA(y, x, VSET1(1.3981999507e-3f));
    y = VFMA(y, x, VSET1(8.3334519073e-3f));
    y = VFMA(y, x, VSET1(4.1665795894e-2f));
    y = VFMA(y, x, VSET1(1.6666665459e-1f));
    y = VFMA(y, x, VSET1(5.0000001201e-1f));
    y = VFMA(y, VMUL(x, x), VADD(x, VSET1(1.0f)));
#ifdef __AVX512F__
    return _mm512_scalef_ps(y, n); /* y · 2^n */
#else
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return VMUL(y, _mm256_castsi256_ps(exponent)); /* y · 2^n, n ≥ -126 */
#endif
}

/* out = RMSNorm(x) · weight, over n values (n % VL == 0). */
static void rms_norm(const float *x, const float *weight, float eps, float *out, int64_t n) {
    vf sq = VZERO();
    for (int64_t i = 0; i < n; i += VL) {
        const vf v = VLOAD(x + i);
        sq = VFMA(v, v, sq);
    }
    const vf r = VSET1(1.0f / sqrtf(VSUM(sq) / (float)n + eps));
    for (int64_t i = 0; i < n; i += VL) VSTORE(out + i, VMUL(VLOAD(weight + i), VMUL(VLOAD(x + i), r)));
}

/* x·cos + rotate_half(x)·sin for `heads` vectors of d values (Hugging Face's rotary). */
static void rotate(float *x, int heads, int d, const float *cos, const float *sin) {
    const int half = d / 2;
    float rotated[512];
    for (int h = 0; h < heads; h++) {
        float *v = x + (int64_t)h * d;
        for (int i = 0; i < half; i++) {
            rotated[i] = -v[half + i];
            rotated[half + i] = v[i];
        }
        for (int i = 0; i < d; i++) v[i] = v[i] * cos[i] + rotated[i] * sin[i];
    }
}

/* One row's attention for one head: softmax(q·Kᵀ / √d) · V over positions [0, len). */
static void attend(const float *q, const float *keys, const float *values, int64_t len, int d, float *scores,
                   float *out) {
    const float scale = 1.0f / sqrtf((float)d);
    float top = -INFINITY;
    for (int64_t j = 0; j < len; j++) {
        const float *k = keys + j * d;
        vf acc = VZERO();
        for (int i = 0; i < d; i += VL) {
            const vmask m = tail(d - i);
            acc = VFMA(VLOAD_TAIL(m, q + i), VLOAD_TAIL(m, k + i), acc);
        }
        scores[j] = VSUM(acc) * scale;
        top = fmaxf(top, scores[j]);
    }
    vf total = VZERO();
    for (int64_t j = 0; j < len; j += VL) {
        const vmask m = tail(len - j);
        const vf e = vexp(VSUB(VLOAD_TAIL(m, scores + j), VSET1(top)));
        VSTORE_TAIL(m, scores + j, e);
        total = VADD(total, VKEEP(m, e));
    }
    const float inv = 1.0f / VSUM(total);
    for (int i = 0; i < d; i += VL) {
        const vmask m = tail(d - i);
        vf acc = VZERO();
        for (int64_t j = 0; j < len; j++) acc = VFMA(VSET1(scores[j]), VLOAD_TAIL(m, values + j * d + i), acc);
        VSTORE_TAIL(m, out + i, VMUL(acc, VSET1(inv)));
    }
}

enum { WQ, WK, WV, WO, WGATE, WUP, WDOWN, BQ, BK, BV, BO, BGATE, BUP, BDOWN, NORM1, NORM2, SLOTS };

/* x [M, H] (the rows' embeddings) → the last layer's output, in place. table:
   SLOTS addresses a layer (packed weights, biases or 0, the two norms' weights).
   keys, values: [L, kv_heads, capacity, d]; the rows take positions start …
   start + M - 1 and are written there. cos, sin: [M, d], the rows' rotary tables.
   H, heads · d, kv_heads · d and I multiples of 16; d ≤ 512 and even. */
int tandem_i4w_layers(const int64_t *table, int L, float *x, int M, int H, int heads, int kv_heads, int d, int I,
                      float eps1, float eps2, float *keys, float *values, int64_t capacity, int64_t start,
                      const float *cos, const float *sin, int threads) {
    const int64_t QD = (int64_t)heads * d, KD = (int64_t)kv_heads * d, widest = I > H ? I : H;
    const int64_t floats = M * (H + QD + 2 * KD + QD + 2 * I + H) + start + M;
    float *work = malloc(floats * sizeof(float));
    uint8_t *scratch = malloc(M * (widest + 8 * (widest / G)) + 64);
    if (!work || !scratch) {
        free(work);
        free(scratch);
        return -1;
    }
    float *h = work, *q = h + M * H, *k = q + M * QD, *v = k + M * KD, *att = v + M * KD, *gate = att + M * QD,
          *up = gate + M * I, *out = up + M * I, *scores = out + M * H;
    const int group = heads / kv_heads;
    for (int l = 0; l < L; l++) {
        const int64_t *t = table + (int64_t)l * SLOTS;
#define W(slot) ((const uint8_t *)(intptr_t)t[slot])
#define F(slot) ((const float *)(intptr_t)t[slot])
        for (int m = 0; m < M; m++) rms_norm(x + m * H, F(NORM1), eps1, h + m * H, H);
        tandem_i4w_linear(h, W(WQ), F(BQ), q, scratch, M, QD, H, threads);
        tandem_i4w_linear(h, W(WK), F(BK), k, scratch, M, KD, H, threads);
        tandem_i4w_linear(h, W(WV), F(BV), v, scratch, M, KD, H, threads);
        float *K = keys + (int64_t)l * kv_heads * capacity * d, *V = values + (int64_t)l * kv_heads * capacity * d;
        for (int m = 0; m < M; m++) {
            rotate(q + m * QD, heads, d, cos + (int64_t)m * d, sin + (int64_t)m * d);
            rotate(k + m * KD, kv_heads, d, cos + (int64_t)m * d, sin + (int64_t)m * d);
            for (int kh = 0; kh < kv_heads; kh++) {
                memcpy(K + (kh * capacity + start + m) * d, k + m * KD + kh * d, d * sizeof(float));
                memcpy(V + (kh * capacity + start + m) * d, v + m * KD + kh * d, d * sizeof(float));
            }
        }
        for (int m = 0; m < M; m++)
            for (int hh = 0; hh < heads; hh++) {
                const int kh = hh / group;
                attend(q + m * QD + hh * d, K + kh * capacity * d, V + kh * capacity * d, start + m + 1, d, scores,
                       att + m * QD + hh * d);
            }
        tandem_i4w_linear(att, W(WO), F(BO), out, scratch, M, H, QD, threads);
        for (int64_t i = 0; i < M * H; i++) x[i] += out[i];
        for (int m = 0; m < M; m++) rms_norm(x + m * H, F(NORM2), eps2, h + m * H, H);
        tandem_i4w_linear(h, W(WGATE), F(BGATE), gate, scratch, M, I, H, threads);
        tandem_i4w_linear(h, W(WUP), F(BUP), up, scratch, M, I, H, threads);
        for (int64_t i = 0; i < M * I; i += VL) { /* silu(gate) · up */
            const vf g = VLOAD(gate + i);
            const vf silu = VDIV(g, VADD(VSET1(1.0f), vexp(VSUB(VZERO(), g))));
            VSTORE(gate + i, VMUL(silu, VLOAD(up + i)));
        }
        tandem_i4w_linear(gate, W(WDOWN), F(BDOWN), out, scratch, M, H, I, threads);
        for (int64_t i = 0; i < M * H; i++) x[i] += out[i];
#undef W
#undef F
    }
    free(work);
    free(scratch);
    return 0;
}
