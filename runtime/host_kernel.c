/* One pass of the host optimizer: AdamW over fp32 masters with the policy's gradient and moment storage
 * expanded, updated and rounded back element by element (runtime/host_kernel.py builds and loads it).
 *
 * Bits: every operation is one that torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
 * ADAMW mode) performs on fp32, in the same order, each rounded to fp32. Torch's build contracts multiply-adds
 * into fused ones where its compiler chose to; this file is compiled with -ffp-contract=off and writes those
 * fused multiply-adds out as fmaf, as measured against torch 2.13 (x86-64, AVX-512): in the vector body the
 * first moment's lerp fma(w, g - m, m) (torch's explicit fmadd) and the second moment fma(c2 g, g, v b2); in
 * the scalar tail, the last (numel mod 8) elements of a tensor (`nvec` says where it starts; host_kernel.py
 * LANES), the same lerp and fma(v, b2, (c2 g) g). The storage conversions are c10's: bf16 by round-to-nearest-
 * even, float8_e4m3fn by fp8e4m3fn_from_fp32_value, fp8 blocks scaled as host_state.py's torch path does.
 * host_kernel.py checks the result against that path bit for bit before a machine uses this code, so a torch
 * built with other contractions runs the torch path instead.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256 /* elements per pass through the locals (= planner/host_policy.py FP8_BLOCK) */

typedef struct {
    double lr, beta1, beta2, weight_decay, eps, step; /* step: the count after this update (1-based) */
    float factor;                                      /* the gradient times it (1: as stored; g * 1.0f is g) */
    int32_t grad_bf16;   /* gradients stored as bf16 (else fp32) */
    int32_t moments;     /* 0: fp32, 1: bf16, 2: fp8 e4m3fn with per-BLOCK fp32 scales */
} Hyper;

static inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float bf16_to_f32(uint16_t h) { return from_bits((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = bits(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + (((u >> 16) & 1) + 0x7FFFu)) >> 16);
}

/* float8_e4m3fn -> fp32, exactly (0x7f and 0xff are NaN), branch-free so that loops over it vectorise: the
 * 7 magnitude bits placed under an exponent bias of 120 give 2^(e-7) x (1 + mant/8) for e > 0; for e = 0, under
 * a bias of 121 they give 2^-6 + mant x 2^-9, and subtracting 2^-6 leaves the subnormal's value exactly. Written
 * as selects on the sign-extended byte (its sign bit is fp32's), which compile to masked moves: 1.2x faster
 * than the same function as and/or masks, the same bits for all 256 inputs. */
static inline float fp8_to_f32(uint8_t q) {
    const int32_t wide = (int8_t)q;
    const uint32_t mag = (uint32_t)wide & 0x7f;
    const float r_normal = from_bits((mag << 20) + (120u << 23));
    const float r_sub = from_bits((mag << 20) + (121u << 23)) - 0x1p-6f;
    float r = mag < 8 ? r_sub : r_normal;
    r = mag == 0x7f ? from_bits(0x7FC00000u) : r;
    return from_bits(bits(r) | ((uint32_t)wide & 0x80000000u));
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
    float decay, w, lerp_coeff, beta2, c2, bc2_sqrt, eps, step_size, neg_step_size;
    int lerp_small;
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
    c.eps = (float)h->eps;
    c.step_size = (float)step_size;
    c.neg_step_size = (float)(-step_size);
    return c;
}

/* One element of torch's vector body: the gradient already scaled, p / m / v updated through the pointers. */
static inline void adam_vec1(float *p, float g, float *m, float *v, const Coef *c) {
    const float pi = *p * c->decay;
    const float mi = fmaf(c->lerp_coeff, g - *m, c->lerp_small ? *m : g); /* torch's blendv lerp */
    float vi = fmaf(c->c2 * g, g, *v * c->beta2);
    *m = mi;
    *v = vi;
    *p = pi + c->neg_step_size * mi / (sqrtf(vi) / c->bc2_sqrt + c->eps);
}

/* One element of torch's scalar tail. */
static inline void adam_tail1(float *p, float g, float *m, float *v, const Coef *c) {
    const float pi = *p * c->decay;
    /* m + w (g - m), or g - (g - m)(1 - w), contracted; -(x)(1 - w) is x (w - 1) exactly */
    const float mi = fmaf(c->lerp_coeff, g - *m, c->lerp_small ? *m : g);
    float vi = fmaf(*v, c->beta2, c->c2 * g * g);
    *m = mi;
    *v = vi;
    *p = pi - c->step_size * mi / (sqrtf(vi) / c->bc2_sqrt + c->eps);
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

/* Elements [FROM, TO) through the element function FN (adam_vec1 or adam_tail1), in place. */
#define ELEMENTS(FN, FROM, TO, LOADG, LOADM, STOREM)                                                         \
    for (int64_t i0 = FROM; i0 < TO; i0 += CHUNK) {                                                         \
        const int64_t i1 = i0 + CHUNK < TO ? i0 + CHUNK : TO, f0 = i0 + AHEAD, f1 = i1 + AHEAD < TO ? i1 + AHEAD : TO; \
        PREFETCH(p, f0, f1, 1);                                                                             \
        PREFETCH(g, f0, f1, 0);                                                                             \
        PREFETCH(m, f0, f1, 1);                                                                             \
        PREFETCH(v, f0, f1, 1);                                                                             \
        for (int64_t i = i0; i < i1; i++) {                                                                 \
            float mi = LOADM(m[i]), vi = LOADM(v[i]);                                                       \
            FN(p + i, LOADG(g[i]) * factor, &mi, &vi, c);                                                   \
            m[i] = STOREM(mi);                                                                              \
            v[i] = STOREM(vi);                                                                              \
        }                                                                                                   \
    }

/* fp32 or bf16 moments, fp32 or bf16 gradients: one loop over [a, b), all in place. */
#define LOOP(NAME, GT, LOADG, MT, LOADM, STOREM)                                                             \
    static void NAME(float *restrict p, const GT *restrict g, MT *restrict m, MT *restrict v, int64_t a,    \
                     int64_t b, int64_t nvec, const Coef *c, float factor) {                                \
        int64_t split = nvec < a ? a : nvec > b ? b : nvec;                                                 \
        ELEMENTS(adam_vec1, a, split, LOADG, LOADM, STOREM)                                                 \
        ELEMENTS(adam_tail1, split, b, LOADG, LOADM, STOREM)                                                \
    }

#define SAME(x) (x)
LOOP(loop_f32_f32, float, SAME, float, SAME, SAME)
LOOP(loop_bf16_f32, uint16_t, bf16_to_f32, float, SAME, SAME)
LOOP(loop_f32_bf16, float, SAME, uint16_t, bf16_to_f32, f32_to_bf16)
LOOP(loop_bf16_bf16, uint16_t, bf16_to_f32, uint16_t, bf16_to_f32, f32_to_bf16)

/* f32_to_fp8 of a finite y, clamped to +-448 first: the magnitude is clamped as an integer (finite floats'
 * magnitudes order as their bits do), so nothing saturates or is NaN, and the rounding is c10's normal or
 * subnormal one. */
static inline uint32_t finite_to_fp8(float y) {
    const uint32_t denorm_mask = 141u << 23, top = 0x43E00000u; /* 448.0f */
    uint32_t u = bits(y) & 0x7FFFFFFFu;
    const uint32_t sign = (bits(y) >> 24) & 0x80u;
    u = u < top ? u : top;
    const uint32_t sub = bits(from_bits(u) + from_bits(denorm_mask)) - denorm_mask;
    const uint32_t normal = (u + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1)) >> 20;
    return (u < (121u << 23) ? sub : normal) | sign;
}

/* fp32 block -> fp8 and its scale = amax / 448 (host_state._quant), given the block's amax of |x| (TOP_ABS):
 * x / scale clamped to +-448 and rounded. A finite block (amax finite) takes finite_to_fp8, 1.7x faster than
 * c10's whole conversion, which a block holding a NaN or an inf takes. */
static void store_fp8(const float *x, int n, float amax, uint8_t *q, float *scale) {
    const float s = amax / 448.0f, d = s > 0 ? s : 1.0f;
    *scale = s;
    if (amax <= 0x1.fffffep127f) {
        for (int i = 0; i < n; i++) q[i] = (uint8_t)finite_to_fp8(x[i] / d);
        return;
    }
    for (int i = 0; i < n; i++) {
        const float y = x[i] / d, lo = y < -448.0f ? -448.0f : y;
        q[i] = f32_to_fp8(lo > 448.0f ? 448.0f : lo);
    }
}

/* The running amax of |x| (torch.amax: NaN if any is) in TOP, an unsigned integer: |x| as one orders as the
 * float does, NaN above everything, so the integer max is the float's, and it vectorises. */
#define TOP_ABS(TOP, X)                                                                                     \
    do {                                                                                                    \
        const uint32_t u_ = bits(X) & 0x7FFFFFFFu;                                                          \
        TOP = u_ > TOP ? u_ : TOP;                                                                          \
    } while (0)

/* fp8 moments (with either gradient dtype): BLOCK at a time, each element's gradient and moments expanded and
 * updated in one pass into fp32 locals (FP8_ELEMENTS), which also takes the block's amax of each moment, then
 * each block requantised. The second moment's floor max(x, tiny) is `x < tiny ? tiny : x`, NaN kept (it
 * compares false; tiny is NaN only where the scale is, and then x is NaN too), as torch.maximum does. */
#define FP8_ELEMENTS(FN, FROM, TO)                                                                          \
    for (int i = (FROM); i < (TO); i++) {                                                                   \
        const float gi = grad_bf16 ? bf16_to_f32(((const uint16_t *)grad)[a + i])                           \
                                   : ((const float *)grad)[a + i];                                          \
        const float x = fp8_to_f32(v[a + i]) * vs;                                                          \
        float mi = fp8_to_f32(m[a + i]) * ms, vi = x < tiny ? tiny : x;                                     \
        FN(p + a + i, gi * factor, &mi, &vi, c);                                                            \
        mf[i] = mi;                                                                                         \
        vf[i] = vi;                                                                                         \
        TOP_ABS(top_m, mi);                                                                                 \
        TOP_ABS(top_v, vi);                                                                                 \
    }
static inline __attribute__((always_inline)) void loop_fp8_body(
    int grad_bf16, float *p, const void *grad, uint8_t *m, uint8_t *v, float *m_scale, float *v_scale,
    int64_t begin, int64_t end, int64_t nvec, const Coef *cc, float factor) {
    const Coef *c = cc;
    float mf[BLOCK], vf[BLOCK];
    for (int64_t a = begin; a < end; a += BLOCK) {
        const int n = (int)(end - a < BLOCK ? end - a : BLOCK);
        const int nv = nvec <= a ? 0 : nvec >= a + n ? n : (int)(nvec - a);
        const float ms = m_scale[a / BLOCK], vs = v_scale[a / BLOCK], tiny = vs * 0x1p-9f;
        uint32_t top_m = 0, top_v = 0;
        const int64_t f0 = a + AHEAD, f1 = a + AHEAD + BLOCK < end ? a + AHEAD + BLOCK : end;
        PREFETCH(p, f0, f1, 1);
        PREFETCH(m, f0, f1, 1);
        PREFETCH(v, f0, f1, 1);
        if (grad_bf16)
            PREFETCH((const uint16_t *)grad, f0, f1, 0);
        else
            PREFETCH((const float *)grad, f0, f1, 0);
        FP8_ELEMENTS(adam_vec1, 0, nv)
        FP8_ELEMENTS(adam_tail1, nv, n)
        store_fp8(mf, n, from_bits(top_m), m + a, m_scale + a / BLOCK);
        store_fp8(vf, n, from_bits(top_v), v + a, v_scale + a / BLOCK);
    }
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
