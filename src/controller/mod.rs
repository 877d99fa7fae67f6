//! The controller: watches claims, volumes and classes, and drives guests to provision and delete.
//!
//! Claims (provision path) and volumes (delete path) are each a kube-runtime `Controller` with
//! its own reconcile and error policy; StorageClasses are a shared read-only cache. Each
//! controller never runs two reconciles for one object at once and re-runs an object that changed
//! while in flight.

pub mod bindable;
pub mod bookkeeping;
pub mod cache;
pub mod claim_watch;
pub mod claims;
pub mod convert;
pub mod data_source;
pub mod decide;
pub mod events;
pub mod expand;
pub mod failures;
pub mod gate;
pub mod handle;
pub mod inflight;
pub mod leader;
pub mod node;
pub mod plan;
pub mod ratelimit;
pub mod relist;
pub mod slim;
mod start;
pub mod storage;
pub mod volumes;

use std::num::{NonZeroU16, NonZeroU32};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::storage::v1::StorageClass;
use kube::Client;
use kube::Resource;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::metrics::{Metrics, Queue};
use crate::wasm::Plugins;
use bookkeeping::Book;
use cache::CachedVolume;
use handle::RecentWrites;
use inflight::Turns;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use ratelimit::RateLimiter;

pub use slim::slim;
pub use start::{run, run_watching};

/// Settles what the intent logs hold for claims that are gone (see [`storage::intent`]); the controller
/// runs it periodically while it leads. Returns how many entries were settled.
pub async fn recover_intents(ctx: &Context) -> Result<usize, kube::Error> {
    // Recovery leaves a volume entry to the volume path while that path will delete the PV;
    // which PVs those are is the volume path's to say.
    let queued = |pv: &k8s_openapi::api::core::v1::PersistentVolume| {
        volumes::queued_for_delete(ctx, &ctx.plugins(), pv).is_some()
    };
    storage::recovery::recover_intents(ctx, &queued).await
}

/// Everything the controller is told by the command line, parsed and validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Concurrent reconciles per controller (claims and volumes each); none could never run.
    pub worker_threads: NonZeroU16,
    /// First retry delay after a failure.
    pub retry_interval_start: Duration,
    /// Largest retry delay.
    pub retry_interval_max: Duration,
    /// Every object is reconciled again this often.
    pub resync_period: Duration,
    /// Provision failures before a claim is given up (0 = never).
    pub failed_provision_threshold: u32,
    /// Delete failures before a volume is given up (0 = never).
    pub failed_delete_threshold: u32,
    /// Attempts to create a PV object before its storage is cleaned up (and attempts at that
    /// cleanup); with none a provisioned PV would never be saved.
    pub create_pv_retry_count: NonZeroU32,
    /// Pause between those attempts.
    pub create_pv_retry_interval: Duration,
    /// Bound on one provision operation, guest call and API writes included.
    pub provision_timeout: Duration,
    /// Bound on one delete operation.
    pub delete_timeout: Duration,
    /// Hold `Delete` PVs with the library's PV finalizer until their storage is deleted (on by
    /// default: the record that survives a kill between the PV DELETE and the storage delete).
    pub add_pv_finalizer: bool,
    /// Keep settled claims and PVs whole in the caches (see [`cache`]).
    pub cache_whole_objects: bool,
    /// Provision only claims kube-controller-manager has marked for a provisioner, never ahead
    /// of the mark (see [`decide::Unmarked`]).
    pub wait_for_mark: bool,
    /// How provisioning intent is recorded before a guest call (leak protection).
    pub intent: IntentRecord,
    /// Client-side API request rate.
    pub kube_api_qps: f64,
    /// Client-side API request burst.
    pub kube_api_burst: u32,
    /// How long in-flight work may take to finish on shutdown.
    pub shutdown_grace: Duration,
    /// The controller name in events.
    pub reporter: String,
    /// This replica's name in events (pod name or host name).
    pub instance: Option<String>,
    /// Leader election (`--leader-election*`).
    pub election: gate::ElectionSettings,
    /// Node-local deployment (`--node-deployment*`): serve only this node's claims and volumes.
    pub node: Option<node::NodeSettings>,
}

