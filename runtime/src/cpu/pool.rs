//! The CPU backend's fork-join pool: a step's parallel ops (matrix products, attention, the
//! DeltaNet heads, per-row ops over a prefill chunk) hand their tasks to threads that stay
//! awake between ops.
//!
//! Why not rayon's pool, which the step used before: a decode step of SmolLM2 is some 200
//! parallel ops of 20–40 µs each, with serial work between them. Rayon's idle workers yield
//! and soon sleep on a futex between ops, and the yields, the sleeps and the wake-ups took
//! 14–18% of a 2-thread decode step (perf: `sched_yield`, `futex_wait`, `try_to_wake_up`).
//! Here a worker that ran out of tasks spins on the job counter for a while (a step's next op
//! comes within microseconds) and parks only after [`SPIN_FOR`] without work, as llama.cpp's
//! threads do; the caller works on its own job's tasks beside the workers.
//!
//! A job is `tasks` indices; every participant claims the next unclaimed one until none are
//! left, so each task runs exactly once, on whichever thread claims it. Results never depend
//! on which thread ran what: callers give each task its own output.
//!
//! One job runs at a time. A job asked for while another runs (another thread's step in a
//! test process, or a task that asks for one of its own) runs all its tasks on the caller:
//! the same results, without the other threads.

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker without tasks keeps polling before it parks (then a job must wake it,
/// a futex call on each side). Longer than the serial work between a step's ops and between
/// the steps of a running generation, short enough that an idle server's workers sleep.
pub const SPIN_FOR: Duration = Duration::from_millis(2);

/// Polls with the CPU's spin hint before a worker also yields its core at each poll, for when
/// other threads want it (the server's, or more threads than cores).
const SPIN_HINTS: u32 = 1 << 12;

/// The pool every CPU step uses: as many threads as rayon's global pool (the caller one of
/// them), so `RAYON_NUM_THREADS` sets both.
pub fn global() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(rayon::current_num_threads()))
}

/// A job's body as each participant runs it: the tasks it claims, in turn.
type Body<'a> = dyn Fn(&mut Claims<'_>) + Sync + 'a;

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held by the caller whose job runs.
    submit: Mutex<u32>,
}

struct Shared {
    /// The current job's epoch (high 32 bits) and its next unclaimed task (low 32 bits), one
    /// word, so a claim succeeds only while the job it was read for is still current.
    next: AtomicU64,
    /// The current job, written before its epoch is published.
    job: Mutex<Job>,
    /// Workers inside a job's body or about to check for one: the caller returns only when
    /// every task is claimed and none is left here, so no worker still holds its body.
    active: AtomicUsize,
    /// Workers parked on `wake`.
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
    /// A panic in a worker's tasks, resumed on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    shutdown: AtomicBool,
}

#[derive(Clone, Copy)]
struct Job {
    epoch: u32,
    tasks: usize,
    /// The caller's body, its lifetime erased: only dereferenced by a participant that has
    /// claimed one of this job's tasks, and the caller outlives every such participant.
    body: Option<*const Body<'static>>,
}

// SAFETY: `body` points at a `Sync` closure, and is only called while its job's caller waits
// (see `Job::body`).
unsafe impl Send for Job {}

/// The tasks one participant claims from a job, in the order it claims them.
pub struct Claims<'p> {
    source: Source<'p>,
}

enum Source<'p> {
    /// Every task, on the caller alone.
    Alone(Range<usize>),
    /// Claimed from the pool's current job, the first already claimed.
    Pool {
        shared: &'p Shared,
        epoch: u32,
        tasks: usize,
        first: Option<usize>,
    },
}

impl Iterator for Claims<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        match &mut self.source {
            Source::Alone(range) => range.next(),
            Source::Pool {
                shared,
                epoch,
                tasks,
                first,
            } => first.take().or_else(|| shared.claim(*epoch, *tasks)),
        }
    }
}

impl Shared {
    /// The next task of job `epoch` (of `tasks`), if that job is still current and has one.
    fn claim(&self, epoch: u32, tasks: usize) -> Option<usize> {
        let mut word = self.next.load(Acquire);
        loop {
            let (current, task) = ((word >> 32) as u32, (word & u64::from(u32::MAX)) as usize);
            if current != epoch || task >= tasks {
                return None;
            }
            match self.next.compare_exchange_weak(word, word + 1, SeqCst, Acquire) {
                Ok(_) => return Some(task),
                Err(now) => word = now,
            }
        }
    }

