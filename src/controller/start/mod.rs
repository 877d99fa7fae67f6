//! Start-up wiring: the watches and caches, both controllers, the leader campaign, plugin
//! reloads and the periodic tasks, all supervised; and the orderly shutdown. Its parts:
//! `watches` (what feeds the caches) and `tasks` (the long-lived tasks beside the controllers).

mod tasks;
mod watches;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::bindable::BindableVolumes;
use super::cache::{self, CachedVolume};
use super::claim_watch::{ClaimKeeping, claim_watch};
use super::slim::slim;
use super::{Caches, Context, Settings, claims, gate, node, volumes};
use crate::metrics::Metrics;
use crate::wasm::Plugins;

/// The long-lived tasks: if one ends, the process is no longer whole, and it exits.
type Supervised = JoinSet<&'static str>;

/// Runs both controllers until `shutdown` resolves, then lets in-flight work finish.
pub async fn run(
    client: Client,
    plugins: Arc<Plugins>,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let (_fixed, plugins) = watch::channel(plugins);
    run_watching(client, plugins, settings, Metrics::new(), shutdown).await
}

/// [`run`] with live plugins and metrics: every set sent on `plugins` replaces the current one
/// (calls in flight finish on the guest they started with) and re-runs every claim and volume,
/// so claims that waited for a returning guest go ahead; `metrics` is marked ready once every
/// cache has synced.
pub async fn run_watching(
    client: Client,
    mut plugins: watch::Receiver<Arc<Plugins>>,
    settings: Settings,
    metrics: Metrics,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let initial = plugins.borrow_and_update().clone();
    metrics.guests_loaded(initial.len());
    metrics.guests_compiling(initial.compiling());
    let settings = effective(settings);
    let mut tasks = Supervised::new();
    let (node_state, node_deleted) = match &settings.node {
        Some(node) => {
            let (state, deleted, watch) = watches::watch_nodes(&client, node).await?;
            tasks.spawn(async move {
                let _ = watch.await;
                "the Node watch"
            });
            (Some(state), deleted.boxed())
        }
        None => (None, futures::stream::pending().boxed()),
    };
    let sources = Sources::new(&client, &settings, &plugins);
    let ctx = Arc::new(Context::new(
        client.clone(),
        initial,
        settings.clone(),
        sources.caches.clone(),
        metrics.clone(),
        node_state,
    ));
    start_background(&ctx, &mut tasks, sources.class_watch).await?;
    tokio::time::timeout(
        Duration::from_secs(60),
        sources.caches.classes.wait_until_ready(),
    )
    .await
    .map_err(|_| anyhow::anyhow!("StorageClass cache did not sync within 60 s"))??;

    let stopping = Stopping::on(shutdown);
    let (stop_campaign, campaign) = campaign(&client, &settings, &ctx);
    let reloaded = follow_plugins(&mut tasks, ctx.clone(), plugins);
    let controllers = run_controllers(
        sources.claim_controller,
        sources.volume_controller,
        &ctx,
        Ticks {
            reloaded,
            node_deleted,
        },
        &stopping,
    );
    tracing::info!(guests = ctx.plugins().len(), "controller started");
    let readiness = tokio::spawn(report_ready(sources.caches, metrics.clone()));
    let outcome = until_done(
        controllers,
        &stopping,
        settings.shutdown_grace,
        campaign,
        &mut tasks,
    )
    .await;
    // In-flight work is done or abandoned (its futures are dropped): hand the lease over now.
    let _ = stop_campaign.send(true);
    if let Some(campaign) = outcome.campaign {
        let _ = tokio::time::timeout(Duration::from_secs(5), campaign).await;
    }
    readiness.abort();
    tasks.abort_all();
    metrics.set_ready(false);
    outcome.result?;
    // The log's last requests get their own grace: the in-flight work may have used it all.
    stop(&ctx, settings.shutdown_grace.min(LOG_CLOSE_GRACE)).await;
    Ok(())
}

