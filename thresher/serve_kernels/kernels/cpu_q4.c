/* 4-bit and 8-bit weight x 8-bit activation matmuls for x86 CPUs (AVX2, AVX512-VNNI).
 *
 * y[m, n] = sum_k (q[n, k] - z[n, g]) * s[n, g] * x[m, k],  g = k / G
 *
 * thr_q4_matmul takes 4-bit codes in the layout below, thr_q8_matmul 8-bit codes a byte each,
 * row-major (GPTQ's 8-bit: llama.cpp's Q8_0 x Q8_0 product with GPTQ's zero points).
 *
 * The activations are rounded to int8 per block of 32 (d = max|x| / 127, as llama.cpp's Q8_0
 * does for its Q4_0 matmuls), so the inner products run on integer multiply-adds: vpdpbusd
 * (unsigned 4-bit codes times signed int8) with AVX512-VNNI, vpmaddubsw + vpmaddwd with AVX2.
 * The zero point is folded out: sum_k (q - z) s x = s * sum_k q x - s z * sum_k x, so each
 * row needs one float per group besides its scale.
 *
 * Weight layout, per row: K / 64 chunks of 32 bytes; byte j of chunk c holds code 64c + j in
 * its low nibble and code 64c + 32 + j in its high nibble, so one load and two masks give the
 * 64 codes in order. Scales: float [N, 2, K / G], per row the group scales s, then s * z.
 * With AVX512-VNNI, groups of a multiple of 128 read the packed bytes directly for up to
 * DIRECT_ROWS activation rows (rows_dot_packed); other layouts unpack 4 rows at a time into a
 * buffer first. With AVX2 every layout and batch reads them directly, a thread's rows as four
 * streams (row_group).
 * Requires K % 64 == 0 and G % 32 == 0 (G divides K). Built by cpu_q4.py with the host's
 * -march; threads are torch's (its libgomp is the one loaded in the process).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define QBLOCK 32

/* Block scales below this are taken as zero (their block's codes too): a scale over 16 stays
 * exact (rows_dot_packed), and such a block's products, under 1e-33, were lost anyway. */
#define MIN_SCALE 0x1p-120f

/* One activation row in int8 blocks: codes, block scales and, per weight group, sum of x. Codes
 * round half to even (nearbyintf; cvtps2dq under the default rounding mode, the same bits). */
static void quantize_row(const void *x, int x_bf16, int64_t k, int64_t g, int8_t *xq, float *d,
                         float *gsum) {
    for (int64_t gi = 0; gi < k / g; gi++) gsum[gi] = 0.0f;
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        int64_t j = b * QBLOCK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 v0, v1;
        if (x_bf16) {
            const __m256i_u *h = (const __m256i_u *)((const uint16_t *)x + j);
            v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h[0]), 16));
            v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h[1]), 16));
        } else {
            v0 = _mm512_loadu_ps((const float *)x + j);
            v1 = _mm512_loadu_ps((const float *)x + j + 16);
        }
        /* a NaN lane leaves the max as it was, as the scalar comparison does */
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v1),
                                                        _mm512_max_ps(_mm512_abs_ps(v0),
                                                                      _mm512_setzero_ps())));
        float db = amax / 127.0f;
        if (db < MIN_SCALE) db = 0.0f;
        __m512 inv = _mm512_set1_ps(db > 0.0f ? 1.0f / db : 0.0f);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm_storeu_si128((__m128i *)(xq + j), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + j + 16), _mm512_cvtepi32_epi8(q1));
        int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
        float buf[QBLOCK];
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            buf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[j + i]) : ((const float *)x)[j + i];
            float a = fabsf(buf[i]);
            amax = a > amax ? a : amax;
        }
        float db = amax / 127.0f;
        if (db < MIN_SCALE) db = 0.0f;
        float inv = db > 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            int v = (int)nearbyintf(buf[i] * inv);
            xq[j + i] = (int8_t)v;
            sum += v;
        }
#endif
        d[b] = db;
        gsum[j / g] += db * (float)sum;
    }
}

#define ROWS 4 /* weight rows per step: they share each activation load */
#define DIRECT_ROWS 16 /* up to this many activation rows, groups of 128k read the packed bytes */
#ifndef PREFETCH
#define PREFETCH 4096
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4_ISA "avx512vnni"

