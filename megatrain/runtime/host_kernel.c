/* One pass of the host optimizer: AdamW over fp32 masters with the policy's gradient and moment storage
 * expanded, updated and rounded back element by element (runtime/host_kernel.py builds and loads it).
 *
 * Bits: every operation is one that torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
 * ADAMW mode) performs on fp32, in the same order, each rounded to fp32. Torch's build contracts multiply-adds
 * into fused ones where its compiler chose to; this file is compiled with -ffp-contract=off and writes those
 * fused multiply-adds out as fmaf, as measured against torch 2.13 (x86-64, AVX-512): in the vector body the
 * first moment's lerp fma(w, g - m, m) (torch's explicit fmadd) and the second moment fma(c2 g, g, v b2); in
 * the scalar tail, the last (numel mod 8) elements of a tensor (`nvec` says where it starts; host_kernel.py
 * LANES), the same lerp and fma(v, b2, (c2 g) g). The storage conversions: bf16 moments by stochastic rounding
 * (SR below), float8_e4m3fn by c10's fp8e4m3fn_from_fp32_value after a first rounding to fp16 (FP8_CODES), fp8
 * blocks scaled as host_state.py's torch path does.
 *
 * SR: bf16 moments are rounded stochastically, as runtime/stochastic_round.py does: the fp32 bits plus 16 random
 * bits, truncated (a NaN written as c10's 0x7FC0). Round-to-nearest could not take the second moment's steps at
 * beta2 near 1 (smaller than half of bf16's spacing: v stayed where it was); rounding up with the probability of
 * the distance is unbiased, so the steps add up. The bits are sr_bits(seed, index), index the element's place
 * in its whole parameter (Hyper.origin: where this tensor starts in it) and seed the parameter's and step's
 * (computed by stochastic_round.step_seed), so any slicing of the parameter into chunks, threads or data-parallel
 * shards draws the same bits for an element; one draw per element rounds both moments (m by its high half, v by
 * its low half). One multiply per element: a two-multiply hash (lowbias32) per element slowed the loop in cache
 * where this one costs little (docs/log/2026-12-06-stochastic-rounding.md).
 * host_kernel.py checks the result against that path bit for bit before a machine uses this code, so a torch
 * built with other contractions runs the torch path instead.
 *
 * FP8_UPDATE: with fp8 moments the weights take host_state._fp8_update, not torch's formula: den = fma(sqrt(v),
 * 1 / sqrt(bc2), eps) and p' = fma(p, 1 - lr wd, (-lr / bc1) m / den): one division, one square root and two
 * fused multiply-adds per element where torch's has two divisions and four more separate operations. The fp8
 * loop is bound by the core's vector ports and its divider, not by memory, on a core that streams 31 GB/s
 * (2-core Xeon VM, AVX-512, 16 elements cost about 50 vector operations besides the division and square root).
 *
 * FP8_CODES: fp8 moments are rounded to float8_e4m3fn in two steps, first to fp16 at a scale of 1 / 256 (fp16's
 * 11 significant bits, its subnormal step 2^-16 below 2^-6), then to e4m3 by round-to-nearest-even
 * (host_state._quant: x r / 256 to float16, times 256, to float8_e4m3fn). A value within 2^-8 of a step of an
 * e4m3 midpoint (2^-7 of values) lands on it and goes to the even neighbour, the wrong one for half of them:
 * the error stays under 0.504 of a step. Two steps because the vector loop then converts with vcvtps2ph and
 * rounds the codes as 16-bit integers: 17 vector operations per 16 elements of both moments, not 27 (as measured
 * when introduced; fp16x16_round below).
 *
 * Both measured with benchmarks/host_kernel_driver.c (ns per element, in cache / from DRAM on huge pages): c10's
 * rounding and separate operations 0.575-0.583 / 0.631-0.639, FP8_CODES 0.508-0.516 / 0.568-0.576, and
 * FP8_UPDATE 0.490-0.494 / 0.558-0.559.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define FP8_AVX512 1 /* the fp8 loop's vector code (below) */
#define BF16_AVX512 1 /* the bf16 moments' vector loop (BF16_VECTOR) */
#endif

#define BLOCK 256 /* elements per pass through the locals (= planner/host_policy.py FP8_BLOCK) */

typedef struct {
    double lr, beta1, beta2, weight_decay, eps, step; /* step: the count after this update (1-based) */
    float factor;                                      /* the gradient times it (1: as stored; g * 1.0f is g) */
    int32_t grad_bf16;   /* gradients stored as bf16 (else fp32) */
    int32_t moments;     /* 0: fp32, 1: bf16, 2: fp8 e4m3fn with per-BLOCK fp32 scales */
    uint32_t sr_seed;    /* bf16 moments: the parameter's and step's seed of the stochastic rounding (SR) */
    int64_t origin;      /* bf16 moments: the index in its parameter of the tensor's first element (SR) */
} Hyper;

static inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float bf16_to_f32(uint16_t h) { return from_bits((uint32_t)h << 16); }

/* SR's 32 random bits of a parameter's element `index` (stochastic_round.element_bits): the index's Weyl product
 * (neighbours spread over the word; in a loop, one add per vector) with the seed mixed in, one multiply and a
 * shift to carry the high bits into the low half */
#define SR_WEYL 0x9E3779B9u
#define SR_MUL 0x7FEB352Du
static inline uint32_t sr_bits(uint32_t seed, uint32_t index) {
    const uint32_t x = ((index * SR_WEYL) ^ seed) * SR_MUL;
    return x ^ (x >> 16);
}

/* SR of f with the 16 random bits r: branch-free, so that loops over it vectorise without AVX-512. Below a NaN
 * the sum cannot wrap or reach the sign bit (a finite value's carry ends at an infinity's pattern). */
static inline uint16_t f32_to_bf16_sr(float f, uint32_t r) {
    const uint32_t nan = -(uint32_t)(f != f);
    return (uint16_t)((0x7FC0u & nan) | (((bits(f) + r) >> 16) & ~nan));
}

/* Branch-free selects for the element functions below: (a & mask) | (b & ~mask), mask all ones where `cond`.
 * Written as `cond ? a : b` with a floating-point operand, GCC sinks that operation into the arm that uses it,
 * and then, under its default -ftrapping-math, will not if-convert a loop over the function ("could trap"):
 * without AVX-512, where the fp8 loops are these functions vectorised by the compiler, that cost 3.9x (the C
 * driver, -march=x86-64-v3, `fp8 cache`: 7.5 -> 1.9 ns per element). */
static inline uint32_t pick(int cond, uint32_t a, uint32_t b) {
    const uint32_t mask = -(uint32_t)(cond != 0);
    return (a & mask) | (b & ~mask);
}

