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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* With AVX-512, each block of 8 cached keys and each cached value is widened to fp32 once for
 * all the query heads that share it (not once per head), and the products run 16 lanes wide. The
 * sums are the 8-lane path's, lane for lane and in the same order, so the bits are too; where the
 * CPU has AVX512-BF16, bf16 caches' scores take vdpbf16ps instead (ATT_BF16DOT below: the same
 * fp32 products, summed in another order). */
#define ATT_WIDE 1
#ifndef VAHEAD
#define VAHEAD 32 /* from memory: 1.2x 8 tokens at 1,024 (16 / 4 heads x 64) */
#endif

/* 8 cached keys (rows) in fp32, two tokens per 16 lanes: kp[(p * d / 8 + i / 8) * 16 + l] is
 * token 2p + l / 8's dim i + l % 8 (as the 8-lane path holds one token's 8 dims). */
static inline void pair_keys(const void *k_cache, const int64_t *rows, int64_t d, int bf16,
                             float *kp) {
    size_t es = bf16 ? 2 : 4;
    for (int p = 0; p < 4; p++) {
        const char *a = (const char *)k_cache + rows[2 * p] * es;
        const char *b = (const char *)k_cache + rows[2 * p + 1] * es;
        for (int64_t i = 0; i < d; i += 8)
            _mm512_storeu_ps(kp + (p * (d / 8) + i / 8) * 16,
                             _mm512_insertf32x8(_mm512_castps256_ps512(load8(a, i, bf16)),
                                                load8(b, i, bf16), 1));
    }
}

/* One head's scores for 8 paired keys: qd its query with each 8 dims twice over */
static inline void scores8(const float *qd, const float *kp, int64_t d, float scale, float *s) {
    __m512 acc[4];
    for (int p = 0; p < 4; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d / 8; i++) {
        __m512 qv = _mm512_loadu_ps(qd + 16 * i);
        for (int p = 0; p < 4; p++)
            acc[p] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kp + (p * (d / 8) + i) * 16), acc[p]);
    }
    __m256 a[8];
    for (int p = 0; p < 4; p++) {
        a[2 * p] = _mm512_castps512_ps256(acc[p]);
        a[2 * p + 1] = _mm512_extractf32x8_ps(acc[p], 1);
    }
    _mm256_storeu_ps(s, _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale)));
}

/* up to 16 values' dims from fp32 or bf16 memory (lanes past `m` zero) */
static inline __m512 load16(const void *p, __mmask16 m, int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(m, p);
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Heads g0..g0+ng-1 (ng <= 4), dims i0..i0+16nv-1 of sum_t p_t v_t (the last 16 masked by
 * `last`): each value's 16-dim pieces are loaded once for the ng heads. */
static inline __attribute__((always_inline)) void values4(
    const float *s, int64_t len, int64_t g0, int ng, const void *v_cache, const int64_t *rows,
    int64_t i0, int nv, __mmask16 last, int bf16, const float *inv, void *out, int64_t out_row,
    int64_t d) {
    size_t es = bf16 ? 2 : 4;
    __m512 o[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < ng; g++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) o[g][v] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        const char *vr = (const char *)v_cache + (rows[t] + i0) * es;
        if (t + VAHEAD < len) /* a value VAHEAD tokens on, the lines this pass reads */
            for (int64_t b = 0; b < 16 * nv * (int64_t)es; b += 64)
                _mm_prefetch((const char *)v_cache + (rows[t + VAHEAD] + i0) * es + b,
                             _MM_HINT_T0);
        __m512 x[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++)
            x[v] = load16(vr + 16 * v * es, v == nv - 1 ? last : 0xffff, bf16);
#pragma GCC unroll 4
        for (int g = 0; g < ng; g++) {
            __m512 p = _mm512_set1_ps(s[(g0 + g) * len + t]);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) o[g][v] = _mm512_fmadd_ps(p, x[v], o[g][v]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < ng; g++) {
        float buf[64];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(buf + 16 * v, o[g][v]);
        int64_t n = d - i0 < 64 ? d - i0 : 64;
        for (int64_t i = 0; i < n; i++)
            store_f(out, (out_row + g0 + g) * d + i0 + i, buf[i] * inv[g0 + g], bf16);
    }
}
#endif

#if defined(ATT_WIDE) && defined(__AVX512BF16__)
#define ATT_BF16DOT 1
/* Lane j: the sum of the 16 lanes of a[(j % 4) * 4 + j / 4] (a transposing tree of 128-bit and
 * in-lane shuffles: 45 instructions for 16 sums). */
static inline __m512 reduce16(const __m512 *a) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* 128-bit blocks: a[2i]'s halves in 0-1, a[2i + 1]'s in 2-3 */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* block k: a[4i + k]'s 4 partial sums */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* block k: two lanes of a[8i + k], two of a[8i + 4 + k] */
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));
}

