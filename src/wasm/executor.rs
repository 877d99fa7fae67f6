//! Guest calls run on threads of their own: a short call at the controller's priority, a call
//! that keeps running at a lower one.
//!
//! A guest that spins until its deadline then only takes CPU nobody else wants: the
//! controller's watches, reconcile loops and lease renewals (and whatever else shares the node,
//! such as the kubelet or, on a test machine, the control plane) go first. A call that ends
//! within its first slice of CPU ([`FIRST_SLICE`], most calls: a provision takes well under a
//! millisecond) never waits behind busy cores at that lower priority: at nice 10 a thread gets
//! about a tenth of a core next to one that is busy at nice 0, and every claim waits for its
//! call.
//!
//! Each call takes a thread of the executor's pool for its whole length, its filesystem work
//! included ([`super::fs_view::FsWork`]): one hand-off there and back per call rather than one
//! per filesystem operation, each of which woke two or three threads (on a virtual machine, an
//! idle vCPU each). A call still running past its first slice is handed, between two epoch
//! ticks, to a thread of the nicer pool (the priority of a thread cannot be raised again
//! without privileges, so threads never go back). A call blocked in the kernel on a pod's lock
//! holds only its own thread, and its caller gives up on it at its deadline
//! ([`super::call_clock`]): other calls, of this guest or another, never wait behind it. The
//! executor's worker threads only drive the calls' timers. The guests' `max-concurrency`
//! bounds their calls (and so their threads) in flight.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinError;

/// CPU a call runs at the controller's priority before it moves to the nicer threads: a few
/// times a provision's, and one epoch tick, the finest the engine checks at.
pub const FIRST_SLICE: Duration = super::engine::EPOCH_TICK;

/// How the guest executor is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutorOptions {
    /// Worker threads driving the calls' timers (each call runs on a thread of its own).
    pub threads: usize,
    /// How much nicer than the process the threads of calls past their first slice are
    /// (0..=19; 0 keeps the same priority).
    pub nice: i32,
}

impl Default for ExecutorOptions {
    fn default() -> ExecutorOptions {
        ExecutorOptions {
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            nice: 10,
        }
    }
}

/// The runtime guest calls are spawned on. Cheap to clone; the threads stop with the last clone.
#[derive(Clone)]
pub struct GuestExecutor {
    inner: Arc<Threads>,
}

struct Threads {
    /// Calls start here, at the process's priority.
    calls: Pool,
    /// Calls past their first slice go on here, `nice` steps nicer.
    long_calls: Pool,
}

/// A runtime whose blocking pool runs calls; its workers drive their timers.
struct Pool {
    runtime: Option<Runtime>,
    handle: Handle,
}

impl Pool {
    fn new(name: &str, threads: usize, nice: i32) -> std::io::Result<Pool> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(name)
            .enable_all()
            // Every thread, the pool's that run the calls among them.
            .on_thread_start(move || lower_priority(nice))
            .build()?;
        let handle = runtime.handle().clone();
        Ok(Pool {
            runtime: Some(runtime),
            handle,
        })
    }

    /// Runs `work` on a thread of the pool, inside the runtime.
    async fn block_on<R: Send + 'static>(
        &self,
        work: impl Future<Output = R> + Send + 'static,
    ) -> Result<R, JoinError> {
        let handle = self.handle.clone();
        self.handle
            .spawn_blocking(move || handle.block_on(work))
            .await
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which tokio forbids inside another runtime; calls still in
        // flight are bounded by their deadlines anyway.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl GuestExecutor {
    /// Starts the executor's threads.
    pub fn new(options: ExecutorOptions) -> std::io::Result<GuestExecutor> {
        let threads = options.threads.max(1);
        Ok(GuestExecutor {
            inner: Arc::new(Threads {
                calls: Pool::new("wasm-call", threads, 0)?,
                long_calls: Pool::new("wasm-guest", threads, options.nice.clamp(0, 19))?,
            }),
        })
    }

    /// Runs `call` on a thread of its own and waits for it. Dropping the returned future does
    /// not cancel the call: it runs to its end (bounded by the guest's deadline, or by the
    /// kernel for a call blocked there), like a call that was already writing storage should.
    pub async fn run<R: Send + 'static>(
        &self,
        call: impl Future<Output = R> + Send + 'static,
    ) -> Result<R, JoinError> {
        self.run_sliced(call, Arc::default()).await
    }

    /// As [`GuestExecutor::run`], and once `long` is set (the call's first slice is over) the
    /// call goes on on the nicer threads, from the next point it waits at (an epoch tick).
    pub async fn run_sliced<R: Send + 'static>(
        &self,
        call: impl Future<Output = R> + Send + 'static,
        long: Arc<AtomicBool>,
    ) -> Result<R, JoinError> {
        let mut call = Box::pin(call);
        let first = self
            .inner
            .calls
            .block_on(async move {
                let sliced = std::future::poll_fn(|cx| match call.as_mut().poll(cx) {
                    Poll::Ready(done) => Poll::Ready(Some(done)),
                    Poll::Pending if long.load(Ordering::Acquire) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                })
                .await;
                sliced.ok_or(call)
            })
            .await?;
        match first {
            Ok(done) => Ok(done),
            Err(call) => self.inner.long_calls.block_on(call).await,
        }
    }
}

