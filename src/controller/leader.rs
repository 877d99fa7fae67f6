//! The Lease protocol: who holds a `coordination.k8s.io/v1` Lease, when it may be taken over,
//! and the loop that campaigns for and renews the whole-controller lease.
//!
//! The semantics are client-go's `leaderelection` package: a holder renews every retry period
//! and stops writing once it has not renewed for the renew deadline; a candidate takes the lease
//! over when its record has not changed for the lease duration *as measured on the candidate's own
//! monotonic clock* since it first saw that record (never by comparing the holder's wall-clock
//! `renewTime` with ours), so clock skew between nodes cannot give two replicas the lease. Because
//! the renew deadline is shorter than the lease duration, a holder that cannot renew has closed
//! its write gate before any candidate can have taken over.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::events::{Event, EventAction, Recorder};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::{Api, Resource};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::events;

/// Timing of an election, as the `--leader-election-*` flags give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// How long a lease record stays valid for others after it last changed.
    pub lease_duration: Duration,
    /// How long the holder keeps writing without a successful renew.
    pub renew_deadline: Duration,
    /// How often the holder renews and candidates retry.
    pub retry_period: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Why an election cannot be configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    /// The holder would still write after others may take over.
    #[error(
        "--leader-election-lease-duration ({lease:?}) must be longer than --leader-election-renew-deadline ({renew:?})"
    )]
    DeadlineNotShorter {
        /// The lease duration.
        lease: Duration,
        /// The renew deadline.
        renew: Duration,
    },
    /// The holder would not get a second renew attempt before the deadline.
    #[error(
        "--leader-election-renew-deadline ({renew:?}) must be longer than 1.2 x --leader-election-retry-period ({retry:?})"
    )]
    RetryTooSlow {
        /// The renew deadline.
        renew: Duration,
        /// The retry period.
        retry: Duration,
    },
    /// Whole seconds are all a Lease records.
    #[error("--leader-election-lease-duration must be at least 1s, got {0:?}")]
    TooShort(Duration),
}

impl Timing {
    /// Checks the relations client-go checks (duration > deadline > 1.2 x retry).
    pub fn validate(&self) -> Result<(), TimingError> {
        if self.lease_duration < Duration::from_secs(1) {
            return Err(TimingError::TooShort(self.lease_duration));
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(TimingError::DeadlineNotShorter {
                lease: self.lease_duration,
                renew: self.renew_deadline,
            });
        }
        if self.renew_deadline.as_secs_f64() <= 1.2 * self.retry_period.as_secs_f64() {
            return Err(TimingError::RetryTooSlow {
                renew: self.renew_deadline,
                retry: self.retry_period,
            });
        }
        Ok(())
    }

    fn lease_seconds(&self) -> i32 {
        i32::try_from(self.lease_duration.as_secs()).unwrap_or(i32::MAX)
    }
}

/// The parts of a lease record that matter for who may hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The holder's identity; `None` when free (never held, or released).
    pub holder: Option<String>,
    /// How long the record stays valid after it changed.
    pub lease_duration: Duration,
    /// The holder's last renew (compared for change only, never against our clock).
    pub renew_time: Option<Timestamp>,
    /// How often the lease changed hands.
    pub transitions: i32,
}

impl Record {
    /// The record of a Lease object.
    pub fn of(lease: &Lease) -> Record {
        let spec = lease.spec.clone().unwrap_or_default();
        Record {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            lease_duration: Duration::from_secs(
                u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
            ),
            renew_time: spec.renew_time.map(|t| t.0),
            transitions: spec.lease_transitions.unwrap_or(0),
        }
    }
}

/// A record and when this replica first saw it, on its own monotonic clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// The record.
    pub record: Record,
    /// When this replica first saw this exact record.
    pub seen_at: Instant,
}

/// Folds a freshly read record into what we knew: an unchanged record keeps its first sighting.
pub fn observe(previous: Option<Observed>, record: Record, now: Instant) -> Observed {
    match previous {
        Some(previous) if previous.record == record => previous,
        _ => Observed {
            record,
            seen_at: now,
        },
    }
}

/// What a replica does next about a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// No Lease object exists: create it with us as holder.
    Create,
    /// We hold it: renew.
    Renew,
    /// It is free or expired: take it over.
    Acquire,
    /// Someone else holds it until `until` (our clock) unless they renew.
    Wait {
        /// The holder.
        holder: String,
        /// When the record expires for us if it does not change.
        until: Instant,
    },
}

