//! Guest code runs on threads of its own, at a lower CPU priority than the controller.
//!
//! A guest that spins until its deadline then only takes CPU nobody else wants: the
//! controller's watches, reconcile loops and lease renewals (and whatever else shares the node,
//! such as the kubelet or, on a test machine, the control plane) go first. Guests do not slow
//! each other either: a spinning guest yields at every epoch tick, so the executor's threads are
//! shared between all calls in flight.

use std::future::Future;
use std::sync::Arc;

use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinError;

/// How the guest executor is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutorOptions {
    /// Worker threads running guest code.
    pub threads: usize,
    /// How much nicer than the process those threads are (0..=19; 0 keeps the same priority).
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

    /// Runs `call` on the executor and waits for it. Dropping the returned future does not
    /// cancel the call: it runs to its end (bounded by the guest's deadline), like a call that
    /// was already writing storage should.
    pub async fn run<R: Send + 'static>(
        &self,
        call: impl Future<Output = R> + Send + 'static,
    ) -> Result<R, JoinError> {
        self.inner.handle.spawn(call).await
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

    #[test]
    fn nice_zero_keeps_the_priority() {
        let executor = GuestExecutor::new(ExecutorOptions {
            threads: 1,
            nice: 0,
        })
        .expect("executor");
        let caller = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let here = own_nice();
        let nice = caller
            .block_on(executor.run(async { own_nice() }))
            .expect("the call ran");
        assert_eq!(nice, here);
    }

    #[tokio::test]
    async fn dropped_inside_a_runtime_without_panicking() {
        let executor = GuestExecutor::new(ExecutorOptions::default()).expect("executor");
        assert_eq!(executor.run(async { 7 }).await.expect("ran"), 7);
        drop(executor);
    }
}
