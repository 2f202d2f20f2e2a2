/* NF4 matmuls for the one-call decode step (cpu_step.c): y [m, n] = x [m, k] @ W.T with W in
 * bitsandbytes' NF4 layout as thresher publishes it: codes row-major, two per byte (the first in
 * the high nibble), one absmax per block of bs codes (bf16 here, as bitsandbytes' CPU kernel
 * holds it), W = map[code] * absmax.
 *
 * Activations are rounded to bf16 and the absmax held in bf16, as bitsandbytes' CPU kernel on the
 * operator path holds them; each weight map[code] * absmax and the sums are fp32; y is not
 * rounded (the caller rounds it to bf16, that kernel's output dtype). bitsandbytes' kernel sums
 * in lower precision: its outputs are off the fp64 product of the same bf16 inputs by 1.4x what
 * rounding them to bf16 costs, these by 1.0x. The 16 values of a block (map times its absmax) sit
 * in one register and each code indexes them (a permute); high nibbles are the even elements and
 * low nibbles the odd, multiplied by the activations split the same way, so no code moves. A
 * token's output is the same chain of fmas whatever its batch. Needs bs a multiple of 32
 * dividing k.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define NROWS 4 /* weight rows per pass: they share each activation load */
#define NTOK 4  /* activation rows per pass: they share each weight's decoding */
#ifndef NF4_PREFETCH
#define NF4_PREFETCH 4096 /* bytes ahead in each row: the rows are read in 16-byte steps */
#endif

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void tile(const uint8_t *codes, const uint16_t *amax,
                                                       int64_t k, int64_t bs, int nr, int nt,
                                                       const float *map, const float *xs,
                                                       float *out) {
    __m512 acc[NTOK][NROWS], table = _mm512_loadu_ps(map);
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) acc[t][r] = _mm512_setzero_ps();
    int64_t blocks = k / bs, half = k / 2;
    for (int64_t b = 0; b < blocks; b++) {
        __m512 tv[NROWS];
        for (int r = 0; r < nr; r++) {
            _mm_prefetch((const char *)(codes + r * half + b * bs / 2) + NF4_PREFETCH, _MM_HINT_T0);
            tv[r] = _mm512_mul_ps(table, _mm512_set1_ps(bf16_to_f32(amax[r * blocks + b])));
        }
        for (int64_t c = b * bs / 2; c < (b + 1) * bs / 2; c += 16) { /* 16 bytes: 32 codes */
            __m512 we[NROWS], wo[NROWS];
            for (int r = 0; r < nr; r++) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + r * half + c)));
                we[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tv[r]);
                wo[r] = _mm512_permutexvar_ps(v, tv[r]); /* the low 4 bits index */
            }
            for (int t = 0; t < nt; t++) {
                __m512 xe = _mm512_loadu_ps(xs + t * k + c), xo = _mm512_loadu_ps(xs + t * k + half + c);
                for (int r = 0; r < nr; r++)
                    acc[t][r] = _mm512_fmadd_ps(wo[r], xo, _mm512_fmadd_ps(we[r], xe, acc[t][r]));
            }
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) out[t * NROWS + r] = _mm512_reduce_add_ps(acc[t][r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* the value of each lane's code (its low 4 bits) from 16 in two registers */
static inline __m256 lookup(__m256i idx, __m256 lo, __m256 hi) {
    __m256 mask = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)); /* bit 3: the high eight */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                            mask);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) void tile(const uint8_t *codes, const uint16_t *amax,
                                                       int64_t k, int64_t bs, int nr, int nt,
                                                       const float *map, const float *xs,
                                                       float *out) {
    __m256 acc[NTOK][NROWS];
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) acc[t][r] = _mm256_setzero_ps();
    int64_t blocks = k / bs, half = k / 2;
    for (int64_t b = 0; b < blocks; b++) {
        __m256 lo[NROWS], hi[NROWS];
        for (int r = 0; r < nr; r++) {
            __m256 a = _mm256_set1_ps(bf16_to_f32(amax[r * blocks + b]));
            lo[r] = _mm256_mul_ps(_mm256_loadu_ps(map), a);
            hi[r] = _mm256_mul_ps(_mm256_loadu_ps(map + 8), a);
        }
        for (int64_t c = b * bs / 2; c < (b + 1) * bs / 2; c += 8) { /* 8 bytes: 16 codes */
            __m256 we[NROWS], wo[NROWS];
            for (int r = 0; r < nr; r++) {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + r * half + c)));
                we[r] = lookup(_mm256_srli_epi32(v, 4), lo[r], hi[r]);
                wo[r] = lookup(v, lo[r], hi[r]);
            }
            for (int t = 0; t < nt; t++) {
                __m256 xe = _mm256_loadu_ps(xs + t * k + c), xo = _mm256_loadu_ps(xs + t * k + half + c);
                for (int r = 0; r < nr; r++)
                    acc[t][r] = _mm256_fmadd_ps(wo[r], xo, _mm256_fmadd_ps(we[r], xe, acc[t][r]));
            }
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) out[t * NROWS + r] = hsum(acc[t][r]);
}
#else
#error "cpu_nf4.c needs AVX2 and FMA"
#endif

/* the tile with its shapes as constants, each its own function: with the three inlined into
 * one caller GCC merged them into one with the shapes as variables (and spills), at half speed */
#define TILE_ARGS const uint8_t *codes, const uint16_t *amax, int64_t k, int64_t bs, \
                  const float *map, const float *xs, float *out
