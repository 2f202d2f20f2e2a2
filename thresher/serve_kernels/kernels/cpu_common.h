/* What thresher's C kernels share: bf16 <-> fp32, an 8-lane horizontal sum, when to open a
 * parallel region, how a thread groups its weight rows. */
#ifndef THRESHER_CPU_COMMON_H
#define THRESHER_CPU_COMMON_H

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Whether a kernel may open its own parallel region: only outside every region, active or not.
 * Inside a region that runs on one thread (its if clause false) libgomp starts a nested team
 * with new threads for each inner region, 100+ microseconds each, where at the outermost level
 * it reuses its pool. */
static inline int outermost(void) { return omp_get_level() == 0; }

/* Group q of the weight rows [lo, hi) a thread reads `nr` at a time: its first row (*r0), the
 * distance between its rows (*step) and its row count, 0 past the last group. spread 0: groups
 * of neighbouring rows. spread 1: `nr` streams, equal runs of rows each read front to back, a
 * group taking the next row of each (the rest, fewer than nr rows, one last group). Where a
 * core's hardware prefetchers keep few misses in flight within a page (AMD Zen 3), four
 * neighbouring rows of 2-4 KB fill one or two pages at a time and read at half the speed of
 * four streams (cpu_gemv.py). A row's sum does not depend on the rows sharing its group. */
static inline int row_group(int64_t lo, int64_t hi, int nr, int spread, int64_t q, int64_t *r0,
                            int64_t *step) {
    int64_t len = spread ? (hi - lo) / nr : 0;
    *step = q < len ? len : 1;
    *r0 = q < len ? lo + q : lo + nr * len + (spread ? 0 : q * nr);
    if (q < len) return nr;
    if (spread && q > len) return 0;
    return *r0 >= hi ? 0 : (hi - *r0 < nr ? (int)(hi - *r0) : nr);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even; NaN stays NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* element i of an fp32 or bf16 array, as fp32 */
static inline float load_f(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* store f as element i of an fp32 or bf16 array; returns the value stored, as fp32 */
static inline float store_f(void *p, int64_t i, float f, int bf16) {
    if (!bf16) {
        ((float *)p)[i] = f;
        return f;
    }
    uint16_t h = f32_to_bf16(f);
    ((uint16_t *)p)[i] = h;
    return bf16_to_f32(h);
}

#if defined(__AVX512F__)
/* 16 finite fp32 values rounded to bf16 (nearest even, as f32_to_bf16): the bf16 bits are the
 * high half of each lane of the result */
static inline __m512i round_bf16_hi(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                 _mm512_set1_epi32(1))));
}
#endif

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
