#include "core/threadpool.h"
#include "core/common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GH_PAUSE() _mm_pause()
#else
#define GH_PAUSE() ((void) 0)
#endif

/* How long an idle worker spins (checking the clock) before it sleeps on the condition
 * variable. Within a token, decode issues a job every ~20-100 us; between two tokens the
 * Python loop (gh_eval's wrapper, logits, sampling, detokenizing) takes ~100-200 us of
 * CPU (measured on the shipped tiny model: generate 270-395 us of CPU per token against
 * 270-390 us for gh_eval calls alone, ~80-100 us apart), so 1 ms keeps a decoding
 * context's workers awake through the whole stream with a 5x margin, while a context
 * with no work sleeps within 1 ms and costs no CPU. The old bound (200,000 iterations,
 * mostly sched_yield) spun 0.5-0.7 s of CPU per worker after every burst of work: 4 idle
 * 2-thread contexts used 0.32-1.06 s of CPU in the 2 s after a generation, now 0.000 s
 * (tests/model/test_threads.py::test_idle_contexts_use_no_cpu bounds it). */
#ifndef GH_SPIN_US
#define GH_SPIN_US 1000
#endif
/* Pure spinning (pause) for this many checks, then sched_yield between checks: when the
 * machine has more runnable threads than cores, the thread we wait for may need our
 * core, and a waiter that never yields stalls every job for a whole time slice. */
#define GH_SPIN_BEFORE_YIELD 2000
/* Read the clock once per this many spin checks (a vDSO clock_gettime is ~20-50 ns, a
 * pause ~10-40 ns on current x86: the bound is exact to a few microseconds). */
#define GH_SPIN_CLOCK_EVERY 32

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

typedef struct {
    gh_threadpool * tp;
    int             ith;
    pthread_t       thread;
} gh_worker;

struct gh_threadpool {
    int              n_threads;
    gh_worker *      workers;     /* n_threads - 1 */
    gh_task_fn       fn;
    void *           arg;
    atomic_uint      generation;  /* bumped for every job */
    atomic_int       n_pending;   /* workers still running the current job */
    atomic_bool      stop;
    pthread_mutex_t  mutex;
    pthread_cond_t   cond;        /* wakes sleeping workers */
    atomic_int       n_sleeping;
};

/* Waits for a job (returns its generation) or stop: spins for GH_SPIN_US of wall time,
 * then sleeps.
 *
 * Wake-up protocol (no lost wake-ups): a sleeper increments n_sleeping and then reads
 * generation, both under the mutex; gh_threadpool_run increments generation and then reads
 * n_sleeping. All four are seq_cst, so in their single total order either the sleeper's
 * increment comes first (then run sees n_sleeping > 0 and broadcasts; it must take the
 * mutex to do so, which it gets only once the sleeper is inside pthread_cond_wait or has
 * left, so the broadcast cannot fall between the sleeper's check and its wait), or run's
 * read of n_sleeping comes first (then run's increment of generation, which precedes that
 * read, precedes the sleeper's read of generation, which sees the new job and does not
 * sleep). The stop flag is set under the mutex with a broadcast, so it wakes sleepers too. */
static unsigned wait_for_job(gh_threadpool * tp, unsigned seen) {
    uint64_t t0 = 0;
    for (int spins = 0;; spins++) {
        const unsigned gen = atomic_load_explicit(&tp->generation, memory_order_acquire);
        if (gen != seen || atomic_load_explicit(&tp->stop, memory_order_acquire)) return gen;
        if (spins % GH_SPIN_CLOCK_EVERY == 0) {
            const uint64_t t = now_ns();
            if (spins == 0) t0 = t;
            else if (t - t0 >= (uint64_t) GH_SPIN_US * 1000u) break;
        }
        if (spins < GH_SPIN_BEFORE_YIELD) GH_PAUSE(); else sched_yield();
    }
    pthread_mutex_lock(&tp->mutex);
    atomic_fetch_add(&tp->n_sleeping, 1);
    while (atomic_load(&tp->generation) == seen && !atomic_load(&tp->stop)) {
        pthread_cond_wait(&tp->cond, &tp->mutex);
    }
    atomic_fetch_sub(&tp->n_sleeping, 1);
    pthread_mutex_unlock(&tp->mutex);
    return atomic_load_explicit(&tp->generation, memory_order_acquire);
}

static void * worker_main(void * p) {
    gh_worker * w = p;
    gh_threadpool * tp = w->tp;
    unsigned seen = 0;
    for (;;) {
        const unsigned gen = wait_for_job(tp, seen);
        if (atomic_load_explicit(&tp->stop, memory_order_acquire)) break;
        seen = gen;
        tp->fn(tp->arg, w->ith, tp->n_threads);
        atomic_fetch_sub_explicit(&tp->n_pending, 1, memory_order_release);
    }
    return NULL;
}

