/* A whole CPU decode step in one call: every decoder layer (pre-norm RMSNorm; rotary GQA over the
 * paged KV cache, with sinks and a sliding window (gpt-oss), or multi-head latent attention over a
 * latent cache (DeepSeek-V3); SwiGLU MLP or top-k MoE with an optional shared expert, softmax
 * routing, a rule with sigmoid scores, a selection bias and expert groups, or gpt-oss's top-k
 * softmax and clamped experts; Qwen3.5's gated attention and Gated DeltaNet with per-sequence
 * states), for T new tokens that each continue one sequence.
 *
 * The operator path pays Python and torch dispatch around each of a layer's dozen operations;
 * that host cost stays fixed when memory gets faster. Here the model is a table of pointers
 * prepared once (cpu_step.py) and one ctypes call runs all layers; OpenMP threads run inside the
 * matmuls (thr_dense_matmul below, on AMX tiles where there are any; thr_q4_matmul,
 * thr_q8_matmul, thr_nf4_matmul) and the attention (thr_paged_decode).
 *
 * Activations live in fp32 buffers whose values are rounded to the serving dtype (bf16 or fp32)
 * where the operator path rounds them, so the two paths agree to the order of fp32 sums: the
 * norms' outputs and residual sums, every linear's output, q/k norms and each rotary product,
 * the cache rows, attention, the router logits and weights, the SiLU product, the weighted sum
 * of the experts (4-bit experts in bf16 whatever the serving dtype, as cpu_q4's expert path and
 * bitsandbytes' NF4 kernel compute them).
 */
#define _GNU_SOURCE /* syscall: asking Linux for the AMX tiles */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

int thr_q4_matmul(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w,
                  const float *sz, int64_t n, int64_t g, void *y, int y_bf16);
int thr_q8_matmul(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *w,
                  const float *sz, int64_t n, int64_t g, void *y, int y_bf16);
int thr_nf4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *codes,
                   const uint16_t *absmax, const float *map, int64_t bs, int64_t n, float *y);
int thr_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                     const int32_t *block_tables, int64_t table_stride,
                     const int32_t *context_lens, int64_t batch, int64_t hq, int64_t hkv,
                     int64_t d, int64_t block_size, float scale, void *out, int bf16);
int thr_paged_decode_sinks(const void *q, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_stride,
                           const int32_t *context_lens, int64_t batch, int64_t hq, int64_t hkv,
                           int64_t d, int64_t block_size, float scale, const float *sinks,
                           int64_t window, void *out, int bf16);

enum { LIN_NONE = 0, LIN_F32 = 1, LIN_BF16 = 2, LIN_Q4 = 3, LIN_NF4 = 4, LIN_Q8 = 5 };

typedef struct {
    int32_t kind, pad;
    int64_t n, k, group;  /* out, in features; q4 / q8 group size, NF4 block size */
    const void *w;        /* dense [n, k] row-major, cpu_q4's packed codes, 8-bit codes [n, k],
                           * or NF4 codes */
    const void *sz;       /* q4, q8: fp32 scales and scales * zeros; NF4: bf16 absmax */
    const float *bias;    /* fp32 [n] or NULL */
    const float *map;     /* NF4: the 16 code values */
} thr_linear;

typedef struct {
    thr_linear qkv, o;
    const float *in_norm, *post_norm; /* fp32 [hidden] */
    const float *q_norm, *k_norm;     /* fp32, [d] per head or the full width; NULL: none */
    int32_t qk_norm_full, pad;
    float clip, pad2;                 /* clip_qkv (0: none) */
    int64_t rotary_dim;
    void *k_cache, *v_cache;          /* [blocks, block_size, hkv, d], serving dtype */
    int32_t moe, top_k, experts, renorm, expert_bf16, pad3;
    thr_linear router;
    const thr_linear *gate_up, *down; /* [experts], or one (a dense MLP) */
    thr_linear shared_gate_up, shared_down, shared_gate; /* kind LIN_NONE where absent */
    int32_t interleave; /* rotary over channel pairs (0, 1), (2, 3), ...: de-interleaved first */
    /* a routing rule (rule 1; GLM-4.5, DeepSeek-V3, ERNIE-4.5): logits in fp32, scores by sigmoid
     * (else softmax), experts selected on scores + correction within the topk_group best of
     * n_group groups, gated by the scores, renormalized if renorm, times scaling */
    int32_t rule, sigmoid, n_group, topk_group;
    float scaling;
    const float *correction; /* fp32 [experts] or NULL */
    /* latent attention (mla 1; DeepSeek-V3, Kimi-K2): qkv is the down projection q_a | kv_a */
    int32_t mla, pad4;
    int64_t heads, q_rank, nope, rank, v_dim;
    float att_scale, pad5;
    thr_linear q_b;                  /* q_b_proj (q_rank > 0), else the full query projection */
    const float *q_a_norm, *kv_a_norm; /* fp32 [q_rank], [rank] */
    const void *w_kb_t, *w_vb;       /* [heads, rank, nope], [heads, v_dim, rank]: serving dtype */
    /* gpt-oss: attention with a sink logit per head (fp32 [hq]) and a window (0: none); the
     * router's top-k logits softmaxed (topk_softmax); experts as separate gate and up linears
     * with gate_up holding the gates, biases, and the clamped SwiGLU (alpha, limit) */
    const float *sinks;
    int64_t window;
    int32_t topk_softmax, clamped;
    float alpha, limit;
    const thr_linear *up; /* also NF4 experts (gate and up apart, not clamped) */
    /* Qwen3.5: gated full attention (q_proj emits each head's query, then its output gate), or
     * a Gated DeltaNet (delta 1): qkv is in_proj_qkv, o is out_proj, per-sequence states */
    int32_t gated, delta;
    int64_t nk, nv, dk, dv, taps;    /* key heads, value heads, their dims, the conv's taps */
    float delta_eps, pad6;
    thr_linear in_z, in_b, in_a;
    const void *conv_w;              /* [channels, taps], serving dtype */
    const float *neg_a, *dt_bias;    /* fp32 [nv]: -exp(A_log), dt_bias */
    const float *delta_norm;         /* fp32 [dv]: the output's RMSNorm per value head */
    void *conv_state;                /* [slots, channels, taps - 1], serving dtype */
    float *delta_state;              /* [slots, nv, dk, dv], fp32 */
} thr_layer;

typedef struct {
    int64_t layers, hidden, hq, hkv, d, block_size, max_inter;
    int64_t qkv_max, att_max; /* widest q|k|v (or down) projection, widest per-token attention */
    float eps, scale;
    int32_t bf16, pad;
    const void *embed;       /* [vocab, hidden], serving dtype */
    const float *final_norm; /* fp32 [hidden] */
    const float *cos_sin;    /* fp32 [positions, rotary_dim]: cos | sin */
    const thr_layer *layer;
    thr_linear lm_head; /* kind LIN_NONE: the LM head stays on torch */
} thr_model;

static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static void round_all(float *p, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) p[i] = bf16_to_f32(f32_to_bf16(p[i]));
}

/* ---- dense matmul: y [m, n] = x [m, k] @ W.T, W fp32 or bf16, x and y fp32 ---- */

