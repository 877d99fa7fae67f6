//! The controller: watches claims, volumes and classes, and drives guests to provision and delete.
//!
//! Claims (provision path) and volumes (delete path) are each a kube-runtime `Controller` with
//! its own reconcile and error policy; StorageClasses are a shared read-only cache. Each
//! controller never runs two reconciles for one object at once and re-runs an object that changed
//! while in flight.

pub mod claims;
pub mod decide;
pub mod events;
pub mod failures;
pub mod gate;
pub mod leader;
pub mod node;
pub mod ratelimit;
pub mod volumes;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// How long our own recent writes are remembered while the caches catch up.
const WRITE_MEMORY: Duration = Duration::from_secs(120);

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

use crate::metrics::Metrics;
use crate::wasm::Plugins;
use failures::FailureBook;
use ratelimit::RateLimiter;

/// Everything the controller is told by the command line, parsed and validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Concurrent reconciles per controller (claims and volumes each).
    pub worker_threads: u16,
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
    /// Attempts to create a PV object before its storage is cleaned up.
    pub create_pv_retry_count: u32,
    /// Pause between those attempts.
    pub create_pv_retry_interval: Duration,
    /// Bound on one provision operation, guest call and API writes included.
    pub provision_timeout: Duration,
    /// Bound on one delete operation.
    pub delete_timeout: Duration,
    /// Manage the library's PV finalizer.
    pub add_pv_finalizer: bool,
    /// Record provisioning intent as a finalizer on the claim (leak protection; 2 writes per claim).
    pub claim_finalizer: bool,
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

impl Default for Settings {
    fn default() -> Self {
        Settings {
            worker_threads: 4,
            retry_interval_start: Duration::from_secs(15),
            retry_interval_max: Duration::from_secs(1000),
            resync_period: Duration::from_secs(15 * 60),
            failed_provision_threshold: 15,
            failed_delete_threshold: 15,
            create_pv_retry_count: 5,
            create_pv_retry_interval: Duration::from_secs(10),
            provision_timeout: Duration::from_secs(300),
            delete_timeout: Duration::from_secs(300),
            add_pv_finalizer: false,
            claim_finalizer: true,
            kube_api_qps: 20.0,
            kube_api_burst: 40,
            shutdown_grace: Duration::from_secs(30),
            reporter: "wasm-provisioner".into(),
            instance: None,
            election: gate::ElectionSettings::default(),
            node: None,
        }
    }
}

/// Shared state of both controllers.
pub struct Context {
    /// The API client.
    pub client: Client,
    /// The loaded guests (swapped as a whole on reload).
    plugins: RwLock<Arc<Plugins>>,
    /// StorageClass cache.
    pub classes: Store<StorageClass>,
    /// PersistentVolume cache.
    pub volumes: Store<PersistentVolume>,
    /// PersistentVolumeClaim cache.
    pub claims: Store<PersistentVolumeClaim>,
    /// Event publisher.
    pub recorder: events::Recorder,
    /// Settings.
    pub settings: Settings,
    /// Claim failures by UID.
    pub claim_failures: Mutex<FailureBook>,
    /// Volume failures by name.
    pub volume_failures: Mutex<FailureBook>,
    /// API request budget.
    pub api_rate: RateLimiter,
    /// PVs this process created, until the PV cache shows them: a claim event arriving before
    /// the PV's own watch event must not call the guest again.
    created: RecentWrites,
    /// Claims (by UID) whose finalizer this process removed: a deleted claim's event arriving
    /// before the removal's own must not start its cleanup (a guest call) again.
    released: RecentWrites,
    /// Who may write: the write gate every guest call and API write passes.
    pub election: Arc<gate::Election>,
    /// Prometheus series and readiness.
    pub metrics: Metrics,
    /// Node mode's node cache and bookkeeping (None outside node mode).
    pub node: Option<node::NodeState>,
}

impl Context {
    /// The current set of guests.
    pub fn plugins(&self) -> Arc<Plugins> {
        self.plugins.read().expect("plugins lock").clone()
    }

    /// Replaces the set of guests; calls in flight keep the set they started with.
    pub fn set_plugins(&self, plugins: Arc<Plugins>) {
        self.metrics.guests_loaded(plugins.len());
        *self.plugins.write().expect("plugins lock") = plugins;
    }

