/* The compute-dtype cast that feeds a bf16 host-to-device copy: fp32 masters to bf16, as torch's
 * `.to(torch.bfloat16)` gives it on the CPU (runtime/host_kernel.py builds it into one library with
 * host_kernel.c and checks it against torch before a machine uses it; planner/cast.py decides where it runs).
 *
 * Bits: torch's CPU conversion is its vectorised one for every length (a tail is a masked vector), which rounds
 * to nearest even by integer arithmetic on the bits, subnormals included (nothing is flushed), and writes every
 * NaN, of either sign and any payload, as 0xFFFF (measured against torch 2.13, x86-64 AVX-512; c10's scalar
 * rounding, which host_kernel.c's bf16 moments follow, writes 0x7FC0 instead). So this is not vcvtneps2bf16,
 * which flushes subnormal inputs and keeps a NaN's sign and payload.
 *
 * Why C: torch's copy_ converts at the rate the planner priced (host bandwidth / 6 B) only with many threads;
 * the h2d worker has one or two (runtime/cpus.py), on which copy_ measured well below it (docs/RESULTS.md,
 * "Compute-dtype cast"). This loop is bound by memory: read 4 B, write 2 B per element.
 */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

void mt_adamw(float *param, const void *grad, void *exp_avg, void *exp_avg_sq, float *avg_scale,
              float *sq_scale, int64_t begin, int64_t end, int64_t nvec, const void *h);

/* STREAM: store the bf16 with non-temporal stores (from a 64-byte boundary): what is cast is read next by the
 * link's DMA (or the sim device's copy), not by this core, and a streaming store skips reading each destination
 * line before writing it: 6 B of memory traffic per element instead of 8. On the 2-core EPYC VM, 16M-element
 * casts at 1 thread interleaved over 30 rounds, G elements/s median (best): 3.16 (5.28) without, 3.41 (6.08)
 * with, torch's copy_ 2.95 (4.86); the machine was shared and noisy (docs/RESULTS.md "Compute-dtype cast"). */
#ifndef STREAM
#define STREAM 1
#endif
#define COPY_BLOCK 32768 /* elements updated, then cast while in cache (mt_adamw_copy); a multiple of 256 */

static inline uint16_t cast1(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = -(uint32_t)(f != f); /* branch-free, so that the loop vectorises without AVX-512 */
    return (uint16_t)((0xFFFFu & nan) | (r & ~nan));
}

#ifdef __AVX512F__
static inline __m256i cast16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r));
}
#endif

/* dst[i] = bf16(src[i]) for i in [0, n). */
void mt_cast_bf16(const float *restrict src, uint16_t *restrict dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i < n && ((uintptr_t)(dst + i) & 63); i++) dst[i] = cast1(src[i]);
    if (STREAM) {
        for (; i + 32 <= n; i += 32) {
            const __m256i a = cast16(_mm512_loadu_ps(src + i)), b = cast16(_mm512_loadu_ps(src + i + 16));
            _mm256_stream_si256((__m256i *)(dst + i), a);
            _mm256_stream_si256((__m256i *)(dst + i + 16), b);
        }
        _mm_sfence();
    }
    for (; i + 32 <= n; i += 32) {
        const __m256i a = cast16(_mm512_loadu_ps(src + i)), b = cast16(_mm512_loadu_ps(src + i + 16));
        _mm256_storeu_si256((__m256i *)(dst + i), a);
        _mm256_storeu_si256((__m256i *)(dst + i + 16), b);
    }
#endif
    for (; i < n; i++) dst[i] = cast1(src[i]);
}

/* For tests/runtime/test_host_kernel.py: mismatches of the vector cast against cast1 over every `stride`-th fp32
 * bit pattern, part `part` of `parts` (dealt out 32 patterns at a time); -1 where there is no vector code. */
int64_t mt_cast_check(uint32_t stride, uint32_t part, uint32_t parts) {
#ifdef __AVX512F__
    int64_t bad = 0;
    float x[32];
    uint16_t q[32];
    const uint64_t step = stride ? stride : 1;
    for (uint64_t u0 = 32 * step * part; u0 < (1ull << 32); u0 += 32 * step * parts) {
        for (int j = 0; j < 32; j++) {
            const uint32_t u = (uint32_t)(u0 + (uint64_t)j * step);
            memcpy(x + j, &u, 4);
        }
        mt_cast_bf16(x, q, 32);
        for (int j = 0; j < 32; j++) bad += q[j] != cast1(x[j]);
    }
    return bad;
#else
    (void)stride, (void)part, (void)parts;
    return -1;
#endif
}

/* mt_adamw over [begin, end), then each updated weight cast into `copy` (the persistent bf16 copy the "copy"
 * placement of planner/cast.py keeps): COPY_BLOCK elements at a time, so the cast reads the weights from cache,
 * not memory, and the step moves 2 B per parameter more (the write), not 6. Same bits as the step followed by
 * mt_cast_bf16. */
void mt_adamw_copy(float *param, const void *grad, void *exp_avg, void *exp_avg_sq, float *avg_scale,
                   float *sq_scale, int64_t begin, int64_t end, int64_t nvec, const void *h, uint16_t *copy) {
    for (int64_t a = begin; a < end; a += COPY_BLOCK) {
        const int64_t b = a + COPY_BLOCK < end ? a + COPY_BLOCK : end;
        mt_adamw(param, grad, exp_avg, exp_avg_sq, avg_scale, sq_scale, a, b, nvec, h);
        mt_cast_bf16(param + a, copy + a, b - a);
    }
}