#ifndef DROWS
#define DROWS 4 /* weight rows per step: they share each activation load */
#endif
#ifndef DPREFETCH
#define DPREFETCH 2048
#endif

#if defined(__AVX512F__)
#define DENSE_ISA "avx512"
#define VW 16
/* Several activation rows (a decode batch): TOKENS rows x DROWS weight rows per pass, each weight
 * vector loaded and widened once for all the rows, out [TOKENS][DROWS]. Weights in bf16 (x split
 * into even and odd elements, `half` floats apart, rows `xstride` apart) or fp32.
 *
 * Every activation row gets the same sequence of roundings whatever the batch (one row or many,
 * and bf16-exact rows as vdpbf16ps's tile_dp adds them: odd product, then even), so a token's
 * output does not depend on what it is batched with: a speculative verify chunk (1 + k tokens)
 * computes the logits plain decoding would, bit for bit. */
#define TOKENS 4
static inline __attribute__((always_inline)) void tile(const void *w, int wbf16, int64_t k, int nr,
                                                       int nt, const float *x, int64_t xstride,
                                                       int64_t half, float *out) {
    __m512 acc[TOKENS][DROWS];
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) acc[t][r] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    int64_t c = 0;
    if (wbf16) {
        const uint16_t *wb = (const uint16_t *)w;
        for (; c + 32 <= k; c += 32) {
            __m512 we[DROWS], wo[DROWS];
            for (int r = 0; r < nr; r++) {
                _mm_prefetch((const char *)(wb + r * k + c) + DPREFETCH, _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512((const void *)(wb + r * k + c));
                we[r] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                wo[r] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
            }
            for (int t = 0; t < nt; t++) {
                __m512 xe = _mm512_loadu_ps(x + t * xstride + c / 2);
                __m512 xo = _mm512_loadu_ps(x + t * xstride + half + c / 2);
                for (int r = 0; r < nr; r++) /* the odd product first, as vdpbf16ps adds */
                    acc[t][r] = _mm512_fmadd_ps(we[r], xe, _mm512_fmadd_ps(wo[r], xo, acc[t][r]));
            }
        }
    } else {
        const float *wf = (const float *)w;
        for (; c + 16 <= k; c += 16) {
            __m512 wv[DROWS];
            for (int r = 0; r < nr; r++) {
                _mm_prefetch((const char *)(wf + r * k + c) + DPREFETCH, _MM_HINT_T0);
                wv[r] = _mm512_loadu_ps(wf + r * k + c);
            }
            for (int t = 0; t < nt; t++) {
                __m512 xv = _mm512_loadu_ps(x + t * xstride + c);
                for (int r = 0; r < nr; r++) acc[t][r] = _mm512_fmadd_ps(wv[r], xv, acc[t][r]);
            }
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) {
            float s = _mm512_reduce_add_ps(acc[t][r]);
            for (int64_t i = c; i < k; i++)
                s += (wbf16 ? (i % 2 ? x[t * xstride + half + i / 2] : x[t * xstride + i / 2])
                            : x[t * xstride + i]) * load_f(w, r * k + i, wbf16);
            out[t * DROWS + r] = s;
        }
}
#define HAVE_TILE 1

#if defined(__AVX512BF16__)
#define HAVE_DP 1
/* bf16 weights times bf16-exact activations on vdpbf16ps: products exact, sums in fp32 as the
 * fma chain's. xb: the activations' bf16 bits, rows k apart. */
static inline __attribute__((always_inline)) void tile_dp(const uint16_t *w, int64_t k, int nr,
                                                          int nt, const uint16_t *xb, float *out) {
    __m512 acc[TOKENS][DROWS];
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) acc[t][r] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 32 <= k; c += 32) {
        __m512i wv[DROWS];
        for (int r = 0; r < nr; r++) {
            _mm_prefetch((const char *)(w + r * k + c) + DPREFETCH, _MM_HINT_T0);
            wv[r] = _mm512_loadu_si512((const void *)(w + r * k + c));
        }
        for (int t = 0; t < nt; t++) {
            __m512i xv = _mm512_loadu_si512((const void *)(xb + t * k + c));
            for (int r = 0; r < nr; r++)
                acc[t][r] = _mm512_dpbf16_ps(acc[t][r], (__m512bh)wv[r], (__m512bh)xv);
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) {
            float s = _mm512_reduce_add_ps(acc[t][r]);
            for (int64_t i = c; i < k; i++)
                s += bf16_to_f32(xb[t * k + i]) * bf16_to_f32(w[r * k + i]);
            out[t * DROWS + r] = s;
        }
}
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define DENSE_ISA "avx2"
#define VW 8
static float dot_tail(const float *x, const void *w, int wbf16, int64_t from, int64_t k) {
    float s = 0.0f;
    for (int64_t i = from; i < k; i++) s += x[i] * load_f(w, i, wbf16);
    return s;
}

/* bf16 rows: a 32-byte load is 16 weights; as 8 int32 lanes, the low halves (<< 16) are the
 * even weights and the high halves (masked) the odd ones, multiplied by x split the same way.
 * Row r at w + r * stride. Every row of a batch goes through here, so a row's output does not
 * depend on its batch. */
static void rows_bf16(const uint16_t *w, int64_t stride, int64_t k, int nr, const float *xe,
                      const float *xo, float *out) {
    __m256 acc[2 * DROWS];
    for (int r = 0; r < 2 * nr; r++) acc[r] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
        __m256 ve = _mm256_loadu_ps(xe + c / 2), vo = _mm256_loadu_ps(xo + c / 2);
        for (int r = 0; r < nr; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + r * stride + c));
            acc[2 * r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), ve,
                                         acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), vo,
                                             acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float s = hsum8(_mm256_add_ps(acc[2 * r], acc[2 * r + 1]));
        for (int64_t i = c; i < k; i++)
            s += (i % 2 ? xo[i / 2] : xe[i / 2]) * bf16_to_f32(w[r * stride + i]);
        out[r] = s;
    }
}

static void rows_f32(const float *w, int64_t stride, int64_t k, int nr, const float *x,
                     float *out) {
    __m256 acc[DROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= k; c += 8) {
        __m256 xv = _mm256_loadu_ps(x + c);
        for (int r = 0; r < nr; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * stride + c), xv, acc[r]);
    }
    for (int r = 0; r < nr; r++) out[r] = hsum8(acc[r]) + dot_tail(x, w + r * stride, 0, c, k);
}
#else
#error "cpu_step.c needs AVX2 and FMA"
#endif

const char *thr_dense_isa(void) {
#ifdef HAVE_DP
    return DENSE_ISA "+bf16";
#else
    return DENSE_ISA;
#endif
}

#ifdef HAVE_DP
static int dense_dp(const float *x, int64_t k, const uint16_t *w, int64_t n, float *y) {
    int64_t m = 1;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(m * k));
    if (!xb) return -1;
    for (int64_t i = 0; i < m * k; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        xb[i] = (uint16_t)(u >> 16);
    }
    int64_t blocks = (n + DROWS - 1) / DROWS;
#pragma omp parallel for schedule(static) if (n * k >= 65536 && outermost())
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r0 = b * DROWS;
        int nr = n - r0 < DROWS ? (int)(n - r0) : DROWS;
        float acc[TOKENS * DROWS];
        if (nr == DROWS)
            tile_dp(w + r0 * k, k, DROWS, 1, xb, acc);
        else
            tile_dp(w + r0 * k, k, nr, 1, xb, acc);
        for (int r = 0; r < nr; r++) y[r0 + r] = acc[r];
    }
    free(xb);
    return 0;
}
#endif