    /// Looks up a class in the cache.
    pub fn class(&self, name: &str) -> Option<Arc<StorageClass>> {
        self.classes.get(&ObjectRef::new(name))
    }

    /// Records that we created a PV.
    pub fn remember_created(&self, pv: &str) {
        self.created.insert(pv);
    }

    /// Whether we created this PV recently (the cache may not show it yet).
    pub fn recently_created(&self, pv: &str) -> bool {
        self.created.contains(pv)
    }

    /// Records that we removed (`false`) or added (`true`) a claim's finalizer.
    pub fn remember_claim_finalizer(&self, uid: &str, present: bool) {
        if present {
            self.released.remove(uid);
        } else {
            self.released.insert(uid);
        }
    }

    /// Whether the claim still holds our finalizer as far as we know: the cache shows it and we
    /// did not just remove it ourselves (the cache may be behind our own patch).
    pub fn holds_claim_finalizer(&self, pvc: &PersistentVolumeClaim) -> bool {
        decide::has_finalizer(&pvc.metadata.finalizers, decide::FINALIZER_CLAIM)
            && !self
                .released
                .contains(pvc.metadata.uid.as_deref().unwrap_or_default())
    }

    /// Waits for the API request budget.
    pub async fn api_budget(&self) {
        self.api_rate.acquire().await;
    }

    /// Checks the write gate right before a guest call or API write (see [`gate::write_gate`]).
    pub async fn write_gate(&self) -> Result<bool, gate::GateError> {
        gate::write_gate().await
    }
}

/// Runs both controllers until `shutdown` resolves, then lets in-flight work finish.
pub async fn run(
    client: Client,
    plugins: Arc<Plugins>,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let (_fixed, plugins) = tokio::sync::watch::channel(plugins);
    run_watching(client, plugins, settings, Metrics::new(), shutdown).await
}