/* float8_e4m3fn -> fp32, exactly (0x7f and 0xff are NaN), branch-free so that loops over it vectorise: the
 * 7 magnitude bits placed under an exponent bias of 120 give 2^(e-7) x (1 + mant/8) for e > 0; for e = 0, under
 * a bias of 121 they give 2^-6 + mant x 2^-9, and subtracting 2^-6 leaves the subnormal's value exactly; the
 * sign-extended byte's sign bit is fp32's. */
static inline float fp8_to_f32(uint8_t q) {
    const int32_t wide = (int8_t)q;
    const uint32_t mag = (uint32_t)wide & 0x7f;
    const uint32_t r_normal = (mag << 20) + (120u << 23);
    const uint32_t r_sub = bits(from_bits((mag << 20) + (121u << 23)) - 0x1p-6f);
    const uint32_t r = pick(mag == 0x7f, 0x7FC00000u, pick(mag < 8, r_sub, r_normal));
    return from_bits(r | ((uint32_t)wide & 0x80000000u));
}

/* c10's fp8e4m3fn_from_fp32_value (round to nearest even, saturating) without branches. */
static inline uint8_t f32_to_fp8(float f) {
    const uint32_t denorm_mask = 141u << 23;
    uint32_t u = bits(f);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    const uint32_t sub = bits(from_bits(u) + from_bits(denorm_mask)) - denorm_mask;
    const uint32_t normal = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1)) >> 20;
    const uint32_t is_sub = -(uint32_t)(u < (121u << 23)), big = -(uint32_t)(u >= (1087u << 20));
    const uint32_t saturated = 0x7e + (uint32_t)(u > 0x7F800000u); /* from 480 on: finite or inf 0x7e, NaN 0x7f */
    uint32_t r = (sub & is_sub) | (normal & ~is_sub);
    r = (saturated & big) | (r & ~big);
    return (uint8_t)(r | (sign >> 24));
}

/* The fp32 coefficients, cast from double where torch casts them. */
typedef struct {
    float decay, w, lerp_coeff, beta2, c2, bc2_sqrt, inv_bc2_sqrt, eps, step_size, neg_step_size;
    int lerp_small;
    uint32_t seed;  /* SR: Hyper's sr_seed and origin */
    int64_t origin;
} Coef;

static Coef coefficients(const Hyper *h) {
    Coef c;
    double bc1 = 1 - pow(h->beta1, h->step), bc2 = 1 - pow(h->beta2, h->step);
    double step_size = h->lr / bc1, w = 1 - h->beta1;
    c.decay = h->weight_decay != 0.f ? (float)(1 - h->lr * h->weight_decay) : 1.0f; /* x * 1.0f is x, bit for bit */
    c.w = (float)w;
    c.lerp_small = fabsf(c.w) < 0.5f;
    c.lerp_coeff = c.lerp_small ? c.w : c.w - 1.0f;
    c.beta2 = (float)h->beta2;
    c.c2 = (float)(1 - h->beta2);
    c.bc2_sqrt = (float)sqrt(bc2);
    c.inv_bc2_sqrt = (float)(1 / sqrt(bc2));
    c.eps = (float)h->eps;
    c.step_size = (float)step_size;
    c.neg_step_size = (float)(-step_size);
    c.seed = h->sr_seed;
    c.origin = h->origin;
    return c;
}

/* AdamW's denominator: torch's sqrt(v) / sqrt(bc2) + eps, or with `fp8` (FP8_UPDATE) fma(sqrt(v), 1 / sqrt(bc2),
 * eps); the weight after the update `u` = (-lr / bc1) m / den: torch's p (1 - lr wd) + u, or fma(p, 1 - lr wd, u). */
static inline float adam_den(float v, const Coef *c, const int fp8) {
    return fp8 ? fmaf(sqrtf(v), c->inv_bc2_sqrt, c->eps) : sqrtf(v) / c->bc2_sqrt + c->eps;
}
static inline float adam_weight(float p, float u, const Coef *c, const int fp8) {
    return fp8 ? fmaf(p, c->decay, u) : p * c->decay + u;
}

/* One element of torch's vector body: the gradient already scaled, p / m / v updated through the pointers. */
static inline void adam_vec1(float *p, float g, float *m, float *v, const Coef *c, const int fp8) {
    const float mi = fmaf(c->lerp_coeff, g - *m, c->lerp_small ? *m : g); /* torch's blendv lerp */
    float vi = fmaf(c->c2 * g, g, *v * c->beta2);
    *m = mi;
    *v = vi;
    *p = adam_weight(*p, c->neg_step_size * mi / adam_den(vi, c, fp8), c, fp8);
}

/* One element of torch's scalar tail. */
static inline void adam_tail1(float *p, float g, float *m, float *v, const Coef *c, const int fp8) {
    /* m + w (g - m), or g - (g - m)(1 - w), contracted; -(x)(1 - w) is x (w - 1) exactly */
    const float mi = fmaf(c->lerp_coeff, g - *m, c->lerp_small ? *m : g);
    float vi = fmaf(*v, c->beta2, c->c2 * g * g);
    *m = mi;
    *v = vi;
    /* (-s m) / d is -((s m) / d): vec1's bits; p d - x is p d + (-x) */
    *p = adam_weight(*p, -(c->step_size * mi / adam_den(vi, c, fp8)), c, fp8);
}

/* Software prefetch, AHEAD elements in front of the loop, CHUNK elements at a time. The update's divisions
 * and square root hold the loads behind them in the core's window, so one core alone keeps too few cache misses
 * in flight to stream at the memory's rate. On 12M elements (out of cache, 1 thread, 2-core Xeon VM; a C driver,
 * four interleaved runs), ns per element without / with: bf16 0.95-1.01 / 0.76-0.83, bf16 moments with fp32
 * gradients 1.07-1.16 / 0.83-0.89, exact clipped 1.25-1.35 / 1.18-1.22, fp8 1.86-2.13 / 1.57-1.73 (its loop
 * prefetches a BLOCK at a time; in CHUNKs it measured the same). Prefetching a chunk of 256 at a time gained
 * half as much, and 512 at a time lost (too many misses issued at once); 512 ahead beat 256 and 1024.
 * Prefetching changes no result. */
#define AHEAD 512
#define CHUNK 64
#define PREFETCH(PTR, FROM, TO, RW)                                                                         \
    for (int64_t j_ = (FROM); j_ < (TO); j_ += 64 / (int64_t)sizeof(*(PTR)))                                \
        __builtin_prefetch((PTR) + j_, RW, 3)
/* The four streams of a loop over p, g, m, v (the gradient only read). */
#define PREFETCH_STATE(FROM, TO)                                                                            \
    do {                                                                                                    \
        PREFETCH(p, FROM, TO, 1);                                                                           \
        PREFETCH(g, FROM, TO, 0);                                                                           \
        PREFETCH(m, FROM, TO, 1);                                                                           \
        PREFETCH(v, FROM, TO, 1);                                                                           \
    } while (0)