/* Each row of x [m, k] as its even elements, then its odd ones ((k + 1) / 2 floats each), as a
 * bf16 matrix's widened halves meet them; NULL when out of memory. */
static float *split_even_odd(const float *x, int64_t m, int64_t k) {
    int64_t half = (k + 1) / 2;
    float *xs = malloc(sizeof(float) * (size_t)(m * 2 * half));
    if (xs)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < k; j++)
                xs[i * 2 * half + (j % 2) * half + j / 2] = x[i * k + j];
    return xs;
}

/* y [m, n] (rows ystride apart) = x [m, k] @ W.T on the vector units */
#ifdef HAVE_TILE
static int dense_rows(const float *x, int64_t m, int64_t k, const void *w, int wbf16, int64_t n,
                      float *y, int64_t ystride) {
    float *xs = NULL; /* bf16 weights: x's even and odd elements, per row */
    if (wbf16 && !(xs = split_even_odd(x, m, k))) return -1;
    int64_t blocks = (n + DROWS - 1) / DROWS, half = (k + 1) / 2;
#pragma omp parallel for schedule(static) if (n * k >= 65536 && outermost())
    for (int64_t b = 0; b < blocks; b++) {
        int64_t r0 = b * DROWS;
        int nr = n - r0 < DROWS ? (int)(n - r0) : DROWS;
        for (int64_t i = 0; i < m; i += TOKENS) { /* each weight vector widened once for the rows */
            int nt = m - i < TOKENS ? (int)(m - i) : TOKENS;
            const float *xi = wbf16 ? xs + i * 2 * half : x + i * k;
            int64_t xstride = wbf16 ? 2 * half : k;
            float acc[TOKENS * DROWS];
            if (nt == TOKENS && nr == DROWS)
                tile((const char *)w + r0 * k * (wbf16 ? 2 : 4), wbf16, k, DROWS, TOKENS, xi,
                     xstride, half, acc);
            else if (nt == 1 && nr == DROWS) /* one row (decode at c=1): its own unrolled copy */
                tile((const char *)w + r0 * k * (wbf16 ? 2 : 4), wbf16, k, DROWS, 1, xi,
                     xstride, half, acc);
            else
                tile((const char *)w + r0 * k * (wbf16 ? 2 : 4), wbf16, k, nr, nt, xi, xstride,
                     half, acc);
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < nr; r++) y[(i + t) * ystride + r0 + r] = acc[t * DROWS + r];
        }
    }
    free(xs);
    return 0;
}
#else
/* The AVX2 path: each thread's rows as DROWS streams (row_group): on an AMD EPYC (Zen 3) four
 * neighbouring rows read 11-12 GB/s per core with a 2 KB software prefetch, four streams 20-24. */
static int dense_rows(const float *x, int64_t m, int64_t k, const void *w, int wbf16, int64_t n,
                      float *y, int64_t ystride) {
    float *xs = NULL; /* bf16 weights: x's even and odd elements, per row */
    int64_t half = (k + 1) / 2, size = wbf16 ? 2 : 4;
    if (wbf16 && !(xs = split_even_odd(x, m, k))) return -1;
#pragma omp parallel if (n * k >= 65536 && outermost())
    {
        int64_t threads = omp_get_num_threads(), id = omp_get_thread_num(), r0, stride;
        int64_t lo = n * id / threads, hi = n * (id + 1) / threads;
        int nr;
        for (int64_t g = 0; (nr = row_group(lo, hi, DROWS, 1, g, &r0, &stride)); g++) {
            const char *wr = (const char *)w + r0 * k * size;
            for (int64_t i = 0; i < m; i++) {
                float acc[DROWS];
                if (wbf16 && nr == DROWS)
                    rows_bf16((const uint16_t *)wr, stride * k, k, DROWS, xs + i * 2 * half,
                              xs + i * 2 * half + half, acc);
                else if (wbf16)
                    rows_bf16((const uint16_t *)wr, stride * k, k, nr, xs + i * 2 * half,
                              xs + i * 2 * half + half, acc);
                else
                    rows_f32((const float *)wr, stride * k, k, nr, x + i * k, acc);
                for (int r = 0; r < nr; r++) y[i * ystride + r0 + r * stride] = acc[r];
            }
        }
    }
    free(xs);
    return 0;
}
#endif

static int bf16_exact(const float *x, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        if (u & 0xffffu) return 0;
    }
    return 1;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_ROWS 16 /* weight rows per tile, and tokens per activation tile */
#define AMX_K 32    /* bf16 values per tile row */

/* Linux lends a process the tile registers only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); 1 granted, -1 refused or switched off (thr_amx), 0 not asked yet */
static int amx_state;

/* want 1: use the tiles where permitted, 0: don't, -1: leave as is; returns whether they are used */
int thr_amx(int want) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_RELAXED);
    if (want == 0) s = -1;
    if ((want == 1 && s <= 0) || (want < 0 && s == 0))
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    __atomic_store_n(&amx_state, s, __ATOMIC_RELAXED);
    return s > 0;
}

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tiles 0-1: sums, 2-3: weights, 4: activations; 16 rows of 64 bytes each. A static: GCC 12's
 * _tile_loadconfig tells the compiler it reads 8 bytes, so the stores filling a config on the
 * stack can be dropped as dead (docs/gguf.md: llama.cpp's AMX crash) */
static const amx_config AMX_TILES = {.palette = 1,
                                     .colsb = {64, 64, 64, 64, 64},
                                     .rows = {AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS, AMX_ROWS}};

/* Batches of bf16-exact rows on the matrix units (AMX): y.T = W @ x.T, so 16 weight rows load
 * straight from the row-major matrix as the A tile and the activations, repacked once per call
 * into pairs of k (the B tile's layout), are the B tile, 16 tokens wide (zeros past m). Every
 * output is the same chain of tile products whatever the batch, so a row's bits do not depend
 * on it; rows past the last whole 16 take the vector path, which does not either. */
static int dense_amx(const float *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                     float *y) {
    int64_t kbs = k / AMX_K, tbs = (m + AMX_ROWS - 1) / AMX_ROWS, full = n / AMX_ROWS * AMX_ROWS;
    uint16_t *xp = aligned_alloc(64, sizeof(uint16_t) * (size_t)(tbs * kbs * AMX_ROWS * AMX_K));
    if (!xp) return -1;
    for (int64_t tb = 0; tb < tbs; tb++) /* [tb][kb][k pair][token][2] */
        for (int64_t kb = 0; kb < kbs; kb++) {
            uint16_t *dst = xp + (tb * kbs + kb) * AMX_ROWS * AMX_K;
            for (int64_t p = 0; p < AMX_K / 2; p++)
                for (int64_t t = 0; t < AMX_ROWS; t++)
                    for (int j = 0; j < 2; j++) {
                        int64_t tok = tb * AMX_ROWS + t;
                        uint32_t u = 0;
                        if (tok < m) memcpy(&u, x + tok * k + kb * AMX_K + 2 * p + j, 4);
                        dst[p * 2 * AMX_ROWS + 2 * t + j] = (uint16_t)(u >> 16);
                    }
        }
    int64_t blocks = (full + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS); /* two weight tiles per block */
#pragma omp parallel if (full * k >= 65536 && outermost())
    {
        _tile_loadconfig(&AMX_TILES);
        float out[2][AMX_ROWS][AMX_ROWS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r0 = b * 2 * AMX_ROWS;
            int two = r0 + 2 * AMX_ROWS <= full;
            const uint16_t *w0 = w + r0 * k, *w1 = w0 + AMX_ROWS * k;
            for (int64_t tb = 0; tb < tbs; tb++) {
                const uint16_t *xb = xp + tb * kbs * AMX_ROWS * AMX_K;
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t kb = 0; kb < kbs; kb++) {
                    _tile_loadd(4, xb + kb * AMX_ROWS * AMX_K, 64);
                    _tile_loadd(2, w0 + kb * AMX_K, k * 2);
                    _tile_dpbf16ps(0, 2, 4);
                    if (two) {
                        _tile_loadd(3, w1 + kb * AMX_K, k * 2);
                        _tile_dpbf16ps(1, 3, 4);
                    }
                }
                _tile_stored(0, out[0], 64);
                _tile_stored(1, out[1], 64);
                int64_t nt = m - tb * AMX_ROWS < AMX_ROWS ? m - tb * AMX_ROWS : AMX_ROWS;
                for (int h = 0; h < 1 + two; h++)
                    for (int64_t t = 0; t < nt; t++)
                        for (int r = 0; r < AMX_ROWS; r++)
                            y[(tb * AMX_ROWS + t) * n + r0 + h * AMX_ROWS + r] = out[h][r][t];
            }
        }
        _tile_release();
    }
    free(xp);
    if (full == n) return 0;
#ifdef HAVE_DP
    if (m == 1) return dense_dp(x, k, w + full * k, n - full, y + full);
#endif
    return dense_rows(x, m, k, w + full * k, 1, n - full, y + full, n);
}
#else
int thr_amx(int want) { (void)want; return 0; }
#endif