/* Scores of up to 16 cached keys (nt) for `group` heads with bf16 caches: each key's dims pair
 * with the bf16 query's in vdpbf16ps, 32 dims an instruction and no widening (the keys' widening
 * and the 8-token reductions were most of a short context's time); the 16 tokens' sums are
 * reduced together. Products are exact in fp32 and summed in fp32 as by the fma chains, in
 * another order; the instruction flushes subnormal inputs and sums to zero. qb holds each head's
 * query padded with zeros to dp dims (a multiple of 32); `tail` masks a key's last 32 dims. */
static inline __attribute__((always_inline)) void scores16_bf16(
    const uint16_t *qb, int64_t dp, int64_t group, const uint16_t *k_cache, const int64_t *rows,
    int nt, __mmask32 tail, float scale, float *s, int64_t len) {
    for (int64_t g = 0; g < group; g++) {
        const uint16_t *qg = qb + g * dp;
        __m512 acc[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            __m512 a = _mm512_setzero_ps();
            if (j < nt) {
                const uint16_t *kr = k_cache + rows[j];
                int64_t c = 0;
                for (; c + 32 < dp; c += 32)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qg + c),
                                         (__m512bh)_mm512_loadu_si512(kr + c));
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qg + c),
                                     (__m512bh)_mm512_maskz_loadu_epi16(tail, kr + c));
            }
            acc[(j % 4) * 4 + j / 4] = a;
        }
        __m512 r = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(s + g * len, (__mmask16)((1u << nt) - 1), r);
    }
}
#endif

/* One sequence, one kv head, its `group` query heads: scores, softmax, values. `s` holds
 * group * len scores, `rows` the len cache rows, `qf` the queries in fp32. Scores go 8 cached
 * tokens at a time (8 independent sums, reduced together); the weighted values keep 64 output
 * dims in registers per pass. */
static void head_group(const float *qf, const void *k_cache, const void *v_cache,
                       const int32_t *table, int64_t from, int64_t end, int64_t hkv, int64_t kh,
                       int64_t d, int64_t block_size, int64_t group, float scale,
                       const float *sinks, int bf16, float *s, int64_t *rows, float *scratch,
                       void *out, int64_t out_row) {
    size_t es = bf16 ? 2 : 4;
    int64_t len = end - from; /* the cached positions from..end-1 (a window's, or all) */
    for (int64_t t = 0; t < len;) { /* block by block: no division per token */
        int64_t at = from + t, off = at % block_size;
        int64_t base = (int64_t)table[at / block_size] * block_size;
        for (; off < block_size && t < len; off++, t++) rows[t] = ((base + off) * hkv + kh) * d;
    }
    int64_t t0 = 0;
    float *inv = scratch; /* per head: 1 / the softmax's denominator */
#ifdef ATT_BF16DOT
    if (bf16) {
        int64_t dp = (d + 31) / 32 * 32;
        uint16_t *qb = (uint16_t *)(scratch + group);
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < dp; i++)
                qb[g * dp + i] = i < d ? f32_to_bf16(qf[g * d + i]) : 0; /* exact: q is bf16 */
        __mmask32 tail = d % 32 ? (__mmask32)((1u << (d % 32)) - 1) : 0xffffffffu;
        for (; t0 < len; t0 += 16) {
            int nt = len - t0 < 16 ? (int)(len - t0) : 16;
            for (int64_t j = t0 + 16; j < t0 + 32 && j < len; j++) /* the next 16 keys' lines */
                for (int64_t b = 0; b < d * 2; b += 64)
                    _mm_prefetch((const char *)k_cache + rows[j] * 2 + b, _MM_HINT_T0);
            const uint16_t *kc = k_cache; /* the common widths as constants: unrolled */
            if (dp == 64)
                scores16_bf16(qb, 64, group, kc, rows + t0, nt, tail, scale, s + t0, len);
            else if (dp == 128)
                scores16_bf16(qb, 128, group, kc, rows + t0, nt, tail, scale, s + t0, len);
            else
                scores16_bf16(qb, dp, group, kc, rows + t0, nt, tail, scale, s + t0, len);
        }
    }