/// The protocol's one decision.
pub fn next_step(observed: Option<&Observed>, me: &str, now: Instant) -> Step {
    let Some(observed) = observed else {
        return Step::Create;
    };
    match observed.record.holder.as_deref() {
        Some(holder) if holder == me => Step::Renew,
        None => Step::Acquire,
        Some(holder) => {
            let until = observed.seen_at + observed.record.lease_duration;
            if now >= until {
                Step::Acquire
            } else {
                Step::Wait {
                    holder: holder.to_string(),
                    until,
                }
            }
        }
    }
}

/// The spec that makes `me` the holder: a renew keeps the acquire time and transition count,
/// a takeover starts a new term.
pub fn held_spec(
    previous: Option<&LeaseSpec>,
    me: &str,
    timing: &Timing,
    now: Timestamp,
) -> LeaseSpec {
    let previous_holder = previous.and_then(|p| p.holder_identity.as_deref());
    let transitions = previous.and_then(|p| p.lease_transitions).unwrap_or(0);
    let renewing = previous_holder == Some(me);
    LeaseSpec {
        holder_identity: Some(me.to_string()),
        lease_duration_seconds: Some(timing.lease_seconds()),
        acquire_time: if renewing {
            previous.and_then(|p| p.acquire_time.clone())
        } else {
            Some(MicroTime(now))
        },
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(match previous_holder {
            Some(h) if !h.is_empty() && h != me => transitions.saturating_add(1),
            _ => transitions,
        }),
        ..LeaseSpec::default()
    }
}

/// The spec a holder leaves when it lets go: no holder, so a candidate takes over at once.
pub fn released_spec(previous: &LeaseSpec, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: None,
        lease_duration_seconds: Some(1),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: previous.lease_transitions,
        ..LeaseSpec::default()
    }
}

/// The outcome of one attempt to hold a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// We hold it; writes are allowed until the attempt's start plus the renew deadline.
    Held,
    /// Someone else does (or won the race for it).
    HeldBy {
        /// The holder, if known.
        holder: String,
        /// When to look again.
        until: Instant,
    },
}

/// One Lease as seen by one replica: reads it, decides, writes it with optimistic concurrency.
#[derive(Debug)]
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: Timing,
    labels: BTreeMap<String, String>,
    observed: Option<Observed>,
    current: Option<Lease>,
}

impl LeaseLock {
    /// A lock on Lease `name` in the namespace of `api`, for `identity`.
    pub fn new(
        api: Api<Lease>,
        name: String,
        identity: String,
        timing: Timing,
        labels: BTreeMap<String, String>,
    ) -> LeaseLock {
        LeaseLock {
            api,
            name,
            identity,
            timing,
            labels,
            observed: None,
            current: None,
        }
    }

    /// Starts from an earlier sighting, so a stale record does not wait a whole duration again.
    pub fn with_observed(mut self, observed: Option<Observed>) -> LeaseLock {
        self.observed = observed;
        self
    }

    /// The Lease name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What we last saw of the record.
    pub fn observed(&self) -> Option<&Observed> {
        self.observed.as_ref()
    }