/* y [m, n] = x [m, k] @ W.T for W fp32 or bf16 [n, k]; x and y fp32, y not rounded. bf16-exact
 * rows of a bf16 matrix (a bf16 model's decode) take the matrix units where there are any (one
 * row or many), else vdpbf16ps for one row; the rest take the widening tile. Returns 0, or -1
 * when out of memory. */
int thr_dense_matmul(const float *x, int64_t m, int64_t k, const void *w, int wbf16, int64_t n,
                     float *y) {
    if (wbf16 && bf16_exact(x, m * k)) {
#ifdef HAVE_AMX
        if (k % AMX_K == 0 && n >= AMX_ROWS && thr_amx(-1))
            return dense_amx(x, m, k, (const uint16_t *)w, n, y);
#endif
#ifdef HAVE_DP
        if (m == 1) return dense_dp(x, k, (const uint16_t *)w, n, y);
#endif
    }
    return dense_rows(x, m, k, w, wbf16, n, y, n);
}

/* ---- the layer's pieces ---- */

/* y [m, n] = x @ L.T (+ bias), rounded to the serving dtype as the operator path rounds it */
static int linear(const thr_linear *L, const float *x, int64_t m, float *y, int bf16) {
    int rc;
    if (L->kind == LIN_Q4 || L->kind == LIN_Q8) {
        rc = (L->kind == LIN_Q4 ? thr_q4_matmul : thr_q8_matmul)(
            x, 0, m, L->k, (const uint8_t *)L->w, (const float *)L->sz, L->n, L->group, y, 0);
        if (L->bias) round_all(y, m * L->n, bf16); /* the kernel's output, then + bias */
    } else if (L->kind == LIN_NF4) {
        rc = thr_nf4_matmul(x, m, L->k, (const uint8_t *)L->w, (const uint16_t *)L->sz, L->map,
                            L->group, L->n, y);
        round_all(y, m * L->n, 1); /* bitsandbytes' kernel returns bf16, then + bias */
    } else {
        rc = thr_dense_matmul(x, m, L->k, L->w, L->kind == LIN_BF16, L->n, y);
    }
    if (rc) return rc;
    if (L->bias)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < L->n; j++) y[i * L->n + j] += L->bias[j];
    round_all(y, m * L->n, bf16);
    return 0;
}

/* out = rms_norm(v) * w over rows of d, rounded; cpu_norm.c's arithmetic */
static void norm_rows(const float *v, const float *w, float *out, int64_t rows, int64_t d,
                      float eps, int bf16) {
    for (int64_t r = 0; r < rows; r++) {
        float part[16] = {0};
        for (int64_t i = 0; i < d; i++) part[i % 16] += v[r * d + i] * v[r * d + i];
        float ss = 0.0f;
        for (int j = 0; j < 16; j++) ss += part[j];
        float rstd = 1.0f / sqrtf(ss / (float)d + eps);
        for (int64_t i = 0; i < d; i++) out[r * d + i] = rnd(v[r * d + i] * rstd * w[i], bf16);
    }
}

/* res = round(x + res) (or x on the first layer), h = norm(res) */
static void add_norm(const float *x, float *res, int first, const float *w, float *h, int64_t t,
                     int64_t d, float eps, int bf16) {
    for (int64_t i = 0; i < t * d; i++) res[i] = first ? x[i] : rnd(x[i] + res[i], bf16);
    norm_rows(res, w, h, t, d, eps, bf16);
}

/* rotate `heads` heads of d at position pos over their first rd channels (halves style): as the
 * CPU operator path, cos and sin rounded to the dtype and each product rounded */
static void rotate(float *x, int64_t heads, int64_t d, int64_t rd, const float *cs, int bf16) {
    int64_t h2 = rd / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *p = x + h * d;
        for (int64_t i = 0; i < h2; i++) {
            float c = rnd(cs[i], bf16), s = rnd(cs[h2 + i], bf16);
            float a = p[i], b = p[h2 + i];
            p[i] = rnd(rnd(a * c, bf16) + rnd(-b * s, bf16), bf16);
            p[h2 + i] = rnd(rnd(b * c, bf16) + rnd(a * s, bf16), bf16);
        }
    }
}

static void store_act(void *dst, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)dst)[i] = f32_to_bf16(v);
    else
        ((float *)dst)[i] = v;
}

static float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* channels (0, 1), (2, 3), ... of each of `heads` heads of d -> halves (0, 2, ...), (1, 3, ...) */
static void deinterleave(float *x, int64_t heads, int64_t d, int64_t stride) {
    float tmp[d];
    for (int64_t h = 0; h < heads; h++) {
        float *p = x + h * stride;
        for (int64_t i = 0; i < d / 2; i++) tmp[i] = p[2 * i], tmp[d / 2 + i] = p[2 * i + 1];
        memcpy(p, tmp, sizeof(float) * (size_t)d);
    }
}

typedef struct { /* scratch of one step, sized for t tokens */
    float *x, *res, *h, *qkv, *att, *q2, *gu, *act, *mo, *acc, *xs, *logits, *tw;
    int64_t *tid;
    void *qa, *oa;
} work;

