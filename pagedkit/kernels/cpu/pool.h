/* A small thread pool for the CPU attention kernel (paged_attention.c): `parallel_for(n, fn, arg, threads)` runs
 * fn(arg, item, worker) for item in [0, n) on the calling thread and up to threads - 1 workers, each taking the next
 * item from a shared counter; it returns when every item is done. Workers are created on first use, sleep on a
 * condition variable between jobs (no spinning: onnxruntime's own pool shares the cores) and are never joined (the
 * library stays loaded for the process). One job at a time (a mutex), so concurrent sessions serialize here. */
#ifndef PAGEDKIT_CPU_POOL_H
#define PAGEDKIT_CPU_POOL_H
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define POOL_MAX 64
typedef void (*pool_fn)(void* arg, int64_t item, int worker);

static struct {
  pthread_mutex_t job_mu, mu;
  pthread_cond_t wake, idle;
  int workers;          /* created */
  int active;           /* workers taking part in the current job */
  uint64_t generation;  /* bumped per job */
  pool_fn fn;
  void* arg;
  int64_t n;
  atomic_llong next, done;
  int busy;             /* workers still inside the current job */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0, 0};

static void pool_drain(int worker) {
  for (;;) {
    int64_t i = atomic_fetch_add(&pool.next, 1);
    if (i >= pool.n) break;
    pool.fn(pool.arg, i, worker);
    atomic_fetch_add(&pool.done, 1);
  }
}

static void* pool_worker(void* p) {
  int id = (int)(intptr_t)p;
  uint64_t seen = 0;
  pthread_mutex_lock(&pool.mu);
  for (;;) {
    while (pool.generation == seen || id > pool.active) pthread_cond_wait(&pool.wake, &pool.mu);
    seen = pool.generation;
    pool.busy++;
    pthread_mutex_unlock(&pool.mu);
    pool_drain(id);
    pthread_mutex_lock(&pool.mu);
    if (--pool.busy == 0) pthread_cond_broadcast(&pool.idle);
  }
  return NULL;
}

static void parallel_for(int64_t n, pool_fn fn, void* arg, int threads) {
  if (threads > POOL_MAX) threads = POOL_MAX;
  if (threads <= 1 || n <= 1) {
    for (int64_t i = 0; i < n; i++) fn(arg, i, 0);
    return;
  }
  pthread_mutex_lock(&pool.job_mu);
  pthread_mutex_lock(&pool.mu);
  while (pool.workers < threads - 1) {  /* grow (a failed create leaves fewer workers: fine) */
    pthread_t th;
    if (pthread_create(&th, NULL, pool_worker, (void*)(intptr_t)(pool.workers + 1)) != 0) break;
    pthread_detach(th);
    pool.workers++;
  }
  pool.fn = fn;
  pool.arg = arg;
  pool.n = n;
  atomic_store(&pool.next, 0);
  atomic_store(&pool.done, 0);
  pool.active = threads - 1 < pool.workers ? threads - 1 : pool.workers;
  pool.generation++;
  pthread_cond_broadcast(&pool.wake);
  pthread_mutex_unlock(&pool.mu);
  pool_drain(0);
  pthread_mutex_lock(&pool.mu);
  while (atomic_load(&pool.done) < n || pool.busy > 0) pthread_cond_wait(&pool.idle, &pool.mu);
  pthread_mutex_unlock(&pool.mu);
  pthread_mutex_unlock(&pool.job_mu);
}
#endif
