//! The write gate: whether this replica may call a guest or write to the API server right now.
//!
//! Every replica runs the watches and reconciles; the gate is what keeps standbys from acting.
//! In `leader` mode it is the whole-controller lease ([`super::leader`]). In `per-claim` mode
//! (the 2017 seed's active-active mode) the first gated action of a reconcile takes a short-lived
//! Lease named after the claim's (or volume's) UID, renews it while the reconcile runs, and
//! deletes it when the reconcile ends; a replica that finds it held backs off until it expires.
//!
//! Each reconcile opens a [`Scope`] for its object and hands it, inside its
//! [`super::handle::Handle`], to every write: there is no ambient default a write could slip
//! through.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::leader::{Attempt, LeaderGate, LeaseLock, Observed, Timing, gate_open};

/// Label on per-object leases: which kind of object they lock.
pub const LOCK_LABEL: &str = "wasm-provisioner.dev/lock";

/// How replicas share the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// No election: this replica writes whenever it likes (one replica only).
    Off,
    /// One lease for the whole controller; only its holder writes.
    #[default]
    Leader,
    /// One short-lived lease per claim or volume; all replicas work.
    PerClaim,
}

/// The `--leader-election*` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionSettings {
    /// The mode.
    pub mode: Mode,
    /// Namespace of the leases.
    pub namespace: String,
    /// Name of the whole-controller lease, and prefix of per-object leases.
    pub lease_name: String,
    /// This replica's identity in lease records.
    pub identity: String,
    /// The name its intent log is kept under: the pod's name when it has one (a restarted
    /// container takes up its own log), else `identity`.
    pub log_identity: String,
    /// Durations.
    pub timing: Timing,
}

impl Default for ElectionSettings {
    fn default() -> Self {
        ElectionSettings {
            mode: Mode::Leader,
            namespace: "default".into(),
            lease_name: "wasm-provisioner".into(),
            identity: "wasm-provisioner".into(),
            log_identity: "wasm-provisioner".into(),
            timing: Timing::default(),
        }
    }
}

/// What a reconcile locks in per-claim mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LockKey {
    /// A claim, by UID.
    Claim(String),
    /// A volume, by UID.
    Volume(String),
}

impl LockKey {
    /// The per-object Lease's name: `<lease-name>-claim-<uid>` or `<lease-name>-volume-<uid>`.
    pub fn lease_name(&self, prefix: &str) -> String {
        match self {
            LockKey::Claim(uid) => format!("{prefix}-claim-{uid}"),
            LockKey::Volume(uid) => format!("{prefix}-volume-{uid}"),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            LockKey::Claim(_) => "claim",
            LockKey::Volume(_) => "volume",
        }
    }
}

/// Why this replica may not write now.
#[derive(Debug, thiserror::Error)]
pub enum GateError {
    /// Another replica holds the whole-controller lease (or ours lapsed).
    #[error("not the leader")]
    NotLeader,
    /// Another replica is working on this object (per-claim mode).
    #[error("lease {lease} is held by {holder}")]
    HeldBy {
        /// The lease.
        lease: String,
        /// Its holder.
        holder: String,
        /// When to look again.
        retry_in: Duration,
    },
    /// Our per-object lease could not be renewed in time; another replica may take over.
    #[error("lease {lease} lapsed mid-operation")]
    Lapsed {
        /// The lease.
        lease: String,
        /// When to look again.
        retry_in: Duration,
    },
    /// The lease could not be read or written.
    #[error("lease {lease}: {source}")]
    Lease {
        /// The lease.
        lease: String,
        /// The API error.
        #[source]
        source: kube::Error,
        /// When to look again.
        retry_in: Duration,
    },
}

impl GateError {
    /// When the reconcile should run again; `None` = when leadership is gained (leader mode
    /// re-runs every object then).
    pub fn retry_in(&self) -> Option<Duration> {
        match self {
            GateError::NotLeader => None,
            GateError::HeldBy { retry_in, .. }
            | GateError::Lapsed { retry_in, .. }
            | GateError::Lease { retry_in, .. } => Some(*retry_in),
        }
    }
}

/// The election state of this replica, shared by every reconcile.
#[derive(Debug)]
pub enum Election {
    /// No election.
    Off,
    /// Whole-controller lease.
    Leader(Arc<LeaderGate>),
    /// Per-object leases.
    PerClaim(Box<ObjectLocks>),
}