/// The settings as this deployment runs them: node mode has no whole-controller election. Their
/// values were checked where they were parsed (`config`), once.
fn effective(mut settings: Settings) -> Settings {
    let requested = settings.election.mode;
    settings.election.mode = node::election_mode(requested, settings.node.is_some());
    if settings.election.mode != requested {
        tracing::info!(
            "node deployment: whole-controller leader election is off (every node's instance must act)"
        );
    }
    settings
}

/// The caches and the two controllers over them, not yet running.
struct Sources {
    caches: Caches,
    class_watch: BoxFuture<'static, ()>,
    claim_controller: Controller<PersistentVolumeClaim>,
    volume_controller: Controller<CachedVolume>,
}

impl Sources {
    fn new(
        client: &Client,
        settings: &Settings,
        plugins: &watch::Receiver<Arc<Plugins>>,
    ) -> Sources {
        let (classes, class_writer) = reflector::store::<StorageClass>();
        let class_watch = crate::controller::relist::watcher(Api::<StorageClass>::all(client.clone()), Default::default())
            .default_backoff()
            .modify(slim)
            .reflect(class_writer)
            .for_each(|event| {
                if let Err(error) = event {
                    tracing::warn!(%error, "watching StorageClasses failed (RBAC: list, watch storageclasses)");
                }
                futures::future::ready(())
            })
            .boxed();
        let config = ControllerConfig::default().concurrency(settings.worker_threads.get());
        let whole = settings.cache_whole_objects;
        let finalizer_mode = settings.add_pv_finalizer;
        let (volumes, volume_writer) = reflector::store::<CachedVolume>();
        let bindable = Arc::new(BindableVolumes::default());
        let volume_watch = watches::cached_watch(
            Api::all(client.clone()),
            volume_writer,
            move |pv| !whole && cache::volume_settled(pv, finalizer_mode),
            cache::storage_of,
            {
                let bindable = bindable.clone();
                move |event| {
                    watches::served_paths(event);
                    bindable.observe(event);
                }
            },
        );
        let volume_controller =
            Controller::for_stream(volume_watch, volumes.clone()).with_config(config.clone());
        let (claims, claim_writer) = reflector::store::<PersistentVolumeClaim>();
        let keeping = Arc::new(ClaimKeeping::new(whole, plugins.clone()));
        let claim_watch = claim_watch(Api::all(client.clone()), claim_writer, keeping);
        let claim_controller =
            Controller::for_stream(claim_watch, claims.clone()).with_config(config);
        Sources {
            caches: Caches {
                classes,
                volumes,
                claims,
                bindable,
            },
            class_watch,
            claim_controller,
            volume_controller,
        }
    }
}

/// Starts the supervised tasks that need no lease: the class watch, forgetting gone objects,
/// and (intent-log mode) the log's writer and recovery, after checking the log can be written.
async fn start_background(
    ctx: &Arc<Context>,
    tasks: &mut Supervised,
    class_watch: BoxFuture<'static, ()>,
) -> anyhow::Result<()> {
    tasks.spawn(async move {
        class_watch.await;
        "the StorageClass watch"
    });
    tasks.spawn(tasks::forget_gone_objects(ctx.clone()));
    tasks.spawn(tasks::wake_parked_claims(ctx.clone()));
    if let Some(log) = &ctx.intents {
        // Fail at start, not by provisioning nothing: the namespace must exist and the RBAC
        // allow the log to be written.
        log.check_writable().await.map_err(|error| {
            anyhow::anyhow!(
                "{error}; check --leader-election-namespace (or POD_NAMESPACE) and the RBAC for configmaps in that namespace"
            )
        })?;
        tasks.spawn(log.clone().run());
        tasks.spawn(tasks::recover_intents(ctx.clone()));
    }
    tasks.spawn(tasks::report_leadership(
        ctx.election.clone(),
        ctx.metrics.clone(),
        ctx.settings.election.lease_name.clone(),
    ));
    Ok(())
}

/// The shutdown request, for every part that must see it.
#[derive(Clone)]
struct Stopping(watch::Receiver<bool>);