/// `--worker-threads` unless set: claim attempts in flight (one fewer) and volume reconciles.
/// A reconcile spends most of its time waiting for the API server; with 3 attempts in flight
/// (4 workers) 20 ms from it, throughput was bound to 14 PVs/s whatever the budget
/// (docs/benchmarks.md).
pub const DEFAULT_WORKER_THREADS: u16 = 32;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            worker_threads: NonZeroU16::new(DEFAULT_WORKER_THREADS).expect("not zero"),
            retry_interval_start: Duration::from_secs(15),
            retry_interval_max: Duration::from_secs(1000),
            resync_period: Duration::from_secs(15 * 60),
            failed_provision_threshold: 15,
            failed_delete_threshold: 15,
            create_pv_retry_count: NonZeroU32::new(5).expect("5 is not zero"),
            create_pv_retry_interval: Duration::from_secs(10),
            provision_timeout: Duration::from_secs(300),
            delete_timeout: Duration::from_secs(300),
            add_pv_finalizer: true,
            cache_whole_objects: false,
            wait_for_mark: false,
            intent: IntentRecord::Log,
            kube_api_qps: 50.0,
            kube_api_burst: 100,
            shutdown_grace: Duration::from_secs(30),
            reporter: "wasm-provisioner".into(),
            instance: None,
            election: gate::ElectionSettings::default(),
            node: None,
        }
    }
}

/// How the intent to provision is made durable before a guest is called, so a claim deleted
/// mid-provision or a crash between the guest call and the PV create leaks no storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IntentRecord {
    /// One batched log per replica ([`storage::intent`]): about one API write per claim in all.
    #[default]
    Log,
    /// Our finalizer on the claim, with its class recorded: two writes per claim. Used in
    /// per-claim and node modes, where every replica works at once.
    ClaimFinalizer,
    /// None: a crash or a claim deleted mid-provision may leak storage.
    Off,
}

/// Shared state of both controllers. Writes go through a per-reconcile [`handle::Handle`].
pub struct Context {
    /// The API client.
    pub client: Client,
    /// The loaded guests (swapped as a whole on reload).
    plugins: RwLock<Arc<Plugins>>,
    /// StorageClass cache.
    pub classes: Store<StorageClass>,
    /// PersistentVolume cache (settled PVs as their identity only).
    pub volumes: Store<CachedVolume>,
    /// PersistentVolumeClaim cache (settled claims are not kept).
    pub claims: Store<PersistentVolumeClaim>,
    /// The PVs kube-controller-manager could still bind a claim to, by class.
    pub bindable: Arc<bindable::BindableVolumes>,
    /// Event publisher.
    pub recorder: events::Recorder,
    /// Settings.
    pub settings: Settings,
    /// Claim failures and give-ups by UID.
    pub claim_book: Book,
    /// Volume failures and give-ups by name.
    pub volume_book: Book,
    /// API request budget.
    pub api_rate: Arc<RateLimiter>,
    /// This replica's intent log (`IntentRecord::Log`).
    pub intents: Option<Arc<storage::intent::IntentLog>>,
    /// Our own writes the caches may not show yet (PVs created, claim finalizers set).
    pub recent: RecentWrites,
    /// Claim attempts in flight, capped below the worker count over every class (see [`inflight`]).
    pub turns: Turns,
    /// Who may write: the write gate every guest call and API write passes.
    pub election: Arc<gate::Election>,
    /// Prometheus series and readiness.
    pub metrics: Metrics,
    /// Node mode's node cache and bookkeeping (None outside node mode).
    pub node: Option<node::NodeState>,
    /// Claims a guest is copying into clones now (their finalizer's bookkeeping).
    pub clone_sources: claims::CloneSources,
}