/* the gated MLP out [rows, hidden] = dn(silu(g) * u), in dtype bf16: g and u from gu's rows
 * (gate | up), or from gu and up where they are apart (up not NULL) */
static int mlp(const thr_linear *gu, const thr_linear *up, const thr_linear *dn, const float *x,
               int64_t rows, float *gbuf, float *abuf, float *out, int bf16) {
    int64_t inter = up ? gu->n : gu->n / 2, stride = up ? inter : 2 * inter;
    float *ub = up ? gbuf + rows * inter : gbuf + inter;
    int rc = linear(gu, x, rows, gbuf, bf16);
    if (!rc && up) rc = linear(up, x, rows, ub, bf16);
    if (rc) return rc;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inter; i++)
            abuf[r * inter + i] = rnd(silu_mul(gbuf[r * stride + i], ub[r * stride + i]), bf16);
    return linear(dn, abuf, rows, out, bf16);
}

/* gpt-oss's expert (models.gpt_oss.clamped_swiglu): g = min(gate x, limit), u = clamp(up x,
 * +-limit), dn(((u + 1) * g) * sigmoid(alpha g)), each operation rounded to the dtype */
static int clamped_mlp(const thr_layer *L, const thr_linear *gate, const thr_linear *up,
                       const thr_linear *dn, const float *x, int64_t rows, float *gbuf,
                       float *abuf, float *out, int bf16) {
    int64_t inter = gate->n;
    float *ub = gbuf + rows * inter;
    int rc = linear(gate, x, rows, gbuf, bf16);
    if (!rc) rc = linear(up, x, rows, ub, bf16);
    if (rc) return rc;
    float lim = L->limit;
    for (int64_t i = 0; i < rows * inter; i++) {
        float g = gbuf[i] > lim ? lim : gbuf[i];
        float u = ub[i] > lim ? lim : ub[i] < -lim ? -lim : ub[i];
        float sg = rnd(1.0f / (1.0f + expf(-rnd(g * L->alpha, bf16))), bf16);
        abuf[i] = rnd(rnd(rnd(u + 1.0f, bf16) * g, bf16) * sg, bf16);
    }
    return linear(dn, abuf, rows, out, bf16);
}

/* the index of the largest of v[0..n) not yet taken (ties: the lowest index), marked taken */
static int64_t take_max(const float *v, unsigned char *taken, int64_t n) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; e++)
        if (!taken[e] && (best < 0 || v[e] > v[best])) best = e;
    if (best >= 0) taken[best] = 1;
    return best;
}

/* a routing rule's experts and gate values (RoutingRule.select) from fp32 logits [t, E] */
static void route(const thr_layer *L, int64_t t, float *logits, int64_t *tid, float *tw,
                  int bf16) {
    int64_t E = L->experts, K = L->top_k, G = L->n_group > 1 ? L->n_group : 1, per = E / G;
    unsigned char taken[E], gtaken[G];
    float choice[E], gscore[G];
    for (int64_t i = 0; i < t; i++) {
        float *s = logits + i * E;
        if (L->sigmoid) {
            for (int64_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-s[e]));
        } else {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t e = 0; e < E; e++) mx = s[e] > mx ? s[e] : mx;
            for (int64_t e = 0; e < E; e++) sum += (s[e] = expf(s[e] - mx));
            for (int64_t e = 0; e < E; e++) s[e] /= sum;
        }
        for (int64_t e = 0; e < E; e++) choice[e] = s[e] + (L->correction ? L->correction[e] : 0);
        memset(taken, 0, (size_t)E);
        if (L->sigmoid && G > 1) { /* groups ranked by their two best choices; the rest masked */
            for (int64_t g = 0; g < G; g++) {
                unsigned char *tg = taken + g * per;
                int64_t a = take_max(choice + g * per, tg, per), b = per > 1 ?
                            take_max(choice + g * per, tg, per) : -1;
                gscore[g] = choice[g * per + a] + (b >= 0 ? choice[g * per + b] : 0.0f);
                memset(tg, 0, (size_t)per);
            }
            memset(gtaken, 0, (size_t)G);
            for (int64_t j = 0; j < L->topk_group && j < G; j++) take_max(gscore, gtaken, G);
            for (int64_t e = 0; e < E; e++) taken[e] = !gtaken[e / per];
        }
        float tot = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            int64_t e = take_max(choice, taken, E);
            tid[i * K + j] = e;
            tot += (tw[i * K + j] = s[e]);
        }
        if (L->sigmoid) tot += 1e-20f;
        for (int64_t j = 0; j < K; j++) {
            float g = L->renorm ? tw[i * K + j] / tot : tw[i * K + j];
            tw[i * K + j] = rnd(L->sigmoid ? g * L->scaling : g, bf16);
        }
    }
}

/* gpt-oss's routing: the top-k logits, softmaxed over the k */
static void route_topk_softmax(const thr_layer *L, int64_t t, const float *logits, int64_t *tid,
                               float *tw, int bf16) {
    int64_t E = L->experts, K = L->top_k;
    unsigned char taken[E];
    for (int64_t i = 0; i < t; i++) {
        const float *lg = logits + i * E;
        float tot = 0.0f;
        memset(taken, 0, (size_t)E);
        for (int64_t j = 0; j < K; j++) tid[i * K + j] = take_max(lg, taken, E);
        float mx = lg[tid[i * K]];
        for (int64_t j = 0; j < K; j++) tot += (tw[i * K + j] = expf(lg[tid[i * K + j]] - mx));
        for (int64_t j = 0; j < K; j++) tw[i * K + j] = rnd(tw[i * K + j] / tot, bf16);
    }
}

/* softmax in fp32 over the experts, top-k, renormalized per the family */
static void route_softmax(const thr_layer *L, int64_t t, float *logits, int64_t *tid, float *tw,
                          int bf16) {
    int64_t E = L->experts, K = L->top_k;
    for (int64_t i = 0; i < t; i++) {
        float *lg = logits + i * E, mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) mx = lg[e] > mx ? lg[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += (lg[e] = expf(lg[e] - mx));
        for (int64_t e = 0; e < E; e++) lg[e] /= sum;
        float tot = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (lg[e] >= 0.0f && (best < 0 || lg[e] > lg[best])) best = e;
            tid[i * K + j] = best;
            tw[i * K + j] = lg[best];
            tot += lg[best];
            lg[best] = -1.0f;
        }
        for (int64_t j = 0; j < K; j++)
            tw[i * K + j] = rnd(L->renorm ? tw[i * K + j] / tot : tw[i * K + j], bf16);
    }
}

/* Expert e's MLP on the rows routed to it, gathered at row offset o of the scratch buffers */
static int run_expert(const thr_model *m, const thr_layer *L, int64_t t, work *w, int64_t e,
                      int64_t o) {
    int eb = m->bf16 || L->expert_bf16;
    int64_t hd = m->hidden, K = L->top_k, rows = 0, mi = m->max_inter;
    float *xs = w->xs + o * hd;
    for (int64_t i = 0; i < t * K; i++)
        if (w->tid[i] == e) {
            for (int64_t c = 0; c < hd; c++) xs[rows * hd + c] = rnd(w->h[(i / K) * hd + c], eb);
            rows++;
        }
    float *gu = w->gu + o * 2 * mi, *act = w->act + o * mi, *mo = w->mo + o * hd;
    return L->clamped ? clamped_mlp(L, &L->gate_up[e], &L->up[e], &L->down[e], xs, rows, gu, act,
                                    mo, eb)
                      : mlp(&L->gate_up[e], L->up ? &L->up[e] : NULL, &L->down[e], xs, rows, gu,
                            act, mo, eb);
}

