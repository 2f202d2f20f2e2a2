/* Decode attention over the paged KV cache on the CPU: one new token per sequence.
 *
 * The operator path gathers each sequence's blocks (index_select, views, transposes) and calls
 * scaled_dot_product_attention: a dozen dispatched operators and ~50 us per layer for one token
 * of a short context. Here one call walks the block table: for sequence b and query head h (kv
 * head h / (Hq / Hkv)), scores s_t = scale * q . k_t over the sequence's context_lens[b] cached
 * tokens, softmax in fp32, out = sum_t p_t v_t / sum_t p_t, rounded to the activation dtype.
 * Caches [blocks, block_size, Hkv, D] and q/out [B, Hq, D], fp32 or bf16.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 8 values from fp32 or bf16 memory (bf16: the 16 bits become a float's top half) */
static inline __m256 load8(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float ld(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void st(void *p, int64_t i, float f, int bf16) {
    if (!bf16) {
        ((float *)p)[i] = f;
        return;
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u |= 0x400000u;
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (scores minus their max), 8 lanes: 2^n * p(r) with x = n ln2 + r, a degree-6
 * polynomial on |r| <= ln2 / 2 (relative error ~2e-7, below fp32 rounding of the sums). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#define MAX_GROUP 16 /* query heads per kv head handled together */

/* One sequence, one kv head, its `group` query heads: scores, softmax, values. `s` holds
 * group * len scores, `o` group * d partial outputs, `qf` the queries in fp32. */
static void head_group(const float *qf, const void *k_cache, const void *v_cache,
                       const int32_t *table, int64_t len, int64_t hkv, int64_t kh, int64_t d,
                       int64_t block_size, int64_t group, float scale, int bf16, float *s,
                       float *o, void *out, int64_t out_row) {
    size_t es = bf16 ? 2 : 4;
    for (int64_t t = 0; t < len; t++) {
        int64_t row = ((int64_t)table[t / block_size] * block_size + t % block_size) * hkv + kh;
        const char *kr = (const char *)k_cache + row * d * es;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qf + g * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 16 <= d; i += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), load8(kr, i, bf16), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + 8), load8(kr, i + 8, bf16), a1);
            }
            for (; i + 8 <= d; i += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), load8(kr, i, bf16), a0);
            float dot = hsum8(_mm256_add_ps(a0, a1));
            for (; i < d; i++) dot += qg[i] * ld(kr, i, bf16);
            s[g * len + t] = dot * scale;
        }
    }
    float sums[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        float *sg = s + g * len, m = -INFINITY;
        for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
        __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
            _mm256_storeu_ps(sg + t, p);
            acc = _mm256_add_ps(acc, p);
        }
        float sum = hsum8(acc);
        for (; t < len; t++) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        sums[g] = sum;
        for (int64_t i = 0; i < d; i++) o[g * d + i] = 0.0f;
    }
    for (int64_t t = 0; t < len; t++) {
        int64_t row = ((int64_t)table[t / block_size] * block_size + t % block_size) * hkv + kh;
        const char *vr = (const char *)v_cache + row * d * es;
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) {
            __m256 v = load8(vr, i, bf16);
            for (int64_t g = 0; g < group; g++)
                _mm256_storeu_ps(o + g * d + i, _mm256_fmadd_ps(_mm256_set1_ps(s[g * len + t]), v,
                                                                _mm256_loadu_ps(o + g * d + i)));
        }
        for (; i < d; i++) {
            float v = ld(vr, i, bf16);
            for (int64_t g = 0; g < group; g++) o[g * d + i] += s[g * len + t] * v;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = sums[g] > 0.0f ? 1.0f / sums[g] : 0.0f;
        for (int64_t i = 0; i < d; i++) st(out, (out_row + g) * d + i, o[g * d + i] * inv, bf16);
    }
}

/* Returns 0, -1 when out of memory, -2 for more than MAX_GROUP query heads per kv head. */
int thr_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                     const int32_t *block_tables, int64_t table_stride,
                     const int32_t *context_lens, int64_t batch, int64_t hq, int64_t hkv,
                     int64_t d, int64_t block_size, float scale, void *out, int bf16) {
    int64_t group = hq / hkv, max_len = 1;
    if (group > MAX_GROUP) return -2;
    for (int64_t b = 0; b < batch; b++)
        if (context_lens[b] > max_len) max_len = context_lens[b];
    int failed = 0;
#pragma omp parallel if (batch * hq * max_len * d > 262144)
    {
        float *s = malloc(sizeof(float) * (size_t)(group * max_len));
        float *o = malloc(sizeof(float) * (size_t)(group * d));
        float *qf = malloc(sizeof(float) * (size_t)(group * d));
        if (!s || !o || !qf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t kh = 0; kh < hkv; kh++) {
                if (!s || !o || !qf) continue;
                int64_t row0 = b * hq + kh * group;
                for (int64_t i = 0; i < group * d; i++) qf[i] = ld(q, row0 * d + i, bf16);
                head_group(qf, k_cache, v_cache, block_tables + b * table_stride, context_lens[b],
                           hkv, kh, d, block_size, group, scale, bf16, s, o, out, row0);
            }
        free(s), free(o), free(qf);
    }
    return failed ? -1 : 0;
}
