//! The bookkeeping every reconcile shares, claims and volumes alike: the given-up check, the
//! operation timeout, metrics, the failure book, the give-up event and the requeue policy.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::controller::Action;
use tracing::{Instrument, Span};

use super::Context;
use super::decide;
use super::events::{Event, EventAction};
use super::failures::FailureBook;
use super::gate::GateError;
use super::handle::Handle;
use crate::metrics::Queue;

/// What a reconcile error tells the bookkeeping.
pub trait Failure: std::fmt::Display {
    /// The gate refused this replica (not a failure: another replica acts, or none may).
    fn gate_refusal(&self) -> Option<&GateError>;
    /// Whether it counts toward the failure threshold.
    fn counts(&self) -> bool;
    /// Short label for logs and metrics.
    fn label(&self) -> &'static str;
    /// The error for an operation that ran past its timeout.
    fn timed_out(after: Duration) -> Self;
}

/// How a reconcile that did not fail ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Done {
    /// The operation this queue exists for happened (a PV created, or storage deleted).
    Succeeded,
    /// Nothing to do, or settled without the operation.
    Nothing,
    /// Look again after this long (a busy guest or class, node mode's waits): not a failure.
    RetryIn(Duration),
}

/// Which operation a queue runs, for the metrics.
#[derive(Debug, Clone)]
pub enum Operation {
    /// Provisioning a claim of `class` with a data source of kind `source` ("" for none).
    Provision {
        /// The class name.
        class: String,
        /// The data-source kind.
        source: String,
    },
    /// Deleting the storage of a volume of `class`.
    Delete {
        /// The class name.
        class: String,
    },
    /// Growing the volume of a claim of `class`.
    Expand {
        /// The class name.
        class: String,
    },
}

/// One object's reconcile as the bookkeeping sees it.
pub struct Tracked {
    /// Claim UID or PV name.
    pub key: String,
    /// A fingerprint of what makes a new attempt worth it after a give-up.
    pub fingerprint: u64,
    /// The object, for the give-up event.
    pub reference: ObjectReference,
    /// What the reconcile does.
    pub operation: Operation,
}

/// How a tracked attempt ended, beyond its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The work ran (or the gate stopped it); more attempts may come.
    Ran,
    /// Not run: the object was given up before, until it changes.
    Skipped,
    /// This failure reached the threshold: no more attempts.
    GaveUp,
}

/// Failure counts and give-ups of one queue.
#[derive(Debug)]
pub struct Book {
    queue: Queue,
    failures: Mutex<FailureBook>,
    /// Keys whose last attempt failed (counted or not) and that wait for a retry, with how
    /// many attempts in a row failed: retries back off on it, so a thousand claims whose guest
    /// answers `transient` do not crowd out the others.
    retrying: Mutex<std::collections::HashMap<String, u32>>,
}

impl Book {
    /// An empty book for `queue`.
    pub fn new(queue: Queue) -> Book {
        Book {
            queue,
            failures: Mutex::new(FailureBook::default()),
            retrying: Mutex::default(),
        }
    }

    /// Whether `key`'s last attempt failed and it waits for a retry (its turn comes by backoff,
    /// so nothing is recorded ahead for it).
    pub fn is_retrying(&self, key: &str) -> bool {
        self.retrying.lock().expect("lock").contains_key(key)
    }

    /// How long `key` waits when its retry cannot start now (retries at their limit): as long as
    /// after one more failure, so that a crowd of retries never spins.
    pub fn retry_wait(&self, ctx: &Context, key: &str) -> Duration {
        let in_a_row = self
            .retrying
            .lock()
            .expect("lock")
            .get(key)
            .copied()
            .unwrap_or(1);
        let settings = &ctx.settings;
        decide::backoff(
            in_a_row,
            settings.retry_interval_start,
            settings.retry_interval_max,
        )
    }

    /// Whether `key` is given up for this fingerprint.
    pub fn is_given_up(&self, key: &str, fingerprint: u64) -> bool {
        self.failures
            .lock()
            .expect("lock")
            .is_given_up(key, fingerprint)
    }

    /// Gives `key` up for this fingerprint without counting failures (a claim no guest can serve).
    pub fn give_up(&self, key: &str, fingerprint: u64) {
        self.failures
            .lock()
            .expect("lock")
            .give_up(key, fingerprint);
    }

    /// Forgets `key` (success, or the object is gone).
    pub fn forget(&self, key: &str) {
        self.failures.lock().expect("lock").forget(key);
        self.retrying.lock().expect("lock").remove(key);
    }

    /// Drops the keys of objects that no longer exist.
    pub fn retain(&self, alive: impl Fn(&str) -> bool) {
        self.failures.lock().expect("lock").retain(&alive);
        self.retrying
            .lock()
            .expect("lock")
            .retain(|key, _| alive(key));
    }

