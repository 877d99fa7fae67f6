//! Guest code runs on threads of its own, at a lower CPU priority than the controller.
//!
//! A guest that spins until its deadline then only takes CPU nobody else wants: the
//! controller's watches, reconcile loops and lease renewals (and whatever else shares the node,
//! such as the kubelet or, on a test machine, the control plane) go first. Guests do not slow
//! each other either: a spinning guest yields at every epoch tick, so the executor's threads are
//! shared between all calls in flight.
//!
//! A call into an idle executor asks the kernel to wake the guest thread on the CPU the caller
//! runs on, which is about to wait for the result anyway: the hand-off is then a switch on one
//! CPU instead of the wake-up of an idle one (tens of microseconds on a virtual machine, and
//! again for the caller on the way back). The thread drops that pin as soon as it runs, and a
//! busy executor is left alone, so calls under load spread over the threads as before.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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
    /// Calls queued or running.
    in_flight: Arc<AtomicUsize>,
    steering: Arc<Steering>,
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
        let steering = Arc::new(Steering::new());
        let (parking, unparked) = (steering.clone(), steering.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.threads.max(1))
            .thread_name("wasm-guest")
            .enable_all()
            .on_thread_start(move || lower_priority(nice))
            .on_thread_park(move || parking.parking())
            .on_thread_unpark(move || unparked.release())
            .build()?;
        let handle = runtime.handle().clone();
        Ok(GuestExecutor {
            inner: Arc::new(Threads {
                runtime: Some(runtime),
                handle,
                in_flight: Arc::new(AtomicUsize::new(0)),
                steering,
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
        let in_flight = InFlight::enter(&self.inner.in_flight);
        if in_flight.first {
            self.inner.steering.wake_here();
        }
        let steering = self.inner.steering.clone();
        self.inner
            .handle
            .spawn(async move {
                // The thread that took the call may not have parked in between.
                steering.release();
                let _in_flight = in_flight;
                call.await
            })
            .await
    }
}

/// Counts a call until its task ends (or is dropped with the runtime).
struct InFlight {
    count: Arc<AtomicUsize>,
    /// Nothing else was in flight: the threads are parked, or about to be.
    first: bool,
}

impl InFlight {
    fn enter(count: &Arc<AtomicUsize>) -> InFlight {
        let first = count.fetch_add(1, Ordering::AcqRel) == 0;
        InFlight {
            count: count.clone(),
            first,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Where the next guest thread wakes up: the one that parked last (tokio wakes the most
/// recently parked worker first) is pinned to the caller's CPU until it runs. At most one
/// worker is pinned at a time; all of it is best effort (a miss only costs the wake-up it
/// tried to save).
#[cfg(target_os = "linux")]
struct Steering {
    /// The CPUs the threads may run on (the creating thread's, e.g. a cgroup's cpuset).
    allowed: Option<rustix::thread::CpuSet>,
    /// Thread id of the worker that parked last (0: none yet).
    last_parked: std::sync::atomic::AtomicI32,
    /// Thread id of the worker pinned now (0: none).
    pinned: std::sync::atomic::AtomicI32,
}

#[cfg(target_os = "linux")]
impl Steering {
    fn new() -> Steering {
        Steering {
            allowed: rustix::thread::sched_getaffinity(None).ok(),
            last_parked: 0.into(),
            pinned: 0.into(),
        }
    }

    /// On a worker about to park.
    fn parking(&self) {
        self.last_parked.store(
            rustix::thread::gettid().as_raw_nonzero().get(),
            Ordering::Release,
        );
    }

    /// On the caller: pins the worker that will take the call to this CPU.
    fn wake_here(&self) {
        let Some(allowed) = &self.allowed else {
            return;
        };
        let raw = self.last_parked.load(Ordering::Acquire);
        let Some(worker) = rustix::thread::Pid::from_raw(raw) else {
            return;
        };
        let cpu = rustix::thread::sched_getcpu();
        if !allowed.is_set(cpu) {
            return;
        }
        // A worker pinned earlier that tokio did not wake is unpinned here, so no pin outlives
        // the next call.
        let earlier = self.pinned.swap(raw, Ordering::AcqRel);
        if earlier != raw
            && let Some(earlier) = rustix::thread::Pid::from_raw(earlier)
        {
            let _ = rustix::thread::sched_setaffinity(Some(earlier), allowed);
        }
        let mut here = rustix::thread::CpuSet::new();
        here.set(cpu);
        if rustix::thread::sched_setaffinity(Some(worker), &here).is_err() {
            let _ = self
                .pinned
                .compare_exchange(raw, 0, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// On a worker that runs again: back to every CPU it may use, if it was pinned.
    fn release(&self) {
        let me = rustix::thread::gettid().as_raw_nonzero().get();
        if self.pinned.load(Ordering::Acquire) != me
            || self
                .pinned
                .compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return;
        }
        if let Some(allowed) = &self.allowed {
            let _ = rustix::thread::sched_setaffinity(None, allowed);
        }
    }
}

#[cfg(not(target_os = "linux"))]
struct Steering;

#[cfg(not(target_os = "linux"))]
impl Steering {
    fn new() -> Steering {
        Steering
    }
    fn parking(&self) {}
    fn wake_here(&self) {}
    fn release(&self) {}
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
    fn a_call_does_not_wait_behind_a_busy_guest_thread() {
        let executor = GuestExecutor::new(ExecutorOptions {
            threads: 2,
            nice: 0,
        })
        .expect("executor");
        let caller = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        // The first call holds its thread, like a guest spinning between two epoch ticks.
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
    fn a_call_runs_on_every_allowed_cpu_not_pinned_to_the_callers() {
        let allowed = rustix::thread::sched_getaffinity(None).expect("affinity");
        let (executor, caller) = one_thread_at_nice_zero();
        for _ in 0..3 {
            let during = caller
                .block_on(
                    executor
                        .run(async { rustix::thread::sched_getaffinity(None).expect("affinity") }),
                )
                .expect("the call ran");
            assert!(
                during == allowed,
                "the wake-up pin is dropped once the call starts"
            );
        }
    }

    #[tokio::test]
    async fn dropped_inside_a_runtime_without_panicking() {
        let executor = GuestExecutor::new(ExecutorOptions::default()).expect("executor");
        assert_eq!(executor.run(async { 7 }).await.expect("ran"), 7);
        drop(executor);
    }
}