/* Codes of `nr` rows (each k/2 bytes, `stride` apart) as one byte each, in order; with groups of
 * 32, also each row's block scales as 16 floats per chunk (8 of block 2c, 8 of block 2c + 1).
 * `seg`: in the direct path's order instead, each 128-code segment's blocks 0, 2, 1, 3 (its 64
 * bytes' low nibbles, then their high nibbles), so that a matmul of many rows sums the same
 * products in the same lanes and order as the direct path's few rows. */
static inline void unpack_rows(const uint8_t *w, int64_t stride, int64_t k, int nr, uint8_t *out,
                               const float *sz, int64_t sz_stride, int64_t g, float *ws,
                               int seg) {
    if (g == 32)
        for (int r = 0; r < nr; r++)
            for (int64_t c = 0; c < k / 64; c++)
                for (int j = 0; j < 16; j++)
                    ws[r * (k / 4) + 16 * c + j] = sz[r * sz_stride + 2 * c + j / 8];
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (int r = 0; r < nr; r++)
        for (int64_t c = 0; c < k / 64; c++) {
            /* the next rows' bytes, PREFETCH ahead: one core's misses in flight bound its DRAM read */
            _mm_prefetch((const char *)(w + r * stride + 32 * c + PREFETCH), _MM_HINT_T0);
            __m256i p = _mm256_loadu_si256((const __m256i *)(w + r * stride + 32 * c));
            int64_t lo = seg ? 128 * (c / 2) + 32 * (c % 2) : 64 * c, hi = lo + (seg ? 64 : 32);
            _mm256_storeu_si256((__m256i *)(out + r * k + lo), _mm256_and_si256(p, mask));
            _mm256_storeu_si256((__m256i *)(out + r * k + hi),
                                _mm256_and_si256(_mm256_srli_epi16(p, 4), mask));
        }
}