#endif
#ifdef ATT_WIDE
    if (d % 8 == 0 && t0 == 0) {
        float *qd = scratch + group, *kp = qd + group * 2 * d;
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < d; i += 8) {
                __m256 q8 = _mm256_loadu_ps(qf + g * d + i);
                _mm512_storeu_ps(qd + g * 2 * d + 2 * i,
                                 _mm512_insertf32x8(_mm512_castps256_ps512(q8), q8, 1));
            }
        for (; t0 + 8 <= len; t0 += 8) {
            for (int64_t j = t0 + 8; j < t0 + 16 && j < len; j++) /* the next 8 keys' lines */
                for (int64_t b = 0; b < d * (int64_t)es; b += 64)
                    _mm_prefetch((const char *)k_cache + rows[j] * es + b, _MM_HINT_T0);
            pair_keys(k_cache, rows + t0, d, bf16, kp);
            for (int64_t g = 0; g < group; g++)
                scores8(qd + g * 2 * d, kp, d, scale, s + g * len + t0);
        }
    }
#else
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
#endif
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
        /* the max 8 lanes at a time (one chain of vmaxss was a fifth of a long context's time);
         * a NaN score is skipped, as by the scalar comparison */
        __m256 mv = _mm256_set1_ps(m);
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sg + t), mv);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        m = _mm_cvtss_f32(m4);
        for (; t < len; t++) m = sg[t] > m ? sg[t] : m;
        mv = _mm256_set1_ps(m);
        __m256 acc = _mm256_setzero_ps();
        t = 0;
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
        inv[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
#ifdef ATT_WIDE
    if (d % 8 == 0) {
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            int ng = group - g0 < 4 ? (int)(group - g0) : 4;
            for (int64_t i0 = 0; i0 < d; i0 += 64) {
                int64_t rest = d - i0;
                if (ng == 4 && rest >= 64) { /* the common case, its loops unrolled */
                    values4(s, len, g0, 4, v_cache, rows, i0, 4, 0xffff, bf16, inv, out,
                            out_row, d);
                    continue;
                }
                int nv = rest >= 64 ? 4 : (int)((rest + 15) / 16);
                __mmask16 last = rest >= 64 || rest % 16 == 0
                                     ? 0xffff
                                     : (__mmask16)((1u << (rest % 16)) - 1);
                values4(s, len, g0, ng, v_cache, rows, i0, nv, last, bf16, inv, out, out_row, d);
            }
        }
        return;
    }
#endif
    for (int64_t g = 0; g < group; g++) {
        float *sg = s + g * len;
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
                store_f(out, (out_row + g) * d + i0 + i, buf[i] * inv[g], bf16);
        }
        for (int64_t i = i0; i < d; i++) { /* d not a multiple of 8 */
            float acc1 = 0.0f;
            for (int64_t t2 = 0; t2 < len; t2++)
                acc1 += sg[t2] * load_f((const char *)v_cache + rows[t2] * es, i, bf16);
            store_f(out, (out_row + g) * d + i, acc1 * inv[g], bf16);
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
    int parallel = batch * hq * max_len * d > 262144 && outermost(), failed = 0;
    int64_t threads = parallel ? omp_get_max_threads() : 1, units = batch * hkv;
    int64_t chunks = units >= threads ? 1 : (threads + units - 1) / units;
    chunks = chunks > group ? group : chunks;
    int64_t per = (group + chunks - 1) / chunks;
#pragma omp parallel if (parallel)
    {
        float *s = malloc(sizeof(float) * (size_t)(per * max_len));
        int64_t *rows = malloc(sizeof(int64_t) * (size_t)max_len);
        float *qf = malloc(sizeof(float) * (size_t)(per * d));
        /* 1 / denominators; with ATT_WIDE the doubled queries and 8 paired keys too, or with
         * ATT_BF16DOT the bf16 queries padded to 32 dims (per * 32 more covers a small d) */
        float *scratch = malloc(sizeof(float) * (size_t)(per + per * 2 * d + per * 32 + 8 * d));
        if (!s || !rows || !qf || !scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(3)
        for (int64_t b = 0; b < batch; b++)
            for (int64_t kh = 0; kh < hkv; kh++)
                for (int64_t c = 0; c < chunks; c++) {
                    int64_t g0 = c * per, n = group - g0 < per ? group - g0 : per;
                    if (!s || !rows || !qf || !scratch || n <= 0) continue;
                    int64_t row0 = b * hq + kh * group + g0, len = context_lens[b];
                    int64_t from = window && len > window ? len - window : 0;
                    for (int64_t i = 0; i < n * d; i++) qf[i] = load_f(q, row0 * d + i, bf16);
                    head_group(qf, k_cache, v_cache, block_tables + b * table_stride, from, len,
                               hkv, kh, d, block_size, n, scale,
                               sinks ? sinks + kh * group + g0 : NULL, bf16, s, rows, scratch,
                               out, row0);
                }
        free(s), free(rows), free(qf), free(scratch);
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