static int moe(const thr_model *m, const thr_layer *L, int64_t t, work *w, float *out) {
    int bf16 = m->bf16, eb = bf16 || L->expert_bf16;
    int64_t hd = m->hidden, E = L->experts, K = L->top_k;
    int rc = linear(&L->router, w->h, t, w->logits, L->rule ? 0 : bf16);
    if (rc) return rc;
    if (L->rule)
        route(L, t, w->logits, w->tid, w->tw, bf16);
    else if (L->topk_softmax)
        route_topk_softmax(L, t, w->logits, w->tid, w->tw, bf16);
    else
        route_softmax(L, t, w->logits, w->tid, w->tw, bf16);
    /* the experts that got tokens, each with its rows at an offset of the scratch buffers
     * (t * K rows in all), most rows first */
    int64_t sel[E], cnt[E], off[E], nsel = 0, total = 0;
    memset(cnt, 0, sizeof(cnt));
    for (int64_t i = 0; i < t * K; i++)
        if (w->tid[i] >= 0) cnt[w->tid[i]]++;
    for (int64_t e = 0; e < E; e++)
        if (cnt[e]) {
            off[e] = total, total += cnt[e];
            int64_t j = nsel++;
            for (; j > 0 && cnt[sel[j - 1]] < cnt[e]; j--) sel[j] = sel[j - 1];
            sel[j] = e;
        }
    /* With at least as many experts as threads (and an even share, or two each), each thread
     * runs whole experts, one parallel region for all of them; otherwise the experts run in
     * turn, outside any region, so that each one's matmuls split their rows over the threads.
     * Either way every output row is the same arithmetic. */
    int threads = omp_get_max_threads(), err = 0;
    if (threads > 1 && nsel >= threads && (nsel % threads == 0 || nsel >= 2 * threads) &&
        outermost()) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t j = 0; j < nsel; j++) {
            int rc_e = run_expert(m, L, t, w, sel[j], off[sel[j]]);
            if (rc_e) {
#pragma omp atomic write
                err = rc_e;
            }
        }
    } else {
        for (int64_t j = 0; j < nsel && !err; j++)
            err = run_expert(m, L, t, w, sel[j], off[sel[j]]);
    }
    if (err) return err;
    memset(w->acc, 0, sizeof(float) * (size_t)(t * hd));
    for (int64_t e = 0; e < E; e++) { /* the weighted sum in expert order, whoever ran them */
        int64_t r = 0;
        for (int64_t i = 0; i < t * K; i++)
            if (w->tid[i] == e) {
                float *a = w->acc + (i / K) * hd;
                const float *o = w->mo + (off[e] + r) * hd;
                if (L->clamped) /* gpt-oss adds into a dtype tensor: each product and sum rounded */
                    for (int64_t c = 0; c < hd; c++) a[c] = rnd(a[c] + rnd(w->tw[i] * o[c], eb), eb);
                else
                    for (int64_t c = 0; c < hd; c++) a[c] += w->tw[i] * o[c];
                r++;
            }
    }
    for (int64_t i = 0; i < t * hd; i++) out[i] = rnd(w->acc[i], bf16);
    if (L->shared_gate_up.kind == LIN_NONE) return 0;
    rc = mlp(&L->shared_gate_up, NULL, &L->shared_down, w->h, t, w->gu, w->act, w->mo, bf16);
    if (rc) return rc;
    if (L->shared_gate.kind != LIN_NONE) {
        rc = linear(&L->shared_gate, w->h, t, w->logits, bf16);
        if (rc) return rc;
        for (int64_t i = 0; i < t; i++) {
            float g = rnd(1.0f / (1.0f + expf(-w->logits[i])), bf16);
            for (int64_t c = 0; c < hd; c++) w->mo[i * hd + c] = rnd(g * w->mo[i * hd + c], bf16);
        }
    }
    for (int64_t i = 0; i < t * hd; i++) out[i] = rnd(out[i] + w->mo[i], bf16);
    return 0;
}

static int attention(const thr_model *m, const thr_layer *L, int64_t t, const int64_t *pos,
                     const int64_t *slots, const int32_t *tables, int64_t table_stride,
                     const int32_t *ctx, work *w) {
    int bf16 = m->bf16;
    int64_t hq = m->hq, hkv = m->hkv, d = m->d, width = (hq + 2 * hkv) * d;
    int rc = linear(&L->qkv, w->h, t, w->qkv, bf16);
    if (rc) return rc;
    if (L->gated) /* rows [q0 g0 q1 g1 ... | k | v] -> gates into q2, rows [q | k | v] in place */
        for (int64_t i = 0; i < t; i++) {
            float *src = w->qkv + i * (width + hq * d), *dst = w->qkv + i * width;
            for (int64_t h = 0; h < hq; h++)
                memcpy(w->q2 + (i * hq + h) * d, src + (2 * h + 1) * d, sizeof(float) * d);
            for (int64_t h = 0; h < hq; h++)
                memmove(dst + h * d, src + 2 * h * d, sizeof(float) * d);
            memmove(dst + hq * d, src + 2 * hq * d, sizeof(float) * 2 * hkv * d);
        }
    for (int64_t i = 0; i < t; i++) {
        float *q = w->qkv + i * width, *k = q + hq * d, *v = k + hkv * d;
        if (L->q_norm && L->qk_norm_full) { /* over the full projection width (OLMoE) */
            norm_rows(q, L->q_norm, q, 1, hq * d, m->eps, bf16);
            norm_rows(k, L->k_norm, k, 1, hkv * d, m->eps, bf16);
        }
        if (L->clip > 0.0f)
            for (int64_t j = 0; j < width; j++)
                q[j] = q[j] > L->clip ? L->clip : q[j] < -L->clip ? -L->clip : q[j];
        if (L->interleave) deinterleave(q, hq + hkv, d, d); /* q and k heads are adjacent */
        if (L->q_norm && !L->qk_norm_full) { /* per head (Qwen3) */
            norm_rows(q, L->q_norm, q, hq, d, m->eps, bf16);
            norm_rows(k, L->k_norm, k, hkv, d, m->eps, bf16);
        }
        const float *cs = m->cos_sin + pos[i] * L->rotary_dim;
        rotate(q, hq, d, L->rotary_dim, cs, bf16);
        rotate(k, hkv, d, L->rotary_dim, cs, bf16);
        for (int64_t j = 0; j < hq * d; j++) store_act(w->qa, i * hq * d + j, q[j], bf16);
        if (slots[i] >= 0)
            for (int64_t j = 0; j < hkv * d; j++) {
                store_act(L->k_cache, slots[i] * hkv * d + j, k[j], bf16);
                store_act(L->v_cache, slots[i] * hkv * d + j, v[j], bf16);
            }
    }
    rc = thr_paged_decode_sinks(w->qa, L->k_cache, L->v_cache, tables, table_stride, ctx, t, hq,
                                hkv, d, m->block_size, m->scale, L->sinks, L->window, w->oa, bf16);
    if (rc) return rc;
    for (int64_t j = 0; j < t * hq * d; j++) w->att[j] = load_f(w->oa, j, bf16);
    if (L->gated)
        for (int64_t j = 0; j < t * hq * d; j++)
            w->att[j] = rnd(w->att[j] * rnd(1.0f / (1.0f + expf(-w->q2[j])), bf16), bf16);
    return linear(&L->o, w->att, t, w->h, bf16);
}

