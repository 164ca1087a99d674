/* ns per element of runtime/host_kernel.c's mt_adamw, one thread, without Python: the figures docs/RESULTS.md
 * "Host optimizer throughput" quotes as "the C driver".
 *
 * Build and run (from the repository root):
 *   gcc -O3 -march=native -ffp-contract=off -fno-math-errno -DKERNEL='"../runtime/host_kernel.c"' \
 *       benchmarks/host_kernel_driver.c -o /tmp/driver -lm
 *   /tmp/driver fp8 cache     # 16k elements stepped 2,000 times (in L2), best of 5 rounds
 *   /tmp/driver fp8 dram      # 24M elements, a 1 GiB read-modify-write before each step (the state from DRAM)
 *   HUGE=1 /tmp/driver fp8 dram   # the arrays advised MADV_HUGEPAGE before first touch, as the host store's
 *   /tmp/driver divider       # ns per 16 lanes of vdivps / vsqrtps (zmm), four independent chains
 * Policies: fp8 (bf16 gradients, fp8 moments), bf16 (bf16 gradients and moments), bf16-moments (fp32
 * gradients, bf16 moments), exact (fp32); a third
 * argument is the clip factor (default 1: unclipped). Bf16 gradients of about 1e-3, weight decay 0.1, betas
 * (0.9, 0.95), moments from zero, one step per call with the step count rising.
 */
#include KERNEL
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void *alloc(size_t bytes) {
    const size_t huge = 2 << 20, size = (bytes + huge - 1) / huge * huge;
    void *q = aligned_alloc(huge, size);
    if (q && getenv("HUGE")) madvise(q, size, MADV_HUGEPAGE);
    return q;
}

#ifdef FP8_AVX512
static void divider(void) {
    __m512 a[4], b = _mm512_set1_ps(1.0000001f);
    for (int k = 0; k < 4; k++) a[k] = _mm512_set1_ps(1.1f + 0.1f * k);
    const long n = 100000000;
    double t = now();
    for (long i = 0; i < n; i++)
        for (int k = 0; k < 4; k++) a[k] = _mm512_div_ps(a[k], b);
    printf("vdivps zmm: %.3f ns per 16 lanes\n", (now() - t) / n / 4 * 1e9);
    t = now();
    for (long i = 0; i < n; i++)
        for (int k = 0; k < 4; k++) a[k] = _mm512_sqrt_ps(a[k]);
    printf("vsqrtps zmm: %.3f ns per 16 lanes\n", (now() - t) / n / 4 * 1e9);
    float out[16];
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    printf("(%g)\n", out[0]);
}
#endif

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "divider")) {
#ifdef FP8_AVX512
        divider();
        return 0;
#else
        fprintf(stderr, "divider: needs AVX-512\n");
        return 1;
#endif
    }
    if (argc < 3) {
        fprintf(stderr, "usage: %s fp8|bf16|bf16-moments|exact cache|dram [clip factor] | %s divider\n", argv[0],
                argv[0]);
        return 2;
    }
    const int moments = !strcmp(argv[1], "fp8") ? 2 : !strncmp(argv[1], "bf16", 4) ? 1 : 0;
    const int grad_bf16 = moments && strcmp(argv[1], "bf16-moments"); /* bf16-moments: fp32 gradients */
    const int dram = !strcmp(argv[2], "dram");
    const int64_t n = dram ? 24000000 : 16384;
    const int reps = dram ? 1 : 2000, rounds = dram ? 6 : 5;
    const float factor = argc > 3 ? (float)atof(argv[3]) : 1.0f;
    const size_t moment_bytes = moments == 2 ? 1 : moments == 1 ? 2 : 4;
    float *p = alloc(n * 4), *ms = alloc((n / BLOCK + 1) * 4), *vs = alloc((n / BLOCK + 1) * 4);
    void *g = alloc(n * (grad_bf16 ? 2 : 4)), *m = alloc(n * moment_bytes), *v = alloc(n * moment_bytes);
    const size_t flush_bytes = (size_t)1 << 30;
    char *flush = dram ? malloc(flush_bytes) : NULL;
    srand(1);
    for (int64_t i = 0; i < n; i++) {
        p[i] = (rand() / (float)RAND_MAX - 0.5f) * 0.1f;
        const float gi = (rand() / (float)RAND_MAX - 0.5f) * 1e-3f;
        if (grad_bf16)
            ((uint16_t *)g)[i] = f32_to_bf16(gi);
        else
            ((float *)g)[i] = gi;
    }
    memset(m, 0, n * moment_bytes);
    memset(v, 0, n * moment_bytes);
    memset(ms, 0, (n / BLOCK + 1) * 4);
    memset(vs, 0, (n / BLOCK + 1) * 4);
    if (flush) memset(flush, 0, flush_bytes);
    Hyper h = {1e-3, 0.9, 0.95, 0.1, 1e-8, 1, factor, grad_bf16, moments};
    const int64_t nvec = n - n % 8;
    double best = 1e9;
    for (int r = 0, step = 1; r < rounds; r++) {
        if (flush)
            for (size_t j = 0; j < flush_bytes; j += 64) flush[j] += 1; /* read and write: evicts the L3 */
        const double t = now();
        for (int k = 0; k < reps; k++, step++) {
            h.step = step;
            mt_adamw(p, g, m, v, ms, vs, 0, n, nvec, &h);
        }
        const double ns = (now() - t) / reps / n * 1e9;
        if ((r > 0 || !dram) && ns < best) best = ns; /* dram: the first step faults its pages in */
    }
    printf("%s %s%s: %.3f ns per element\n", argv[1], argv[2], getenv("HUGE") ? " (huge pages)" : "", best);
    return 0;
}