/* Elements [FROM, TO) through the element function FN (adam_vec1 or adam_tail1), in place. */
#define ELEMENTS(FN, FROM, TO, LOADG, LOADM, STOREM)                                                         \
    for (int64_t i0 = FROM; i0 < TO; i0 += CHUNK) {                                                         \
        const int64_t i1 = i0 + CHUNK < TO ? i0 + CHUNK : TO, f0 = i0 + AHEAD, f1 = i1 + AHEAD < TO ? i1 + AHEAD : TO; \
        PREFETCH_STATE(f0, f1);                                                                             \
        for (int64_t i = i0; i < i1; i++) {                                                                 \
            float mi = LOADM(m[i]), vi = LOADM(v[i]);                                                       \
            FN(p + i, LOADG(g[i]) * factor, &mi, &vi, c, 0);                                                \
            m[i] = STOREM(mi, i, 16);                                                                       \
            v[i] = STOREM(vi, i, 0);                                                                        \
        }                                                                                                   \
    }

#ifdef FP8_AVX512
static inline __m512 bf16x16_to_f32(const uint16_t *q) { /* exactly: a bf16 is an fp32's high half */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)q)), 16));
}
#endif

#ifdef BF16_AVX512
/* BF16_VECTOR: bf16 moments 16 at a time, written out where the compiler's vectorisation of the element loop
 * was slower (when the rounding was to nearest: 2-vCPU EPYC (Zen 4) VM, benchmarks/host_kernel_driver.c
 * `bf16 cache`, see docs/RESULTS.md). Same bits: adam_vec1's operations in its order, and SR's draws and
 * rounding (sr_bits, f32_to_bf16_sr) in 16 lanes; mt_bf16_check compares them on every fp32. */
static inline __m256i bf16x16_sr(__m512 x, __m512i r) { /* SR of 16 values none of which is a NaN */
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16));
}
static inline void f32x16_to_bf16_sr(__m512 x, __m512i r, uint16_t *q) {
    const __m512i y = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    const __m512i out = _mm512_mask_mov_epi32(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtepi32_epi16(out));
}
/* The draws of elements i .. i + 15 (indices in the tensor; SR): lane k's Weyl product is the first's plus k WEYL */
#define SR_LANE(k) ((int32_t)((k) * SR_WEYL))
static inline __m512i sr_bits16(const Coef *c, int64_t i) {
    const __m512i lanes = _mm512_set_epi32(SR_LANE(15u), SR_LANE(14u), SR_LANE(13u), SR_LANE(12u), SR_LANE(11u),
                                           SR_LANE(10u), SR_LANE(9u), SR_LANE(8u), SR_LANE(7u), SR_LANE(6u),
                                           SR_LANE(5u), SR_LANE(4u), SR_LANE(3u), SR_LANE(2u), SR_LANE(1u), 0);
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32((int32_t)((uint32_t)(c->origin + i) * SR_WEYL)), lanes);
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_set1_epi32((int32_t)c->seed)), _mm512_set1_epi32((int32_t)SR_MUL));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
static inline __m512 grad16(const float *g) { return _mm512_loadu_ps(g); }
static inline __m512 grad16_bf16(const uint16_t *g) { return bf16x16_to_f32(g); }

/* One vector of 16 (gradient already loaded as fp32): adam_vec1's operations in its order. `small`: torch's lerp
 * from m (else back from g); `scaled`: factor != 1 (g * 1.0f is g, so an unclipped step skips the multiply). */
typedef struct {
    __m512 fac, lerp, b2, c2, bc2, eps, nstep, decay;
} Vec16;
static inline __attribute__((always_inline)) void bf16_update16(const int small, const int scaled, float *p,
                                                                __m512 gr, uint16_t *m, uint16_t *v,
                                                                const Vec16 *k, __m512i h) {
    const __m512 gi = scaled ? _mm512_mul_ps(gr, k->fac) : gr;
    const __m512 mo = bf16x16_to_f32(m), vo = bf16x16_to_f32(v);
    const __m512 mi = _mm512_fmadd_ps(k->lerp, _mm512_sub_ps(gi, mo), small ? mo : gi);
    const __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(k->c2, gi), gi, _mm512_mul_ps(vo, k->b2));
    const __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), k->bc2), k->eps);
    const __m512 u = _mm512_div_ps(_mm512_mul_ps(k->nstep, mi), den);
    _mm512_storeu_ps(p, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p), k->decay), u));
    const __m512i rm = _mm512_srli_epi32(h, 16), rv = _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF));
    if (__builtin_expect(_mm512_cmp_ps_mask(mi, vi, _CMP_UNORD_Q) != 0, 0)) { /* a NaN in either: one test */
        f32x16_to_bf16_sr(mi, rm, m);
        f32x16_to_bf16_sr(vi, rv, v);
        return;
    }
    _mm256_storeu_si256((__m256i *)m, bf16x16_sr(mi, rm));
    _mm256_storeu_si256((__m256i *)v, bf16x16_sr(vi, rv));
}

/* Elements [a, the last multiple of 16 from a that b allows) of a loop over bf16 moments (torch's vector body:
 * b <= nvec), 64 per pass with the element loop's prefetch, compiled once per gradient dtype, lerp form and
 * `scaled`; returns where it stopped. */
#define BF16_VECTOR(NAME, GT, LOADG16)                                                                      \
    static inline __attribute__((always_inline)) int64_t NAME##_body(                                     \
        const int small, const int scaled, float *restrict p, const GT *restrict g, uint16_t *restrict m,  \
        uint16_t *restrict v, int64_t a, int64_t b, const Coef *c, float factor) {                         \
        const Vec16 k = {_mm512_set1_ps(factor), _mm512_set1_ps(c->lerp_coeff), _mm512_set1_ps(c->beta2),   \
                         _mm512_set1_ps(c->c2), _mm512_set1_ps(c->bc2_sqrt), _mm512_set1_ps(c->eps),        \
                         _mm512_set1_ps(c->neg_step_size), _mm512_set1_ps(c->decay)};                       \
        int64_t i = a;                                                                                      \
        for (; i + CHUNK <= b; i += CHUNK) {                                                                \
            if (i + AHEAD + CHUNK <= b) PREFETCH_STATE(i + AHEAD, i + AHEAD + CHUNK);                      \
            for (int j = 0; j < CHUNK; j += 16)                                                             \
                bf16_update16(small, scaled, p + i + j, LOADG16(g + i + j), m + i + j, v + i + j, &k,       \
                              sr_bits16(c, i + j));                                                         \
        }                                                                                                   \
        for (; i + 16 <= b; i += 16)                                                                        \
            bf16_update16(small, scaled, p + i, LOADG16(g + i), m + i, v + i, &k, sr_bits16(c, i));         \
        return i;                                                                                           \
    }                                                                                                       \
    static int64_t NAME(float *restrict p, const GT *restrict g, uint16_t *restrict m, uint16_t *restrict v, \
                        int64_t a, int64_t b, const Coef *c, float factor) {                                \
        if (factor != 1.0f)                                                                                 \
            return c->lerp_small ? NAME##_body(1, 1, p, g, m, v, a, b, c, factor)                           \
                                 : NAME##_body(0, 1, p, g, m, v, a, b, c, factor);                          \
        return c->lerp_small ? NAME##_body(1, 0, p, g, m, v, a, b, c, factor)                               \
                             : NAME##_body(0, 0, p, g, m, v, a, b, c, factor);                              \
    }