/* sum_i a[i] * b[i]: the zero points' share, sum over groups of s * z * sum(x) */
static inline float zdot(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* Two activation blocks' scales as one vector: lanes 0-7 block 2c, lanes 8-15 block 2c + 1
 * (vpdpbusd's lane i sums bytes 4i..4i+3). */
static inline __m512 pair(float a, float b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}

/* out[r] = sum_g s[r, g] * sum_{k in g} q[r, k] * xhat[k] for nr <= ROWS unpacked rows */
static inline __attribute__((always_inline)) void rows_dot(
    const uint8_t *wb, const float *ws, const float *sz, int64_t sz_stride, int64_t k, int64_t g,
    int nr, const int8_t *xq, const float *d, float *out) {
    __m512 acc[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    if (g == 32) { /* a scale per block: `ws` holds each row's as vpdpbusd's lanes need them */
        for (int64_t c = 0; c < k / 64; c++) {
            __m512i xv = _mm512_loadu_si512((const void *)(xq + 64 * c));
            __m512 dv = pair(d[2 * c], d[2 * c + 1]);
            for (int r = 0; r < nr; r++) {
                __m512i wv = _mm512_loadu_si512((const void *)(wb + r * k + 64 * c));
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
                __m512 sc = _mm512_mul_ps(dv, _mm512_loadu_ps(ws + r * (k / 4) + 16 * c));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[r]);
            }
        }
    } else {
        int64_t per_group = g / 64;
        for (int64_t gi = 0; gi < k / g; gi++) {
            __m512 gacc[ROWS];
            for (int r = 0; r < nr; r++) gacc[r] = _mm512_setzero_ps();
            for (int64_t c = gi * per_group; c < (gi + 1) * per_group; c++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xq + 64 * c));
                __m512 dv = pair(d[2 * c], d[2 * c + 1]);
                for (int r = 0; r < nr; r++) {
                    __m512i wv = _mm512_loadu_si512((const void *)(wb + r * k + 64 * c));
                    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
                    gacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dv, gacc[r]);
                }
            }
            for (int r = 0; r < nr; r++)
                acc[r] = _mm512_fmadd_ps(gacc[r], _mm512_set1_ps(sz[r * sz_stride + gi]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* Groups of a multiple of 128: rows_dot straight from the packed bytes, no unpacked copy. One
 * 64-byte load is two chunks (128 codes); its low nibbles are codes 0-31 and 64-95 of the
 * segment, its high nibbles 32-63 and 96-127, so the activations are permuted to match once per
 * call (``permute_segments``). Decode (a few rows) reads each weight byte once: unpacking it to
 * a buffer first only added stores and loads. The high nibbles are masked in place, 16 times
 * their codes, against their blocks' scales over 16 (``segment_scales``; no shift): exact, since
 * quantize_row keeps every scale normal or zero, so the sums are the unpacked rows' bit for bit. */
#define Q4_DIRECT 1
static void permute_segments(const int8_t *xq, int64_t k, int8_t *xp) {
    for (int64_t s = 0; s < k / 128; s++) {
        memcpy(xp + 128 * s, xq + 128 * s, 32);
        memcpy(xp + 128 * s + 32, xq + 128 * s + 64, 32);
        memcpy(xp + 128 * s + 64, xq + 128 * s + 32, 32);
        memcpy(xp + 128 * s + 96, xq + 128 * s + 96, 32);
    }
}

/* The activation block scales as rows_dot_packed's lanes need them: per 128-code segment,
 * 16 floats for its low nibbles (blocks 0 and 2) and 16 for its high nibbles (blocks 1 and 3,
 * over 16: the high nibbles are read in place, as 16 times their code) */
static void segment_scales(const float *d, int64_t k, float *dv) {
    for (int64_t s = 0; s < k / 128; s++) {
        _mm512_storeu_ps(dv + 32 * s, pair(d[4 * s], d[4 * s + 2]));
        _mm512_storeu_ps(dv + 32 * s + 16, pair(d[4 * s + 1] * 0.0625f, d[4 * s + 3] * 0.0625f));
    }
}

static inline __attribute__((always_inline)) void rows_dot_packed(
    const uint8_t *w, int64_t stride, const float *sz, int64_t sz_stride, int64_t k, int64_t g,
    int nr, const int8_t *xp, const float *dv, float *out) {
    __m512 acc[ROWS];
    const __m512i lmask = _mm512_set1_epi8(0x0f), hmask = _mm512_set1_epi8((char)0xf0);
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    int64_t per_group = g / 128;
    for (int64_t s0 = 0; s0 < k / 128; s0 += per_group) {
        __m512 gacc[ROWS];
        for (int r = 0; r < nr; r++) gacc[r] = _mm512_setzero_ps();
        for (int64_t s = s0; s < s0 + per_group; s++) {
            __m512i xlo = _mm512_loadu_si512((const void *)(xp + 128 * s));
            __m512i xhi = _mm512_loadu_si512((const void *)(xp + 128 * s + 64));
            __m512 dlo = _mm512_loadu_ps(dv + 32 * s), dhi = _mm512_loadu_ps(dv + 32 * s + 16);
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = w + r * stride + 64 * s;
                _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512((const void *)p);
                __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                _mm512_and_si512(v, lmask), xlo);
                __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                _mm512_and_si512(v, hmask), xhi);
                gacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), dlo, gacc[r]);
                gacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), dhi, gacc[r]);
            }
        }
        for (int r = 0; r < nr; r++)
            acc[r] = _mm512_fmadd_ps(gacc[r], _mm512_set1_ps(sz[r * sz_stride + s0 / per_group]),
                                     acc[r]);
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* 8-bit codes, a byte each in order, read straight from the weight rows (``stride`` bytes
 * apart): as rows_dot, with a prefetch ahead of each row; groups of 32 scale each block's lanes
 * (pair) */
