//! Start-up wiring: the watches and caches, both controllers, the leader campaign, plugin
//! reloads and the periodic tasks, all supervised; and the orderly shutdown.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

use super::cache::{self, Cached, CachedVolume};
use super::claim_watch::{ClaimKeeping, claim_watch};
use super::{Caches, Context, Settings, claims, events, gate, leader, node, volumes};
use crate::metrics::Metrics;
use crate::wasm::Plugins;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;

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
    let (node_state, node_deleted, node_watch) = match &settings.node {
        Some(node) => {
            let (state, deleted, watch) = watch_nodes(&client, node).await?;
            (Some(state), deleted.left_stream(), Some(watch))
        }
        None => (None, futures::stream::pending().right_stream(), None),
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

    let pv_api: Api<CachedVolume> = Api::all(client.clone());
    let pvc_api: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let controller_config = ControllerConfig::default().concurrency(settings.worker_threads);
    let whole = settings.cache_whole_objects;
    let finalizer_mode = settings.add_pv_finalizer;
    let (volumes, volume_writer) = reflector::store::<CachedVolume>();
    let volume_watch = cached_watch(
        pv_api,
        volume_writer,
        move |pv| !whole && cache::volume_settled(pv, finalizer_mode),
        cache::storage_of,
        served_paths,
    );
    let volume_controller = Controller::for_stream(volume_watch, volumes.clone())
        .with_config(controller_config.clone());
    let volumes_ready = volumes.clone();
    let (claims, claim_writer) = reflector::store::<PersistentVolumeClaim>();
    let keeping = Arc::new(ClaimKeeping::new(whole, plugins.clone()));
    let claim_watch = claim_watch(pvc_api, claim_writer, keeping);
    let claim_controller =
        Controller::for_stream(claim_watch, claims.clone()).with_config(controller_config);

    let ctx = Arc::new(Context::new(
        client.clone(),
        initial,
        settings.clone(),
        Caches {
            classes: classes.clone(),
            volumes,
            claims: claims.clone(),
        },
        metrics.clone(),
        node_state,
    ));
    let election = ctx.election.clone();
    // Long-lived tasks: if one ends, the process is no longer whole, and it exits.
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(watch) = node_watch {
        tasks.spawn(async move {
            let _ = watch.await;
            "the Node watch"
        });
    }
    tasks.spawn(async move {
        class_watch.await;
        "the StorageClass watch"
    });
    tasks.spawn(forget_gone_objects(ctx.clone()));
    if let Some(log) = &ctx.intents {
        // Fail at start, not by provisioning nothing: the namespace must exist and the RBAC
        // allow the log to be written.
        log.check_writable().await.map_err(|error| {
            anyhow::anyhow!(
                "{error}; check --leader-election-namespace (or POD_NAMESPACE) and the RBAC for configmaps in that namespace"
            )
        })?;
        super::volumes::install_intents_ahead(&ctx);
        tasks.spawn(log.clone().run());
        tasks.spawn(recover_intents(ctx.clone()));
    }

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

    tasks.spawn(report_leadership(
        election.clone(),
        metrics.clone(),
        settings.election.lease_name.clone(),
    ));

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
    tasks.spawn({
        let ctx = ctx.clone();
        async move {
            while plugins.changed().await.is_ok() {
                let next = plugins.borrow_and_update().clone();
                ctx.set_plugins(next);
                reloaded_tx.send_modify(|generation| *generation += 1);
            }
            // The sender went away: the current set stays for the rest of the run.
            std::future::pending::<&'static str>().await
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
        .run(volumes::reconcile_cached, volumes::error_policy_cached, ctx.clone())
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
        Some(ended) = tasks.join_next() => {
            anyhow::bail!("a background task ended unexpectedly: {ended:?}");
        }
    }
    // In-flight work is done or abandoned (its futures are dropped): hand the lease over now.
    let _ = stop_campaign.send(true);
    if let Some(campaign) = campaign {
        let _ = tokio::time::timeout(Duration::from_secs(5), campaign).await;
    }
    readiness.abort();
    tasks.abort_all();
    metrics.set_ready(false);
    if let Some(log) = &ctx.intents {
        // A log per process start would pile up: an empty one goes with its process.
        match log.delete_if_empty().await {
            Ok(true) => tracing::debug!(log = log.name(), "empty intent log deleted"),
            Ok(false) => tracing::info!(
                log = log.name(),
                entries = log.len(),
                "intent log kept for recovery"
            ),
            Err(error) => tracing::warn!(%error, "deleting the empty intent log failed"),
        }
    }
    // Events of the last moments (a deleted claim cleaned up, a PV saved) are written, not lost.
    ctx.recorder.flush(Duration::from_secs(5)).await;
    tracing::info!("controller stopped");
    Ok(())
}

/// How often the intent logs are checked for claims deleted while no one worked on them.
const RECOVERY_PERIOD: Duration = Duration::from_secs(10);

/// Intent-log recovery, once the caches are ready and then every [`RECOVERY_PERIOD`], while this
/// replica may act (a standby's turn comes when it leads).
async fn recover_intents(ctx: Arc<Context>) -> &'static str {
    loop {
        tokio::time::sleep(if ctx.metrics.is_ready() {
            RECOVERY_PERIOD
        } else {
            Duration::from_millis(200)
        })
        .await;
        if !ctx.metrics.is_ready() || !ctx.election.is_leader() {
            continue;
        }
        match super::recovery::recover_intents(&ctx).await {
            Ok(0) => {}
            Ok(settled) => tracing::info!(settled, "intent log recovered"),
            Err(error) => {
                tracing::warn!(%error, "reading the intent logs failed (RBAC: list configmaps)")
            }
        }
    }
}

/// How often per-object memory of objects that are gone is dropped.
const FORGET_PERIOD: Duration = Duration::from_secs(30);

async fn forget_gone_objects(ctx: Arc<Context>) -> &'static str {
    loop {
        tokio::time::sleep(FORGET_PERIOD).await;
        ctx.forget_gone();
    }
}