BF16_VECTOR(vector_f32_bf16, float, grad16)
BF16_VECTOR(vector_bf16_bf16, uint16_t, grad16_bf16)
#undef BF16_VECTOR
#endif

/* fp32 or bf16 moments, fp32 or bf16 gradients: one loop over [a, b), all in place; VEC, where there is one,
 * takes torch's vector body first, 16 at a time. */
#define LOOP(NAME, GT, LOADG, MT, LOADM, STOREM, VEC)                                                        \
    static void NAME(float *restrict p, const GT *restrict g, MT *restrict m, MT *restrict v, int64_t a,    \
                     int64_t b, int64_t nvec, const Coef *c, float factor) {                                \
        int64_t split = nvec < a ? a : nvec > b ? b : nvec;                                                 \
        const int64_t from = VEC;                                                                           \
        ELEMENTS(adam_vec1, from, split, LOADG, LOADM, STOREM)                                              \
        ELEMENTS(adam_tail1, split, b, LOADG, LOADM, STOREM)                                                \
    }

#define SAME(x) (x)
#define KEEP(x, i, half) (x)
/* SR of element i's moment by `half` (16: the first moment's) of its draw */
#define SR(x, i, half) f32_to_bf16_sr(x, (sr_bits(c->seed, (uint32_t)(c->origin + (i))) >> (half)) & 0xFFFFu)
LOOP(loop_f32_f32, float, SAME, float, SAME, KEEP, a)
LOOP(loop_bf16_f32, uint16_t, bf16_to_f32, float, SAME, KEEP, a)
#ifdef BF16_AVX512
LOOP(loop_f32_bf16, float, SAME, uint16_t, bf16_to_f32, SR, vector_f32_bf16(p, g, m, v, a, split, c, factor))
LOOP(loop_bf16_bf16, uint16_t, bf16_to_f32, uint16_t, bf16_to_f32, SR, vector_bf16_bf16(p, g, m, v, a, split, c, factor))
#else
LOOP(loop_f32_bf16, float, SAME, uint16_t, bf16_to_f32, SR, a)
LOOP(loop_bf16_bf16, uint16_t, bf16_to_f32, uint16_t, bf16_to_f32, SR, a)
#endif

/* y rounded as FP8_CODES' first step, to fp16 at a scale of 1 / 256 (fp16(y / 256) x 256, exactly): to 11
 * significant bits by round-to-nearest-even from 2^-6 up, to a multiple of 2^-16 below (fp16's subnormal step
 * there: 2^-24 x 256). A NaN or an inf stays. */
static inline float fp16_grid(float y) {
    const uint32_t u = bits(y) & 0x7FFFFFFFu, sign = bits(y) & 0x80000000u;
    const uint32_t normal = ((u + 0xFFFu + ((u >> 13) & 1)) & ~0x1FFFu) | sign;
    const uint32_t sub = bits((from_bits(u) + 0x1p7f) - 0x1p7f) | sign; /* 2^7's ulp is 2^-16 */
    return from_bits(pick(u >= 0x7F800000u, bits(y), pick(u >= (121u << 23), normal, sub)));
}

/* FP8_CODES' code of a finite y, clamped to +-448 first: after fp16_grid, c10's rounding (normal or subnormal)
 * of its magnitude, clamped as an integer (finite floats' magnitudes order as their bits do), so nothing
 * saturates or is NaN. */
static inline uint32_t finite_to_fp8(float y) {
    const uint32_t denorm_mask = 141u << 23, top = 0x43E00000u; /* 448.0f */
    const uint32_t sign = (bits(y) >> 24) & 0x80u;
    uint32_t u = bits(y) & 0x7FFFFFFFu;
    u = bits(fp16_grid(from_bits(u < top ? u : top)));
    const uint32_t sub = bits(from_bits(u) + from_bits(denorm_mask)) - denorm_mask;
    const uint32_t normal = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1)) >> 20;
    return pick(u < (121u << 23), sub, normal) | sign;
}

/* A block whose amax of |x| has the bits `top` (finite): its scale, what dequantising multiplies by, is amax / 448;
 * requantising multiplies by its quantiser r = 448 / amax (at most FLT_MAX: an all-zero block's zeros times it
 * are zeros) and clamps to +-448, as host_state._quant does. One rounding of x r where x / scale divided. */
static inline float block_scale(uint32_t top) { return from_bits(top) / 448.0f; }
static inline float block_quantiser(uint32_t top) {
    const float r = 448.0f / from_bits(top);
    return r < 0x1.fffffep127f ? r : 0x1.fffffep127f;
}

#ifdef FP8_AVX512
/* fp8 moments 16 at a time with AVX-512 (its F16C conversions and byte ops): the same bits as the element
 * functions, written out because the compiler's vectorisation of those left fp8 at half the memory's rate.
 * tests/runtime/test_host_kernel.py checks both conversions against the element functions on every input. */

/* 16 float8_e4m3fn -> fp32 times `s256` (the block scale x 256). Each byte sign-extended to 16 bits, shifted
 * left 7 and its bit 14 cleared is the fp16 of its value / 256, exactly: e4m3's exponent (bias 7) lands in
 * fp16's (bias 15) and its subnormals are fp16 subnormals. value x s = (fp16 x 256) x s = fp16 x (256 s): one
 * rounding of the same product, with 256 s exact below 2^120. The NaN codes (0x7f, 0xff) would decode as
 * +-480: a block holding one takes the element loop (codes_above). */
static inline __m512 fp8x16_to_f32(const uint8_t *q, __m512 s256, int positive) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q);
    const __m256i h = positive ? _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7) /* codes below 0x7f */
                               : _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                                  _mm256_set1_epi16((short)0xBF80));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), s256);
}