    /// The slot for a worker's panic. A worker must not panic outside its tasks (the caller
    /// would wait for it forever), so a poisoned lock is taken as it is: the slot holds a
    /// payload or nothing either way.
    fn panic_slot(&self) -> std::sync::MutexGuard<'_, Option<Box<dyn Any + Send>>> {
        self.panic.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn epoch(&self) -> u32 {
        (self.next.load(Acquire) >> 32) as u32
    }

    /// A worker's life: wait for a job, claim its tasks while there are any, again.
    fn work(&self) {
        let mut seen = self.epoch();
        while self.wait_for_job(&mut seen) {
            self.active.fetch_add(1, SeqCst);
            let job = *self.job.lock().expect("job slot");
            if let Some(first) = (job.epoch == seen).then(|| self.claim(seen, job.tasks)).flatten() {
                let mut claims = Claims {
                    source: Source::Pool {
                        shared: self,
                        epoch: seen,
                        tasks: job.tasks,
                        first: Some(first),
                    },
                };
                // SAFETY: a task of this job is claimed and not yet run, so its caller is
                // still waiting (for it, and then for `active` to fall to zero), and `body`
                // is alive until then.
                let body = unsafe { &*job.body.expect("a job with tasks has a body") };
                if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut claims))) {
                    // Nothing else claims the rest: the caller does, then resumes the panic.
                    self.panic_slot().get_or_insert(panic);
                }
            }
            self.active.fetch_sub(1, SeqCst);
        }
    }

    /// Wait until the epoch moves past `seen` (updating it; true) or the pool shuts down
    /// (false): polling for [`SPIN_FOR`], then parked.
    fn wait_for_job(&self, seen: &mut u32) -> bool {
        let started = Instant::now();
        let mut polls = 0u32;
        loop {
            let epoch = self.epoch();
            if epoch != *seen {
                *seen = epoch;
                return true;
            }
            if self.shutdown.load(Acquire) {
                return false;
            }
            polls = polls.wrapping_add(1);
            if polls < SPIN_HINTS {
                std::hint::spin_loop();
            } else if started.elapsed() < SPIN_FOR {
                std::thread::yield_now();
            } else {
                self.park(*seen);
                polls = 0;
            }
        }
    }

    /// Sleep until the epoch moves past `seen` or the pool shuts down.
    fn park(&self, seen: u32) {
        let mut guard = self.park.lock().expect("park lock");
        // Counted before the epoch is looked at, under the lock the caller takes to wake:
        // either the caller sees this sleeper, or this sees the caller's epoch.
        self.sleepers.fetch_add(1, SeqCst);
        while self.epoch() == seen && !self.shutdown.load(SeqCst) {
            guard = self.wake.wait(guard).expect("park lock");
        }
        self.sleepers.fetch_sub(1, SeqCst);
    }

    fn wake_sleepers(&self) {
        if self.sleepers.load(SeqCst) > 0 {
            let _guard = self.park.lock().expect("park lock");
            self.wake.notify_all();
        }
    }
}