static inline __attribute__((always_inline)) void rows_dot8(
    const uint8_t *w, int64_t stride, const float *sz, int64_t sz_stride, int64_t k, int64_t g,
    int nr, const int8_t *xq, const float *d, float *out) {
    __m512 acc[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    int64_t per_group = g == 32 ? 1 : g / 64; /* 64-byte chunks per scale step */
    for (int64_t c0 = 0; c0 < k / 64; c0 += per_group) {
        __m512 gacc[ROWS];
        for (int r = 0; r < nr; r++) gacc[r] = _mm512_setzero_ps();
        for (int64_t c = c0; c < c0 + per_group; c++) {
            __m512i xv = _mm512_loadu_si512((const void *)(xq + 64 * c));
            __m512 dv = pair(d[2 * c], d[2 * c + 1]);
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = w + r * stride + 64 * c;
                _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                  _mm512_loadu_si512((const void *)p), xv);
                gacc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dv, gacc[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            const float *s = sz + r * sz_stride;
            __m512 sc = g == 32 ? pair(s[2 * c0], s[2 * c0 + 1]) : _mm512_set1_ps(s[c0 / per_group]);
            acc[r] = _mm512_fmadd_ps(gacc[r], sc, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#define SPREAD 0 /* a thread's rows in groups of neighbours (row_group) */
#elif defined(__AVX2__) && defined(__FMA__)
#define Q4_ISA "avx2"
#define SPREAD 1 /* a thread's rows as ROWS streams (row_group) */
static inline float zdot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float v = hsum8(acc);
    for (; i < n; i++) v += a[i] * b[i];
    return v;
}

/* 32 codes (unsigned, a register) times 32 int8 activations as 8 fp32 partial sums; no
 * saturation since two products are at most 2 * 15 * 127 */
static inline __m256 dot32(__m256i w, const int8_t *x) {
    __m256i p = _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* Every size of batch reads the packed bytes directly: a 32-byte load holds a chunk's 64 codes,
 * its low nibbles the first block of 32 and its high nibbles the second, in the activations'
 * order. dv: each activation block's scale as 8 lanes (block_scales), loaded beside the FMA.
 * Per group, the low and the high blocks' sums apart, then times the group's scale (each block
 * its own scale for groups of 32); the row sums live in memory, which leaves the registers to
 * the inner loop (with them held there it spilled and ran a third slower). A prefetch 1 KB
 * ahead in each stream: 7-12% faster from memory than none or 4 KB on a Zen 3 (medians of 15
 * interleaved passes, one and two threads). */
#define Q4_DIRECT_ALL 1
#define STREAM_PREFETCH 1024
static void block_scales(const float *d, int64_t blocks, float *dv) {
    for (int64_t b = 0; b < blocks; b++) _mm256_storeu_ps(dv + 8 * b, _mm256_set1_ps(d[b]));
}

static inline __attribute__((always_inline)) void rows_dot_packed(
    const uint8_t *w, int64_t stride, const float *sz, int64_t sz_stride, int64_t k, int64_t g,
    int nr, const int8_t *xq, const float *dv, float *out) {
    float acc[ROWS][8] __attribute__((aligned(32)));
    for (int r = 0; r < nr; r++) _mm256_store_ps(acc[r], _mm256_setzero_ps());
    const __m256i mask = _mm256_set1_epi8(0x0f);
    int64_t per_group = g == 32 ? 1 : g / 64; /* chunks per scale step */
    for (int64_t c0 = 0; c0 < k / 64; c0 += per_group) {
        __m256 glo[ROWS], ghi[ROWS];
        for (int r = 0; r < nr; r++) glo[r] = ghi[r] = _mm256_setzero_ps();
        for (int64_t c = c0; c < c0 + per_group; c++)
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = w + r * stride + 32 * c;
                _mm_prefetch((const char *)p + STREAM_PREFETCH, _MM_HINT_T0);
                __m256i v = _mm256_loadu_si256((const __m256i *)p);
                __m256 lo = dot32(_mm256_and_si256(v, mask), xq + 64 * c);
                __m256 hi = dot32(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                                  xq + 64 * c + 32);
                glo[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(dv + 16 * c), glo[r]);
                ghi[r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(dv + 16 * c + 8), ghi[r]);
            }
        for (int r = 0; r < nr; r++) {
            const float *s = sz + r * sz_stride;
            __m256 a = _mm256_load_ps(acc[r]);
            if (g == 32)
                a = _mm256_fmadd_ps(ghi[r], _mm256_set1_ps(s[2 * c0 + 1]),
                                    _mm256_fmadd_ps(glo[r], _mm256_set1_ps(s[2 * c0]), a));
            else
                a = _mm256_fmadd_ps(_mm256_add_ps(glo[r], ghi[r]),
                                    _mm256_set1_ps(s[c0 / per_group]), a);
            _mm256_store_ps(acc[r], a);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum8(_mm256_load_ps(acc[r]));
}

/* 32 8-bit codes times 32 int8 activations as 8 int32 sums, widened to 16 bits first: the
 * pairs' sums reach 2 * 255 * 128, past vpmaddubsw's saturation */
static inline __m256 dot32_wide(const uint8_t *w, const int8_t *x) {
    __m256i a = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w)),
                                  _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x)));
    __m256i b = _mm256_madd_epi16(
        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 16))),
        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + 16))));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(a, b));
}