/* Whether a block's BLOCK codes hold a NaN code: the max of (code | 0x80) is 0xff only then. With `low`, any
 * code from 0x7f up: a NaN or a negative value (a second moment's codes hold neither). */
static inline int codes_above(const uint8_t *q, int low) {
    const __m512i top = _mm512_set1_epi8(low ? 0 : (char)0x80);
    __m512i x = _mm512_or_si512(_mm512_loadu_si512(q), top);
    for (int i = 64; i < BLOCK; i += 64) x = _mm512_max_epu8(x, _mm512_or_si512(_mm512_loadu_si512(q + i), top));
    return _mm512_cmpge_epu8_mask(x, _mm512_set1_epi8(low ? 0x7F : (char)0xFF)) != 0;
}

/* FP8_CODES 16 or 32 at a time. fp16x16_round: 16 fp16 h of y = x r / 256 (|y| <= 1.75: bit 14, the top of
 * the exponent, is 0) rounded as integers: with `sign`, bit 14 first takes the sign (bit 15; a second moment's
 * values are not negative and skip it), then the bits are rounded to nearest even at bit 7 (e4m3's step, 2^-17 in
 * fp16's subnormals, which the step continues exactly, and 3 mantissa bits above); bits 7-14 are the code, the
 * high byte of the word doubled, which is what it returns. high_bytes16 packs the 16 codes. f32x16_to_fp8: x times
 * r8 = r x 2^-8 (r: the block's quantiser, r8 normal), which is x r / 256 exactly (where it is not, |x r| <
 * 2^-118 and both are codes of +-0), to fp16 by vcvtps2ph (round-to-nearest-even), to codes. No clamp: |x| <= amax
 * and r <= 448 / amax (1 + 2^-24), so |x r| is at most a few ulps above 448, whose fp16 at 1 / 256 is 1.75 as
 * clamped. fp8x32_store: the codes of 16 first and 16 second moments. All in 256-bit vectors: a 512-bit operation
 * costs a 2-vCPU EPYC (Zen 4) two 256-bit ones, so joining two moments' halves into one was an operation more
 * (docs/RESULTS.md, "fp8 phase by phase"). */
static inline __m256i fp16x16_round(__m256i h, const int sign) {
    if (sign) h = _mm256_ternarylogic_epi32(h, _mm256_srai_epi16(h, 1), _mm256_set1_epi16(0x4000), 0xD8);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(h, 7), _mm256_set1_epi16(1));
    const __m256i r = _mm256_add_epi16(_mm256_add_epi16(h, _mm256_set1_epi16(0x3F)), odd);
    return _mm256_add_epi16(r, r);
}
static inline __m128i high_bytes16(__m256i w) {
#ifdef __AVX512VBMI__ /* one byte permutation */
    const __m256i high = _mm256_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 31, 29, 27, 25, 23, 21, 19,
                                         17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm256_castsi256_si128(_mm256_permutexvar_epi8(high, w));
#else
    return _mm256_cvtepi16_epi8(_mm256_srli_epi16(w, 8));
#endif
}
#define TO_FP16(X, R8) _mm512_cvtps_ph(_mm512_mul_ps(X, R8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline __m128i f32x16_to_fp8(__m512 x, __m512 r8) { return high_bytes16(fp16x16_round(TO_FP16(x, r8), 1)); }
static inline void fp8x32_store(__m512 xm, __m512 r8m, __m512 xv, __m512 r8v, uint8_t *qm, uint8_t *qv) {
    _mm_storeu_si128((__m128i *)qm, f32x16_to_fp8(xm, r8m));
    _mm_storeu_si128((__m128i *)qv, high_bytes16(fp16x16_round(TO_FP16(xv, r8v), 0)));
}
#undef TO_FP16
#endif

/* fp32 x[0, n) -> fp8 q for a block whose amax of |x| has the bits `top`, scale s. A finite block takes
 * finite_to_fp8 (or f32x16_to_fp8, the same bits) of x times its quantiser, 1.7x faster than c10's whole
 * conversion, which a block holding a NaN or an inf takes (x / s clamped to +-448: 0 or NaN). */
static void quant_fp8(const float *x, int n, uint32_t top, float s, uint8_t *q) {
    if (top <= 0x7F7FFFFFu) {
        const float r = block_quantiser(top);
        int i = 0;
#ifdef FP8_AVX512
        if (r >= 0x1p-118f) {
            const __m512 r8 = _mm512_set1_ps(r * 0x1p-8f);
            for (; i + 16 <= n; i += 16) _mm_storeu_si128((__m128i *)(q + i), f32x16_to_fp8(_mm512_loadu_ps(x + i), r8));
        }
#endif
        for (; i < n; i++) q[i] = (uint8_t)finite_to_fp8(x[i] * r);
        return;
    }
    const float d = s > 0 ? s : 1.0f;
    for (int i = 0; i < n; i++) {
        const float y = x[i] / d, lo = y < -448.0f ? -448.0f : y;
        q[i] = f32_to_fp8(fp16_grid(lo > 448.0f ? 448.0f : lo));
    }
}

/* A block's requantisation: now (quant_fp8), or, for a finite block the vector loop updated (`vector`: full,
 * and its second moment never negative, which that loop's decoding and amax need), deferred: the result is
 * where its codes go (NULL: written) and *r8 its quantiser x 2^-8, for the next block's update loop (finish). */
static inline uint8_t *requant(const float *x, int n, uint32_t top, float s, uint8_t *q, float *r8, int vector) {
#ifdef FP8_AVX512
    const float r = block_quantiser(top); /* (a non-finite block fails the test on top) */
    if (vector && top <= 0x7F7FFFFFu && r >= 0x1p-118f) {
        *r8 = r * 0x1p-8f;
        return q;
    }
#else
    (void)r8, (void)vector;
#endif
    quant_fp8(x, n, top, s, q);
    return NULL;
}

#ifdef FP8_AVX512
/* A deferred block's codes from `from` on (none when q is NULL). */
static inline void finish(uint8_t *q, const float *x, float r8, int from) {
    for (int i = from; q && i < BLOCK; i += 16)
        _mm_storeu_si128((__m128i *)(q + i), f32x16_to_fp8(_mm512_load_ps(x + i), _mm512_set1_ps(r8)));
}
#endif

/* The running amax of |x| (torch.amax: NaN if any is) in TOP, an unsigned integer: |x| as one orders as the
 * float does, NaN above everything, so the integer max is the float's, and it vectorises. */
#define TOP_ABS(TOP, X)                                                                                     \
    do {                                                                                                    \
        const uint32_t u_ = bits(X) & 0x7FFFFFFFu;                                                          \
        TOP = u_ > TOP ? u_ : TOP;                                                                          \
    } while (0)