    /// Keys tracked.
    pub fn len(&self) -> usize {
        self.failures.lock().expect("lock").len()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn settings(
        &self,
        ctx: &Context,
        operation: &Operation,
    ) -> (u32, Duration, &'static str, EventAction) {
        let s = &ctx.settings;
        if let Operation::Expand { .. } = operation {
            return (
                s.failed_provision_threshold,
                s.provision_timeout,
                super::events::EXPANSION_GIVEN_UP,
                EventAction::Expand,
            );
        }
        match self.queue {
            Queue::Claims => (
                s.failed_provision_threshold,
                s.provision_timeout,
                super::events::GIVEN_UP,
                EventAction::Provision,
            ),
            Queue::Volumes => (
                s.failed_delete_threshold,
                s.delete_timeout,
                super::events::DELETE_GIVEN_UP,
                EventAction::Delete,
            ),
        }
    }

    /// Runs `work` for one object with the shared bookkeeping, unless the object is given up;
    /// returns the action and how the attempt ended (the caller may owe a last write then).
    pub async fn track<E, F>(
        &self,
        handle: &Handle<'_>,
        tracked: &Tracked,
        span: Span,
        work: F,
    ) -> (Result<Action, E>, Ending)
    where
        E: Failure,
        F: Future<Output = Result<Done, E>>,
    {
        let ctx = handle.ctx();
        let (threshold, timeout, reason, action) = self.settings(ctx, &tracked.operation);
        if self.is_given_up(&tracked.key, tracked.fingerprint) {
            return (Ok(Action::await_change()), Ending::Skipped);
        }
        let reconciling = ctx.metrics.reconcile_started(self.queue, &tracked.key);
        let outcome = match tokio::time::timeout(timeout, work.instrument(span.clone())).await {
            Ok(outcome) => outcome,
            Err(_) => Err(E::timed_out(timeout)),
        };
        let error = match outcome {
            Ok(done) => {
                if done == Done::Succeeded {
                    let took = reconciling.elapsed();
                    match &tracked.operation {
                        Operation::Provision { class, source } => {
                            ctx.metrics.provision_succeeded(class, source, took)
                        }
                        Operation::Delete { class } => ctx.metrics.delete_succeeded(class, took),
                        Operation::Expand { class } => ctx.metrics.expand_succeeded(class),
                    }
                    self.forget(&tracked.key);
                }
                return (
                    Ok(match done {
                        Done::RetryIn(wait) => Action::requeue(wait),
                        Done::Succeeded | Done::Nothing => Action::await_change(),
                    }),
                    Ending::Ran,
                );
            }
            Err(error) => error,
        };
        if error.gate_refusal().is_some() {
            tracing::debug!(parent: &span, %error, "not acting on this replica now");
            return (Err(error), Ending::Ran);
        }
        let _entered = span.enter();
        tracing::warn!(%error, kind = error.label(), "reconcile failed");
        match &tracked.operation {
            Operation::Provision { class, source } => {
                ctx.metrics.provision_failed(class, source, error.label())
            }
            Operation::Delete { class } => ctx.metrics.delete_failed(class, error.label()),
            Operation::Expand { class } => ctx.metrics.expand_failed(class, error.label()),
        }
        if !error.counts() {
            return (Err(error), Ending::Ran);
        }
        let failures = {
            let mut book = self.failures.lock().expect("lock");
            let failures = book.record_failure(&tracked.key, tracked.fingerprint);
            if decide::exceeded_threshold(failures, threshold) {
                book.give_up(&tracked.key, tracked.fingerprint);
            }
            failures
        };
        if !decide::exceeded_threshold(failures, threshold) {
            return (Err(error), Ending::Ran);
        }
        tracing::warn!(failures, "giving up");
        handle.event(&tracked.reference, Event::warning(reason, action, format!(
                "Giving up after {failures} failed attempts (threshold {threshold}); the last error was: {error}. Change the object or restart the provisioner to retry."
            )));
        (Err(error), Ending::GaveUp)
    }

    /// The requeue policy after a failed reconcile: the gate's own timing, nothing once given
    /// up, exponential backoff for counted failures, the start interval for the rest.
    pub fn requeue<E: Failure>(
        &self,
        ctx: &Context,
        key: &str,
        fingerprint: u64,
        error: &E,
    ) -> Action {
        if let Some(gate) = error.gate_refusal() {
            return gate
                .retry_in()
                .map_or_else(Action::await_change, Action::requeue);
        }
        let settings = &ctx.settings;
        let failures = {
            let book = self.failures.lock().expect("lock");
            if book.is_given_up(key, fingerprint) {
                return Action::await_change();
            }
            book.failures(key, fingerprint)
        };
        ctx.metrics.retry_scheduled(self.queue, key);
        let in_a_row = {
            let mut retrying = self.retrying.lock().expect("lock");
            let in_a_row = retrying.entry(key.to_string()).or_default();
            *in_a_row = in_a_row.saturating_add(1);
            *in_a_row
        };
        // Failures that do not count toward giving up (transient, in background) still back
        // off, on their own streak: retried at once, a crowd of them would starve the rest.
        let streak = if error.counts() { failures } else { in_a_row };
        Action::requeue(decide::backoff(
            streak,
            settings.retry_interval_start,
            settings.retry_interval_max,
        ))
    }
}

/// A short random wait (50-250 ms) before looking at a claim again whose guest or class is busy:
/// long enough not to spin, short enough that a slot freed a moment later is used at once.
pub fn busy_wait() -> Duration {
    use rand::Rng;
    Duration::from_millis(rand::rng().random_range(50..=250))
}
