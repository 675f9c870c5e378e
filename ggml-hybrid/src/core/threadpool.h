/* A persistent pool of worker threads. The calling thread takes part as thread 0, so
 * a pool of n threads starts n-1 workers. Workers spin for a short, clock-measured time
 * between jobs (decode issues hundreds of small jobs per token; GH_SPIN_US in
 * threadpool.c) and then sleep on a condition variable, so an idle pool costs no CPU. */
#ifndef GH_THREADPOOL_H
#define GH_THREADPOOL_H

#include <stdbool.h>

typedef struct gh_threadpool gh_threadpool;

/* ith in [0, nth): which slice of the work this call does. */
typedef void (*gh_task_fn)(void * arg, int ith, int nth);

gh_threadpool * gh_threadpool_new(int n_threads); /* NULL on failure (message set) */
void gh_threadpool_free(gh_threadpool * tp);
int gh_threadpool_n_threads(const gh_threadpool * tp);
/* Runs fn(arg, ith, nth) on every thread and returns when all are done. */
void gh_threadpool_run(gh_threadpool * tp, gh_task_fn fn, void * arg);

/* The gh_op_* entry points (tests, tools) share one kept pool, so repeated calls do not
 * pay for starting threads. acquire: *tp = NULL for one thread, else the kept pool
 * (resized to n_threads) or, while another caller holds it, a private pool; *kept says
 * which, for release. Returns GH_ERR_OOM (message set) if no pool can be made. */
int gh_op_pool_acquire(int n_threads, gh_threadpool ** tp, bool * kept);
void gh_op_pool_release(gh_threadpool * tp, bool kept);

#endif
