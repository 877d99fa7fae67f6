//! The long-lived tasks beside the controllers: intent-log recovery, forgetting gone objects,
//! waking parked claims whose turn nobody took, the leadership metric, and the leader campaign.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

use crate::controller::{Context, decide, events, gate, leader};
use crate::metrics::Metrics;

/// How often the intent logs are checked for claims deleted while no one worked on them.
const RECOVERY_PERIOD: Duration = Duration::from_secs(10);

/// Intent-log recovery, once the caches are ready and then every [`RECOVERY_PERIOD`], while this
/// replica may act (a standby's turn comes when it leads).
pub(super) async fn recover_intents(ctx: Arc<Context>) -> &'static str {
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
        match crate::controller::recover_intents(&ctx).await {
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

pub(super) async fn forget_gone_objects(ctx: Arc<Context>) -> &'static str {
    loop {
        tokio::time::sleep(FORGET_PERIOD).await;
        ctx.forget_gone();
        // Off the runtime's threads: it takes each arena's lock while it walks it.
        tokio::task::spawn_blocking(crate::malloc::give_back);
    }
}

/// How often the claims' queues are checked for claims that will not take their place or kept
/// turn, and for woken claims not back yet (see [`crate::controller::inflight`]): the longest a
/// class's queue can stall.
const TURNS_PERIOD: Duration = Duration::from_secs(2);

pub(super) async fn wake_parked_claims(ctx: Arc<Context>) -> &'static str {
    loop {
        tokio::time::sleep(TURNS_PERIOD).await;
        ctx.turns
            .refresh(|class, claim| belongs(&ctx, class, claim), TURNS_PERIOD);
    }
}

/// Whether `claim` still waits for a turn of `class`: it exists, it is ours to look at (the
/// claim cache drops what is not), and it names `class`.
fn belongs(ctx: &Context, class: &str, claim: &ObjectRef<PersistentVolumeClaim>) -> bool {
    ctx.claims
        .get(claim)
        .is_some_and(|pvc| decide::claim_class(&pvc) == Some(class))
}

/// `leader_election_master_status` follows the gate (polled: cheap, and never misses a flip).
pub(super) async fn report_leadership(
    election: Arc<gate::Election>,
    metrics: Metrics,
    lease: String,
) -> &'static str {
    loop {
        metrics.leader(&lease, election.is_leader());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Starts campaigning for the whole-controller lease, woken early by a watch on that lease.
pub(super) async fn start_campaign(
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
    let lease_watch = crate::controller::relist::watcher(
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