/* Qwen3.5's Gated DeltaNet (deltanet.py) for t tokens in order, token i continuing the sequence
 * in state slot rows[i] (a sequence's tokens in order continue each other's states): the
 * depthwise causal conv + SiLU over the slot's last inputs, then the gated delta rule in fp32
 * (q, k l2-normed; the state decayed by exp(g), corrected towards v at strength beta, read
 * with q), the per-head RMSNorm times SiLU(z), out_proj. */
static int delta_net(const thr_model *m, const thr_layer *L, int64_t t, const int64_t *rows,
                     work *w) {
    int bf16 = m->bf16;
    int64_t C = L->qkv.n, taps = L->taps, nk = L->nk, nv = L->nv, dk = L->dk, dv = L->dv;
    int64_t kd = nk * dk, rep = nv / nk;
    float *beta = w->acc, *g = w->acc + t * nv, *qn = w->xs, *kn = w->xs + kd;
    int rc = linear(&L->qkv, w->h, t, w->qkv, bf16);
    if (!rc) rc = linear(&L->in_z, w->h, t, w->q2, bf16);
    if (!rc) rc = linear(&L->in_b, w->h, t, beta, bf16);
    if (!rc) rc = linear(&L->in_a, w->h, t, g, bf16);
    if (rc) return rc;
    for (int64_t i = 0; i < t; i++) {
        float *mixed = w->qkv + i * C, *out = w->att + i * nv * dv;
        for (int64_t h = 0; h < nv; h++) {
            float a = g[i * nv + h] + L->dt_bias[h];
            beta[i * nv + h] = 1.0f / (1.0f + expf(-beta[i * nv + h]));
            g[i * nv + h] = L->neg_a[h] * (a > 20.0f ? a : log1pf(expf(a))); /* softplus */
        }
        char *cs = (char *)L->conv_state + rows[i] * C * (taps - 1) * (bf16 ? 2 : 4);
        for (int64_t c = 0; c < C; c++) { /* conv over [state | new], state shifted */
            float y = 0.0f;
            for (int64_t j = 0; j < taps; j++) {
                float v = j < taps - 1 ? load_f(cs, c * (taps - 1) + j, bf16) : mixed[c];
                y += rnd(v * load_f(L->conv_w, c * taps + j, bf16), bf16);
            }
            for (int64_t j = 0; j + 1 < taps - 1; j++)
                store_act(cs, c * (taps - 1) + j, load_f(cs, c * (taps - 1) + j + 1, bf16), bf16);
            if (taps > 1) store_act(cs, c * (taps - 1) + taps - 2, mixed[c], bf16);
            y = rnd(y, bf16);
            mixed[c] = rnd(y / (1.0f + expf(-y)), bf16);
        }
        for (int64_t h = 0; h < nk; h++) { /* q and k l2-normed per key head, q / sqrt(dk) */
            float sq = 0.0f, sk = 0.0f;
            for (int64_t j = 0; j < dk; j++) {
                sq += mixed[h * dk + j] * mixed[h * dk + j];
                sk += mixed[kd + h * dk + j] * mixed[kd + h * dk + j];
            }
            float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
            for (int64_t j = 0; j < dk; j++) {
                qn[h * dk + j] = mixed[h * dk + j] * rq / sqrtf((float)dk);
                kn[h * dk + j] = mixed[kd + h * dk + j] * rk;
            }
        }
        for (int64_t h = 0; h < nv; h++) {
            float *S = L->delta_state + (rows[i] * nv + h) * dk * dv, decay = expf(g[i * nv + h]);
            const float *q = qn + (h / rep) * dk, *k = kn + (h / rep) * dk;
            const float *v = mixed + 2 * kd + h * dv;
            float *o = out + h * dv, b = beta[i * nv + h];
            for (int64_t j = 0; j < dk * dv; j++) S[j] *= decay;
            for (int64_t c = 0; c < dv; c++) o[c] = 0.0f; /* the recall of k, then the read */
            for (int64_t j = 0; j < dk; j++)
                for (int64_t c = 0; c < dv; c++) o[c] += S[j * dv + c] * k[j];
            for (int64_t c = 0; c < dv; c++) o[c] = (v[c] - o[c]) * b;
            for (int64_t j = 0; j < dk; j++)
                for (int64_t c = 0; c < dv; c++) S[j * dv + c] += k[j] * o[c];
            for (int64_t c = 0; c < dv; c++) o[c] = 0.0f;
            for (int64_t j = 0; j < dk; j++)
                for (int64_t c = 0; c < dv; c++) o[c] += S[j * dv + c] * q[j];
        }
        for (int64_t j = 0; j < nv * dv; j++) out[j] = rnd(out[j], bf16);
        norm_rows(out, L->delta_norm, out, nv, dv, L->delta_eps, bf16);
        for (int64_t j = 0; j < nv * dv; j++) {
            float z = w->q2[i * nv * dv + j];
            out[j] = rnd(out[j] * (z / (1.0f + expf(-z))), bf16);
        }
    }
    return linear(&L->o, w->att, t, w->h, bf16);
}

/* head h's rows of x [t, heads, width] (columns from..from+k) @ W_h.T for W_h = w's h-th [n, k]
 * matrix, rounded, into y [t, heads, n]: the latent attention's absorbed kv_b. Threads take
 * heads (each head's matmul then runs on one thread); xb holds [heads, t, k], yb [heads, t, n]. */
static int per_head(const float *x, int64_t t, int64_t heads, int64_t width, int64_t from,
                    int64_t k, const void *w, int64_t n, float *xb, float *yb, float *y, int bf16) {
    int failed = 0;
#pragma omp parallel for schedule(static) if (heads * n * k >= 65536 && outermost())
    for (int64_t h = 0; h < heads; h++) {
        float *xh = xb + h * t * k, *yh = yb + h * t * n;
        for (int64_t i = 0; i < t; i++)
            memcpy(xh + i * k, x + (i * heads + h) * width + from, sizeof(float) * (size_t)k);
        if (thr_dense_matmul(xh, t, k, (const char *)w + h * n * k * (bf16 ? 2 : 4), bf16, n, yh)) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = 0; j < n; j++) y[(i * heads + h) * n + j] = rnd(yh[i * n + j], bf16);
    }
    return failed ? -1 : 0;
}

/* Multi-head latent attention (mla.py's LatentAttention): the cache row of a token is its
 * normed latent c and its rotated key [c | k_rope] (one kv head of rank + rope), kv_b absorbed:
 * queries [W_kb^T q_nope | q_rope] attend over the cache rows as keys and values, and the
 * output's latent part leaves through W_vb before o_proj. */
