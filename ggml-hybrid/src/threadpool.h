/* A persistent pool of worker threads. The calling thread takes part as thread 0, so
 * a pool of n threads starts n-1 workers. Workers spin briefly between jobs (decode
 * issues hundreds of small jobs per token) and then sleep on a condition variable. */
#ifndef GH_THREADPOOL_H
#define GH_THREADPOOL_H

typedef struct gh_threadpool gh_threadpool;

/* ith in [0, nth): which slice of the work this call does. */
typedef void (*gh_task_fn)(void * arg, int ith, int nth);

gh_threadpool * gh_threadpool_new(int n_threads); /* NULL on failure (message set) */
void gh_threadpool_free(gh_threadpool * tp);
int gh_threadpool_n_threads(const gh_threadpool * tp);
/* Runs fn(arg, ith, nth) on every thread and returns when all are done. */
void gh_threadpool_run(gh_threadpool * tp, gh_task_fn fn, void * arg);

#endif
