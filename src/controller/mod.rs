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
pub mod ratelimit;
pub mod volumes;

use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::controller::{Config as ControllerConfig, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

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
            kube_api_qps: 20.0,
            kube_api_burst: 40,
            shutdown_grace: Duration::from_secs(30),
            reporter: "wasm-provisioner".into(),
            instance: None,
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
    /// Event publisher.
    pub recorder: Recorder,
    /// Settings.
    pub settings: Settings,
    /// Claim failures by UID.
    pub claim_failures: Mutex<FailureBook>,
    /// Volume failures by name.
    pub volume_failures: Mutex<FailureBook>,
    /// API request budget.
    pub api_rate: RateLimiter,
}

impl Context {
    /// The current set of guests.
    pub fn plugins(&self) -> Arc<Plugins> {
        self.plugins.read().expect("plugins lock").clone()
    }

    /// Replaces the set of guests; calls in flight keep the set they started with.
    pub fn set_plugins(&self, plugins: Arc<Plugins>) {
        *self.plugins.write().expect("plugins lock") = plugins;
    }

    /// Looks up a class in the cache.
    pub fn class(&self, name: &str) -> Option<Arc<StorageClass>> {
        self.classes.get(&ObjectRef::new(name))
    }

    /// Waits for the API request budget.
    pub async fn api_budget(&self) {
        self.api_rate.acquire().await;
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
    run_watching(client, plugins, settings, shutdown).await
}

/// [`run`] with live plugins: every set sent on `plugins` replaces the current one (calls in
/// flight finish on the guest they started with) and re-runs every claim and volume, so claims
/// that waited for a returning guest go ahead.
pub async fn run_watching(
    client: Client,
    mut plugins: tokio::sync::watch::Receiver<Arc<Plugins>>,
    settings: Settings,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let initial = plugins.borrow_and_update().clone();
    let (classes, class_writer) = reflector::store::<StorageClass>();
    let class_api: Api<StorageClass> = Api::all(client.clone());
    let class_watch = watcher(class_api.clone(), watcher::Config::default())
        .default_backoff()
        .reflect(class_writer)
        .applied_objects()
        .for_each(|_| futures::future::ready(()));
    tokio::spawn(class_watch);

    let pv_api: Api<PersistentVolume> = Api::all(client.clone());
    let pvc_api: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let controller_config = ControllerConfig::default().concurrency(settings.worker_threads);
    let volume_controller =
        Controller::new(pv_api, watcher::Config::default()).with_config(controller_config.clone());
    let volumes = volume_controller.store();
    let claim_controller =
        Controller::new(pvc_api, watcher::Config::default()).with_config(controller_config);
    let claims = claim_controller.store();

    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: settings.reporter.clone(),
            instance: settings.instance.clone(),
        },
    );
    let ctx = Arc::new(Context {
        client: client.clone(),
        plugins: RwLock::new(initial),
        classes: classes.clone(),
        volumes,
        recorder,
        api_rate: RateLimiter::new(settings.kube_api_qps, settings.kube_api_burst),
        claim_failures: Mutex::new(FailureBook::default()),
        volume_failures: Mutex::new(FailureBook::default()),
        settings: settings.clone(),
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
        .graceful_shutdown_on(shutdown_signal(shutdown_rx.clone()))
        .run(claims::reconcile, claims::error_policy, ctx.clone())
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "claim reconcile");
            }
        });
    let volume_run = volume_controller
        .reconcile_all_on(futures::stream::select(
            resync_ticks(resync),
            reload_ticks(reloaded),
        ))
        .graceful_shutdown_on(shutdown_signal(shutdown_rx.clone()))
        .run(volumes::reconcile, volumes::error_policy, ctx.clone())
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "volume reconcile");
            }
        });
    tracing::info!(guests = ctx.plugins().len(), "controller started");
    let grace = settings.shutdown_grace;
    let both = async {
        tokio::join!(claim_run, volume_run);
    };
    tokio::pin!(both);
    tokio::select! {
        _ = &mut both => {}
        _ = async {
            let _ = shutdown_signal(shutdown_rx.clone()).await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?grace, "in-flight work did not finish within the shutdown grace period");
        }
    }
    tracing::info!("controller stopped");
    Ok(())
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
