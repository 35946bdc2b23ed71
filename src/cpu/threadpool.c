/* Thread pool: nthreads-1 workers sleeping on a condition variable; each run
 * bumps a generation counter, everybody (the caller too) pulls task indices
 * from an atomic counter, and the caller waits until all workers report.
 * Locking: run_mu serializes runs; mu guards generation, busy, stop and the
 * run's fn/arg/ntasks (written before generation moves, read by workers
 * after they see it move). Workers belong to the process that started them
 * (pid): in a fork()ed child they do not exist, and the first run there
 * starts new ones; the fork handlers (kva_threadpool_fork_*) keep both
 * mutexes unheld across a fork. */
#include "cpu/threadpool.h"
#include "core/internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

struct kva_threadpool {
  int threads;  /* the caller + up to threads-1 workers */
  int workers;  /* workers running (threads-1, fewer if a restart in a child failed) */
  pid_t pid;    /* process the workers run in */
  pthread_t *tid; /* [threads], tid[1..workers] */
  pthread_mutex_t mu, run_mu;
  pthread_cond_t cv_start, cv_done;
  long generation;
  int busy; /* workers still in the current run */
  int stop;
  kva_task_fn fn;
  void *arg;
  long ntasks;
  atomic_long next;
};

typedef struct { kva_threadpool *pool; int worker; } worker_arg;

static void drain(kva_threadpool *p, int worker) {
  for (;;) {
    long t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
    if (t >= p->ntasks) break;
    p->fn(p->arg, t, worker);
  }
}

static void *worker_main(void *v) {
  worker_arg *wa = (worker_arg *)v;
  kva_threadpool *p = wa->pool;
  int worker = wa->worker;
  free(wa);
  long seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && p->generation == seen) pthread_cond_wait(&p->cv_start, &p->mu);
    if (p->stop) break;
    seen = p->generation;
    pthread_mutex_unlock(&p->mu);
    drain(p, worker);
    pthread_mutex_lock(&p->mu);
    if (--p->busy == 0) pthread_cond_signal(&p->cv_done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* Starts workers 1..threads-1 in this process (none running: a new pool,
 * or a child after fork). Returns the index of the first that failed to
 * start, or threads. */
static int start_workers(kva_threadpool *p) {
  p->pid = getpid();
  p->generation = 0;
  p->busy = 0;
  p->stop = 0;
  p->workers = 0;
  for (int i = 1; i < p->threads; ++i) {
    worker_arg *wa = (worker_arg *)malloc(sizeof *wa);
    if (wa) {
      wa->pool = p;
      wa->worker = i;
    }
    if (!wa || pthread_create(&p->tid[i], NULL, worker_main, wa)) {
      free(wa);
      return i;
    }
    p->workers = i;
  }
  return p->threads;
}

int kva_threadpool_create(kva_threadpool **out, int threads) {
  kva_threadpool *p = (kva_threadpool *)calloc(1, sizeof *p);
  if (!p) return kva_seterr(KVA_ENOMEM, "thread pool");
  p->threads = threads < 1 ? 1 : threads;
  p->tid = (pthread_t *)calloc((size_t)p->threads, sizeof *p->tid);
  if (!p->tid) { free(p); return kva_seterr(KVA_ENOMEM, "thread pool"); }
  pthread_mutex_init(&p->mu, NULL);
  pthread_mutex_init(&p->run_mu, NULL);
  pthread_cond_init(&p->cv_start, NULL);
  pthread_cond_init(&p->cv_done, NULL);
  int failed = start_workers(p);
  if (failed < p->threads) {
    kva_threadpool_destroy(p); /* joins the ones started */
    return kva_seterr(KVA_ENOMEM, "could not start worker thread %d", failed);
  }
  *out = p;
  return 0;
}

void kva_threadpool_destroy(kva_threadpool *p) {
  if (!p) return;
  /* In a fork()ed child that never ran the pool, the workers are the
   * parent's: there is nobody to stop or join. */
  if (p->pid == getpid()) {
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv_start);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i <= p->workers; ++i) pthread_join(p->tid[i], NULL);
  }
  pthread_mutex_destroy(&p->mu);
  pthread_mutex_destroy(&p->run_mu);
  pthread_cond_destroy(&p->cv_start);
  pthread_cond_destroy(&p->cv_done);
  free(p->tid);
  free(p);
}

int kva_threadpool_size(const kva_threadpool *p) { return p->threads; }

void kva_threadpool_run(kva_threadpool *p, kva_task_fn fn, void *arg, long ntasks) {
  if (ntasks <= 0) return;
  pthread_mutex_lock(&p->run_mu);
  if (p->threads > 1 && p->pid != getpid()) start_workers(p); /* a fork()ed child: the workers stayed behind */
  if (p->workers == 0 || ntasks == 1) {
    for (long t = 0; t < ntasks; ++t) fn(arg, t, 0);
    pthread_mutex_unlock(&p->run_mu);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->arg = arg;
  p->ntasks = ntasks;
  atomic_store(&p->next, 0);
  p->busy = p->workers;
  p->generation++;
  pthread_cond_broadcast(&p->cv_start);
  pthread_mutex_unlock(&p->mu);
  drain(p, 0);
  pthread_mutex_lock(&p->mu);
  while (p->busy > 0) pthread_cond_wait(&p->cv_done, &p->mu);
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_unlock(&p->run_mu);
}

void kva_threadpool_fork_prepare(kva_threadpool *p) {
  pthread_mutex_lock(&p->run_mu);
  pthread_mutex_lock(&p->mu);
}

void kva_threadpool_fork_parent(kva_threadpool *p) {
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_unlock(&p->run_mu);
}

/* The child's condition variables may still count the parent's waiting
 * workers; they start fresh (the next run starts new workers). */
void kva_threadpool_fork_child(kva_threadpool *p) {
  pthread_cond_init(&p->cv_start, NULL);
  pthread_cond_init(&p->cv_done, NULL);
  pthread_mutex_unlock(&p->mu);
  pthread_mutex_unlock(&p->run_mu);
}