gh_threadpool * gh_threadpool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    gh_threadpool * tp = calloc(1, sizeof *tp);
    if (!tp) { gh_fail(GH_ERR_OOM, "out of memory creating a thread pool"); return NULL; }
    tp->n_threads = n_threads;
    atomic_init(&tp->generation, 0);
    atomic_init(&tp->n_pending, 0);
    atomic_init(&tp->stop, false);
    atomic_init(&tp->n_sleeping, 0);
    pthread_mutex_init(&tp->mutex, NULL);
    pthread_cond_init(&tp->cond, NULL);
    if (n_threads > 1) {
        tp->workers = calloc((size_t) n_threads - 1, sizeof *tp->workers);
        if (!tp->workers) {
            gh_threadpool_free(tp);
            gh_fail(GH_ERR_OOM, "out of memory creating a thread pool");
            return NULL;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            tp->workers[i].tp = tp;
            tp->workers[i].ith = i + 1;
            if (pthread_create(&tp->workers[i].thread, NULL, worker_main, &tp->workers[i]) != 0) {
                tp->n_threads = i + 1; /* only join what started */
                gh_threadpool_free(tp);
                gh_fail(GH_ERR_OOM, "cannot start worker thread %d of %d", i + 1, n_threads);
                return NULL;
            }
        }
    }
    return tp;
}

void gh_threadpool_free(gh_threadpool * tp) {
    if (!tp) return;
    if (tp->workers) {
        pthread_mutex_lock(&tp->mutex);
        atomic_store(&tp->stop, true);
        pthread_cond_broadcast(&tp->cond);
        pthread_mutex_unlock(&tp->mutex);
        for (int i = 0; i < tp->n_threads - 1; i++) pthread_join(tp->workers[i].thread, NULL);
        free(tp->workers);
    }
    pthread_mutex_destroy(&tp->mutex);
    pthread_cond_destroy(&tp->cond);
    free(tp);
}

int gh_threadpool_n_threads(const gh_threadpool * tp) { return tp ? tp->n_threads : 1; }

void gh_threadpool_run(gh_threadpool * tp, gh_task_fn fn, void * arg) {
    if (!tp || tp->n_threads == 1) {
        fn(arg, 0, 1);
        return;
    }
    tp->fn = fn;
    tp->arg = arg;
    atomic_store_explicit(&tp->n_pending, tp->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add(&tp->generation, 1); /* seq_cst: pairs with the n_sleeping check */
    if (atomic_load(&tp->n_sleeping) > 0) {
        pthread_mutex_lock(&tp->mutex);
        pthread_cond_broadcast(&tp->cond);
        pthread_mutex_unlock(&tp->mutex);
    }
    fn(arg, 0, tp->n_threads);
    for (int spins = 0; atomic_load_explicit(&tp->n_pending, memory_order_acquire) > 0; spins++) {
        if (spins < GH_SPIN_BEFORE_YIELD) GH_PAUSE(); else sched_yield();
    }
}

static pthread_mutex_t g_op_pool_mutex = PTHREAD_MUTEX_INITIALIZER;
static gh_threadpool * g_op_pool;

/* Join the kept pool's threads when the library is unloaded (Python's cffi closes it at
 * interpreter exit) or the process exits: a worker still spinning in unmapped code would
 * crash. */
__attribute__((destructor)) static void op_pool_fini(void) {
    if (pthread_mutex_trylock(&g_op_pool_mutex) != 0) return; /* a call is running: leave it */
    gh_threadpool_free(g_op_pool);
    g_op_pool = NULL;
    pthread_mutex_unlock(&g_op_pool_mutex);
}

int gh_op_pool_acquire(int n_threads, gh_threadpool ** tp, bool * kept) {
    *tp = NULL;
    *kept = false;
    if (n_threads <= 1) return GH_OK;
    if (pthread_mutex_trylock(&g_op_pool_mutex) == 0) {
        if (g_op_pool && gh_threadpool_n_threads(g_op_pool) != n_threads) {
            gh_threadpool_free(g_op_pool);
            g_op_pool = NULL;
        }
        if (!g_op_pool) g_op_pool = gh_threadpool_new(n_threads);
        if (!g_op_pool) {
            pthread_mutex_unlock(&g_op_pool_mutex);
            return GH_ERR_OOM;
        }
        *tp = g_op_pool;
        *kept = true;
        return GH_OK;
    }
    return (*tp = gh_threadpool_new(n_threads)) ? GH_OK : GH_ERR_OOM;
}

void gh_op_pool_release(gh_threadpool * tp, bool kept) {
    if (kept) pthread_mutex_unlock(&g_op_pool_mutex);
    else gh_threadpool_free(tp);
}
