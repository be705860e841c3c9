/* pdserve's native CPU kernels (float32), built at first use by engine/native/build.py and called
 * through ctypes: no torch headers, no compiler flags that change rounding (no -ffast-math).
 *
 *   rope_store        rotate q and k of a fused qkv projection (rotate-half, HF layout), write q to
 *                     a dense [T, Hq, D] output and k, v straight into the paged KV pool
 *   decode_attention  one query per request over its pages in place (no gather), GQA and sliding
 *                     window, online softmax over blocks of keys
 *
 * Threads: OpenMP with the caller's thread count; torch's wheel ships the same libgomp soname, so
 * these loops run on torch's own OpenMP pool.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KEY_BLOCK 128

/* exp(x) for x <= 0 in float32, within ~2 ulp (Cephes' expf polynomial), written so the compiler
 * vectorizes it: range reduction x = n ln2 + r, |r| <= ln2/2, 2^n built in the exponent bits. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

/* p[i] = exp(s[i] - m) for i < n; returns their sum */
static float exp_shift_sum(float *s, int n, float m) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) {
        float e = exp_nonpos(s[i] - m);
        s[i] = e;
        sum += e;
    }
    return sum;
}

static inline float dot(const float *a, const float *b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* rotate-half of one head: out[:h] = x1 cos - x2 sin, out[h:] = x2 cos + x1 sin (h = D / 2) */
static inline void rotate(float *out, const float *x, const float *cos, const float *sin, int half) {
#pragma omp simd
    for (int i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[half + i] = x2 * cos[i] + x1 * sin[i];
    }
}

/* qkv [T, (Hq + 2 Hkv) D] rows qkv_stride apart; cos, sin [T, D/2] contiguous; q_out [T, Hq, D]
 * contiguous. Token t's K/V go to page page_idx[t], slot offset[t]: element (page, slot, head, d) of
 * the layer's K view sits at k_base + page * page_stride + slot * slot_stride + head * D + d (V alike).
 * Returns 0, or -2 (nothing written) when a slot lies outside the pool's num_pages x page_size. */
int rope_store(const float *qkv, int64_t qkv_stride, int T, int Hq, int Hkv, int D,
               const float *cos, const float *sin, float *q_out,
               float *k_base, float *v_base, int64_t page_stride, int64_t slot_stride, int64_t num_pages,
               int page_size, const int64_t *page_idx, const int64_t *offset, int nthreads) {
    for (int t = 0; t < T; t++)  /* every slot inside the pool, or nothing is written */
        if (page_idx[t] < 0 || page_idx[t] >= num_pages || offset[t] < 0 || offset[t] >= page_size) return -2;
    int half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * (Hq + 2 * Hkv) * D > 32768)
    for (int t = 0; t < T; t++) {
        const float *row = qkv + (int64_t)t * qkv_stride;
        const float *c = cos + (int64_t)t * half, *s = sin + (int64_t)t * half;
        for (int h = 0; h < Hq; h++)
            rotate(q_out + ((int64_t)t * Hq + h) * D, row + (int64_t)h * D, c, s, half);
        int64_t at = page_idx[t] * page_stride + offset[t] * slot_stride;
        for (int h = 0; h < Hkv; h++) {
            rotate(k_base + at + (int64_t)h * D, row + (int64_t)(Hq + h) * D, c, s, half);
            memcpy(v_base + at + (int64_t)h * D, row + (int64_t)(Hq + Hkv + h) * D, sizeof(float) * D);
        }
    }
    return 0;
}

/* Attention of request b's query heads kv_lo*G .. kv_hi*G-1 (KV heads kv_lo..kv_hi-1). The key loop is
 * outermost, so each cache slot's K (then V) row of those heads is read once, front to back: a
 * page's rows lie side by side, which the hardware prefetcher streams; the next page's first row is
 * prefetched by hand, since pages lie anywhere in the pool. Online softmax over blocks of keys. */
