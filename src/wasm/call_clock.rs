//! The deadline of one guest call as its caller keeps it: the call runs on a thread of its own
//! with its filesystem work inline, where a pod's lock can hold the thread in the kernel past
//! any timeout the call sets itself, so the caller waits for it against this clock instead.
//!
//! ```text
//! dispatch ─▶ clock ─▶ executor thread: begin ─ start(deadline) ─▶ guest ─▶ stop ─▶ checks
//!   waits for: the call's end │ the deadline passing while started (not stopped)
//!   deadline first ─▶ abandon: the call counts as stuck (its slot, its thread charged to the
//!                     guest) until its thread ends; `stop` then fails, so nothing the guest
//!                     returned is used
//! ```
//!
//! Starting and stopping the clock wake nobody: the caller looks at it on a timer of its own,
//! first when the earliest deadline a call started after the dispatch could have passes (so
//! a call that ends in time costs no wake-up of the caller but its result's; on a virtual
//! machine each wake-up of an idle vCPU costs tens of microseconds).

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::handles::Lingering;

/// One dispatch's clock, shared by the caller and the thread running the call.
#[derive(Debug)]
pub(super) struct CallClock {
    state: Mutex<ClockState>,
    /// 1 for as long as the call's thread holds the clock: what a stuck call is charged as.
    running: Arc<AtomicUsize>,
    /// Set once the call has run past its first slice ([`super::executor::FIRST_SLICE`]).
    pub(super) long: Arc<AtomicBool>,
    lingering: Arc<Lingering>,
}

#[derive(Debug, Default)]
struct ClockState {
    /// The guest part of a call is running and must end by then.
    started: Option<Started>,
    /// The caller gave up on the call.
    abandoned: bool,
}

#[derive(Debug, Clone, Copy)]
struct Started {
    operation: &'static str,
    timeout: Duration,
    /// The epoch deadline plus the margin the host allows a host call past it.
    until: Instant,
}

impl Started {
    fn abandoned(self) -> Abandoned {
        Abandoned {
            operation: self.operation,
            timeout: self.timeout,
        }
    }
}

/// What the caller gave up on: the operation, and the timeout it had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Abandoned {
    pub(super) operation: &'static str,
    pub(super) timeout: Duration,
}

impl CallClock {
    /// A clock for one dispatch of a guest whose stuck calls `lingering` counts.
    pub(super) fn new(lingering: Arc<Lingering>) -> Arc<CallClock> {
        Arc::new(CallClock {
            state: Mutex::default(),
            running: Arc::new(AtomicUsize::new(1)),
            long: Arc::default(),
            lingering,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ClockState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The guest part of `operation` (its deadline `timeout` away) started and must end by
    /// `until`, the deadline plus the margin the host allows.
    pub(super) fn start(&self, operation: &'static str, timeout: Duration, until: Instant) {
        self.state().started = Some(Started {
            operation,
            timeout,
            until,
        });
    }

    /// The guest part ended: `Err` when the caller gave up on the call first (nothing the
    /// guest returned may be used then).
    pub(super) fn stop(&self) -> Result<(), Abandoned> {
        let mut state = self.state();
        let started = state.started.take();
        if state.abandoned {
            let started = started.expect("a call is abandoned only once started");
            return Err(started.abandoned());
        }
        Ok(())
    }

    /// On the caller: resolves when a started call passes its deadline, having marked it
    /// abandoned (charged to the guest as stuck until its thread ends). Never resolves while
    /// no call is started. `least` is the shortest a call may take before it is overdue (its
    /// timeout and margin): no call started after now can be overdue sooner.
    pub(super) async fn overrun(&self, least: Duration) -> Abandoned {
        let mut check = Instant::now() + least;
        loop {
            tokio::time::sleep_until(check.into()).await;
            let mut state = self.state();
            let now = Instant::now();
            match state.started {
                Some(started) if now >= started.until => {
                    state.abandoned = true;
                    drop(state);
                    self.lingering.call_stuck(&self.running);
                    return started.abandoned();
                }
                Some(started) => check = started.until,
                None => check = now + least,
            }
        }
    }
}

impl Drop for CallClock {
    /// The last holder is the call's thread: a call given up on has ended after all.
    fn drop(&mut self) {
        if self.state().abandoned {
            self.lingering.call_ended();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[tokio::test]
    async fn a_call_that_stops_in_time_is_never_abandoned() {
        let lingering = Arc::new(Lingering::default());
        let clock = CallClock::new(lingering.clone());
        clock.start("provision", ms(300), Instant::now() + ms(300));
        let waiter = {
            let clock = clock.clone();
            tokio::spawn(async move { clock.overrun(ms(300)).await })
        };
        tokio::time::sleep(ms(100)).await;
        assert_eq!(clock.stop(), Ok(()));
        tokio::time::sleep(ms(900)).await;
        assert!(!waiter.is_finished(), "no deadline while nothing runs");
        waiter.abort();
        assert_eq!(lingering.stuck_calls(), 0);
    }

    #[tokio::test]
    async fn a_call_past_its_deadline_is_abandoned_and_charged_until_its_thread_ends() {
        let lingering = Arc::new(Lingering::default());
        let clock = CallClock::new(lingering.clone());
        let caller = {
            let clock = clock.clone();
            tokio::spawn(async move { clock.overrun(ms(250)).await })
        };
        // Waiting for a slot has no deadline; the guest part does.
        tokio::time::sleep(ms(600)).await;
        assert!(!caller.is_finished());
        let started = Instant::now();
        clock.start("delete", ms(200), started + ms(250));
        let abandoned = caller.await.expect("joined");
        assert!(started.elapsed() >= ms(250), "not before the deadline");
        assert_eq!(
            abandoned,
            Abandoned {
                operation: "delete",
                timeout: ms(200)
            }
        );
        assert_eq!(lingering.stuck_calls(), 1);
        assert_eq!(
            lingering.count(),
            1,
            "its thread is charged as an operation"
        );
        // The thread comes back from the kernel: what the guest returned is not used.
        assert_eq!(clock.stop(), Err(abandoned));
        drop(clock);
        assert_eq!(lingering.stuck_calls(), 0);
        assert_eq!(lingering.count(), 0);
    }

    #[tokio::test]
    async fn a_stop_after_the_deadline_but_before_the_caller_looked_wins() {
        let lingering = Arc::new(Lingering::default());
        let clock = CallClock::new(lingering.clone());
        clock.start("provision", ms(100), Instant::now() + ms(100));
        tokio::time::sleep(ms(300)).await;
        // The deadline passed but the caller has not looked yet: the call stops first, and
        // the caller keeps waiting for its end instead.
        assert_eq!(clock.stop(), Ok(()));
        let overrun = tokio::time::timeout(ms(500), clock.overrun(ms(100))).await;
        assert!(overrun.is_err());
        assert_eq!(lingering.stuck_calls(), 0);
    }
}