impl Election {
    /// Builds the election for `settings` (the leader loop itself is started by `run`).
    pub fn new(client: &Client, settings: &ElectionSettings) -> Election {
        match settings.mode {
            Mode::Off => Election::Off,
            Mode::Leader => Election::Leader(Arc::new(LeaderGate::default())),
            Mode::PerClaim => Election::PerClaim(Box::new(ObjectLocks {
                api: Api::namespaced(client.clone(), &settings.namespace),
                prefix: settings.lease_name.clone(),
                identity: settings.identity.clone(),
                timing: settings.timing,
                sightings: Mutex::new(HashMap::new()),
            })),
        }
    }

    /// Whether this replica leads (leader mode) or works at all (other modes): for logs and metrics.
    pub fn is_leader(&self) -> bool {
        match self {
            Election::Leader(gate) => gate.is_open(),
            Election::Off | Election::PerClaim(_) => true,
        }
    }
}

/// Per-object leases of per-claim mode, and what we saw of those held by others.
#[derive(Debug)]
pub struct ObjectLocks {
    api: Api<Lease>,
    prefix: String,
    identity: String,
    timing: Timing,
    /// Kept across reconciles so a lease left by a crashed replica expires for us.
    sightings: Mutex<HashMap<String, Observed>>,
}

impl ObjectLocks {
    async fn acquire(&self, key: &LockKey) -> Result<HeldLock, GateError> {
        let name = key.lease_name(&self.prefix);
        let labels = BTreeMap::from([(LOCK_LABEL.to_string(), key.kind().to_string())]);
        let earlier = self.sightings.lock().expect("sightings").remove(&name);
        let mut lock = LeaseLock::new(
            self.api.clone(),
            name.clone(),
            self.identity.clone(),
            self.timing,
            labels,
        )
        .with_observed(earlier);
        let started = Instant::now();
        let attempt = lock.attempt().await.map_err(|source| GateError::Lease {
            lease: name.clone(),
            source,
            retry_in: self.timing.retry_period,
        })?;
        match attempt {
            Attempt::Held => {
                let deadline = Arc::new(Mutex::new(started + self.timing.renew_deadline));
                let lock = Arc::new(tokio::sync::Mutex::new(lock));
                let renewer = tokio::spawn(renew(lock.clone(), deadline.clone(), self.timing));
                Ok(HeldLock {
                    name,
                    lock,
                    deadline,
                    renewer,
                    retry_in: self.timing.retry_period,
                })
            }
            Attempt::HeldBy { holder, until } => {
                if let Some(observed) = lock.observed() {
                    let mut sightings = self.sightings.lock().expect("sightings");
                    let horizon = 4 * self.timing.lease_duration;
                    sightings.retain(|_, o| o.seen_at.elapsed() < horizon);
                    sightings.insert(name.clone(), observed.clone());
                }
                Err(GateError::HeldBy {
                    lease: name,
                    holder,
                    retry_in: until.saturating_duration_since(Instant::now())
                        + self.timing.retry_period,
                })
            }
        }
    }
}

/// Renews a held per-object lease every retry period; moves the write deadline on success.
async fn renew(
    lock: Arc<tokio::sync::Mutex<LeaseLock>>,
    deadline: Arc<Mutex<Instant>>,
    timing: Timing,
) {
    loop {
        tokio::time::sleep(timing.retry_period).await;
        let started = Instant::now();
        let outcome = tokio::time::timeout(timing.renew_deadline / 2, async {
            lock.lock().await.attempt().await
        })
        .await;
        match outcome {
            Ok(Ok(Attempt::Held)) => {
                *deadline.lock().expect("deadline") = started + timing.renew_deadline;
            }
            Ok(Ok(Attempt::HeldBy { .. })) => return,
            Ok(Err(error)) => tracing::debug!(%error, "renewing a per-object lease"),
            Err(_) => tracing::debug!("renewing a per-object lease timed out"),
        }
    }
}

/// A per-object lease we hold; dropping it stops renewal and deletes the lease.
#[derive(Debug)]
struct HeldLock {
    name: String,
    lock: Arc<tokio::sync::Mutex<LeaseLock>>,
    deadline: Arc<Mutex<Instant>>,
    renewer: JoinHandle<()>,
    retry_in: Duration,
}