static int latent_attention(const thr_model *m, const thr_layer *L, int64_t t, const int64_t *pos,
                            const int64_t *slots, const int32_t *tables, int64_t table_stride,
                            const int32_t *ctx, work *w) {
    int bf16 = m->bf16;
    int64_t H = L->heads, nope = L->nope, rd = L->rotary_dim, r = L->rank, qr = L->q_rank;
    int64_t dw = qr + r + rd, qw = nope + rd, ew = r + rd;
    int rc = linear(&L->qkv, w->h, t, w->qkv, bf16);
    if (rc) return rc;
    if (qr) { /* the query's low rank, normed, then q_b */
        for (int64_t i = 0; i < t; i++)
            norm_rows(w->qkv + i * dw, L->q_a_norm, w->xs + i * qr, 1, qr, 1e-6f, bf16);
        rc = linear(&L->q_b, w->xs, t, w->q2, bf16);
    } else {
        rc = linear(&L->q_b, w->h, t, w->q2, bf16);
    }
    if (rc) return rc;
    /* the query's non-rotary part into latent space: [t, H, rank] into att */
    rc = per_head(w->q2, t, H, qw, 0, nope, L->w_kb_t, r, w->xs, w->mo, w->att, bf16);
    if (rc) return rc;
    for (int64_t i = 0; i < t; i++) {
        const float *cs = m->cos_sin + pos[i] * rd;
        float *row = w->qkv + i * dw + qr; /* [c | k_rope] in place */
        norm_rows(row, L->kv_a_norm, row, 1, r, 1e-6f, bf16);
        if (L->interleave) deinterleave(row + r, 1, rd, rd);
        rotate(row + r, 1, ew, rd, cs, bf16);
        if (slots[i] >= 0)
            for (int64_t j = 0; j < ew; j++) store_act(L->k_cache, slots[i] * ew + j, row[j], bf16);
        float *qi = w->q2 + i * H * qw;
        if (L->interleave) deinterleave(qi + nope, H, rd, qw);
        rotate(qi + nope, H, qw, rd, cs, bf16);
        for (int64_t h = 0; h < H; h++) {
            for (int64_t j = 0; j < r; j++)
                store_act(w->qa, (i * H + h) * ew + j, w->att[(i * H + h) * r + j], bf16);
            for (int64_t j = 0; j < rd; j++)
                store_act(w->qa, (i * H + h) * ew + r + j, qi[h * qw + nope + j], bf16);
        }
    }
    rc = thr_paged_decode(w->qa, L->k_cache, L->k_cache, tables, table_stride, ctx, t, H, 1, ew,
                          m->block_size, L->att_scale, w->oa, bf16);
    if (rc) return rc;
    for (int64_t j = 0; j < t * H * ew; j++) w->q2[j] = load_f(w->oa, j, bf16);
    rc = per_head(w->q2, t, H, ew, 0, r, L->w_vb, L->v_dim, w->xs, w->mo, w->att, bf16);
    if (rc) return rc;
    return linear(&L->o, w->att, t, w->h, bf16);
}

/* Final hidden states [t, hidden] (serving dtype) of t new tokens, one per sequence: ids and
 * positions [t], cache slots [t] (-1: not stored), block tables [t, table_stride], context
 * lengths [t] (this token included) and recurrent state slots [t] (NULL without recurrent
 * layers). Returns 0, -1 when out of memory. */
int thr_decode_step(const thr_model *m, int64_t t, const int64_t *ids, const int64_t *pos,
                    const int64_t *slots, const int32_t *tables, int64_t table_stride,
                    const int32_t *ctx, const int64_t *state_rows, void *out) {
    int bf16 = m->bf16;
    int64_t hd = m->hidden, width = m->qkv_max, rows = t, E = 1, K = 1;
    for (int64_t l = 0; l < m->layers; l++)
        if (m->layer[l].moe) {
            E = m->layer[l].experts > E ? m->layer[l].experts : E;
            K = m->layer[l].top_k > K ? m->layer[l].top_k : K;
        }
    rows = t * K; /* the most rows one expert can get */
    int64_t aw = m->att_max, wide = hd > aw ? hd : aw, rw = hd > aw ? hd : aw;
    work w = {0};
    size_t f = sizeof(float);
    w.x = malloc(f * t * hd), w.res = malloc(f * t * hd), w.h = malloc(f * t * wide);
    w.qkv = malloc(f * t * width), w.att = malloc(f * t * aw), w.q2 = malloc(f * t * aw);
    w.gu = malloc(f * rows * 2 * m->max_inter), w.act = malloc(f * rows * m->max_inter);
    w.mo = malloc(f * rows * rw), w.acc = malloc(f * t * hd), w.xs = malloc(f * rows * rw);
    w.logits = malloc(f * t * (E > 1 ? E : 1)), w.tw = malloc(f * t * K);
    w.tid = malloc(sizeof(int64_t) * t * K);
    w.qa = malloc(f * t * aw), w.oa = malloc(f * t * aw);
    int rc = (w.x && w.res && w.h && w.qkv && w.att && w.q2 && w.gu && w.act && w.mo && w.acc &&
              w.xs && w.logits && w.tw && w.tid && w.qa && w.oa) ? 0 : -1;
    for (int64_t i = 0; !rc && i < t; i++)
        for (int64_t c = 0; c < hd; c++) w.x[i * hd + c] = load_f(m->embed, ids[i] * hd + c, bf16);
    for (int64_t l = 0; !rc && l < m->layers; l++) {
        const thr_layer *L = &m->layer[l];
        add_norm(w.x, w.res, l == 0, L->in_norm, w.h, t, hd, m->eps, bf16);
        rc = L->delta ? delta_net(m, L, t, state_rows, &w)
             : L->mla ? latent_attention(m, L, t, pos, slots, tables, table_stride, ctx, &w)
                      : attention(m, L, t, pos, slots, tables, table_stride, ctx, &w);
        if (rc) break;
        add_norm(w.h, w.res, 0, L->post_norm, w.h, t, hd, m->eps, bf16);
        rc = L->moe ? moe(m, L, t, &w, w.x)
                    : mlp(L->gate_up, NULL, L->down, w.h, t, w.gu, w.act, w.x, bf16);
    }
    if (!rc) {
        add_norm(w.x, w.res, m->layers == 0, m->final_norm, w.h, t, hd, m->eps, bf16);
        for (int64_t i = 0; i < t * hd; i++) store_act(out, i, w.h[i], bf16);
    }
    free(w.x), free(w.res), free(w.h), free(w.qkv), free(w.att), free(w.q2), free(w.gu);
    free(w.act);
    free(w.mo), free(w.acc), free(w.xs), free(w.logits), free(w.tw), free(w.tid), free(w.qa);
    free(w.oa);
    return rc;
}

/* fp32 logits [t, vocab] of final hidden states x [t, hidden] (serving dtype) through the LM
 * head, rounded to the serving dtype first as the operator path's 16-bit matmul rounds them.
 * Returns 0, -1 when out of memory. */
int thr_lm_head(const thr_model *m, const void *x, int64_t t, float *y) {
    int64_t hd = m->lm_head.k;
    float *xf = malloc(sizeof(float) * (size_t)(t * hd));
    if (!xf) return -1;
    for (int64_t i = 0; i < t * hd; i++) xf[i] = load_f(x, i, m->bf16);
    int rc = linear(&m->lm_head, xf, t, y, m->bf16);
    free(xf);
    return rc;
}