/* fp8 moments (with either gradient dtype): BLOCK at a time, each element's gradient and moments expanded and
 * updated in one pass into fp32 locals (FP8_ELEMENTS, or 16 at a time with AVX-512), which also takes the
 * block's amax of each moment, then each block requantised. The second moment's floor max(x, tiny) is
 * `x < tiny ? tiny : x`, NaN kept (it compares false; tiny is NaN only where the scale is, and then x is NaN
 * too), as torch.maximum does; _mm512_max_ps(tiny, x) is the same select. The vector loop takes a full block
 * whose scales are below 2^120 (256 s exact), whose first moment's codes hold no NaN and whose second moment's
 * codes and scale are not negative (only a corrupt state's are); any other block, the elements past the last
 * 16 of the vector body and torch's scalar tail take FP8_ELEMENTS, with the same formulas. */
#define FP8_ELEMENTS(FN, FROM, TO)                                                                          \
    for (int i = (FROM); i < (TO); i++) {                                                                   \
        const float gi = grad_bf16 ? bf16_to_f32(((const uint16_t *)grad)[a + i])                           \
                                   : ((const float *)grad)[a + i];                                          \
        const float x = fp8_to_f32(v[a + i]) * vs;                                                          \
        float mi = fp8_to_f32(m[a + i]) * ms, vi = x < tiny ? tiny : x;                                     \
        FN(p + a + i, gi * factor, &mi, &vi, c, 1);                                                         \
        bm[i] = mi;                                                                                         \
        bv[i] = vi;                                                                                         \
        TOP_ABS(top_m, mi);                                                                                 \
        TOP_ABS(top_v, vi);                                                                                 \
    }
#ifdef FP8_AVX512
/* A full block's update 16 elements at a time (as many 16s as its vector body holds: the count returned), into
 * bm / bv and the amaxes' bits in *top_m / *top_v, the pending block's codes (om / ov times r8m / r8v into
 * pend_m / pend_v, both or neither) written alongside. Compiled once per combination of the gradient's dtype,
 * torch's lerp form (`small`: from m, else back from g) and `scaled` (factor != 1; g * 1.0f is g, so an
 * unclipped step skips the multiply). The second moment's codes and values are never negative (the caller
 * checks its codes and scale; v = (1 - b2) g^2 + b2 v_old with 1 - b2 >= 0 is +0 or more, or NaN), so its amax is the
 * integer max of its bits as they are (a NaN above any number, of either sign), and its decoding skips the
 * sign. The first moment's amax is vrangeps's max of magnitudes, which drops NaNs (maxNum): a NaN first moment
 * comes only from a gradient that is not finite (the moments decoded are finite), which makes the second
 * moment inf or NaN, and then the first moment's amax is taken again. */
static inline __attribute__((always_inline)) int fp8_vector_block(
    const int grad_bf16, const int small, const int scaled, float *p, const void *grad, const uint8_t *m,
    const uint8_t *v, int64_t a, int64_t end, int nv, float ms, float vs, float factor, const Coef *c, float *bm,
    float *bv, const float *om, const float *ov, uint8_t *pend_m, uint8_t *pend_v, float r8m, float r8v,
    uint32_t *top_m, uint32_t *top_v) {
    __m512 tm = _mm512_setzero_ps();
    __m512i tv = _mm512_setzero_si512();
    const __m512 ms256 = _mm512_set1_ps(ms * 256.0f), vs256 = _mm512_set1_ps(vs * 256.0f);
    const __m512 vtiny = _mm512_set1_ps(vs * 0x1p-9f), fac = _mm512_set1_ps(factor), decay = _mm512_set1_ps(c->decay);
    const __m512 lerp = _mm512_set1_ps(c->lerp_coeff), b2 = _mm512_set1_ps(c->beta2), c2 = _mm512_set1_ps(c->c2);
    const __m512 ibc2 = _mm512_set1_ps(c->inv_bc2_sqrt), eps = _mm512_set1_ps(c->eps);
    const __m512 nstep = _mm512_set1_ps(c->neg_step_size), r8mv = _mm512_set1_ps(r8m), r8vv = _mm512_set1_ps(r8v);
    /* G groups of 16 (64 elements per pass, then one at a time), phase by phase across the groups: every
     * group's expansion and moments, then their square roots (each group's pending codes written between
     * them), then their divisions and weights. Written group by group (expand, root, divide, codes, then the
     * next group) the same operations took 0.540 ns per element, phase by phase 0.491 (2-vCPU EPYC, Zen 4,
     * `fp8 cache`; 0.476 with fp8x32_store's 256-bit rounding): independent square roots and divisions side by
     * side in the program, most likely more of them in the core's window at once. Codes after the divisions
     * or before the expansions measured slower. */
#define FP8_GROUPS(I0, G)                                                                                   \
    do {                                                                                                    \
        __m512 mi[G], vi[G], den[G];                                                                        \
        for (int j = 0; j < (G); j++) {                                                                     \
            const int64_t k = a + (I0) + 16 * j;                                                            \
            const __m512 gr = grad_bf16 ? bf16x16_to_f32((const uint16_t *)grad + k)                       \
                                        : _mm512_loadu_ps((const float *)grad + k);                         \
            const __m512 g = scaled ? _mm512_mul_ps(gr, fac) : gr;                                          \
            const __m512 mo = fp8x16_to_f32(m + k, ms256, 0);                                               \
            const __m512 vo = _mm512_max_ps(vtiny, fp8x16_to_f32(v + k, vs256, 1)); /* x < tiny ? tiny : x */ \
            mi[j] = _mm512_fmadd_ps(lerp, _mm512_sub_ps(g, mo), small ? mo : g);                            \
            vi[j] = _mm512_fmadd_ps(_mm512_mul_ps(c2, g), g, _mm512_mul_ps(vo, b2));                        \
        }                                                                                                   \
        for (int j = 0; j < (G); j++) {                                                                     \
            const int i_ = (I0) + 16 * j;                                                                   \
            den[j] = _mm512_fmadd_ps(_mm512_sqrt_ps(vi[j]), ibc2, eps);                                     \
            if (pend_m)                                                                                     \
                fp8x32_store(_mm512_load_ps(om + i_), r8mv, _mm512_load_ps(ov + i_), r8vv, pend_m + i_,     \
                             pend_v + i_);                                                                  \
        }                                                                                                   \
        for (int j = 0; j < (G); j++) {                                                                     \
            const int i_ = (I0) + 16 * j;                                                                   \
            const int64_t k = a + i_;                                                                       \
            const __m512 u = _mm512_div_ps(_mm512_mul_ps(nstep, mi[j]), den[j]);                            \
            _mm512_storeu_ps(p + k, _mm512_fmadd_ps(_mm512_loadu_ps(p + k), decay, u));                     \
            _mm512_store_ps(bm + i_, mi[j]);                                                                \
            _mm512_store_ps(bv + i_, vi[j]);                                                                \
            tm = _mm512_range_ps(tm, mi[j], 0x0B); /* max of |tm|, |mi|, sign cleared */                   \
            tv = _mm512_max_epu32(tv, _mm512_castps_si512(vi[j]));                                          \
        }                                                                                                   \
    } while (0)
    /* 64 elements per pass: their lines AHEAD prefetched one or two per 16 elements (a block's all at once
     * issued 32 misses in a burst, more than the core's fill buffers hold: out of cache, 12M elements, 1 thread,
     * ns per element 1.07 against 0.92), and a quarter of the loop's own instructions. */
    int i0 = 0;
    for (; i0 + 64 <= nv; i0 += 64) {
        const int64_t ahead = a + i0 + AHEAD;
        if (ahead + 64 <= end) {
            for (int j = 0; j < 64; j += 16) __builtin_prefetch(p + ahead + j, 1, 3);
            for (int j = 0; j < 64; j += 64 / (grad_bf16 ? 2 : 4))
                __builtin_prefetch((const char *)grad + (ahead + j) * (grad_bf16 ? 2 : 4), 0, 3);
            __builtin_prefetch(m + ahead, 1, 3);
            __builtin_prefetch(v + ahead, 1, 3);
        }
        FP8_GROUPS(i0, 4);
    }
    for (; i0 + 16 <= nv; i0 += 16) FP8_GROUPS(i0, 1);
#undef FP8_GROUPS
    *top_m = _mm512_reduce_max_epu32(_mm512_and_si512(_mm512_castps_si512(tm), _mm512_set1_epi32(0x7FFFFFFF)));
    *top_v = _mm512_reduce_max_epu32(tv);
    if (*top_v >= 0x7F800000u) { /* a gradient was not finite: the first moment's amax again, its NaNs kept */
        uint32_t top = 0;
        for (int i = 0; i < i0; i++) TOP_ABS(top, bm[i]);
        *top_m = top;
    }
    return i0;
}
#endif