impl Pool {
    /// A pool of `threads` threads, the caller of each job one of them.
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            next: AtomicU64::new(0),
            job: Mutex::new(Job {
                epoch: 0,
                tasks: 0,
                body: None,
            }),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("bbc-cpu-{i}"))
                    .spawn(move || shared.work())
                    .expect("spawn a CPU pool thread")
            })
            .collect();
        Pool {
            shared,
            workers,
            submit: Mutex::new(0),
        }
    }

    /// Threads that run a job's tasks, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// `f(scratch, task)` for every task of `0..tasks`, each exactly once, spread over the
    /// pool; each thread makes its `scratch` with `init` when it claims its first task and
    /// keeps it for the others it claims.
    pub fn for_each<S>(&self, tasks: usize, init: impl Fn() -> S + Sync, f: impl Fn(&mut S, usize) + Sync) {
        self.run(tasks, &|claims: &mut Claims<'_>| {
            let mut scratch = None;
            for task in claims {
                f(scratch.get_or_insert_with(&init), task);
            }
        });
    }

    /// `f(scratch, task)` for every task of `0..tasks`, in task order (see
    /// [`for_each`](Self::for_each)).
    pub fn map<S, R: Send>(
        &self,
        tasks: usize,
        init: impl Fn() -> S + Sync,
        f: impl Fn(&mut S, usize) -> R + Sync,
    ) -> Vec<R> {
        let results: Vec<Mutex<Option<R>>> = (0..tasks).map(|_| Mutex::new(None)).collect();
        self.for_each(tasks, init, |scratch, task| {
            *results[task].lock().expect("a task's own result") = Some(f(scratch, task));
        });
        collect_results(results)
    }

    /// `f(scratch, i, chunk)` for every chunk `i` of `data` (`chunk_len` elements, the last
    /// possibly fewer), each exactly once (see [`for_each`](Self::for_each)).
    pub fn for_chunks_mut<T: Send, S>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        init: impl Fn() -> S + Sync,
        f: impl Fn(&mut S, usize, &mut [T]) + Sync,
    ) {
        assert!(chunk_len > 0, "chunks of at least one element");
        let (len, base) = (data.len(), SendPtr(data.as_mut_ptr()));
        self.for_each(len.div_ceil(chunk_len), init, |scratch, i| {
            let start = i * chunk_len;
            // SAFETY: chunk `i` is `start..min(start + chunk_len, len)` of `data`, which is
            // borrowed mutably for the whole call; chunks are disjoint and each task (so each
            // chunk) runs once.
            let chunk = unsafe { std::slice::from_raw_parts_mut(base.at(start), chunk_len.min(len - start)) };
            f(scratch, i, chunk);
        });
    }

    /// `f(i, chunk)` for every chunk `i` of `data` (see [`for_chunks_mut`](Self::for_chunks_mut)),
    /// in chunk order.
    pub fn map_chunks_mut<T: Send, R: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: impl Fn(usize, &mut [T]) -> R + Sync,
    ) -> Vec<R> {
        let results: Vec<Mutex<Option<R>>> = (0..data.len().div_ceil(chunk_len)).map(|_| Mutex::new(None)).collect();
        self.for_chunks_mut(
            data,
            chunk_len,
            || (),
            |_, i, chunk| {
                *results[i].lock().expect("a chunk's own result") = Some(f(i, chunk));
            },
        );
        collect_results(results)
    }

    /// Run `body` on every participant of a job of `tasks` tasks; return when all have run.
    fn run(&self, tasks: usize, body: &Body<'_>) {
        assert!(tasks < u32::MAX as usize, "tasks fit the job counter");
        let alone = || {
            body(&mut Claims {
                source: Source::Alone(0..tasks),
            })
        };
        if tasks <= 1 || self.workers.is_empty() {
            return alone();
        }
        let mut epoch = match self.submit.try_lock() {
            Ok(epoch) => epoch,
            // A job that panicked held it; the epoch it guards is still right.
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            // Busy (another thread's job, or this one's own from inside a task): the tasks
            // run here.
            Err(TryLockError::WouldBlock) => return alone(),
        };
        *epoch = epoch.wrapping_add(1);
        let shared = &*self.shared;
        // SAFETY: only the lifetime is erased; see `Job::body`.
        let body_ptr = unsafe { std::mem::transmute::<*const Body<'_>, *const Body<'static>>(body) };
        *shared.job.lock().expect("job slot") = Job {
            epoch: *epoch,
            tasks,
            body: Some(body_ptr),
        };
        shared.next.store(u64::from(*epoch) << 32, SeqCst);
        shared.wake_sleepers();
        let own = shared.claim(*epoch, tasks).map(|first| {
            let mut claims = Claims {
                source: Source::Pool {
                    shared,
                    epoch: *epoch,
                    tasks,
                    first: Some(first),
                },
            };
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut claims)))
        });
        // Every task is claimed once this caller's claims ran out (or it panicked: then the
        // rest are claimed here, not run, so the workers finish theirs and stop).
        while shared.claim(*epoch, tasks).is_some() {}
        while shared.active.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
        if let Some(Err(panic)) = own {
            std::panic::resume_unwind(panic);
        }
        // Taken out first: unwinding with the slot's lock held would poison it.
        let worker_panic = shared.panic_slot().take();
        if let Some(panic) = worker_panic {
            std::panic::resume_unwind(panic);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _guard = self.shared.park.lock().expect("park lock");
            self.shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// Each task's result, in task order.
fn collect_results<R>(results: Vec<Mutex<Option<R>>>) -> Vec<R> {
    results
        .into_iter()
        .map(|r| r.into_inner().expect("a task's own result").expect("every task ran"))
        .collect()
}

/// A pointer to `data`'s elements that tasks on other threads offset into disjoint chunks.
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);