static inline __attribute__((always_inline)) void rows_dot8(
    const uint8_t *w, int64_t stride, const float *sz, int64_t sz_stride, int64_t k, int64_t g,
    int nr, const int8_t *xq, const float *d, float *out) {
    __m256 acc[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 32; b++) {
        int64_t gi = (b * 32) / g;
        for (int r = 0; r < nr; r++) {
            acc[r] = _mm256_fmadd_ps(dot32_wide(w + r * stride + 32 * b, xq + 32 * b),
                                     _mm256_set1_ps(d[b] * sz[r * sz_stride + gi]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum8(acc[r]);
}
#else
#error "cpu_q4.c needs AVX2 and FMA"
#endif

const char *thr_q4_isa(void) { return Q4_ISA; }

/* the thread count a parallel region here gets: torch.set_num_threads reaches it */
int thr_q4_threads(void) { return omp_get_max_threads(); }

/* Every activation row of x [m, k] in int8 blocks (quantize_row) into buffers it allocates:
 * codes xq [m, k], block scales d [m, k / 32], per-group sums gsum [m, k / g]. Returns 0, or -1
 * when out of memory (nothing left allocated). */
static int quantize_rows(const void *x, int x_bf16, int64_t m, int64_t k, int64_t g,
                         int8_t **xq, float **d, float **gsum) {
    int64_t blocks = k / QBLOCK, groups = k / g;
    *xq = aligned_alloc(64, (size_t)((m * k + 127) / 64 * 64)); /* a multiple of 64 */
    *d = malloc(sizeof(float) * (size_t)(m * blocks));
    *gsum = malloc(sizeof(float) * (size_t)(m * groups));
    if (!*xq || !*d || !*gsum) {
        free(*xq), free(*d), free(*gsum);
        return -1;
    }
#pragma omp parallel for schedule(static) if (m * k > 16384 && outermost())
    for (int64_t i = 0; i < m; i++)
        quantize_row((const char *)x + (x_bf16 ? 2 : 4) * i * k, x_bf16, k, g, *xq + i * k,
                     *d + i * blocks, *gsum + i * groups);
    return 0;
}

/* y[i, j] = acc - the zero points' share (s z . gsum), as fp32 or bf16 */
static inline void store_row_out(void *y, int y_bf16, int64_t at, float acc, const float *sz_row,
                                 const float *gsum_row, int64_t groups) {
    float v = acc - zdot(sz_row + groups, gsum_row, groups);
    if (y_bf16)
        ((uint16_t *)y)[at] = f32_to_bf16(v);
    else
        ((float *)y)[at] = v;
}

/* y [m, n] from the weight rows ROWS at a time (row_group: neighbours, or streams where SPREAD),
 * each group against every activation row: 8-bit codes (k bytes a row) on rows_dot8, else packed
 * 4-bit codes (k / 2) on rows_dot_packed; xa [m, k] and its scales (ds_stride floats a row) as
 * that kernel takes them. Inlined with `dot8` constant and nr == ROWS apart, so each kernel keeps
 * its shape. */
static inline __attribute__((always_inline)) void quad_rows(
    int dot8, const uint8_t *w, const float *sz, int64_t n, int64_t k, int64_t g, int64_t m,
    const int8_t *xa, const float *ds, int64_t ds_stride, const float *gsum, void *y,
    int y_bf16) {
    int64_t groups = k / g, row = dot8 ? k : k / 2;
#pragma omp parallel if (m * n * k > 262144 && outermost())
    {
        int64_t threads = omp_get_num_threads(), id = omp_get_thread_num(), r0, step;
        int64_t lo = n * id / threads, hi = n * (id + 1) / threads;
        int nr;
        for (int64_t q = 0; (nr = row_group(lo, hi, ROWS, SPREAD, q, &r0, &step)); q++) {
            const uint8_t *wq = w + r0 * row;
            const float *szr = sz + r0 * 2 * groups;
            int64_t ws = step * row, ss = step * 2 * groups; /* between the group's rows */
            for (int64_t i = 0; i < m; i++) {
                const int8_t *xi = xa + i * k;
                const float *di = ds + i * ds_stride;
                float acc[ROWS];
                if (dot8 && nr == ROWS)
                    rows_dot8(wq, ws, szr, ss, k, g, ROWS, xi, di, acc);
                else if (dot8)
                    rows_dot8(wq, ws, szr, ss, k, g, nr, xi, di, acc);
                else if (nr == ROWS)
                    rows_dot_packed(wq, ws, szr, ss, k, g, ROWS, xi, di, acc);
                else
                    rows_dot_packed(wq, ws, szr, ss, k, g, nr, xi, di, acc);
                for (int r = 0; r < nr; r++)
                    store_row_out(y, y_bf16, i * n + r0 + r * step, acc[r], szr + r * ss,
                                  gsum + i * groups, groups);
            }
        }
    }
}

/* y [M, N] = x [M, K] @ W.T; x and y in fp32 or bf16 (flags). Returns 0, or -1 when out of memory. */
int thr_q4_matmul(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w,
                  const float *sz, int64_t n, int64_t g, void *y, int y_bf16) {
    int64_t blocks = k / QBLOCK;
    int8_t *xq;
    float *d, *gsum;
    if (quantize_rows(x, x_bf16, m, k, g, &xq, &d, &gsum)) return -1;
#ifdef Q4_DIRECT_ALL
    float *dv = malloc(sizeof(float) * (size_t)(m * k / 4));
    if (!dv) {
        free(xq), free(d), free(gsum);
        return -1;
    }
    block_scales(d, m * blocks, dv);
    quad_rows(0, w, sz, n, k, g, m, xq, dv, k / 4, gsum, y, y_bf16);
    free(dv), free(xq), free(d), free(gsum);
    return 0;
#else
    int64_t groups = k / g, quads = (n + ROWS - 1) / ROWS;
    int failed = 0;
#if defined(Q4_DIRECT) && !defined(Q4_NO_DIRECT)
    if (g % 128 == 0 && m <= DIRECT_ROWS) {
        int8_t *xp = aligned_alloc(64, (size_t)((m * k + 127) / 64 * 64));
        if (!xp) {
            free(xq), free(d), free(gsum);
            return -1;
        }
        float *dv = malloc(sizeof(float) * (size_t)(m * k / 4));
        if (!dv) {
            free(xp), free(xq), free(d), free(gsum);
            return -1;
        }
        for (int64_t i = 0; i < m; i++) {
            permute_segments(xq + i * k, k, xp + i * k);
            segment_scales(d + i * blocks, k, dv + i * k / 4);
        }
        quad_rows(0, w, sz, n, k, g, m, xp, dv, k / 4, gsum, y, y_bf16);
        free(dv), free(xp), free(xq), free(d), free(gsum);
        return 0;
    }
#endif
    int seg = 0; /* many rows, groups of 128k: the direct path's order (unpack_rows) */
#if defined(Q4_DIRECT) && !defined(Q4_NO_DIRECT)
    if (g % 128 == 0) {
        int8_t *t = aligned_alloc(64, (size_t)((m * k + 127) / 64 * 64));
        if (!t) {
            free(xq), free(d), free(gsum);
            return -1;
        }
        for (int64_t i = 0; i < m; i++) permute_segments(xq + i * k, k, t + i * k);
        free(xq);
        xq = t;
        for (int64_t b = 0; b + 3 < m * blocks; b += 4) { /* block scales as blocks 0, 2, 1, 3 */
            float s1 = d[b + 1];
            d[b + 1] = d[b + 2], d[b + 2] = s1;
        }
        seg = 1;
    }
#endif
#pragma omp parallel if (m * n * k > 262144 && outermost())
    {
        uint8_t *wb = aligned_alloc(64, (size_t)(ROWS * k));
        float *ws = g == 32 ? malloc(sizeof(float) * (size_t)(ROWS * k / 4)) : NULL;
        if (!wb || (g == 32 && !ws)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t qi = 0; qi < quads; qi++) {
            if (!wb || (g == 32 && !ws)) continue;
            int64_t r0 = qi * ROWS;
            int nr = n - r0 < ROWS ? (int)(n - r0) : ROWS;
            const float *szr = sz + r0 * 2 * groups;  /* [nr][2][groups] */
            unpack_rows(w + r0 * (k / 2), k / 2, k, nr, wb, szr, 2 * groups, g, ws, seg);
            for (int64_t i = 0; i < m; i++) {
                float acc[ROWS];
                if (nr == ROWS)
                    rows_dot(wb, ws, szr, 2 * groups, k, g, ROWS, xq + i * k, d + i * blocks, acc);
                else
                    rows_dot(wb, ws, szr, 2 * groups, k, g, nr, xq + i * k, d + i * blocks, acc);
                for (int r = 0; r < nr; r++)
                    store_row_out(y, y_bf16, i * n + r0 + r, acc[r], szr + r * 2 * groups,
                                  gsum + i * groups, groups);
            }
        }
        free(wb);
        free(ws);
    }
    if (failed) {
        free(xq), free(d), free(gsum);
        return -1;
    }
    free(xq), free(d), free(gsum);
    return 0;
#endif
}

/* One token through its top-k experts (a decode step at batch 1), in one call instead of a
 * dozen operators: per expert e = ids[j], h_j = silu(gate) * up of x @ gate_up[e].T, then
 * out = sum_j w_j * (h_j @ down[e].T). Rounded as the operator path rounds it: x, the gate|up
 * and down outputs and the activation in bf16, the weighted sum in fp32, out in x's dtype.
 * Returns 0, -1 when out of memory, -2 for an expert id outside [0, experts). */
int thr_q4_moe_one(const void *x, int x_bf16, const void *tw, int tw_bf16, const int64_t *ids,
                   int64_t k, int64_t experts, int64_t h, int64_t inter,
                   const uint8_t *const *gu_w, const float *const *gu_sz, int64_t gu_g,
                   const uint8_t *const *dn_w, const float *const *dn_sz, int64_t dn_g,
                   void *out) {
    for (int64_t j = 0; j < k; j++)
        if (ids[j] < 0 || ids[j] >= experts) return -2;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)h);
    uint16_t *gu = malloc(sizeof(uint16_t) * (size_t)(k * 2 * inter));
    uint16_t *act = malloc(sizeof(uint16_t) * (size_t)(k * inter));
    uint16_t *dn = malloc(sizeof(uint16_t) * (size_t)(k * h));
    int rc = (xb && gu && act && dn) ? 0 : -1;
    for (int64_t i = 0; !rc && i < h; i++)
        xb[i] = x_bf16 ? ((const uint16_t *)x)[i] : f32_to_bf16(((const float *)x)[i]);
    for (int64_t j = 0; !rc && j < k; j++)
        rc = thr_q4_matmul(xb, 1, 1, h, gu_w[ids[j]], gu_sz[ids[j]], 2 * inter, gu_g,
                           gu + j * 2 * inter, 1);
    for (int64_t j = 0; !rc && j < k; j++)
        for (int64_t i = 0; i < inter; i++) {
            float g = bf16_to_f32(gu[j * 2 * inter + i]);
            float u = bf16_to_f32(gu[j * 2 * inter + inter + i]);
            act[j * inter + i] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
        }
    for (int64_t j = 0; !rc && j < k; j++)
        rc = thr_q4_matmul(act + j * inter, 1, 1, inter, dn_w[ids[j]], dn_sz[ids[j]], h, dn_g,
                           dn + j * h, 1);
    for (int64_t i = 0; !rc && i < h; i++) {
        float y = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            float w = tw_bf16 ? bf16_to_f32(((const uint16_t *)tw)[j]) : ((const float *)tw)[j];
            y += w * bf16_to_f32(dn[j * h + i]);
        }
        if (x_bf16)
            ((uint16_t *)out)[i] = f32_to_bf16(y);
        else
            ((float *)out)[i] = y;
    }
    free(xb), free(gu), free(act), free(dn);
    return rc;
}

/* y [m, n] = x [m, k] @ W.T for 8-bit codes q [n, k] (a byte each, row-major): W = s * (q - z)
 * per group of g inputs, scales as thr_q4_matmul's ([n, 2, k / g]: s, then s * z), activations
 * rounded to int8 per block of 32 as there. Returns 0, -1 when out of memory, -2 for a shape it
 * does not hold (k a multiple of 64; g 32 or a multiple of 64 dividing k). */
int thr_q8_matmul(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w,
                  const float *sz, int64_t n, int64_t g, void *y, int y_bf16) {
    if (k % 64 || g <= 0 || k % g || (g != 32 && g % 64)) return -2;
    int8_t *xq;
    float *d, *gsum;
    if (quantize_rows(x, x_bf16, m, k, g, &xq, &d, &gsum)) return -1;
    quad_rows(1, w, sz, n, k, g, m, xq, d, k / QBLOCK, gsum, y, y_bf16);
    free(xq), free(d), free(gsum);
    return 0;
}

#if defined(__AVX512BW__)
/* 32 codes (bytes) to bf16: q * s - m in fp32 (a product, then a difference: no fma, so the
 * scalar loop's bits), rounded to nearest even as f32_to_bf16 rounds a finite value */
static inline void dequant32(__m256i q, float s, float m, uint16_t *out) {
    __m512 sv = _mm512_set1_ps(s), mv = _mm512_set1_ps(m);
    for (int half = 0; half < 2; half++) {
        __m128i q16 = half ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
        __m512 w = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q16)), sv),
                                 mv);
        _mm256_storeu_si256((__m256i *)(out + 16 * half),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_hi(w), 16)));
    }
}
#endif