static inline __attribute__((always_inline)) void loop_fp8_body(
    int grad_bf16, float *p, const void *grad, uint8_t *m, uint8_t *v, float *m_scale, float *v_scale,
    int64_t begin, int64_t end, int64_t nvec, const Coef *cc, float factor) {
    const Coef *c = cc;
    float mf[2][BLOCK] __attribute__((aligned(64))), vf[2][BLOCK] __attribute__((aligned(64)));
    int cur = 0;
#ifdef FP8_AVX512
    /* Prefetching a block's lines AHEAD at once at its start (as the element loop does) issued 32 misses in a
     * burst, more than the core's fill buffers hold: issued one or two per 16 elements, out of cache (12M
     * elements, 1 thread) ns per element went from 1.07 to 0.92. */
    /* Software pipelining: a full finite block's requantisation waits for the next block's update loop, which
     * writes it out 16 codes per 16 elements updated, so the update's divisions and square roots overlap the
     * conversions' integer work; requantising each block after its own update left the core draining its
     * window at every block's end (in cache, 0.95 against 0.89 ns per element). pend_m / pend_v: where the
     * pending block's codes go (NULL: none pending); its values are in mf / vf[cur ^ 1]. */
#endif
    uint8_t *pend_m = NULL, *pend_v = NULL;
    float r8m = 0.0f, r8v = 0.0f;
    for (int64_t a = begin; a < end; a += BLOCK, cur ^= 1) {
        const int n = (int)(end - a < BLOCK ? end - a : BLOCK);
        const int nv = nvec <= a ? 0 : nvec >= a + n ? n : (int)(nvec - a);
        const float ms = m_scale[a / BLOCK], vs = v_scale[a / BLOCK], tiny = vs * 0x1p-9f;
        float *bm = mf[cur], *bv = vf[cur];
        uint32_t top_m = 0, top_v = 0;
        int i0 = 0, vector = 0;
#ifdef FP8_AVX512
        const float *om = mf[cur ^ 1], *ov = vf[cur ^ 1];
        vector = n == BLOCK && ms < 0x1p120f && vs >= 0.0f && vs < 0x1p120f && c->c2 >= 0.0f &&
                 !codes_above(m + a, 0) && !codes_above(v + a, 1); /* v >= 0: fp8_vector_block */
#endif
        if (!vector) { /* the vector loop prefetches as it goes */
            const int64_t f0 = a + AHEAD, f1 = a + AHEAD + BLOCK < end ? a + AHEAD + BLOCK : end;
            PREFETCH(p, f0, f1, 1);
            PREFETCH(m, f0, f1, 1);
            PREFETCH(v, f0, f1, 1);
            if (grad_bf16)
                PREFETCH((const uint16_t *)grad, f0, f1, 0);
            else
                PREFETCH((const float *)grad, f0, f1, 0);
        }
#ifdef FP8_AVX512
        if (vector) {
            if (!pend_m != !pend_v) { /* one moment's block deferred (the other's quantiser was tiny): now */
                finish(pend_m, om, r8m, 0);
                finish(pend_v, ov, r8v, 0);
                pend_m = pend_v = NULL;
            }
#define FP8_VECTOR(SMALL, SCALED)                                                                           \
    fp8_vector_block(grad_bf16, SMALL, SCALED, p, grad, m, v, a, end, nv, ms, vs, factor, c, bm, bv, om, ov,    \
                     pend_m, pend_v, r8m, r8v, &top_m, &top_v)
            if (factor != 1.0f)
                i0 = c->lerp_small ? FP8_VECTOR(1, 1) : FP8_VECTOR(0, 1);
            else
                i0 = c->lerp_small ? FP8_VECTOR(1, 0) : FP8_VECTOR(0, 0);
#undef FP8_VECTOR
        }
        finish(pend_m, om, r8m, i0);
        finish(pend_v, ov, r8v, i0);
#endif
        FP8_ELEMENTS(adam_vec1, i0, nv)
        FP8_ELEMENTS(adam_tail1, nv > i0 ? nv : i0, n)
        const float sm = block_scale(top_m), sv = block_scale(top_v);
        m_scale[a / BLOCK] = sm;
        v_scale[a / BLOCK] = sv;
        pend_m = requant(bm, n, top_m, sm, m + a, &r8m, vector);
        pend_v = requant(bv, n, top_v, sv, v + a, &r8v, vector);
    }
#ifdef FP8_AVX512
    finish(pend_m, mf[cur ^ 1], r8m, 0);
    finish(pend_v, vf[cur ^ 1], r8v, 0);
#else
    (void)pend_m, (void)pend_v; /* always NULL: requant writes every block at once */
#endif
}
#define FP8_LOOP(NAME, GB)                                                                                  \
    static void NAME(float *p, const void *g, uint8_t *m, uint8_t *v, float *ms, float *vs, int64_t a,      \
                     int64_t b, int64_t nvec, const Coef *c, float f) {                                     \
        loop_fp8_body(GB, p, g, m, v, ms, vs, a, b, nvec, c, f);                                            \
    }