static __attribute__((noinline)) void tile_rows_one(TILE_ARGS) {
    tile(codes, amax, k, bs, NROWS, 1, map, xs, out);
}
static __attribute__((noinline)) void tile_rows_tokens(TILE_ARGS) {
    tile(codes, amax, k, bs, NROWS, NTOK, map, xs, out);
}
static __attribute__((noinline)) void tile_any(TILE_ARGS, int nr, int nt) {
    tile(codes, amax, k, bs, nr, nt, map, xs, out);
}

/* y [m, n] = x [m, k] @ W.T for the NF4 W above; x and y fp32. Returns 0, -1 when out of memory,
 * -2 when bs is not a multiple of 32 dividing k. */
int thr_nf4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes,
                   const uint16_t *absmax, const float *map, int64_t bs, int64_t n, float *y) {
    if (bs <= 0 || bs % 32 || k % bs) return -2;
    int64_t half = k / 2;
    float *xs = malloc(sizeof(float) * (size_t)(m * k)); /* per row: bf16 evens, then odds */
    if (!xs) return -1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < k; j++)
            xs[i * k + (j % 2) * half + j / 2] = bf16_to_f32(f32_to_bf16(x[i * k + j]));
    int64_t blocks = (n + NROWS - 1) / NROWS;
#pragma omp parallel for schedule(static) if (n * k >= 65536 && outermost())
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r0 = b * NROWS;
        int nr = n - r0 < NROWS ? (int)(n - r0) : NROWS;
        const uint8_t *cb = codes + r0 * half;
        const uint16_t *ab = absmax + r0 * (k / bs);
        for (int64_t i = 0; i < m; i += NTOK) {
            int nt = m - i < NTOK ? (int)(m - i) : NTOK;
            float acc[NTOK * NROWS];
            if (nr == NROWS && nt == 1) /* decode at c=1 */
                tile_rows_one(cb, ab, k, bs, map, xs + i * k, acc);
            else if (nr == NROWS && nt == NTOK)
                tile_rows_tokens(cb, ab, k, bs, map, xs + i * k, acc);
            else
                tile_any(cb, ab, k, bs, map, xs + i * k, acc, nr, nt);
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < nr; r++) y[(i + t) * n + r0 + r] = acc[t * NROWS + r];
        }
    }
    free(xs);
    return 0;
}

/* W [n, k] from the published NF4 codes above, absmax fp32 [n, k / bs]: w = map[code] * absmax
 * in fp32, rounded once to bf16 (nearest even) with bf16 set, the bits bitsandbytes'
 * dequantize_4bit to bf16 gives, else kept in fp32 (the dequantizing reference's bits). A prefill
 * multiplies many rows by W, where a bf16 matmul on AMX tiles runs far ahead of any gemv (and,
 * where bitsandbytes has no CPU kernel, an fp32 matmul far ahead of the reference, which rebuilds
 * W from int64 codes each call): this pass writes W into a buffer the caller reuses (cpu_nf4.py).
 * With AVX-512 the 16 values of a block sit in one register as in the matmul, even codes (high
 * nibbles) and odd ones are looked up apart, then put back in order: in bf16 each pair's halves
 * meet in one 32-bit lane, so 32 weights are one store; in fp32 two interleaving permutes.
 * Returns 0, -2 when bs is not a multiple of 32 dividing k. */
int thr_nf4_dequant(const uint8_t *codes, const float *absmax, const float *map, int64_t bs,
                    int64_t n, int64_t k, void *out, int bf16) {
    if (bs <= 0 || bs % 32 || k % bs) return -2;
    int64_t blocks = k / bs, half = k / 2;
#pragma omp parallel for schedule(static) if (n * k >= 65536 && outermost())
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *c = codes + r * half;
        uint16_t *o = (uint16_t *)out + r * k;
        float *of = (float *)out + r * k;
        for (int64_t b = 0; b < blocks; b++) {
            float a = absmax[r * blocks + b];
#if defined(__AVX512BW__)
            __m512 table = _mm512_mul_ps(_mm512_loadu_ps(map), _mm512_set1_ps(a));
            const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
            for (int64_t j = b * bs / 2; j < (b + 1) * bs / 2; j += 16) { /* 32 codes */
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + j)));
                __m512 we = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
                __m512 wo = _mm512_permutexvar_ps(v, table);
                if (!bf16) {
                    _mm512_storeu_ps(of + 2 * j, _mm512_permutex2var_ps(we, lo, wo));
                    _mm512_storeu_ps(of + 2 * j + 16, _mm512_permutex2var_ps(we, hi, wo));
                    continue;
                }
                __m512i pair = _mm512_or_si512(_mm512_srli_epi32(round_bf16_hi(we), 16),
                                               _mm512_and_si512(round_bf16_hi(wo),
                                                                _mm512_set1_epi32((int)0xffff0000u)));
                _mm512_storeu_si512((void *)(o + 2 * j), pair);
            }
#else
            for (int64_t j = b * bs / 2; j < (b + 1) * bs / 2; j++) {
                float e = map[c[j] >> 4] * a, d = map[c[j] & 15] * a;
                if (bf16) {
                    o[2 * j] = f32_to_bf16(e);
                    o[2 * j + 1] = f32_to_bf16(d);
                } else {
                    of[2 * j] = e;
                    of[2 * j + 1] = d;
                }
            }
#endif
        }
    }
    return 0;
}