/* W [n, k] in bf16 from 4-bit codes in the layout above (bits 4) or 8-bit codes a byte each
 * (bits 8), scales as the matmuls': w = q * s - s * z in fp32, rounded once to bf16 (nearest
 * even). For many activation rows (a prefill) a bf16 matmul on AMX tiles runs several times the
 * integer kernels' multiply-adds a second, and this pass costs about what they spend on 8 rows
 * (cpu_q4.py). Returns 0, -2 for a shape the matmuls do not hold. */
int thr_q_dequant(const uint8_t *codes, int bits, const float *sz, int64_t n, int64_t k,
                  int64_t g, uint16_t *out) {
    if (k % 64 || g <= 0 || k % g || (g != 32 && g % 64) || (bits != 4 && bits != 8)) return -2;
    int64_t groups = k / g, row_bytes = bits == 4 ? k / 2 : k;
#pragma omp parallel for schedule(static) if (n * k >= 65536 && outermost())
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *c = codes + r * row_bytes;
        const float *s = sz + r * 2 * groups, *sz_r = s + groups;
        uint16_t *o = out + r * k;
        for (int64_t j = 0; j < k; j += 64) { /* 64 codes: two halves of 32, a group each */
            float s0 = s[j / g], m0 = sz_r[j / g], s1 = s[(j + 32) / g], m1 = sz_r[(j + 32) / g];
#if defined(__AVX512BW__)
            __m256i lo, hi;
            if (bits == 4) { /* one load: low nibbles are codes j.., high ones j + 32.. */
                __m256i b = _mm256_loadu_si256((const __m256i *)(c + j / 2));
                lo = _mm256_and_si256(b, _mm256_set1_epi8(15));
                hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15));
            } else {
                lo = _mm256_loadu_si256((const __m256i *)(c + j));
                hi = _mm256_loadu_si256((const __m256i *)(c + j + 32));
            }
            dequant32(lo, s0, m0, o + j);
            dequant32(hi, s1, m1, o + j + 32);
#else
            for (int i = 0; i < 32; i++) {
                int lo = bits == 4 ? c[j / 2 + i] & 15 : c[j + i];
                int hi = bits == 4 ? c[j / 2 + i] >> 4 : c[j + 32 + i];
                o[j + i] = f32_to_bf16((float)lo * s0 - m0);
                o[j + 32 + i] = f32_to_bf16((float)hi * s1 - m1);
            }
#endif
        }
    }
    return 0;
}