FP8_LOOP(loop_fp8_f32, 0)
FP8_LOOP(loop_fp8_bf16, 1)

/* Elements [begin, end) of one tensor of the policy's storage; [nvec, numel) is torch's scalar tail. For fp8
 * moments begin is a multiple of BLOCK (blocks start at the tensor's first element) and the scales are the
 * tensor's own. */
void mt_adamw(float *param, const void *grad, void *exp_avg, void *exp_avg_sq, float *avg_scale,
              float *sq_scale, int64_t begin, int64_t end, int64_t nvec, const Hyper *h) {
    const Coef c = coefficients(h);
    const float f = h->factor;
    if (h->moments == 2 && h->grad_bf16)
        loop_fp8_bf16(param, grad, exp_avg, exp_avg_sq, avg_scale, sq_scale, begin, end, nvec, &c, f);
    else if (h->moments == 2)
        loop_fp8_f32(param, grad, exp_avg, exp_avg_sq, avg_scale, sq_scale, begin, end, nvec, &c, f);
    else if (h->moments == 1 && h->grad_bf16)
        loop_bf16_bf16(param, grad, exp_avg, exp_avg_sq, begin, end, nvec, &c, f);
    else if (h->moments == 1)
        loop_f32_bf16(param, grad, exp_avg, exp_avg_sq, begin, end, nvec, &c, f);
    else if (h->grad_bf16)
        loop_bf16_f32(param, grad, exp_avg, exp_avg_sq, begin, end, nvec, &c, f);
    else
        loop_f32_f32(param, grad, exp_avg, exp_avg_sq, begin, end, nvec, &c, f);
}

/* For tests/runtime/test_host_kernel.py: the vector conversions' mismatches against the element functions, over
 * every code (scale 1; the positive decoding over those below 0x7f) and every `stride`-th fp32 bit pattern of
 * [0, 448] and 256 ulps past it (as clamped to 448), each of both signs (fp8x32_store's second half: their
 * magnitudes); the encodings against FP8_CODES' definition, c10's rounding of fp16_grid of the value, and
 * finite_to_fp8. With stride 1 that is every fp32 a vector encoding meets: fp16_grid equals vcvtps2ph on all of
 * them. Part `part` of `parts` (the patterns dealt out 8 at a time; part 0 also checks the codes), so that
 * threads can share the work. -1 where the vector code is not built (no AVX-512 where it was compiled). */
int64_t mt_fp8_check(uint32_t stride, uint32_t part, uint32_t parts) {
#ifdef FP8_AVX512
    int64_t bad = 0;
    uint8_t q[16], qm[16], qv[16];
    float x[16], y[16];
    for (int c = 0; part == 0 && c < 256; c += 16) { /* both decodings (`positive`: of the codes below 0x7f) */
        for (int j = 0; j < 16; j++) q[j] = (uint8_t)(c + j);
        _mm512_storeu_ps(x, fp8x16_to_f32(q, _mm512_set1_ps(256.0f), 0));
        _mm512_storeu_ps(y, fp8x16_to_f32(q, _mm512_set1_ps(256.0f), 1));
        for (int j = 0; j < 16; j++)
            bad += ((q[j] & 0x7f) != 0x7f && bits(x[j]) != bits(fp8_to_f32(q[j]))) ||
                   (q[j] < 0x7f && bits(y[j]) != bits(fp8_to_f32(q[j])));
    }
    const uint64_t top = 0x43E00100u, step = stride ? stride : 1; /* 256 ulps past 448: as clamped */
    for (uint64_t u0 = 8 * step * part; u0 <= top; u0 += 8 * step * parts) {
        for (int j = 0; j < 16; j++) { /* 8 patterns, positive then negative */
            const uint64_t u = u0 + (uint64_t)(j % 8) * step;
            x[j] = from_bits((uint32_t)(u < top ? u : top) | (j < 8 ? 0u : 0x80000000u));
        }
        const __m512 r8 = _mm512_set1_ps(0x1p-8f), xs = _mm512_loadu_ps(x);
        _mm_storeu_si128((__m128i *)q, f32x16_to_fp8(xs, r8));
        fp8x32_store(xs, r8, _mm512_abs_ps(xs), r8, qm, qv); /* v's half: |x| */
        for (int j = 0; j < 16; j++) {
            const float clamped = fabsf(x[j]) <= 448.0f ? x[j] : copysignf(448.0f, x[j]);
            bad += q[j] != f32_to_fp8(fp16_grid(clamped)) || q[j] != (uint8_t)finite_to_fp8(x[j]) ||
                   qm[j] != q[j] || qv[j] != f32_to_fp8(fp16_grid(fabsf(clamped)));
        }
    }
    return bad;
#else
    (void)stride, (void)part, (void)parts;
    return -1;
#endif
}

/* For tests/runtime/test_host_kernel.py: the vector SR's mismatches (sr_bits16, f32x16_to_bf16_sr: both halves
 * of the draw) against the element loop's (SR) over every `stride`-th fp32 bit pattern, 16 consecutive ones per
 * vector, each drawn at its pattern as the index (stride 1: all 2^32, NaNs, infinities and subnormals
 * included); part `part` of `parts`, dealt out a vector at a time. -1 where the vector code is not built. */
int64_t mt_bf16_check(uint32_t stride, uint32_t part, uint32_t parts) {
#ifdef BF16_AVX512
    int64_t bad = 0;
    float x[16];
    uint16_t qm[16], qv[16];
    Coef cc;
    const Coef *c = &cc; /* what SR reads */
    cc.seed = 0x9E3779B9u, cc.origin = 0;
    const uint64_t step = stride ? stride : 1;
    for (uint64_t u0 = 16 * step * part; u0 < (1ull << 32); u0 += 16 * step * parts) {
        for (int j = 0; j < 16; j++) x[j] = from_bits((uint32_t)(u0 + (uint64_t)j * step));
        const __m512i h = sr_bits16(c, (int64_t)u0);
        f32x16_to_bf16_sr(_mm512_loadu_ps(x), _mm512_srli_epi32(h, 16), qm);
        f32x16_to_bf16_sr(_mm512_loadu_ps(x), _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF)), qv);
        for (int j = 0; j < 16; j++)
            bad += (qm[j] != SR(x[j], (int64_t)u0 + j, 16)) + (qv[j] != SR(x[j], (int64_t)u0 + j, 0));
    }
    return bad;
#else
    (void)stride, (void)part, (void)parts;
    return -1;
#endif
}
