//! Guest calls run on threads of their own, at a lower CPU priority than the controller.
//!
//! A guest that spins until its deadline then only takes CPU nobody else wants: the
//! controller's watches, reconcile loops and lease renewals (and whatever else shares the node,
//! such as the kubelet or, on a test machine, the control plane) go first.
//!
//! Each call takes a thread of the executor's pool for its whole length, its filesystem work
//! included ([`super::fs_view::FsWork`]): one hand-off there and back per call rather than one
//! per filesystem operation, each of which woke two or three threads (on a virtual machine, an
//! idle vCPU each). A call blocked in the kernel on a pod's lock then holds only its own thread,
//! and its caller gives up on it at its deadline ([`super::call_clock`]): other calls, of this
//! guest or another, never wait behind it. The executor's worker threads only drive the calls'
//! timers. The guest's `max-concurrency` bounds its calls (and so its threads) in flight.

use std::future::Future;
use std::sync::Arc;

use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinError;

/// How the guest executor is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutorOptions {
    /// Worker threads driving the calls' timers (each call runs on a thread of its own).
    pub threads: usize,
    /// How much nicer than the process the executor's threads are (0..=19; 0 keeps the same
    /// priority).
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
    runtime: Option<Runtime>,
    handle: Handle,
}

impl Drop for Threads {
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
        let nice = options.nice.clamp(0, 19);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.threads.max(1))
            .thread_name("wasm-guest")
            .enable_all()
            // Every thread, the pool's that run the calls among them.
            .on_thread_start(move || lower_priority(nice))
            .build()?;
        let handle = runtime.handle().clone();
        Ok(GuestExecutor {
            inner: Arc::new(Threads {
                runtime: Some(runtime),
                handle,
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
        let handle = self.inner.handle.clone();
        self.inner
            .handle
            .spawn_blocking(move || handle.block_on(call))
            .await
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
    fn calls_run_on_nicer_threads_of_their_own() {
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
        let (name, nice) = caller
            .block_on(executor.run(async {
                let name = std::thread::current().name().map(str::to_string);
                (name, own_nice())
            }))
            .expect("the call ran");
        assert_eq!(name.as_deref(), Some("wasm-guest"));
        assert_eq!(nice, (here + 5).min(19));
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
