/* Weight-only low-bit GEMM for the CPU (engine/models/quant_cpu.py builds and calls it).
 *
 * y [T, N] = x [T, K] @ W^T with W kept as stored by engine/models/quant.py's QuantTensor:
 *   bits 8: q uint8 [N, K] (int8 + 128);
 *   bits 4: q uint8 [N, K / 2], two int4 (+ 8) per byte, low nibble first;
 *   scale fp32 [N, K / group]; zero int8 [N, K / group] or NULL;  w = (q - offset - zero) * scale.
 * Per group the integer (q - offset - zero) is exact in fp32; the group's dot product with x is scaled
 * once: y = sum_g scale_g * sum_{k in g} (q_k - offset - zero_g) x_k. Rows are split across threads;
 * each weight vector converted once serves up to 8 rows of x. Needs group % 16 == 0 (the caller checks).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));

static inline v8f load8f(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8i load8u(const uint8_t *p) { /* 8 bytes zero-extended to int32 */
#ifdef __AVX2__
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    v8u8 b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, v8i);
#endif
}

static inline float hsum(v8f v) {
    return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

/* One weight row n against TT (1..8) rows of x; xs: x rows (int8) or the even/odd halves (int4). */
static inline __attribute__((always_inline)) void row_tile(
    const float *x, int64_t ldx, const float *xo, const uint8_t *q, int bits, const float *scale,
    const int8_t *zero, int64_t K, int64_t group, float *y, int64_t ldy, const int TT) {
    const int64_t groups = K / group;
    const int offset = bits == 8 ? 128 : 8;
    v8f tot[8] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        v8f acc[8] = {{0}};
        const v8i off = (v8i){0} + (offset + (zero ? zero[g] : 0));
        if (bits == 8) {
            for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
                const v8f w = __builtin_convertvector(load8u(q + k) - off, v8f);
                for (int j = 0; j < TT; j++)
                    acc[j] += w * load8f(x + j * ldx + k);
            }
        } else {
            for (int64_t k = g * group / 2; k < (g + 1) * group / 2; k += 8) {
                const v8i b = load8u(q + k);
                const v8f lo = __builtin_convertvector((b & 15) - off, v8f);
                const v8f hi = __builtin_convertvector((b >> 4) - off, v8f);
                for (int j = 0; j < TT; j++)
                    acc[j] += lo * load8f(x + j * ldx + k) + hi * load8f(xo + j * ldx + k);
            }
        }
        const v8f s = (v8f){0} + scale[g];
        for (int j = 0; j < TT; j++)
            tot[j] += s * acc[j];
    }
    for (int j = 0; j < TT; j++)
        y[j * ldy] = hsum(tot[j]);
}

/* Returns 0, or -1 when the shapes do not fit (the caller's checks make that unreachable). */
int wq_gemm(const float *x, int64_t T, int64_t K, const uint8_t *q, int bits, const float *scale,
            const int8_t *zero, int64_t N, int64_t group, float *y, int nthreads) {
    if ((bits != 8 && bits != 4) || group <= 0 || K % group || group % 16)
        return -1;
    const int64_t groups = K / group, qrow = bits == 8 ? K : K / 2;
    const float *xe = x, *xo = NULL;
    int64_t ldx = K;
    float *split = NULL;
    if (bits == 4) { /* x's even and odd columns apart, matching the low and high nibbles */
        split = malloc(sizeof(float) * (size_t)(T * K));
        if (!split)
            return -1;
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < K / 2; i++) {
                split[t * K + i] = x[t * K + 2 * i];
                split[t * K + K / 2 + i] = x[t * K + 2 * i + 1];
            }
        xe = split;
        xo = split + K / 2;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = q + n * qrow;
        const float *sn = scale + n * groups;
        const int8_t *zn = zero ? zero + n * groups : NULL;
        int64_t t = 0;
#define TILE(TT) row_tile(xe + t * ldx, ldx, xo ? xo + t * ldx : NULL, qn, bits, sn, zn, K, group, y + t * N + n, N, TT)
        for (; t + 8 <= T; t += 8)
            TILE(8);
        if (T - t >= 4) {
            TILE(4);
            t += 4;
        }
        switch (T - t) {
        case 3: TILE(3); break;
        case 2: TILE(2); break;
        case 1: TILE(1); break;
        default: break;
        }
#undef TILE
    }
    free(split);
    return 0;
}

/* The full-precision weight out [N, K] fp32: (q - offset - zero) * scale, one rounding per element
 * (compressed-tensors' arithmetic in fp32), for row counts where a dense GEMM beats wq_gemm. */
int wq_dequant(const uint8_t *q, int bits, const float *scale, const int8_t *zero, int64_t N, int64_t K,
               int64_t group, float *out, int nthreads) {
    if ((bits != 8 && bits != 4) || group <= 0 || K % group || group % 16)
        return -1;
    const int64_t groups = K / group, qrow = bits == 8 ? K : K / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = n * groups + g;
            const v8i off = (v8i){0} + ((bits == 8 ? 128 : 8) + (zero ? zero[at] : 0));
            const v8f s = (v8f){0} + scale[at];
            float *o = out + n * K + g * group;
            if (bits == 8) {
                for (int64_t k = 0; k < group; k += 8) {
                    const v8f w = __builtin_convertvector(load8u(q + n * qrow + g * group + k) - off, v8f) * s;
                    memcpy(o + k, &w, sizeof w);
                }
            } else {
                for (int64_t k = 0; k < group; k += 16) {
                    const v8i b = load8u(q + n * qrow + (g * group + k) / 2);
                    const v8f lo = __builtin_convertvector((b & 15) - off, v8f) * s;
                    const v8f hi = __builtin_convertvector((b >> 4) - off, v8f) * s;
                    const v8f w0 = __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11);
                    const v8f w1 = __builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15);
                    memcpy(o + k, &w0, sizeof w0);
                    memcpy(o + k + 8, &w1, sizeof w1);
                }
            }
        }
    }
    return 0;
}