    /// Reads the lease and creates, renews or takes it over when the protocol allows.
    pub async fn attempt(&mut self) -> Result<Attempt, kube::Error> {
        let now = Instant::now();
        let current = self.api.get_opt(&self.name).await?;
        self.observed = current
            .as_ref()
            .map(|lease| observe(self.observed.take(), Record::of(lease), now));
        self.current = current;
        let step = next_step(self.observed.as_ref(), &self.identity, now);
        let spec = match step {
            Step::Wait { holder, until } => return Ok(Attempt::HeldBy { holder, until }),
            Step::Create | Step::Renew | Step::Acquire => held_spec(
                self.current.as_ref().and_then(|l| l.spec.as_ref()),
                &self.identity,
                &self.timing,
                Timestamp::now(),
            ),
        };
        let written = match self.current.clone() {
            None => {
                let mut lease = Lease::default();
                lease.metadata.name = Some(self.name.clone());
                lease.metadata.labels = Some(self.labels.clone()).filter(|l| !l.is_empty());
                lease.spec = Some(spec);
                self.api.create(&PostParams::default(), &lease).await
            }
            Some(mut lease) => {
                // `replace` carries the resourceVersion we read: a concurrent writer makes it 409.
                lease.spec = Some(spec);
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match written {
            Ok(lease) => {
                self.observed = Some(observe(self.observed.take(), Record::of(&lease), now));
                self.current = Some(lease);
                Ok(Attempt::Held)
            }
            Err(kube::Error::Api(status)) if status.is_conflict() || status.is_already_exists() => {
                Ok(Attempt::HeldBy {
                    holder: "another replica".into(),
                    until: now + self.timing.retry_period,
                })
            }
            Err(error) => Err(error),
        }
    }

    /// Lets go of a lease we hold, so a candidate takes over without waiting for it to expire.
    pub async fn release(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.current.take() else {
            return Ok(());
        };
        let spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        lease.spec = Some(released_spec(&spec, Timestamp::now()));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(()),
            // Someone took it over already, or it is gone: nothing of ours to release.
            Err(kube::Error::Api(status)) if status.is_conflict() || status.is_not_found() => {
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// Deletes a lease we hold (per-object locks), only the version we wrote.
    pub async fn delete(&mut self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.current.take() else {
            return Ok(());
        };
        // A renew aborted in flight may have landed after all (the response was dropped), so a
        // conflict means "re-read and try again while it is still ours", not "someone else's".
        for _ in 0..3 {
            if Record::of(&lease).holder.as_deref() != Some(self.identity.as_str()) {
                return Ok(());
            }
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: lease.metadata.uid.clone(),
                    resource_version: lease.metadata.resource_version.clone(),
                }),
                ..DeleteParams::default()
            };
            match self.api.delete(&self.name, &params).await {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(status)) if status.is_not_found() => return Ok(()),
                Err(kube::Error::Api(status)) if status.is_conflict() => {
                    match self.api.get_opt(&self.name).await? {
                        Some(fresh) if fresh.metadata.uid == lease.metadata.uid => lease = fresh,
                        _ => return Ok(()),
                    }
                }
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    fn reference(&self) -> Option<ObjectReference> {
        self.current.as_ref().map(|lease| lease.object_ref(&()))
    }
}

/// The write gate of whole-controller election: open while we hold a lease we renewed recently.
#[derive(Debug)]
pub struct LeaderGate {
    state: watch::Sender<Lead>,
}

/// Leadership as the gate records it.
#[derive(Debug, Clone, Copy, Default)]
struct Lead {
    /// `Some(deadline)` while leading: writes stop at the deadline unless a renew moves it.
    deadline: Option<Instant>,
    /// Counts terms, so a watcher never misses one however quickly they follow each other.
    term: u64,
}

impl Default for LeaderGate {
    fn default() -> Self {
        LeaderGate {
            state: watch::Sender::new(Lead::default()),
        }
    }
}

impl LeaderGate {
    /// Whether we may call guests or write now.
    pub fn is_open(&self) -> bool {
        gate_open(self.state.borrow().deadline, Instant::now())
    }

    /// Whether we currently consider ourselves the leader (the gate may still close on its own).
    pub fn is_leading(&self) -> bool {
        self.state.borrow().deadline.is_some()
    }

    pub(crate) fn renewed(&self, deadline: Instant) {
        self.state.send_modify(|lead| {
            if lead.deadline.is_none() {
                lead.term += 1;
            }
            lead.deadline = Some(deadline);
        });
    }

    pub(crate) fn close(&self) {
        self.state.send_modify(|lead| lead.deadline = None);
    }

    /// Emits once every time this replica becomes the leader (not for renewals).
    pub fn gained(&self) -> impl futures::Stream<Item = ()> + Send + use<> {
        let rx = self.state.subscribe();
        let current = rx.borrow().term;
        futures::stream::unfold((rx, current), |(mut rx, mut seen)| async move {
            loop {
                rx.changed().await.ok()?;
                let term = rx.borrow_and_update().term;
                if term > seen {
                    seen = term;
                    return Some(((), (rx, seen)));
                }
            }
        })
    }
}

/// Whether a gate with this deadline is open at `now`.
pub fn gate_open(deadline: Option<Instant>, now: Instant) -> bool {
    deadline.is_some_and(|deadline| now < deadline)
}

/// Campaigns for the whole-controller lease, renews it while held, and releases it when `stop`
/// fires. Losing the lease closes the gate and goes back to campaigning: the watches stay warm,
/// and a flaky API server does not turn into a restart loop (see docs/high-availability.md).
pub async fn campaign(
    mut lock: LeaseLock,
    gate: Arc<LeaderGate>,
    changed: Arc<Notify>,
    recorder: Recorder,
    mut stop: watch::Receiver<bool>,
) {
    let timing = lock.timing;
    let identity = lock.identity.clone();
    loop {
        if *stop.borrow() {
            break;
        }
        let started = Instant::now();
        // Bound every round trip: a hung request must not keep the loop from noticing expiry.
        let outcome = tokio::time::timeout(timing.renew_deadline / 2, lock.attempt()).await;
        let wait_until = match outcome {
            Ok(Ok(Attempt::Held)) => {
                let was_leading = gate.is_leading();
                gate.renewed(started + timing.renew_deadline);
                if !was_leading {
                    tracing::info!(lease = lock.name(), %identity, "became leader");
                    lease_event(lock.reference(), &recorder, &identity, true).await;
                }
                started + timing.retry_period
            }
            other => {
                match &other {
                    Ok(Err(error)) => {
                        tracing::warn!(%error, lease = lock.name(), "leader election")
                    }
                    Err(_) => {
                        tracing::warn!(lease = lock.name(), "leader election request timed out")
                    }
                    Ok(Ok(_)) => {}
                }
                if gate.is_leading() && !gate.is_open() {
                    gate.close();
                    tracing::warn!(lease = lock.name(), %identity, "lost the lease; stopped writing, campaigning again");
                    lease_event(lock.reference(), &recorder, &identity, false).await;
                }
                match other {
                    Ok(Ok(Attempt::HeldBy { until, .. })) if !gate.is_leading() => {
                        until.min(started + timing.retry_period)
                    }
                    _ => started + timing.retry_period,
                }
            }
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wait_until) => {}
            // A watch on the lease wakes candidates the moment a holder releases it.
            _ = changed.notified(), if !gate.is_leading() => {}
            // A dropped sender also means stop.
            changed = stop.changed() => if changed.is_err() { break },
        }
    }
    if gate.is_leading() {
        gate.close();
        let reference = lock.reference();
        match lock.release().await {
            Ok(()) => {
                tracing::info!(lease = lock.name(), %identity, "released the lease");
                lease_event(reference, &recorder, &identity, false).await;
            }
            Err(error) => {
                tracing::warn!(%error, "could not release the lease; it expires on its own")
            }
        }
    }
}

/// `LeaderElection` on the Lease. The action differs per direction: kube's recorder folds events
/// with the same reason and action on one object into a series that keeps the first note.
async fn lease_event(
    reference: Option<ObjectReference>,
    recorder: &Recorder,
    identity: &str,
    became: bool,
) {
    let (action, note) = if became {
        (
            EventAction::BecameLeader,
            format!("{identity} became leader"),
        )
    } else {
        (
            EventAction::StoppedLeading,
            format!("{identity} stopped leading"),
        )
    };
    if let Some(reference) = reference {
        // Awaited: "stopped leading" is sent as the process exits on SIGTERM.
        recorder
            .publish_and_wait(
                &reference,
                Event::normal(events::LEADER_ELECTION, action, note),
            )
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(holder: Option<&str>, renew: i64) -> Record {
        Record {
            holder: holder.map(str::to_string),
            lease_duration: Duration::from_secs(15),
            renew_time: Some(Timestamp::from_second(renew).unwrap()),
            transitions: 0,
        }
    }

    #[test]
    fn timing_defaults_are_valid_and_bad_relations_are_named() {
        assert_eq!(Timing::default().validate(), Ok(()));
        let bad = Timing {
            renew_deadline: Duration::from_secs(15),
            ..Timing::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("must be longer")
        );
        let slow = Timing {
            retry_period: Duration::from_secs(9),
            ..Timing::default()
        };
        assert!(matches!(
            slow.validate(),
            Err(TimingError::RetryTooSlow { .. })
        ));
        let tiny = Timing {
            lease_duration: Duration::from_millis(500),
            renew_deadline: Duration::from_millis(300),
            retry_period: Duration::from_millis(100),
        };
        assert!(matches!(tiny.validate(), Err(TimingError::TooShort(_))));
    }

    #[test]
    fn no_lease_is_created_and_our_own_is_renewed() {
        let now = Instant::now();
        assert_eq!(next_step(None, "me", now), Step::Create);
        let ours = observe(None, record(Some("me"), 1), now);
        assert_eq!(next_step(Some(&ours), "me", now), Step::Renew);
    }

    #[test]
    fn a_released_lease_is_taken_at_once() {
        let now = Instant::now();
        let free = observe(None, record(None, 1), now);
        assert_eq!(next_step(Some(&free), "me", now), Step::Acquire);
    }

    #[test]
    fn expiry_counts_from_our_first_sighting_not_the_holders_clock() {
        let t0 = Instant::now();
        // The holder's renewTime is years in the past (skewed clock): still valid for 15 s.
        let seen = observe(None, record(Some("other"), 0), t0);
        let until = t0 + Duration::from_secs(15);
        assert_eq!(
            next_step(Some(&seen), "me", t0 + Duration::from_secs(14)),
            Step::Wait {
                holder: "other".into(),
                until
            }
        );
        // Reading the same record again does not move the sighting.
        let again = observe(
            Some(seen.clone()),
            record(Some("other"), 0),
            t0 + Duration::from_secs(10),
        );
        assert_eq!(again.seen_at, t0);
        assert_eq!(next_step(Some(&again), "me", until), Step::Acquire);
        // A renewal does.
        let renewed = observe(
            Some(again),
            record(Some("other"), 2),
            t0 + Duration::from_secs(14),
        );
        assert_eq!(renewed.seen_at, t0 + Duration::from_secs(14));
        assert!(matches!(
            next_step(Some(&renewed), "me", until),
            Step::Wait { .. }
        ));
    }

    #[test]
    fn takeover_starts_a_term_and_renewal_keeps_it() {
        let timing = Timing::default();
        let t1 = Timestamp::from_second(100).unwrap();
        let t2 = Timestamp::from_second(102).unwrap();
        let theirs = LeaseSpec {
            holder_identity: Some("other".into()),
            acquire_time: Some(MicroTime(Timestamp::from_second(1).unwrap())),
            lease_transitions: Some(3),
            ..LeaseSpec::default()
        };
        let taken = held_spec(Some(&theirs), "me", &timing, t1);
        assert_eq!(taken.holder_identity.as_deref(), Some("me"));
        assert_eq!(taken.lease_transitions, Some(4));
        assert_eq!(taken.acquire_time, Some(MicroTime(t1)));
        assert_eq!(taken.lease_duration_seconds, Some(15));
        let renewed = held_spec(Some(&taken), "me", &timing, t2);
        assert_eq!(renewed.lease_transitions, Some(4));
        assert_eq!(renewed.acquire_time, Some(MicroTime(t1)));
        assert_eq!(renewed.renew_time, Some(MicroTime(t2)));
        let created = held_spec(None, "me", &timing, t1);
        assert_eq!(created.lease_transitions, Some(0));
        let released = released_spec(&renewed, t2);
        assert_eq!(released.holder_identity, None);
        assert_eq!(released.lease_transitions, Some(4));
        let released_record = Record::of(&Lease {
            spec: Some(released),
            ..Lease::default()
        });
        assert_eq!(released_record.holder, None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_gate_closes_at_the_renew_deadline_without_any_renew() {
        let gate = LeaderGate::default();
        assert!(!gate.is_open());
        gate.renewed(Instant::now() + Duration::from_secs(10));
        assert!(gate.is_open());
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert!(gate.is_open());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(
            !gate.is_open(),
            "closed by the clock, before any candidate may take over"
        );
        assert!(
            gate.is_leading(),
            "the loop has not noticed yet; writes are refused anyway"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn gained_fires_on_becoming_leader_not_on_renewals() {
        use futures::StreamExt;
        let gate = LeaderGate::default();
        let mut gained = Box::pin(gate.gained());
        gate.renewed(Instant::now() + Duration::from_secs(10));
        gained.next().await.unwrap();
        gate.renewed(Instant::now() + Duration::from_secs(12));
        gate.renewed(Instant::now() + Duration::from_secs(14));
        let quiet = tokio::time::timeout(Duration::from_secs(1), gained.next()).await;
        assert!(quiet.is_err(), "renewals are not new terms");
        gate.close();
        gate.renewed(Instant::now() + Duration::from_secs(10));
        tokio::time::timeout(Duration::from_secs(1), gained.next())
            .await
            .expect("a new term after losing the lease")
            .unwrap();
    }
}