/// `leader_election_master_status` follows the gate (polled: cheap, and never misses a flip).
async fn report_leadership(
    election: Arc<gate::Election>,
    metrics: Metrics,
    lease: String,
) -> &'static str {
    loop {
        metrics.leader(&lease, election.is_leader());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Node mode: checks this node exists (a mistyped `--node-name` would otherwise serve nothing,
/// silently), then caches node metadata; the stream ticks when a node is deleted. The watch task
/// is returned for the caller to supervise.
async fn watch_nodes(
    client: &Client,
    settings: &node::NodeSettings,
) -> anyhow::Result<(
    node::NodeState,
    impl futures::Stream<Item = ()> + Send + 'static,
    tokio::task::JoinHandle<()>,
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
    let watch = tokio::spawn(node_watch);
    tokio::time::timeout(Duration::from_secs(60), nodes.wait_until_ready())
        .await
        .map_err(|_| {
            anyhow::anyhow!("Node cache did not sync within 60 s (RBAC: list, watch nodes)")
        })??;
    tracing::info!(node = %settings.name, "node deployment: serving this node's claims and volumes");
    Ok((
        node::NodeState::new(settings.clone(), nodes),
        deleted_rx,
        watch,
    ))
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

/// The watch behind a controller's cache: every object slimmed, and settled down to its identity
/// when `settled` says it needs no work (see [`cache`]).
fn cached_watch<K>(
    api: Api<Cached<K>>,
    writer: reflector::store::Writer<Cached<K>>,
    settled: impl Fn(&K) -> bool + Send + 'static,
    storage: impl Fn(&K) -> Option<u64> + Send + 'static,
    observe: fn(&watcher::Event<Cached<K>>),
) -> impl futures::Stream<Item = Result<Cached<K>, watcher::Error>> + Send + 'static
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    use futures::TryStreamExt;
    watcher(api, watcher::Config::default())
        .default_backoff()
        .inspect_ok(observe)
        .modify(move |cached| {
            cached.settle(&settled, &storage);
            slim(cached);
        })
        .reflect(writer)
        .applied_objects()
}

/// Every PV's node path, whole as the watch delivers it, into the index of served paths that
/// keeps guests from nesting volumes or moving a served directory (`crate::wasm::served`).
fn served_paths(event: &watcher::Event<CachedVolume>) {
    let served = crate::wasm::served::served();
    match event {
        watcher::Event::Apply(pv) | watcher::Event::InitApply(pv) => {
            if let Some(pv) = pv.whole() {
                served.note(pv);
            }
        }
        watcher::Event::Delete(pv) => served.release(&kube::ResourceExt::name_any(pv)),
        watcher::Event::Init | watcher::Event::InitDone => {}
    }
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