impl HeldLock {
    fn check(&self) -> Result<(), GateError> {
        let deadline = *self.deadline.lock().expect("deadline");
        if gate_open(Some(deadline), Instant::now()) {
            Ok(())
        } else {
            Err(GateError::Lapsed {
                lease: self.name.clone(),
                retry_in: self.retry_in,
            })
        }
    }
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        self.renewer.abort();
        let lock = self.lock.clone();
        // Deleting is tidiness, not safety: if it never happens the lease simply expires.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = lock.lock().await.delete().await {
                    tracing::debug!(%error, "deleting a per-object lease");
                }
            });
        }
    }
}

/// The lease a write goes out under, as the gate answered right before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Held already (or no election): nothing changed since the reconcile last looked.
    Held,
    /// A per-object lease taken by this very check: another replica may have finished the object
    /// a moment ago, so the caller should look at the API server again.
    JustTaken,
}

/// One reconcile's standing at the gate, opened per object and handed explicitly to everything
/// that writes for it (see [`super::handle::Handle`]): no write can happen outside a scope.
#[derive(Debug)]
pub struct Scope {
    election: Arc<Election>,
    key: LockKey,
    held: tokio::sync::Mutex<Option<HeldLock>>,
}

impl Scope {
    /// Opens the scope of one reconcile of `key`. In leader mode a standby is refused before
    /// doing anything, not even a read; a per-object lease taken later ends with the scope.
    pub fn open(election: Arc<Election>, key: LockKey) -> Result<Scope, GateError> {
        if let Election::Leader(gate) = &*election
            && !gate.is_open()
        {
            return Err(GateError::NotLeader);
        }
        Ok(Scope {
            election,
            key,
            held: tokio::sync::Mutex::new(None),
        })
    }

    /// Checks the gate right before a guest call or an API write: the lease this scope writes
    /// under, or why it may not write.
    pub async fn check(&self) -> Result<Standing, GateError> {
        match &*self.election {
            Election::Off => Ok(Standing::Held),
            Election::Leader(gate) if gate.is_open() => Ok(Standing::Held),
            Election::Leader(_) => Err(GateError::NotLeader),
            Election::PerClaim(locks) => {
                let mut held = self.held.lock().await;
                match &*held {
                    Some(lock) => lock.check().map(|()| Standing::Held),
                    None => {
                        *held = Some(locks.acquire(&self.key).await?);
                        Ok(Standing::JustTaken)
                    }
                }
            }
        }
    }

    /// The same check without taking a lease, for events: true when a write would be allowed now.
    pub fn may_write_now(&self) -> bool {
        match &*self.election {
            Election::Off => true,
            Election::Leader(gate) => gate.is_open(),
            Election::PerClaim(_) => self
                .held
                .try_lock()
                .map(|held| held.as_ref().is_some_and(|lock| lock.check().is_ok()))
                // Locked only while a lease is being taken; an event then is not ours to send.
                .unwrap_or(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_come_from_uids() {
        assert_eq!(
            LockKey::Claim("0b1c".into()).lease_name("wasm-provisioner"),
            "wasm-provisioner-claim-0b1c"
        );
        assert_eq!(
            LockKey::Volume("9f".into()).lease_name("wp"),
            "wp-volume-9f"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_standby_is_refused_before_its_reconcile_runs() {
        let election = Arc::new(Election::Leader(Arc::new(LeaderGate::default())));
        let outcome = Scope::open(election, LockKey::Claim("u".into()));
        assert!(matches!(outcome, Err(GateError::NotLeader)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_lease_lapses_mid_reconcile_is_refused_at_the_next_write() {
        let gate = Arc::new(LeaderGate::default());
        gate.renewed(Instant::now() + Duration::from_secs(10));
        let election = Arc::new(Election::Leader(gate));
        let scope = Scope::open(election, LockKey::Claim("u".into())).expect("leader");
        assert_eq!(
            scope.check().await.unwrap(),
            Standing::Held,
            "open, and nothing newly taken"
        );
        assert!(scope.may_write_now());
        // A guest call that outlives the renew deadline without a renew.
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert!(!scope.may_write_now());
        assert!(matches!(scope.check().await, Err(GateError::NotLeader)));
    }

    #[tokio::test]
    async fn with_election_off_every_write_passes() {
        let scope = Scope::open(Arc::new(Election::Off), LockKey::Volume("v".into())).unwrap();
        assert!(scope.may_write_now());
        assert_eq!(scope.check().await.unwrap(), Standing::Held);
    }
}