// SAFETY: the chunks handed out through it are disjoint, and `T: Send`.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    fn at(&self, offset: usize) -> *mut T {
        // SAFETY: callers offset within the slice the pointer came from.
        unsafe { self.0.add(offset) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::AtomicU32;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every task runs exactly once, however many threads and tasks, job after job.
        #[test]
        fn every_task_runs_once(threads in 1usize..5, jobs in proptest::collection::vec(0usize..300, 1..8)) {
            let pool = Pool::new(threads);
            for tasks in jobs {
                let runs: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
                pool.for_each(tasks, || (), |_, t| {
                    runs[t].fetch_add(1, SeqCst);
                });
                prop_assert!(runs.iter().all(|r| r.load(SeqCst) == 1));
            }
        }
    }

    #[test]
    fn map_keeps_task_order_and_chunks_cover_the_data() {
        let pool = Pool::new(3);
        let squares = pool.map(1000, || (), |_, t| t * t);
        assert_eq!(squares, (0..1000).map(|t| t * t).collect::<Vec<_>>());
        let mut data = vec![0usize; 1001];
        pool.for_chunks_mut(
            &mut data,
            7,
            || (),
            |_, i, chunk| {
                for (j, x) in chunk.iter_mut().enumerate() {
                    *x += i * 7 + j;
                }
            },
        );
        assert_eq!(data, (0..1001).collect::<Vec<_>>());
    }

    #[test]
    fn scratch_is_made_once_per_thread_a_job() {
        let pool = Pool::new(2);
        let made = AtomicU32::new(0);
        pool.for_each(
            500,
            || made.fetch_add(1, SeqCst),
            |_, _| std::thread::sleep(Duration::from_micros(5)),
        );
        let made = made.load(SeqCst);
        assert!((1..=2).contains(&made), "{made} scratches for 2 threads");
    }

    /// A job from inside a task, and jobs from several threads at once, run (on their caller).
    #[test]
    fn nested_and_concurrent_jobs_run() {
        let pool = Pool::new(2);
        let inner = pool.map(
            4,
            || (),
            |_, t| pool.map(10, || (), |_, u| t * 10 + u).iter().sum::<usize>(),
        );
        assert_eq!(
            inner,
            (0..4)
                .map(|t| (0..10).map(|u| t * 10 + u).sum())
                .collect::<Vec<usize>>()
        );
        std::thread::scope(|s| {
            for k in 0..4usize {
                let pool = &pool;
                s.spawn(move || {
                    for _ in 0..50 {
                        assert_eq!(pool.map(64, || (), |_, t| t + k), (k..64 + k).collect::<Vec<_>>());
                    }
                });
            }
        });
    }

    /// A worker that parked after idling wakes for the next job.
    #[test]
    fn parked_workers_wake_for_a_job() {
        let pool = Pool::new(2);
        let started = Instant::now();
        // Within a second even where other tests' threads hold the cores.
        while pool.shared.sleepers.load(SeqCst) == 0 && started.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(SPIN_FOR);
        }
        assert_eq!(pool.shared.sleepers.load(SeqCst), 1, "the idle worker parked");
        let threads: Mutex<std::collections::HashSet<_>> = Mutex::default();
        // Tasks long enough that the woken worker claims some.
        pool.for_each(
            64,
            || (),
            |_, _| {
                threads.lock().unwrap().insert(std::thread::current().id());
                std::thread::sleep(Duration::from_millis(1));
            },
        );
        assert_eq!(threads.into_inner().unwrap().len(), 2);
    }

    /// A panicking task's panic reaches the caller, and the pool still works after it, on
    /// all its threads.
    #[test]
    fn a_panic_reaches_the_caller() {
        let pool = Pool::new(3);
        for panicking in [0, 77, 199] {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.for_each(200, || (), |_, t| assert_ne!(t, panicking, "task {t} fails"));
            }));
            assert!(caught.is_err());
            let threads: Mutex<std::collections::HashSet<_>> = Mutex::default();
            let squares = pool.map(
                30,
                || (),
                |_, t| {
                    threads.lock().unwrap().insert(std::thread::current().id());
                    std::thread::sleep(Duration::from_millis(2));
                    t * t
                },
            );
            assert_eq!(squares, (0..30).map(|t| t * t).collect::<Vec<_>>());
            assert!(
                threads.into_inner().unwrap().len() > 1,
                "after a panic, one thread runs the tasks"
            );
        }
    }
}