/// [`run`] with live plugins and metrics: every set sent on `plugins` replaces the current one
/// (calls in flight finish on the guest they started with) and re-runs every claim and volume,
/// so claims that waited for a returning guest go ahead; `metrics` is marked ready once every
/// cache has synced.
pub async fn run_watching(
    client: Client,
    mut plugins: tokio::sync::watch::Receiver<Arc<Plugins>>,
    mut settings: Settings,
    metrics: Metrics,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let initial = plugins.borrow_and_update().clone();
    metrics.guests_loaded(initial.len());
    let requested = settings.election.mode;
    settings.election.mode = node::election_mode(requested, settings.node.is_some());
    if settings.election.mode != requested {
        tracing::info!(
            "node deployment: whole-controller leader election is off (every node's instance must act)"
        );
    }
    let (node_state, node_deleted) = match &settings.node {
        Some(node) => {
            let (state, deleted) = watch_nodes(&client, node).await?;
            (Some(state), deleted.left_stream())
        }
        None => (None, futures::stream::pending().right_stream()),
    };
    if settings.election.mode != gate::Mode::Off {
        settings.election.timing.validate()?;
    }
    let (classes, class_writer) = reflector::store::<StorageClass>();
    let class_api: Api<StorageClass> = Api::all(client.clone());
    let class_watch = watcher(class_api.clone(), watcher::Config::default())
        .default_backoff()
        .modify(slim)
        .reflect(class_writer)
        .for_each(|event| {
            if let Err(error) = event {
                tracing::warn!(%error, "watching StorageClasses failed (RBAC: list, watch storageclasses)");
            }
            futures::future::ready(())
        });
    tokio::spawn(class_watch);

    let pv_api: Api<PersistentVolume> = Api::all(client.clone());
    let pvc_api: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let controller_config = ControllerConfig::default().concurrency(settings.worker_threads);
    let (volumes, volume_writer) = reflector::store::<PersistentVolume>();
    let volume_controller =
        Controller::for_stream(slim_watch(pv_api, volume_writer), volumes.clone())
            .with_config(controller_config.clone());
    let volumes_ready = volumes.clone();
    let (claims, claim_writer) = reflector::store::<PersistentVolumeClaim>();
    let claim_controller =
        Controller::for_stream(slim_watch(pvc_api, claim_writer), claims.clone())
            .with_config(controller_config);

    let recorder = events::Recorder::new(
        client.clone(),
        settings.reporter.clone(),
        settings.instance.clone(),
    );
    let election = Arc::new(gate::Election::new(&client, &settings.election));
    let ctx = Arc::new(Context {
        client: client.clone(),
        plugins: RwLock::new(initial),
        classes: classes.clone(),
        volumes,
        claims: claims.clone(),
        recorder,
        api_rate: RateLimiter::new(settings.kube_api_qps, settings.kube_api_burst),
        claim_failures: Mutex::new(FailureBook::default()),
        volume_failures: Mutex::new(FailureBook::default()),
        settings: settings.clone(),
        created: RecentWrites::default(),
        released: RecentWrites::default(),
        election: election.clone(),
        metrics: metrics.clone(),
        node: node_state,
    });

    tokio::time::timeout(Duration::from_secs(60), classes.wait_until_ready())
        .await
        .map_err(|_| anyhow::anyhow!("StorageClass cache did not sync within 60 s"))??;

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = shutdown_tx.send(true);
    });
    let shutdown_signal = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };

    // leader_election_master_status follows the gate (polled: cheap, and never misses a flip).
    tokio::spawn({
        let (election, metrics) = (election.clone(), metrics.clone());
        let lease = settings.election.lease_name.clone();
        async move {
            loop {
                metrics.leader(&lease, election.is_leader());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    });

    // Leader mode: every replica watches and reconciles; the campaign opens the gate for one.
    let (stop_campaign, campaign_stopped) = tokio::sync::watch::channel(false);
    let campaign = match &*election {
        gate::Election::Leader(gate) => Some(tokio::spawn(start_campaign(
            client.clone(),
            settings.election.clone(),
            gate.clone(),
            ctx.recorder.clone(),
            campaign_stopped,
        ))),
        _ => None,
    };
    let gained = |election: &gate::Election| match election {
        gate::Election::Leader(gate) => gate.gained().left_stream(),
        _ => futures::stream::pending().right_stream(),
    };

    let (reloaded_tx, reloaded) = tokio::sync::watch::channel(0u64);
    tokio::spawn({
        let ctx = ctx.clone();
        async move {
            while plugins.changed().await.is_ok() {
                let next = plugins.borrow_and_update().clone();
                ctx.set_plugins(next);
                reloaded_tx.send_modify(|generation| *generation += 1);
            }
        }
    });
    let resync = settings.resync_period;
    let claim_run = claim_controller
        .watches(class_api, watcher::Config::default(), {
            let claims = claims.clone();
            move |class: StorageClass| claims::claims_of_class(&claims, &class)
        })
        .reconcile_all_on(futures::stream::select(
            resync_ticks(resync),
            reload_ticks(reloaded.clone()),
        ))
        .reconcile_all_on(gained(&election))
        .graceful_shutdown_on(shutdown_signal(shutdown_rx.clone()))
        .run(claims::reconcile, claims::error_policy, ctx.clone())
        .for_each(|result| async move {
            match result {
                // A broken watch stops all work: say so where operators look.
                Err(error @ kube::runtime::controller::Error::QueueError(_)) => {
                    tracing::warn!(%error, "watching claims failed (RBAC: list, watch persistentvolumeclaims)");
                }
                Err(error) => tracing::debug!(%error, "claim reconcile"),
                Ok(_) => {}
            }
        });
    let volume_run = volume_controller
        .reconcile_all_on(futures::stream::select(
            resync_ticks(resync),
            reload_ticks(reloaded),
        ))
        // Node mode: a node that disappears may leave Released PVs only other nodes can delete.
        .reconcile_all_on(node_deleted)
        .reconcile_all_on(gained(&election))
        .graceful_shutdown_on(shutdown_signal(shutdown_rx.clone()))
        .run(volumes::reconcile, volumes::error_policy, ctx.clone())
        .for_each(|result| async move {
            match result {
                Err(error @ kube::runtime::controller::Error::QueueError(_)) => {
                    tracing::warn!(%error, "watching volumes failed (RBAC: list, watch persistentvolumes)");
                }
                Err(error) => tracing::debug!(%error, "volume reconcile"),
                Ok(_) => {}
            }
        });
    tracing::info!(guests = ctx.plugins().len(), "controller started");
    // Ready = guests loaded (done before we got here) and every cache synced; the reflectors
    // of the two controllers only run once their streams are polled below.
    let readiness = tokio::spawn({
        let metrics = metrics.clone();
        async move {
            // Polled, not awaited: a store's readiness is a oneshot that wakes only its latest
            // waiter, and kube-runtime's own controller loop waits on the same stores.
            use futures::FutureExt;
            let synced = |ready: Option<Result<(), _>>| ready.is_some_and(|r| r.is_ok());
            loop {
                if synced(classes.wait_until_ready().now_or_never())
                    && synced(volumes_ready.wait_until_ready().now_or_never())
                    && synced(claims.wait_until_ready().now_or_never())
                {
                    tracing::info!("caches synced; ready");
                    metrics.set_ready(true);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    let grace = settings.shutdown_grace;
    let both = async {
        tokio::join!(claim_run, volume_run);
    };
    tokio::pin!(both);
    let mut campaign = campaign;
    tokio::select! {
        _ = &mut both => {}
        _ = async {
            let _ = shutdown_signal(shutdown_rx.clone()).await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?grace, "in-flight work did not finish within the shutdown grace period");
        }
        // The campaign only ends when told to; if it dies, nothing renews the lease: exit.
        outcome = async { campaign.as_mut().expect("spawned").await }, if campaign.is_some() => {
            anyhow::bail!("the leader election task ended unexpectedly: {outcome:?}");
        }
    }
    // In-flight work is done or abandoned (its futures are dropped): hand the lease over now.
    let _ = stop_campaign.send(true);
    if let Some(campaign) = campaign {
        let _ = tokio::time::timeout(Duration::from_secs(5), campaign).await;
    }
    readiness.abort();
    metrics.set_ready(false);
    tracing::info!("controller stopped");
    Ok(())
}

/// Node mode: checks this node exists (a mistyped `--node-name` would otherwise serve nothing,
/// silently), then caches node metadata; the stream ticks when a node is deleted.
async fn watch_nodes(
    client: &Client,
    settings: &node::NodeSettings,
) -> anyhow::Result<(
    node::NodeState,
    impl futures::Stream<Item = ()> + Send + 'static,
)> {
    use k8s_openapi::api::core::v1::Node;
    let api: Api<Node> = Api::all(client.clone());
    match api.get_metadata_opt(&settings.name).await {
        Ok(Some(_)) => {}
        Ok(None) => anyhow::bail!(
            "node {:?} does not exist: --node-name (or NODE_NAME) must name this instance's node",
            settings.name
        ),
        Err(error) => {
            return Err(anyhow::Error::new(error).context(format!(
                "cannot read node {:?} (RBAC: get nodes)",
                settings.name
            )));
        }
    }
    let (nodes, writer) = reflector::store();
    let (deleted_tx, deleted_rx) = futures::channel::mpsc::unbounded::<()>();
    // Metadata only: node status (conditions, images, addresses) is most of a Node's bytes and
    // churn, and node mode needs names and the hostname label.
    let meta: Api<kube::core::PartialObjectMeta<Node>> = Api::all(client.clone());
    let node_watch = watcher(meta, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .for_each(move |event| {
            match event {
                Ok(watcher::Event::Delete(_) | watcher::Event::InitDone) => {
                    let _ = deleted_tx.unbounded_send(());
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "watching nodes failed (RBAC: list, watch nodes)");
                }
            }
            futures::future::ready(())
        });
    tokio::spawn(node_watch);
    tokio::time::timeout(Duration::from_secs(60), nodes.wait_until_ready())
        .await
        .map_err(|_| {
            anyhow::anyhow!("Node cache did not sync within 60 s (RBAC: list, watch nodes)")
        })??;
    tracing::info!(node = %settings.name, "node deployment: serving this node's claims and volumes");
    Ok((node::NodeState::new(settings.clone(), nodes), deleted_rx))
}

/// Starts campaigning for the whole-controller lease, woken early by a watch on that lease.
async fn start_campaign(
    client: Client,
    settings: gate::ElectionSettings,
    gate: Arc<leader::LeaderGate>,
    recorder: events::Recorder,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let api: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client, &settings.namespace);
    let changed = Arc::new(tokio::sync::Notify::new());
    let notify = changed.clone();
    let lease_watch = watcher(
        api.clone(),
        watcher::Config::default().fields(&format!("metadata.name={}", settings.lease_name)),
    )
    .default_backoff()
    .for_each(move |_| {
        notify.notify_one();
        futures::future::ready(())
    });
    let watch_task = tokio::spawn(lease_watch);
    let lock = leader::LeaseLock::new(
        api,
        settings.lease_name.clone(),
        settings.identity.clone(),
        settings.timing,
        Default::default(),
    );
    tracing::info!(
        lease = %settings.lease_name,
        namespace = %settings.namespace,
        identity = %settings.identity,
        "campaigning for leadership"
    );
    leader::campaign(lock, gate, changed, recorder, stop).await;
    watch_task.abort();
}

/// One tick per plugins reload.
fn reload_ticks(
    reloaded: tokio::sync::watch::Receiver<u64>,
) -> impl futures::Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(reloaded, |mut reloaded| async move {
        reloaded.changed().await.ok()?;
        Some(((), reloaded))
    })
}

fn resync_ticks(period: Duration) -> impl futures::Stream<Item = ()> + Send + 'static {
    let start = tokio::time::Instant::now() + period;
    futures::stream::unfold(
        tokio::time::interval_at(start, period),
        |mut interval| async move {
            interval.tick().await;
            Some(((), interval))
        },
    )
}

/// The watch behind a controller's cache, with every object slimmed before it is stored.
fn slim_watch<K>(
    api: Api<K>,
    writer: reflector::store::Writer<K>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(slim)
        .reflect(writer)
        .applied_objects()
}

/// Annotation `kubectl apply` keeps: a second copy of the whole object as the user wrote it.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops what the controller never reads from a cached object: managed fields (a JSON tree per
/// writer, often larger than the object itself) and kubectl's last-applied copy. Every write the
/// controller makes is a patch, so nothing it sends back is derived from the dropped parts.
pub fn slim<K: kube::Resource>(object: &mut K) {
    let meta = object.meta_mut();
    meta.managed_fields = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta};

    #[test]
    fn recent_writes_are_remembered_until_removed() {
        let writes = RecentWrites::default();
        assert!(!writes.contains("u1"));
        writes.insert("u1");
        writes.insert("u2");
        assert!(writes.contains("u1") && writes.contains("u2"));
        writes.remove("u1");
        assert!(!writes.contains("u1") && writes.contains("u2"));
    }

    #[test]
    fn slim_keeps_what_decisions_read() {
        let mut claim = PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("data".into()),
                uid: Some("u1".into()),
                finalizers: Some(vec!["wasm-provisioner.dev/provisioning".into()]),
                annotations: Some(
                    [
                        (LAST_APPLIED.to_string(), "{\"big\":true}".to_string()),
                        (
                            "volume.beta.kubernetes.io/storage-provisioner".to_string(),
                            "example.com/hostpath".to_string(),
                        ),
                    ]
                    .into(),
                ),
                managed_fields: Some(vec![ManagedFieldsEntry {
                    manager: Some("kubectl".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            ..Default::default()
        };
        let before = claim.clone();
        slim(&mut claim);
        assert_eq!(claim.metadata.managed_fields, None);
        let annotations = claim
            .metadata
            .annotations
            .as_ref()
            .expect("annotations kept");
        assert_eq!(annotations.len(), 1);
        assert_eq!(
            annotations["volume.beta.kubernetes.io/storage-provisioner"],
            "example.com/hostpath"
        );
        assert_eq!(claim.metadata.name, before.metadata.name);
        assert_eq!(claim.metadata.uid, before.metadata.uid);
        assert_eq!(claim.metadata.finalizers, before.metadata.finalizers);
        assert_eq!(claim.spec, before.spec);
    }
}

/// Keys of our own writes from the last [`WRITE_MEMORY`]: what the caches may not show yet.
#[derive(Debug, Default)]
struct RecentWrites(Mutex<HashMap<String, Instant>>);

impl RecentWrites {
    fn insert(&self, key: &str) {
        let mut entries = self.0.lock().expect("lock");
        entries.retain(|_, at| at.elapsed() < WRITE_MEMORY);
        entries.insert(key.to_string(), Instant::now());
    }

    fn remove(&self, key: &str) {
        self.0.lock().expect("lock").remove(key);
    }

    fn contains(&self, key: &str) -> bool {
        self.0
            .lock()
            .expect("lock")
            .get(key)
            .is_some_and(|at| at.elapsed() < WRITE_MEMORY)
    }
}
