/* A small thread pool, started once per context: run(fn, n) executes
 * fn(arg, task, worker) for task in [0, n) on the caller plus the workers,
 * handing out tasks dynamically (an atomic counter), and returns when all are
 * done. Calls on one pool are serialized. In a fork()ed child the first run
 * starts new workers (the parent's do not exist there). */
#ifndef KVA_THREADPOOL_H
#define KVA_THREADPOOL_H

typedef struct kva_threadpool kva_threadpool;
typedef void (*kva_task_fn)(void *arg, long task, int worker);

int kva_threadpool_create(kva_threadpool **pool, int threads);
void kva_threadpool_destroy(kva_threadpool *pool);
void kva_threadpool_run(kva_threadpool *pool, kva_task_fn fn, void *arg, long ntasks);
int kva_threadpool_size(const kva_threadpool *pool);
/* pthread_atfork steps for a pool (called by the context's fork handlers):
 * prepare takes the pool's mutexes, parent releases them, child releases
 * them and resets what the parent's workers left behind. */
void kva_threadpool_fork_prepare(kva_threadpool *pool);
void kva_threadpool_fork_parent(kva_threadpool *pool);
void kva_threadpool_fork_child(kva_threadpool *pool);
#endif
