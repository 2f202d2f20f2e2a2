/* Decode attention over the paged KV cache on the CPU: one new token per sequence.
 *
 * The operator path gathers each sequence's blocks (index_select, views, transposes) and calls
 * scaled_dot_product_attention: a dozen dispatched operators and ~50 us per layer for one token
 * of a short context. Here one call walks the block table: for sequence b and query head h (kv
 * head h / (Hq / Hkv)), scores s_t = scale * q . k_t over the sequence's context_lens[b] cached
 * tokens, softmax in fp32, out = sum_t p_t v_t / sum_t p_t, rounded to the activation dtype.
 * Caches [blocks, block_size, Hkv, D] and q/out [B, Hq, D], fp32 or bf16. gpt-oss's layers add
 * a sink logit per head to the softmax's denominator and, in sliding layers, see only the last
 * `window` positions (thr_paged_decode_sinks).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

/* 8 values from fp32 or bf16 memory (bf16: the 16 bits become a float's top half) */
static inline __m256 load8(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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


/* Lane j: the sum of a[j]'s 8 lanes (a transposing hadd tree instead of 8 horizontal sums). */
static inline __m256 reduce8(const __m256 *a) {
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

#define OREGS 8 /* output dims kept in registers per pass: 8 x 8 */

/* One sequence, one kv head, its `group` query heads: scores, softmax, values. `s` holds
 * group * len scores, `rows` the len cache rows, `qf` the queries in fp32. Scores go 8 cached
 * tokens at a time (8 independent sums, reduced together); the weighted values keep 64 output
 * dims in registers per pass. */
static void head_group(const float *qf, const void *k_cache, const void *v_cache,
                       const int32_t *table, int64_t from, int64_t end, int64_t hkv, int64_t kh,
                       int64_t d, int64_t block_size, int64_t group, float scale,
                       const float *sinks, int bf16, float *s, int64_t *rows, void *out,
                       int64_t out_row) {
    size_t es = bf16 ? 2 : 4;
    int64_t len = end - from; /* the cached positions from..end-1 (a window's, or all) */
    for (int64_t t = 0; t < len; t++)
        rows[t] = (((int64_t)table[(from + t) / block_size] * block_size + (from + t) % block_size)
                   * hkv + kh) * d;
    int64_t t0 = 0;
    if (d % 8 == 0)
        for (; t0 + 8 <= len; t0 += 8)
            for (int64_t g = 0; g < group; g++) {
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int64_t i = 0; i < d; i += 8) {
                    __m256 qv = _mm256_loadu_ps(qf + g * d + i);
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(
                            qv, load8((const char *)k_cache + rows[t0 + j] * es, i, bf16), acc[j]);
                }
                _mm256_storeu_ps(s + g * len + t0,
                                 _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
            }
    for (int64_t t = t0; t < len; t++) /* the last len % 8 tokens (all of them if d % 8) */
        for (int64_t g = 0; g < group; g++) {
            const char *kr = (const char *)k_cache + rows[t] * es;
            float dot = 0.0f;
            for (int64_t i = 0; i < d; i++) dot += qf[g * d + i] * load_f(kr, i, bf16);
            s[g * len + t] = dot * scale;
        }
    for (int64_t g = 0; g < group; g++) {
        /* a sink (gpt-oss): one more logit in the softmax's denominator, with no value */
        float *sg = s + g * len, sink = sinks ? sinks[g] : -INFINITY, m = sink;
        for (int64_t t = 0; t < len; t++) m = sg[t] > m ? sg[t] : m;
        __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
            _mm256_storeu_ps(sg + t, p);
            acc = _mm256_add_ps(acc, p);
        }
        float sum = hsum8(acc) + (sinks ? expf(sink - m) : 0.0f);
        for (; t < len; t++) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        int64_t i0 = 0;
        for (; d % 8 == 0 && i0 < d; i0 += 8 * OREGS) {
            int nv = (int)((d - i0) / 8 < OREGS ? (d - i0) / 8 : OREGS);
            __m256 o[OREGS];
            for (int v = 0; v < nv; v++) o[v] = _mm256_setzero_ps();
            for (int64_t t2 = 0; t2 < len; t2++) {
                __m256 p = _mm256_set1_ps(sg[t2]);
                const char *vr = (const char *)v_cache + rows[t2] * es;
                for (int v = 0; v < nv; v++)
                    o[v] = _mm256_fmadd_ps(p, load8(vr, i0 + 8 * v, bf16), o[v]);
            }
            float buf[8 * OREGS];
            for (int v = 0; v < nv; v++) _mm256_storeu_ps(buf + 8 * v, o[v]);
            for (int64_t i = 0; i < 8 * nv; i++)
                store_f(out, (out_row + g) * d + i0 + i, buf[i] * inv, bf16);
        }
        for (int64_t i = i0; i < d; i++) { /* d not a multiple of 8 */
            float acc1 = 0.0f;
            for (int64_t t2 = 0; t2 < len; t2++)
                acc1 += sg[t2] * load_f((const char *)v_cache + rows[t2] * es, i, bf16);
            store_f(out, (out_row + g) * d + i, acc1 * inv, bf16);
        }
    }
}

/* Work items are (sequence, kv head, chunk of its query heads): with fewer sequences x kv heads
 * than threads (one sequence of a latent cache's single kv head), the query heads split so that
 * every thread has work. sinks: fp32 [hq] or NULL; window: each token sees its last `window`
 * cached positions (0: all). Returns 0, or -1 when out of memory. */
static int paged_decode(const void *q, const void *k_cache, const void *v_cache,
                        const int32_t *block_tables, int64_t table_stride,
                        const int32_t *context_lens, int64_t batch, int64_t hq, int64_t hkv,
                        int64_t d, int64_t block_size, float scale, const float *sinks,
                        int64_t window, void *out, int bf16) {
    int64_t group = hq / hkv, max_len = 1;
    for (int64_t b = 0; b < batch; b++)
        if (context_lens[b] > max_len) max_len = context_lens[b];
    int parallel = batch * hq * max_len * d > 262144, failed = 0;
    int64_t threads = parallel ? omp_get_max_threads() : 1, units = batch * hkv;
    int64_t chunks = units >= threads ? 1 : (threads + units - 1) / units;
    chunks = chunks > group ? group : chunks;
    int64_t per = (group + chunks - 1) / chunks;
#pragma omp parallel if (parallel)
    {
        float *s = malloc(sizeof(float) * (size_t)(per * max_len));
        int64_t *rows = malloc(sizeof(int64_t) * (size_t)max_len);
        float *qf = malloc(sizeof(float) * (size_t)(per * d));
        if (!s || !rows || !qf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(3)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t kh = 0; kh < hkv; kh++)
                for (int64_t c = 0; c < chunks; c++) {
                    int64_t g0 = c * per, n = group - g0 < per ? group - g0 : per;
                    if (!s || !rows || !qf || n <= 0) continue;
                    int64_t row0 = b * hq + kh * group + g0, len = context_lens[b];
                    int64_t from = window && len > window ? len - window : 0;
                    for (int64_t i = 0; i < n * d; i++) qf[i] = load_f(q, row0 * d + i, bf16);
                    head_group(qf, k_cache, v_cache, block_tables + b * table_stride, from, len,
                               hkv, kh, d, block_size, n, scale,
                               sinks ? sinks + kh * group + g0 : NULL, bf16, s, rows, out, row0);
                }
        free(s), free(rows), free(qf);
    }
    return failed ? -1 : 0;
}

/* Returns 0, or -1 when out of memory. */
int thr_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                     const int32_t *block_tables, int64_t table_stride,
                     const int32_t *context_lens, int64_t batch, int64_t hq, int64_t hkv,
                     int64_t d, int64_t block_size, float scale, void *out, int bf16) {
    return paged_decode(q, k_cache, v_cache, block_tables, table_stride, context_lens, batch, hq,
                        hkv, d, block_size, scale, NULL, 0, out, bf16);
}

/* thr_paged_decode with gpt-oss's per-head sink logits (fp32 [hq]) and sliding window (0: none) */
int thr_paged_decode_sinks(const void *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_stride,
                           const int32_t *context_lens, int64_t batch, int64_t hq, int64_t hkv,
                           int64_t d, int64_t block_size, float scale, const float *sinks,
                           int64_t window, void *out, int bf16) {
    return paged_decode(q, k_cache, v_cache, block_tables, table_stride, context_lens, batch, hq,
                        hkv, d, block_size, scale, sinks, window, out, bf16);
}