impl Stopping {
    fn on(shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Stopping {
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = tx.send(true);
        });
        Stopping(rx)
    }

    async fn requested(mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

/// Leader mode: every replica watches and reconciles; the campaign opens the gate for one.
/// Returns the campaign's stop switch and task (none outside leader mode).
fn campaign(
    client: &Client,
    settings: &Settings,
    ctx: &Context,
) -> (watch::Sender<bool>, Option<JoinHandle<()>>) {
    let (stop, stopped) = watch::channel(false);
    let task = match &*ctx.election {
        gate::Election::Leader(gate) => Some(tokio::spawn(tasks::start_campaign(
            client.clone(),
            settings.election.clone(),
            gate.clone(),
            ctx.recorder.clone(),
            stopped,
        ))),
        _ => None,
    };
    (stop, task)
}

/// Installs every plugin set sent on `plugins`; the returned generation ticks once per reload.
fn follow_plugins(
    tasks: &mut Supervised,
    ctx: Arc<Context>,
    mut plugins: watch::Receiver<Arc<Plugins>>,
) -> watch::Receiver<u64> {
    let (reloaded_tx, reloaded) = watch::channel(0u64);
    tasks.spawn(async move {
        while plugins.changed().await.is_ok() {
            let next = plugins.borrow_and_update().clone();
            ctx.set_plugins(next);
            reloaded_tx.send_modify(|generation| *generation += 1);
        }
        // The sender went away: the current set stays for the rest of the run.
        std::future::pending::<&'static str>().await
    });
    reloaded
}

/// What re-runs every object besides its own changes.
struct Ticks {
    /// Plugin reloads.
    reloaded: watch::Receiver<u64>,
    /// Node mode: a node deleted (it may leave Released PVs only other nodes can delete).
    node_deleted: BoxStream<'static, ()>,
}

/// Both controllers, running until shutdown.
fn run_controllers(
    claim_controller: Controller<PersistentVolumeClaim>,
    volume_controller: Controller<CachedVolume>,
    ctx: &Arc<Context>,
    ticks: Ticks,
    stopping: &Stopping,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let resync = ctx.settings.resync_period;
    let gained = || match &*ctx.election {
        gate::Election::Leader(gate) => gate.gained().boxed(),
        _ => futures::stream::pending().boxed(),
    };
    let claims = ctx.claims.clone();
    let claim_run = claim_controller
        .watches(
            Api::<StorageClass>::all(ctx.client.clone()),
            watcher::Config::default(),
            move |class: StorageClass| claims::claims_of_class(&claims, &class),
        )
        .reconcile_all_on(futures::stream::select(
            watches::resync_ticks(resync),
            watches::reload_ticks(ticks.reloaded.clone()),
        ))
        .reconcile_all_on(gained())
        .reconcile_on(ctx.turns.wakeups())
        .graceful_shutdown_on(stopping.clone().requested())
        .run(claims::reconcile, claims::error_policy, ctx.clone())
        .for_each(|result| async move {
            report(
                result.map(|_| ()),
                "watching claims failed (RBAC: list, watch persistentvolumeclaims)",
                "claim reconcile",
            )
        });
    let volume_run = volume_controller
        .reconcile_all_on(futures::stream::select(
            watches::resync_ticks(resync),
            watches::reload_ticks(ticks.reloaded),
        ))
        .reconcile_all_on(ticks.node_deleted)
        .reconcile_all_on(gained())
        .graceful_shutdown_on(stopping.clone().requested())
        .run(
            volumes::reconcile_cached,
            volumes::error_policy_cached,
            ctx.clone(),
        )
        .for_each(|result| async move {
            report(
                result.map(|_| ()),
                "watching volumes failed (RBAC: list, watch persistentvolumes)",
                "volume reconcile",
            )
        });
    async move {
        tokio::join!(claim_run, volume_run);
    }
}

/// A controller's result: a broken watch stops all work, so it is said where operators look.
fn report<E: std::fmt::Display, Q: std::fmt::Display>(
    result: Result<(), kube::runtime::controller::Error<E, Q>>,
    watch_failed: &'static str,
    reconcile: &'static str,
) {
    match result {
        Err(error @ kube::runtime::controller::Error::QueueError(_)) => {
            tracing::warn!(%error, "{watch_failed}");
        }
        Err(error) => tracing::debug!(%error, "{reconcile}"),
        Ok(()) => {}
    }
}

/// Ready = guests loaded (done before we got here) and every cache synced; the reflectors of
/// the two controllers only run once their streams are polled.
async fn report_ready(caches: Caches, metrics: Metrics) {
    // Polled, not awaited: a store's readiness is a oneshot that wakes only its latest waiter,
    // and kube-runtime's own controller loop waits on the same stores.
    fn synced<K: kube::Resource + Clone>(store: &Store<K>) -> bool
    where
        K::DynamicType: Eq + std::hash::Hash + Clone,
    {
        store
            .wait_until_ready()
            .now_or_never()
            .is_some_and(|r| r.is_ok())
    }
    loop {
        if synced(&caches.classes) && synced(&caches.volumes) && synced(&caches.claims) {
            tracing::info!("caches synced; ready");
            metrics.set_ready(true);
            // The initial lists' objects that the caches did not keep are freed by now.
            crate::malloc::give_back();
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How the run ended, with the campaign task if it is still running.
struct Outcome {
    result: anyhow::Result<()>,
    campaign: Option<JoinHandle<()>>,
}

/// Waits for the controllers to finish after shutdown (or the grace period to pass), or for a
/// supervised task or the campaign to end, which ends the run with an error.
async fn until_done(
    controllers: impl std::future::Future<Output = ()>,
    stopping: &Stopping,
    grace: Duration,
    mut campaign: Option<JoinHandle<()>>,
    tasks: &mut Supervised,
) -> Outcome {
    tokio::pin!(controllers);
    let result = tokio::select! {
        _ = &mut controllers => Ok(()),
        _ = async {
            stopping.clone().requested().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?grace, "in-flight work did not finish within the shutdown grace period");
            Ok(())
        }
        // The campaign only ends when told to; if it dies, nothing renews the lease: exit.
        outcome = async { campaign.as_mut().expect("spawned").await }, if campaign.is_some() => {
            campaign = None;
            Err(anyhow::anyhow!("the leader election task ended unexpectedly: {outcome:?}"))
        }
        Some(ended) = tasks.join_next() => {
            Err(anyhow::anyhow!("a background task ended unexpectedly: {ended:?}"))
        }
    };
    Outcome { result, campaign }
}

/// How long a clean stop keeps trying to delete (or write) its intent log at most.
const LOG_CLOSE_GRACE: Duration = Duration::from_secs(10);

/// The orderly end after the controllers stopped: entries recorded ahead leave the intent log,
/// an empty log goes (tried again for up to `grace` while the API server fails), events are
/// flushed.
async fn stop(ctx: &Context, grace: Duration) {
    if let Some(log) = &ctx.intents {
        use crate::controller::storage::intent::Closed;
        // What stands for no storage leaves first (entries recorded ahead of a turn that never
        // came, claims whose PV exists): a clean stop then leaves no log in the usual case.
        let queued = |pv: &k8s_openapi::api::core::v1::PersistentVolume| {
            crate::controller::volumes::queued_for_delete(ctx, &ctx.plugins(), pv).is_some()
        };
        let settled = crate::controller::storage::recovery::drop_settled(ctx, &queued);
        tracing::debug!(
            settled,
            "intent entries that stand for no storage left at stop"
        );
        // A log per process start would pile up: an empty one goes with its process.
        match log.close(grace).await {
            Closed::Done {
                entries: 0,
                dropped,
            } => {
                tracing::debug!(log = log.name(), dropped, "empty intent log deleted")
            }
            Closed::Done { entries, dropped } => tracing::info!(
                log = log.name(),
                entries,
                dropped,
                "intent log kept for recovery"
            ),
            Closed::Failed {
                error,
                entries,
                dropped,
            } => tracing::warn!(
                %error,
                log = log.name(),
                entries,
                dropped,
                "the intent log could not be closed at shutdown; it stays in the API server as last written, and the leader takes it over (its entries recorded ahead delete nothing); delete it by hand only with no provisioner running"
            ),
        }
    }
    // Events of the last moments (a deleted claim cleaned up, a PV saved) are written, not lost.
    ctx.recorder.flush(Duration::from_secs(5)).await;
    tracing::info!("controller stopped");
}
