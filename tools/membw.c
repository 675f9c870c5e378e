/* Memory read bandwidth of this machine, as decode sees it (streaming reads).
 *
 *   cc -O2 -march=native -pthread tools/membw.c -o membw && ./membw [threads] [MB per thread] [trials]
 *
 * Each thread sums its own private buffer (default 512 MB, far larger than any cache)
 * with vector loads and four independent accumulators; all threads start together at a
 * barrier and the wall time of the slowest one counts. Prints one line:
 *   threads=T mb_per_thread=M best_gbps=X median_gbps=Y
 * (GB = 1e9 bytes). tools/bench.py compiles and runs it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef struct {
    const uint32_t * buf;
    size_t n;             /* elements */
    pthread_barrier_t * start;
    pthread_barrier_t * stop;
    uint64_t sink;
} job_t;

static uint64_t sum_buf(const uint32_t * p, size_t n) {
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_add_epi32(a0, _mm512_load_si512((const void *)(p + i)));
        a1 = _mm512_add_epi32(a1, _mm512_load_si512((const void *)(p + i + 16)));
        a2 = _mm512_add_epi32(a2, _mm512_load_si512((const void *)(p + i + 32)));
        a3 = _mm512_add_epi32(a3, _mm512_load_si512((const void *)(p + i + 48)));
    }
    a0 = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    uint64_t s = (uint32_t)_mm512_reduce_add_epi32(a0);
    for (; i < n; i++) s += p[i];
    return s;
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_add_epi32(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi32(a1, _mm256_load_si256((const __m256i *)(p + i + 8)));
        a2 = _mm256_add_epi32(a2, _mm256_load_si256((const __m256i *)(p + i + 16)));
        a3 = _mm256_add_epi32(a3, _mm256_load_si256((const __m256i *)(p + i + 24)));
    }
    a0 = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
    uint32_t t[8];
    _mm256_storeu_si256((__m256i *)t, a0);
    uint64_t s = 0;
    for (int k = 0; k < 8; k++) s += t[k];
    for (; i < n; i++) s += p[i];
    return s;
#else
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) { s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3]; }
    for (; i < n; i++) s0 += p[i];
    return s0 + s1 + s2 + s3;
#endif
}

static void * worker(void * arg) {
    job_t * j = arg;
    pthread_barrier_wait(j->start);
    j->sink += sum_buf(j->buf, j->n);
    pthread_barrier_wait(j->stop);
    return NULL;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void * a, const void * b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char ** argv) {
    int nt = argc > 1 ? atoi(argv[1]) : 1;
    size_t mb = argc > 2 ? (size_t)atol(argv[2]) : 512;
    int trials = argc > 3 ? atoi(argv[3]) : 7;
    if (nt < 1 || nt > 256 || mb < 1 || trials < 1) {
        fprintf(stderr, "usage: %s [threads] [MB per thread] [trials]\n", argv[0]);
        return 2;
    }
    size_t bytes = mb << 20, n = bytes / sizeof(uint32_t);
    job_t * jobs = calloc((size_t)nt, sizeof(job_t));
    pthread_t * th = calloc((size_t)nt, sizeof(pthread_t));
    double * gbps = calloc((size_t)trials, sizeof(double));
    if (!jobs || !th || !gbps) { fprintf(stderr, "out of memory\n"); return 1; }
    for (int t = 0; t < nt; t++) {
        void * p = NULL;
        if (posix_memalign(&p, 4096, bytes)) { fprintf(stderr, "out of memory\n"); return 1; }
        memset(p, t + 1, bytes);  /* fault every page in before timing */
        jobs[t].buf = p;
        jobs[t].n = n;
    }
    pthread_barrier_t start, stop;
    uint64_t sink = 0;
    for (int r = 0; r <= trials; r++) {  /* trial 0 is a warm-up */
        pthread_barrier_init(&start, NULL, (unsigned)nt + 1);
        pthread_barrier_init(&stop, NULL, (unsigned)nt + 1);
        for (int t = 0; t < nt; t++) {
            jobs[t].start = &start;
            jobs[t].stop = &stop;
            pthread_create(&th[t], NULL, worker, &jobs[t]);
        }
        pthread_barrier_wait(&start);
        double t0 = now();
        pthread_barrier_wait(&stop);
        double dt = now() - t0;
        for (int t = 0; t < nt; t++) { pthread_join(th[t], NULL); sink += jobs[t].sink; }
        pthread_barrier_destroy(&start);
        pthread_barrier_destroy(&stop);
        if (r > 0) gbps[r - 1] = (double)bytes * nt / dt / 1e9;
    }
    qsort(gbps, (size_t)trials, sizeof(double), cmp_d);
    printf("threads=%d mb_per_thread=%zu best_gbps=%.2f median_gbps=%.2f sink=%llu\n", nt, mb,
           gbps[trials - 1], gbps[trials / 2], (unsigned long long)(sink & 0xff));
    return 0;
}