/// The caches a [`Context`] reads.
#[derive(Clone)]
pub struct Caches {
    /// StorageClasses.
    pub classes: Store<StorageClass>,
    /// PersistentVolumes.
    pub volumes: Store<CachedVolume>,
    /// PersistentVolumeClaims.
    pub claims: Store<PersistentVolumeClaim>,
    /// The PVs kube-controller-manager could still bind a claim to, fed by the PV watch.
    pub bindable: Arc<bindable::BindableVolumes>,
}

impl Context {
    /// The shared state over `caches` (filled by the watches, or by a test).
    pub fn new(
        client: Client,
        plugins: Arc<Plugins>,
        settings: Settings,
        caches: Caches,
        metrics: Metrics,
        node: Option<node::NodeState>,
    ) -> Context {
        let recorder = events::Recorder::new(
            client.clone(),
            settings.reporter.clone(),
            settings.instance.clone(),
        );
        let api_rate = Arc::new(RateLimiter::new(
            settings.kube_api_qps,
            settings.kube_api_burst,
        ));
        let intents = (settings.intent == IntentRecord::Log).then(|| {
            let election = &settings.election;
            Arc::new(storage::intent::IntentLog::new(
                client.clone(),
                &election.namespace,
                &election.lease_name,
                &election.log_identity,
                api_rate.clone(),
            ))
        });
        let turns = Turns::new(settings.worker_threads.get());
        Context {
            election: Arc::new(gate::Election::new(&client, &settings.election)),
            client,
            plugins: RwLock::new(plugins),
            classes: caches.classes,
            volumes: caches.volumes,
            claims: caches.claims,
            bindable: caches.bindable,
            recorder,
            api_rate,
            intents,
            claim_book: Book::new(Queue::Claims),
            volume_book: Book::new(Queue::Volumes),
            settings,
            recent: RecentWrites::default(),
            turns,
            metrics,
            node,
            clone_sources: claims::CloneSources::default(),
        }
    }

    /// The current set of guests.
    pub fn plugins(&self) -> Arc<Plugins> {
        self.plugins.read().expect("plugins lock").clone()
    }

    /// Replaces the set of guests; calls in flight keep the set they started with.
    pub fn set_plugins(&self, plugins: Arc<Plugins>) {
        self.metrics.guests_loaded(plugins.len());
        self.metrics.guests_compiling(plugins.compiling());
        *self.plugins.write().expect("plugins lock") = plugins;
    }

    /// Looks up a class in the cache.
    pub fn class(&self, name: &str) -> Option<Arc<StorageClass>> {
        self.classes.get(&ObjectRef::new(name))
    }

    /// Looks up a PV in the cache.
    pub fn volume(&self, name: &str) -> Option<Arc<CachedVolume>> {
        self.volumes.get(&ObjectRef::new(name))
    }

    /// Whether the PV cache holds every PV (its first list is done). Until then neither "this
    /// claim's PV exists" nor the index of served paths can be answered.
    pub fn volumes_listed(&self) -> bool {
        use futures::FutureExt;
        // Polled, not awaited: see `start::report_ready`.
        self.volumes
            .wait_until_ready()
            .now_or_never()
            .is_some_and(|ready| ready.is_ok())
    }

    /// Forgets what is kept per object for objects that are gone: failure books and waiting
    /// retries. Run periodically, so memory follows what exists, not what ever existed.
    pub fn forget_gone(&self) {
        let claims: std::collections::HashSet<String> = self
            .claims
            .state()
            .iter()
            .filter_map(|c| c.meta().uid.clone())
            .collect();
        let volumes: std::collections::HashSet<String> = self
            .volumes
            .state()
            .iter()
            .filter_map(|v| v.meta().name.clone())
            .collect();
        self.claim_book.retain(|uid| claims.contains(uid));
        self.volume_book.retain(|name| volumes.contains(name));
        self.metrics
            .retain_waiting(Queue::Claims, |uid| claims.contains(uid));
        self.metrics
            .retain_waiting(Queue::Volumes, |name| volumes.contains(name));
    }
}