/// Makes the calling thread `nice` steps nicer than it is (Linux schedules threads one by one).
#[cfg(target_os = "linux")]
fn lower_priority(nice: i32) {
    if nice == 0 {
        return;
    }
    let thread = rustix::thread::gettid();
    let current = rustix::process::getpriority_process(Some(thread)).unwrap_or(0);
    let target = (current + nice).min(19);
    if let Err(error) = rustix::process::setpriority_process(Some(thread), target) {
        tracing::warn!(%error, nice = target, "cannot lower the priority of a guest thread; guests run at the controller's priority");
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority(_nice: i32) {}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn own_nice() -> i32 {
        rustix::process::getpriority_process(Some(rustix::thread::gettid())).expect("getpriority")
    }

    #[test]
    fn a_call_starts_at_the_callers_priority_and_goes_on_nicer_once_long() {
        let executor = GuestExecutor::new(ExecutorOptions {
            threads: 2,
            nice: 5,
        })
        .expect("executor");
        let caller = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let here = own_nice();
        let where_now = || {
            (
                std::thread::current().name().map(str::to_string),
                own_nice(),
            )
        };
        let long = Arc::new(AtomicBool::new(false));
        let (first, then) = caller
            .block_on(executor.run_sliced(
                {
                    let long = long.clone();
                    async move {
                        let first = where_now();
                        // As the epoch callback does once the first slice is over, and the
                        // yield that follows it.
                        long.store(true, Ordering::Release);
                        tokio::task::yield_now().await;
                        (first, where_now())
                    }
                },
                long,
            ))
            .expect("the call ran");
        assert_eq!(first, (Some("wasm-call".to_owned()), here));
        assert_eq!(then, (Some("wasm-guest".to_owned()), (here + 5).min(19)));
        assert_eq!(own_nice(), here, "the caller's thread keeps its priority");
    }

    /// One guest thread at the caller's priority, and a current-thread runtime to call it from.
    fn one_thread_at_nice_zero() -> (GuestExecutor, tokio::runtime::Runtime) {
        let executor = GuestExecutor::new(ExecutorOptions {
            threads: 1,
            nice: 0,
        })
        .expect("executor");
        let caller = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        (executor, caller)
    }

    #[test]
    fn nice_zero_keeps_the_priority() {
        let (executor, caller) = one_thread_at_nice_zero();
        let here = own_nice();
        let nice = caller
            .block_on(executor.run(async { own_nice() }))
            .expect("the call ran");
        assert_eq!(nice, here);
    }

    #[test]
    fn a_call_does_not_wait_behind_a_busy_one() {
        // One worker thread: each call still has a thread of its own.
        let executor = GuestExecutor::new(ExecutorOptions {
            threads: 1,
            nice: 0,
        })
        .expect("executor");
        let caller = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        // The first call holds its thread, like a guest spinning between two epoch ticks or a
        // filesystem call blocked in the kernel.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started, busy_thread) = tokio::sync::oneshot::channel();
        let busy = caller.spawn({
            let executor = executor.clone();
            async move {
                executor
                    .run(async move {
                        let _ = started.send(std::thread::current().id());
                        let _ = held.recv();
                    })
                    .await
            }
        });
        let busy_thread = caller
            .block_on(busy_thread)
            .expect("the first call started");
        let other_thread = caller
            .block_on(async {
                tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    executor.run(async { std::thread::current().id() }),
                )
                .await
            })
            .expect("the second call ran while the first one was still in flight")
            .expect("the call ran");
        assert_ne!(other_thread, busy_thread);
        release.send(()).expect("the first call is waiting");
        caller.block_on(busy).expect("joined").expect("ran");
    }

    #[test]
    fn a_call_blocked_on_its_thread_keeps_the_timers_of_the_others_running() {
        let (executor, caller) = one_thread_at_nice_zero();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started, running) = tokio::sync::oneshot::channel();
        let blocked = caller.spawn({
            let executor = executor.clone();
            async move {
                executor
                    .run(async move {
                        let _ = started.send(());
                        held.recv()
                    })
                    .await
            }
        });
        caller.block_on(running).expect("the blocked call started");
        // A call that sleeps needs the executor's one worker to drive its timer while the
        // other call holds its thread in a blocking wait.
        let slept = caller
            .block_on(async {
                tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    executor.run(tokio::time::sleep(std::time::Duration::from_millis(20))),
                )
                .await
            })
            .expect("the sleeping call ended while the other one was blocked");
        slept.expect("the call ran");
        release.send(()).expect("the blocked call is waiting");
        caller
            .block_on(blocked)
            .expect("joined")
            .expect("ran")
            .expect("released");
    }

    #[tokio::test]
    async fn dropped_inside_a_runtime_without_panicking() {
        let executor = GuestExecutor::new(ExecutorOptions::default()).expect("executor");
        assert_eq!(executor.run(async { 7 }).await.expect("ran"), 7);
        drop(executor);
    }
}