static void attend_one(const float *q, float *out, const float *k_base, const float *v_base, int64_t page_stride,
                       int64_t slot_stride, const int32_t *pages, int S, int lo, int Hq, int G, int kv_lo,
                       int kv_hi, int D, int page_size, float scale) {
    int H = (kv_hi - kv_lo) * G, h0 = kv_lo * G;
    float qs[H][D], acc[H][D], sc[H][KEY_BLOCK], m[H], l[H];  /* stack: 7 KiB for SmolLM2, <= 257 KiB */
    for (int h = 0; h < H; h++) {
        for (int d = 0; d < D; d++) { qs[h][d] = q[(int64_t)(h0 + h) * D + d] * scale; acc[h][d] = 0.0f; }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    int64_t head_off = (int64_t)kv_lo * D;
    for (int start = lo; start < S; start += KEY_BLOCK) {
        int n = S - start < KEY_BLOCK ? S - start : KEY_BLOCK;
        for (int j = 0; j < n; j++) {
            int pos = start + j, slot = pos % page_size;
            int64_t row = pages[pos / page_size] * page_stride + slot * slot_stride + head_off;
            if (slot == 0 && pos + page_size < S) {
                int64_t next = pages[pos / page_size + 1] * page_stride + head_off;
                __builtin_prefetch(k_base + next);
                __builtin_prefetch(v_base + next);
            }
            const float *kp = k_base + row;
            for (int h = 0; h < H; h++) sc[h][j] = dot(qs[h], kp + (int64_t)(h / G) * D, D);
        }
        for (int h = 0; h < H; h++) {
            float mx = m[h];
            for (int j = 0; j < n; j++) mx = sc[h][j] > mx ? sc[h][j] : mx;
            float corr = m[h] == -INFINITY ? 0.0f : exp_nonpos(m[h] - mx);
            l[h] = l[h] * corr + exp_shift_sum(sc[h], n, mx);
            m[h] = mx;
            if (corr != 1.0f)
                for (int d = 0; d < D; d++) acc[h][d] *= corr;
        }
        for (int j = 0; j < n; j++) {
            int pos = start + j;
            const float *vp = v_base + pages[pos / page_size] * page_stride + (pos % page_size) * slot_stride + head_off;
            for (int h = 0; h < H; h++) {
                float p = sc[h][j];
                const float *vh = vp + (int64_t)(h / G) * D;
                float *a = acc[h];
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] += p * vh[d];
            }
        }
    }
    for (int h = 0; h < H; h++) {
        float *o = out + (int64_t)(h0 + h) * D;
        float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int d = 0; d < D; d++) o[d] = acc[h][d] * inv;
    }
}

/* q, out [B, Hq, D] contiguous; K/V views as in rope_store; page_table int32 [B, pt_width] contiguous;
 * seq_lens int32 [B] (keys in cache, the query's own included). Request b's query sits at position
 * seq_lens[b] - 1 and reads keys lo..seq_lens[b]-1, lo = 0 or, with window W > 0, seq_lens[b] - W.
 * One task per request; a batch too small to give every thread two tasks splits by KV head.
 * Returns 0; -1 for a shape this kernel does not take; -2 for a length or page outside the table or
 * the pool (nothing computed). */
int decode_attention(const float *q, float *out, const float *k_base, const float *v_base,
                     int64_t page_stride, int64_t slot_stride, int64_t num_pages, const int32_t *page_table,
                     int64_t pt_width, const int32_t *seq_lens, int B, int Hq, int Hkv, int D, int page_size,
                     int window, float scale, int nthreads) {
    if (Hkv <= 0 || Hq % Hkv || D <= 0 || Hq > 256 || Hq * D > 16384) return -1;  /* bounds a task's stack */
    for (int b = 0; b < B; b++) {  /* every page read lies inside the pool, or nothing is computed */
        int S = seq_lens[b];
        if (S < 1 || (int64_t)(S + page_size - 1) / page_size > pt_width) return -2;
        for (int i = 0; i < (S + page_size - 1) / page_size; i++) {
            int32_t page = page_table[(int64_t)b * pt_width + i];
            if (page < 0 || page >= num_pages) return -2;
        }
    }
    int G = Hq / Hkv;
    int split = B >= 2 * nthreads ? 1 : Hkv;  /* tasks per request: 1, or one per KV head */
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int task = 0; task < B * split; task++) {
        int b = task / split, part = task % split;
        int kv_lo = split == 1 ? 0 : part, kv_hi = split == 1 ? Hkv : part + 1;
        int S = seq_lens[b];
        int lo = (window > 0 && S > window) ? S - window : 0;
        attend_one(q + (int64_t)b * Hq * D, out + (int64_t)b * Hq * D, k_base, v_base, page_stride, slot_stride,
                   page_table + (int64_t)b * pt_width, S, lo, Hq, G, kv_lo, kv_hi, D, page_size, scale);
    }
    return 0;
}
