//! The controller shell without a cluster: claim and volume reconciles against a fake API server
//! behind a real `kube::Client`, with the real scripted guest from `guests/`. One test per branch
//! of the claim and volume paths; the whole layer runs in seconds. The end-to-end suites prove
//! the same paths against a real control plane.

mod capabilities;
mod claim_cache;
#[path = "../common/mod.rs"]
mod common;
mod fake_api;
mod log_safety;
mod relist;
mod volume_path;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Resource;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, ObjectRef, store::Writer};
use kube::runtime::watcher;
use serde_json::{Value, json};
use wasm_provisioner::controller::bookkeeping::Failure;
use wasm_provisioner::controller::cache::{self, CachedVolume};
use wasm_provisioner::controller::claims::{self, ClaimError};
use wasm_provisioner::controller::decide::{ANN_CLASS_RECORD, FINALIZER_CLAIM, FINALIZER_PV};
use wasm_provisioner::controller::events::{Event, EventAction};
use wasm_provisioner::controller::gate::Mode;
use wasm_provisioner::controller::inflight::Turn;
use wasm_provisioner::controller::plan::ANN_MAX_IN_FLIGHT;
use wasm_provisioner::controller::storage::intent::{Intent, IntentLog, Storage};
use wasm_provisioner::controller::{Caches, Context, IntentRecord, Settings, volumes};
use wasm_provisioner::metrics::{Metrics, Queue};
use wasm_provisioner::wasm::{WasmEngine, load_dir};

use common::{PluginsDir, dir_grant};
use fake_api::FakeApi;

/// A claim as the controller's watch caches it: whole, or not at all once settled.
fn claim_event(pvc: PersistentVolumeClaim) -> watcher::Event<PersistentVolumeClaim> {
    if cache::claim_settled(&pvc) {
        watcher::Event::Delete(pvc)
    } else {
        watcher::Event::Apply(pvc)
    }
}

/// A PV as the controller's watch caches it (default settings: PV finalizer mode).
fn cached_volume(pv: PersistentVolume) -> CachedVolume {
    let mut cached = CachedVolume::from(pv);
    cached.settle(|pv| cache::volume_settled(pv, true), cache::storage_of);
    cached
}

const P: &str = "reconcile.wasm-provisioner.dev/scripted";
const NS: &str = "ns";

struct World {
    api: FakeApi,
    ctx: Arc<Context>,
    claims: Writer<PersistentVolumeClaim>,
    volumes: Writer<CachedVolume>,
    classes: Writer<StorageClass>,
    storage: tempfile::TempDir,
    _plugins: PluginsDir,
}

fn settings() -> Settings {
    let mut settings = Settings {
        failed_provision_threshold: 3,
        create_pv_retry_count: std::num::NonZeroU32::MIN,
        // These tests reconcile claims themselves, many at once, with no controller to wake a
        // parked one: a class gets 15 turns (its guest has 16 slots unless a test says).
        worker_threads: std::num::NonZeroU16::new(16).expect("16 is not zero"),
        ..Settings::default()
    };
    settings.election.mode = Mode::Off;
    settings.intent = IntentRecord::ClaimFinalizer;
    settings
}

fn log_settings() -> Settings {
    Settings {
        intent: IntentRecord::Log,
        ..settings()
    }
}

impl World {
    fn new(settings: Settings, limits: &str) -> World {
        World::of("scripted", "/state", settings, limits)
    }

    /// A world whose one guest, serving `P`, is `crate_name`, granted its storage at
    /// `guest_dir`, with `limits` (16 slots unless they say).
    fn of(crate_name: &str, guest_dir: &str, settings: Settings, limits: &str) -> World {
        let storage = tempfile::tempdir().expect("tempdir");
        let limits = if limits.contains("max-concurrency") {
            limits.to_string()
        } else {
            format!("max-concurrency = 16\n{limits}")
        };
        let plugins = PluginsDir::new();
        plugins.add(
            crate_name,
            crate_name,
            &dir_grant(P, storage.path(), guest_dir, &limits),
        );
        let loaded = load_dir(&WasmEngine::new().expect("engine"), plugins.path()).expect("load");
        let api = FakeApi::default();
        let (classes_store, classes) = reflector::store();
        let (volumes_store, mut volumes) = reflector::store();
        // The PV list is done: a reconcile may ask whether a claim's PV exists.
        volumes.apply_watcher_event(&watcher::Event::InitDone);
        let (claims_store, claims) = reflector::store();
        let ctx = Context::new(
            api.client(),
            Arc::new(loaded),
            settings,
            Caches {
                classes: classes_store,
                volumes: volumes_store,
                claims: claims_store,
            },
            Metrics::new(),
            None,
        );
        World {
            api,
            ctx: Arc::new(ctx),
            claims,
            volumes,
            classes,
            storage,
            _plugins: plugins,
        }
    }

    /// Log mode with class `fast` and the intent-log writer running, and the log.
    fn logged() -> (World, Arc<IntentLog>) {
        let mut world = World::new(log_settings(), "");
        world.class("fast", json!({}), json!({}));
        let log = world.ctx.intents.clone().expect("log mode");
        tokio::spawn(log.clone().run());
        (world, log)
    }

    fn class(&mut self, name: &str, parameters: Value, annotations: Value) {
        let class: StorageClass = serde_json::from_value(json!({
            "metadata": {"name": name, "uid": format!("uid-class-{name}"), "annotations": annotations},
            "provisioner": P,
            "parameters": parameters,
            "reclaimPolicy": "Delete",
        }))
        .expect("class");
        self.classes
            .apply_watcher_event(&watcher::Event::Apply(class));
    }

    fn drop_class(&mut self, name: &str) {
        let class: StorageClass =
            serde_json::from_value(json!({"metadata": {"name": name}, "provisioner": P}))
                .expect("class");
        self.classes
            .apply_watcher_event(&watcher::Event::Delete(class));
    }

    /// A claim in the cache and in the fake API server.
    fn claim(&mut self, claim: Value) -> Arc<PersistentVolumeClaim> {
        let name = claim["metadata"]["name"].as_str().unwrap().to_string();
        self.api.put(&claim_path(&name), claim.clone());
        let stored = self.api.get(&claim_path(&name)).unwrap();
        let pvc: PersistentVolumeClaim = serde_json::from_value(stored).expect("claim");
        self.claims.apply_watcher_event(&claim_event(pvc.clone()));
        Arc::new(pvc)
    }

    /// The cache catches up with the API server for this claim.
    fn sync_claim(&mut self, name: &str) -> Arc<PersistentVolumeClaim> {
        let pvc: PersistentVolumeClaim =
            serde_json::from_value(self.api.get(&claim_path(name)).expect("claim stored"))
                .expect("claim");
        self.claims.apply_watcher_event(&claim_event(pvc.clone()));
        Arc::new(pvc)
    }

    /// A fixture's storage where the guest's grant is: a hostPath under `/nowhere` becomes the
    /// PV's directory in `storage` (the host refuses a delete outside the guest's grants).
    fn ground(&self, pv: &mut Value) {
        let name = pv["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let path = &mut pv["spec"]["hostPath"]["path"];
        if path.as_str().is_some_and(|p| p.starts_with("/nowhere")) {
            *path = json!(self.storage.path().join(name).display().to_string());
        }
    }

    fn volume(&mut self, mut pv: Value) -> Arc<PersistentVolume> {
        let name = pv["metadata"]["name"].as_str().unwrap().to_string();
        self.ground(&mut pv);
        self.api.put(&pv_path(&name), pv);
        let stored: PersistentVolume =
            serde_json::from_value(self.api.get(&pv_path(&name)).unwrap()).unwrap();
        self.volumes
            .apply_watcher_event(&watcher::Event::Apply(cached_volume(stored.clone())));
        Arc::new(stored)
    }

    async fn provision(&self, pvc: &Arc<PersistentVolumeClaim>) -> Result<Action, ClaimError> {
        claims::reconcile(pvc.clone(), self.ctx.clone()).await
    }

    async fn events(&self) -> Vec<String> {
        self.ctx.recorder.flush(Duration::from_secs(5)).await;
        self.api.event_reasons()
    }

    fn finalizers(&self, name: &str) -> Vec<String> {
        self.api
            .get(&claim_path(name))
            .and_then(|c| serde_json::from_value(c["metadata"]["finalizers"].clone()).ok())
            .unwrap_or_default()
    }

    /// A turn of `class` for a claim named `name`, asked for as the claim path asks (`None`:
    /// parked); tests hold a class's turns with it.
    fn turn(&self, class: &str, name: &str) -> Option<Turn<'_>> {
        let class = self.ctx.class(class).expect("class");
        let plugins = self.ctx.plugins();
        let guest = plugins.for_provisioner(P).expect("guest");
        let slots = guest.grants().max_concurrency;
        let claim = ObjectRef::new(name).within(NS);
        self.ctx
            .turns
            .acquire_or_park(&class, guest.name(), slots, claim)
    }

    fn guest_calls(&self) -> String {
        std::fs::read_to_string(self.storage.path().join("calls.log")).unwrap_or_default()
    }
}

/// A second process over the same API server and guests: what a restart sees.
fn restarted(world: &World) -> Context {
    let (claims, _) = reflector::store();
    restarted_over(world, claims)
}

/// A restart whose claim cache has caught up with the claims the API server holds.
fn restarted_with_claims(world: &World) -> Context {
    let (claims, mut writer) = reflector::store();
    for claim in world
        .api
        .objects_under(&format!("/api/v1/namespaces/{NS}/persistentvolumeclaims"))
    {
        let pvc: PersistentVolumeClaim = serde_json::from_value(claim).expect("claim");
        writer.apply_watcher_event(&claim_event(pvc));
    }
    restarted_over(world, claims)
}

fn restarted_over(world: &World, claims: reflector::Store<PersistentVolumeClaim>) -> Context {
    let (classes, _) = reflector::store();
    let (volumes, _) = reflector::store();
    Context::new(
        world.api.client(),
        world.ctx.plugins(),
        log_settings(),
        Caches {
            classes,
            volumes,
            claims,
        },
        Metrics::new(),
        None,
    )
}

fn claim_path(name: &str) -> String {
    format!("/api/v1/namespaces/{NS}/persistentvolumeclaims/{name}")
}

fn pv_path(name: &str) -> String {
    format!("/api/v1/persistentvolumes/{name}")
}

fn claim_of(name: &str, class: &str, provisioner: &str) -> Value {
    json!({
        "metadata": {
            "name": name, "namespace": NS, "uid": format!("u-{name}"),
            "annotations": {"volume.beta.kubernetes.io/storage-provisioner": provisioner},
        },
        "spec": {
            "storageClassName": class, "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        }
    })
}

fn requeue_after(action: &Action) -> Option<Duration> {
    // Action keeps its delay private; its Debug form is stable: `Some(123ms)`.
    let text = format!("{action:?}");
    let inner = text.split("Some(").nth(1)?.split(')').next()?;
    if let Some(ms) = inner.strip_suffix("ms") {
        return ms
            .parse::<f64>()
            .ok()
            .map(|v| Duration::from_secs_f64(v / 1000.0));
    }
    inner
        .strip_suffix('s')?
        .parse::<f64>()
        .ok()
        .map(Duration::from_secs_f64)
}

#[tokio::test]
async fn a_claim_is_provisioned_with_three_writes_the_finalizer_alone_first() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(claim_of("data", "fast", P));
    world.provision(&pvc).await.expect("provisioned");
    let calls = world.api.calls();
    let writes: Vec<&String> = calls.iter().filter(|c| !c.starts_with("GET")).collect();
    assert_eq!(
        writes,
        [
            &format!("PATCH {}", claim_path("data")),
            &"POST /api/v1/persistentvolumes".to_string(),
            &format!("PATCH {}", claim_path("data")),
        ],
        "{calls:#?}"
    );
    let intent =
        &world.api.requests()[calls.iter().position(|c| c.starts_with("PATCH")).unwrap()].body;
    assert_eq!(
        intent["metadata"]["finalizers"],
        json!([FINALIZER_CLAIM]),
        "{intent}"
    );
    assert!(
        intent["metadata"].get("annotations").is_none(),
        "nothing but the finalizer is written: {intent}"
    );
    assert!(world.api.get(&pv_path("pvc-u-data")).is_some());
    assert!(world.finalizers("data").is_empty());
    let claim = world.api.get(&claim_path("data")).unwrap();
    assert!(claim["metadata"]["annotations"][ANN_CLASS_RECORD].is_null());
    let events = world.events().await;
    assert!(
        events.contains(&"ProvisioningSucceeded".to_string()),
        "{events:?}"
    );
}

#[tokio::test]
async fn ten_thousand_foreign_claims_and_volumes_leave_no_trace() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    for n in 0..10_000 {
        let pvc: PersistentVolumeClaim =
            serde_json::from_value(claim_of(&format!("f{n}"), "other", "example.com/other"))
                .unwrap();
        claims::reconcile(Arc::new(pvc), world.ctx.clone())
            .await
            .expect("foreign claims are not an error");
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": format!("pv-f{n}"), "uid": format!("uid-pv-f{n}"),
                         "annotations": {"pv.kubernetes.io/provisioned-by": "example.com/other"}},
            "spec": {"persistentVolumeReclaimPolicy": "Delete"},
            "status": {"phase": "Released"}
        }))
        .unwrap();
        volumes::reconcile(Arc::new(pv), world.ctx.clone())
            .await
            .expect("foreign volumes are not an error");
    }
    assert!(
        world.api.requests().is_empty(),
        "{:?}",
        &world.api.calls()[..5]
    );
    assert_eq!(world.ctx.claim_book.len(), 0, "failure book of claims");
    assert_eq!(world.ctx.volume_book.len(), 0, "failure book of volumes");
    assert_eq!(world.ctx.metrics.waiting(Queue::Claims), 0);
    assert_eq!(world.ctx.metrics.waiting(Queue::Volumes), 0);
    assert_eq!(world.ctx.recorder.queued(), 0, "event queue");
    assert_eq!(world.ctx.recorder.series_len(), 0, "event series");
    assert_eq!(world.ctx.recent.len(), 0, "recent writes");
}

#[tokio::test]
async fn settled_claims_leave_the_cache_settled_volumes_keep_their_identity_no_requests() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let mut bound = claim_of("data", "fast", P);
    bound["spec"]["volumeName"] = json!("pvc-uid-data");
    let pvc = world.claim(bound);
    let pv = world.volume(json!({
        "metadata": {"name": "pvc-uid-data", "uid": "uid-pv",
                     "annotations": {"pv.kubernetes.io/provisioned-by": P}},
        "spec": {"persistentVolumeReclaimPolicy": "Delete", "storageClassName": "fast",
                 "hostPath": {"path": "/x"}},
        "status": {"phase": "Bound"}
    }));
    assert!(
        world.ctx.claims.get(&ObjectRef::from_obj(&*pvc)).is_none(),
        "a bound claim leaves the cache"
    );
    let cached_pv = world.ctx.volume("pvc-uid-data").expect("cached");
    assert!(
        cached_pv.whole().is_none(),
        "a bound PV is kept as its identity"
    );
    assert_eq!(cached_pv.meta().uid.as_deref(), Some("uid-pv"));
    // The class changes: only unbound claims are re-checked, and the settled ones cost nothing.
    assert!(
        claims::claims_of_class(&world.ctx.claims, &world.ctx.class("fast").unwrap()).is_empty()
    );
    volumes::reconcile_cached(cached_pv, world.ctx.clone())
        .await
        .expect("settled volume");
    assert!(world.api.requests().is_empty(), "{:?}", world.api.calls());
    // Released: the watch brings the whole PV again, and the delete path runs on it.
    let mut released = (*pv).clone();
    released.status.as_mut().unwrap().phase = Some("Released".into());
    let released = world.volume(serde_json::to_value(&released).unwrap());
    let cached_pv = world.ctx.volume("pvc-uid-data").expect("cached");
    assert_eq!(
        cached_pv.whole(),
        Some(&released),
        "a released PV is kept whole"
    );
}

#[tokio::test]
async fn a_final_refusal_releases_the_claim_so_deleting_it_never_hangs() {
    let mut world = World::new(settings(), "");
    world.class("broken", json!({"fail": "final"}), json!({}));
    let pvc = world.claim(claim_of("data", "broken", P));
    let error = world.provision(&pvc).await.expect_err("final");
    assert_eq!(error.label(), "final");
    assert!(
        world.finalizers("data").is_empty(),
        "the guest holds no storage, so no finalizer may keep the claim: {:?}",
        world.finalizers("data")
    );
    assert!(
        world
            .events()
            .await
            .contains(&"ProvisioningFailed".to_string())
    );
}

#[tokio::test]
async fn a_given_up_claim_is_released() {
    let mut world = World::new(settings(), "");
    world.class("trapping", json!({"fail": "trap"}), json!({}));
    let pvc = world.claim(claim_of("data", "trapping", P));
    for attempt in 1..=3 {
        let error = world.provision(&pvc).await.expect_err("trap");
        assert!(error.counts(), "attempt {attempt}: {error}");
        if attempt < 3 {
            assert_eq!(
                world.finalizers("data"),
                [FINALIZER_CLAIM],
                "a fault may leave storage: the finalizer stays while attempts go on"
            );
        }
    }
    assert!(world.finalizers("data").is_empty(), "given up: released");
    assert!(
        world
            .events()
            .await
            .contains(&"ProvisioningGivenUp".to_string())
    );
    let calls_before = world.guest_calls().lines().count();
    world
        .provision(&pvc)
        .await
        .expect("given up: nothing to do");
    assert_eq!(
        world.guest_calls().lines().count(),
        calls_before,
        "no more guest calls"
    );
}

#[tokio::test]
async fn a_busy_guest_is_looked_at_again_shortly_without_a_failure() {
    let mut world = World::new(settings(), "max-concurrency = 1");
    world.class("slow", json!({"delayMs": "1500"}), json!({}));
    let first = world.claim(claim_of("first", "slow", P));
    let second = world.claim(claim_of("second", "slow", P));
    let running = tokio::spawn({
        let ctx = world.ctx.clone();
        let first = first.clone();
        async move { claims::reconcile(first, ctx).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let action = world
        .provision(&second)
        .await
        .expect("busy is not an error");
    let wait = requeue_after(&action).expect("requeued");
    assert!(wait <= Duration::from_millis(250), "{action:?}");
    assert!(
        world.finalizers("second").is_empty(),
        "no intent before a guest call"
    );
    running.await.unwrap().expect("the first claim provisions");
    assert_eq!(world.ctx.metrics.waiting(Queue::Claims), 0);
}

#[tokio::test]
async fn a_class_limit_holds_its_own_claims_and_not_the_others() {
    use futures::StreamExt;
    use kube::runtime::reflector::ObjectRef;
    let mut world = World::new(settings(), "");
    world.class(
        "storm",
        json!({"delayMs": "1500"}),
        json!({ANN_MAX_IN_FLIGHT: "1"}),
    );
    world.class("quiet", json!({}), json!({}));
    let first = world.claim(claim_of("s1", "storm", P));
    let second = world.claim(claim_of("s2", "storm", P));
    let other = world.claim(claim_of("q1", "quiet", P));
    let mut wakeups = world.ctx.turns.wakeups();
    let running = tokio::spawn({
        let ctx = world.ctx.clone();
        async move { claims::reconcile(first, ctx).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let action = world.provision(&second).await.expect("busy class");
    assert_eq!(
        requeue_after(&action),
        None,
        "parked, not requeued: {action:?}"
    );
    assert_eq!(world.ctx.turns.parked(), 1);
    assert!(world.api.get(&pv_path("pvc-u-s2")).is_none());
    world
        .provision(&other)
        .await
        .expect("other class goes ahead");
    assert!(world.api.get(&pv_path("pvc-u-q1")).is_some());
    running.await.unwrap().expect("first of the storm");
    let woken = tokio::time::timeout(Duration::from_secs(5), wakeups.next())
        .await
        .expect("woken when the first one's turn ends");
    assert_eq!(woken, Some(ObjectRef::from_obj(&*second)));
    world.provision(&second).await.expect("now its turn");
    assert!(world.api.get(&pv_path("pvc-u-s2")).is_some());
}

/// With more workers than their guest has slots, the claims of every class it serves together
/// leave it a slot: a delete finds it free, and the claims over the guest's turns are parked.
/// Before, each class counted alone: two classes took all four slots, and a delete waited for
/// one of their calls to end.
#[tokio::test]
async fn claims_of_every_class_leave_their_guest_a_slot_for_deletes() {
    let mut world = World::new(settings(), "max-concurrency = 4");
    world.class("fast", json!({}), json!({}));
    for crowd in ["crowd-a", "crowd-b"] {
        world.class(crowd, json!({"delayMs": "1500"}), json!({}));
    }
    let claims: Vec<_> = (0..4)
        .map(|n| {
            let class = ["crowd-a", "crowd-b"][n % 2];
            world.claim(claim_of(&format!("c{n}"), class, P))
        })
        .collect();
    let running: Vec<_> = claims
        .iter()
        .map(|pvc| {
            let (ctx, pvc) = (world.ctx.clone(), pvc.clone());
            tokio::spawn(async move { claims::reconcile(pvc, ctx).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let turns = &world.ctx.turns;
    assert_eq!(
        (
            turns.running("crowd-a") + turns.running("crowd-b"),
            turns.parked()
        ),
        (3, 1),
        "three turns for the guest's four slots, over both classes"
    );
    let plugins = world.ctx.plugins();
    let guest = plugins.for_provisioner(P).expect("guest");
    assert!(!guest.at_capacity(), "a slot is left while the claims run");
    let pv = volume_path::released_with_storage(&mut world, "pvc-r", json!({}));
    volumes::reconcile(pv, world.ctx.clone())
        .await
        .expect("deleted with the slot left");
    assert!(world.api.get(&pv_path("pvc-r")).is_none(), "PV removed");
    for reconcile in running {
        reconcile
            .await
            .unwrap()
            .expect("three provisioned, one parked");
    }
}

/// Claim-finalizer mode: the guest answered `transient` (storage may exist), then the claim was
/// deleted. Nothing records what the guest built, so nothing is deleted: the guest is not asked
/// again (before, it was asked to provision once more and what it answered was deleted), the
/// claim is released and an event says its storage is kept.
#[tokio::test]
async fn a_deleted_claim_whose_guest_may_hold_storage_keeps_it_and_says_so() {
    let mut world = World::new(settings(), "");
    world.class(
        "fast",
        json!({"fail": "transient", "failTimes": "1"}),
        json!({}),
    );
    let pvc = world.claim(claim_of("data", "fast", P));
    world
        .provision(&pvc)
        .await
        .expect_err("transient: storage may exist");
    assert_eq!(world.finalizers("data"), [FINALIZER_CLAIM]);
    let before = world.guest_calls();
    world.drop_class("fast");
    let mut deleted = world.api.get(&claim_path("data")).unwrap();
    deleted["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
    world.api.put(&claim_path("data"), deleted);
    let deleted = world.sync_claim("data");
    world.provision(&deleted).await.expect("released");
    assert!(world.finalizers("data").is_empty(), "released");
    assert_eq!(
        world.guest_calls(),
        before,
        "no guest call for a deleted claim"
    );
    assert!(world.events().await.contains(&"StorageKept".to_string()));
}

#[tokio::test]
async fn deleted_claims_of_provisioners_never_served_here_are_left_alone() {
    let mut world = World::new(settings(), "");
    let mut foreign = claim_of("theirs", "x", "example.com/elsewhere");
    foreign["metadata"]["finalizers"] = json!([FINALIZER_CLAIM]);
    foreign["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
    let pvc = world.claim(foreign);
    world.provision(&pvc).await.expect("nothing to do");
    assert!(world.api.calls().is_empty(), "{:?}", world.api.calls());
    assert!(
        world.events().await.is_empty(),
        "no WaitingForGuest for a stranger"
    );
}

#[tokio::test]
async fn an_unparsable_claim_fails_with_an_event() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let mut bad = claim_of("bad", "fast", P);
    bad["spec"]["resources"]["requests"]["storage"] = json!("lots");
    let pvc = world.claim(bad);
    let error = world.provision(&pvc).await.expect_err("invalid");
    assert_eq!(error.label(), "invalid-claim");
    assert_eq!(world.events().await, ["ProvisioningFailed"]);
    assert!(world.guest_calls().is_empty(), "the guest is not called");
}

#[tokio::test]
async fn a_stale_cache_never_leads_to_a_guest_call_without_the_intent() {
    let mut world = World::new(settings(), "");
    world.class(
        "flaky",
        json!({"fail": "final", "failTimes": "1"}),
        json!({}),
    );
    let pvc = world.claim(claim_of("data", "flaky", P));
    world
        .provision(&pvc)
        .await
        .expect_err("first attempt fails for good");
    assert!(world.finalizers("data").is_empty());
    let calls = world.guest_calls().lines().count();
    // The cache still shows the claim as it was, with the finalizer our failed attempt added and
    // then removed: the intent goes on only on the claim as it is now.
    let mut stale = (*pvc).clone();
    stale.metadata.finalizers = Some(vec![FINALIZER_CLAIM.to_string()]);
    let action = world
        .provision(&Arc::new(stale))
        .await
        .expect("looks again");
    assert!(requeue_after(&action).is_some(), "{action:?}");
    assert_eq!(
        world.guest_calls().lines().count(),
        calls,
        "no guest call on a stale claim"
    );
    assert!(world.finalizers("data").is_empty());
    let fresh = world.sync_claim("data");
    let before = world.api.requests().len();
    world.provision(&fresh).await.expect("second attempt");
    let after: Vec<_> = world.api.requests()[before..].to_vec();
    let first_write = after
        .iter()
        .find(|r| r.method != http::Method::GET && !r.path.contains("/events"))
        .expect("writes");
    assert_eq!(first_write.path, claim_path("data"));
    assert_eq!(
        first_write.body["metadata"]["finalizers"][0], FINALIZER_CLAIM,
        "the intent goes on before the guest is called again: {:?}",
        first_write.body
    );
    assert!(world.api.get(&pv_path("pvc-u-data")).is_some());
}

const LOGS: &str = "/api/v1/namespaces/default/configmaps";

fn intent_writes(world: &World) -> usize {
    world
        .api
        .requests()
        .iter()
        .filter(|r| r.path.starts_with(LOGS) && r.method != http::Method::GET)
        .count()
}

#[tokio::test]
async fn the_intent_log_costs_no_claim_write_and_batches_concurrent_claims() {
    let (mut world, log) = World::logged();
    let claims: Vec<_> = (0..8)
        .map(|n| world.claim(claim_of(&format!("c{n}"), "fast", P)))
        .collect();
    let reconciles = claims.iter().map(|pvc| world.provision(pvc));
    for result in futures::future::join_all(reconciles).await {
        result.expect("provisioned");
    }
    let calls = world.api.calls();
    assert!(
        calls.iter().all(|c| !c.contains("persistentvolumeclaims")),
        "claims are not written in log mode: {calls:#?}"
    );
    let writes = intent_writes(&world);
    assert!(
        (1..8).contains(&writes),
        "eight claims at once share their intent writes: {writes}"
    );
    for n in 0..8 {
        assert!(world.api.get(&pv_path(&format!("pvc-u-c{n}"))).is_some());
    }
    // Finished claims leave the log with the next write, or on their own shortly.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let stored = world.api.objects_under(LOGS);
    assert_eq!(stored.len(), 1, "one log per replica");
    assert!(
        stored[0]["data"].as_object().is_none_or(|d| d.is_empty()),
        "{}",
        stored[0]
    );
    assert_eq!(log.len(), 0);
}

/// Log mode: claim `data` of a slow class whose guest has made the storage when the controller
/// "dies" (its reconcile is aborted), with the intent in the log.
async fn crashed_mid_provision() -> World {
    let mut world = World::new(log_settings(), "");
    world.class("slow", json!({"delayMs": "3000"}), json!({}));
    let pvc = world.claim(claim_of("data", "slow", P));
    let log = world.ctx.intents.clone().expect("log mode");
    tokio::spawn(log.clone().run());
    let crashed = tokio::spawn({
        let ctx = world.ctx.clone();
        async move { claims::reconcile(pvc, ctx).await }
    });
    let started = world.storage.path().join("pvc-u-data.started");
    while !started.exists() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    crashed.abort();
    world
}

#[tokio::test]
async fn a_claim_deleted_after_a_crash_mid_call_keeps_its_storage_and_says_so() {
    let world = crashed_mid_provision().await;
    assert!(
        world.storage.path().join("pvc-u-data").is_dir(),
        "storage made"
    );
    let stored = world.api.objects_under(LOGS);
    assert!(
        stored[0]["data"]["u-data"].is_string(),
        "intent recorded: {}",
        stored[0]
    );
    // The claim is deleted while no one works on it.
    world.api.remove(&claim_path("data"));
    let settled = wasm_provisioner::controller::recover_intents(&world.ctx)
        .await
        .expect("recovered");
    assert_eq!(
        settled, 0,
        "a process leaves its own claims in flight to itself"
    );
    // A restarted process does not know what the guest built: it never asks the guest again
    // (a namesake claim's storage could be the answer), so the storage stays and it says so.
    let restarted = restarted(&world);
    let settled = wasm_provisioner::controller::recover_intents(&restarted)
        .await
        .expect("recovered");
    assert_eq!(settled, 1, "the entry leaves the log");
    assert!(
        world.storage.path().join("pvc-u-data").is_dir(),
        "storage kept"
    );
    assert!(!world.guest_calls().contains("delete"));
    restarted.recorder.flush(Duration::from_secs(5)).await;
    assert!(
        world
            .api
            .event_reasons()
            .contains(&"StorageKept".to_string()),
        "{:?}",
        world.api.event_reasons()
    );
}

/// An entry that says what the guest built, for a claim gone before its PV: what a process
/// killed between the guest's answer and the PV create leaves.
async fn record_built(world: &World, log: &IntentLog, uid: &str, name: &str, path: &str) {
    let mut pv = json!({
        "metadata": {"name": format!("pvc-{uid}"), "uid": format!("pv-{uid}"),
                     "annotations": {"pv.kubernetes.io/provisioned-by": P}},
        "spec": {"hostPath": {"path": path}, "persistentVolumeReclaimPolicy": "Delete",
                 "storageClassName": "fast", "capacity": {"storage": "1Gi"}},
    });
    world.ground(&mut pv);
    let pv: PersistentVolume = serde_json::from_value(pv).unwrap();
    let Intent::Claim(mut entry) = Intent::claim(P, &format!("pvc-{uid}"), NS, name) else {
        unreachable!()
    };
    entry.built = Some(Storage::of(&pv, None));
    std::fs::create_dir_all(world.storage.path().join(format!("pvc-{uid}"))).unwrap();
    let generation = log.update(uid, &Intent::Claim(entry)).expect("fits");
    tokio::time::timeout(Duration::from_secs(10), log.durable(generation))
        .await
        .expect("written in time")
        .expect("written");
}

#[tokio::test]
async fn recovery_deletes_what_the_guest_built_for_a_claim_gone_before_its_pv() {
    let (world, log) = World::logged();
    record_built(&world, &log, "u-gone", "gone", "/nowhere/gone").await;
    let settled = wasm_provisioner::controller::recover_intents(&restarted(&world))
        .await
        .expect("recovered");
    assert_eq!(settled, 1);
    assert!(
        !world.storage.path().join("pvc-u-gone").exists(),
        "what the guest built for the gone claim is deleted"
    );
    assert!(
        !world.guest_calls().contains("provision"),
        "the guest is never asked again what it built: {}",
        world.guest_calls()
    );
}

#[tokio::test]
async fn a_namesake_claims_live_storage_is_never_deleted() {
    let (mut world, log) = World::logged();
    // The old claim `data` built /shared/team/data (a pattern from namespace and name) and is
    // gone; a new claim of the same name was given the same directory and is Bound.
    record_built(&world, &log, "u-old", "data", "/shared/team/data").await;
    let mut namesake = claim_of("data", "fast", P);
    namesake["metadata"]["uid"] = json!("u-new");
    namesake["spec"]["volumeName"] = json!("pvc-u-new");
    world.claim(namesake);
    world.api.put(
        &pv_path("pvc-u-new"),
        json!({"metadata": {"name": "pvc-u-new", "uid": "pv-u-new"},
               "spec": {"hostPath": {"path": "/shared/team/data"}}, "status": {"phase": "Bound"}}),
    );
    let settled = wasm_provisioner::controller::recover_intents(&restarted_with_claims(&world))
        .await
        .expect("recovered");
    assert_eq!(settled, 1, "the entry leaves the log");
    assert!(
        world.storage.path().join("pvc-u-old").is_dir(),
        "storage a live claim uses is kept"
    );
    assert!(
        !world.guest_calls().contains("delete"),
        "{}",
        world.guest_calls()
    );
}

#[tokio::test]
async fn recovery_makes_no_request_for_waiting_claims() {
    let (mut world, log) = World::logged();
    for n in 0..1000 {
        let pvc = world.claim(claim_of(&format!("w{n}"), "fast", P));
        let uid = pvc.metadata.uid.clone().unwrap();
        let intent = Intent::claim(P, &format!("pvc-{uid}"), NS, &format!("w{n}"));
        log.update(&uid, &intent).expect("fits");
    }
    let before = world.api.requests().len();
    for _ in 0..3 {
        wasm_provisioner::controller::recover_intents(&world.ctx)
            .await
            .expect("recovered");
    }
    let made: Vec<_> = world.api.requests()[before..]
        .iter()
        .filter(|r| !r.path.starts_with(LOGS))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(
        made.is_empty(),
        "1,000 waiting claims cost no request: {made:?}"
    );
    assert_eq!(log.len(), 1000, "waiting claims are the claim path's");
}

#[tokio::test]
async fn a_claim_whose_class_is_missing_fails_counted_with_an_event() {
    let mut world = World::new(settings(), "");
    let pvc = world.claim(claim_of("data", "nowhere", P));
    let error = world.provision(&pvc).await.expect_err("class missing");
    assert_eq!(error.label(), "class-not-found");
    assert!(error.counts());
    assert_eq!(world.events().await, ["ProvisioningFailed"]);
    assert!(world.finalizers("data").is_empty());
}

#[tokio::test]
async fn a_standby_makes_no_request_at_all() {
    let mut standby = settings();
    standby.election.mode = Mode::Leader;
    let mut world = World::new(standby, "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(claim_of("data", "fast", P));
    let error = world.provision(&pvc).await.expect_err("not the leader");
    assert!(error.gate_refusal().is_some());
    assert!(world.api.requests().is_empty());
    assert!(world.guest_calls().is_empty());
}

#[tokio::test]
async fn no_guest_is_called_before_the_pvs_are_listed() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    let pvc = world.claim(claim_of("data", "fast", P));
    // A process just started: its PV watch has not finished the first list, so neither whether
    // this claim's PV exists nor which node paths are served is known.
    let (listing, _writer) = reflector::store();
    let started = Arc::new(Context::new(
        world.api.client(),
        world.ctx.plugins(),
        settings(),
        Caches {
            classes: world.ctx.classes.clone(),
            volumes: listing,
            claims: world.ctx.claims.clone(),
        },
        Metrics::new(),
        None,
    ));
    let action = claims::reconcile(pvc, started)
        .await
        .expect("looked at again shortly");
    assert!(requeue_after(&action).is_some(), "{action:?}");
    assert!(world.guest_calls().is_empty(), "{}", world.guest_calls());
    assert!(world.api.requests().is_empty());
}

#[tokio::test]
async fn a_claim_whose_guest_refuses_for_now_leaves_the_log() {
    let mut world = World::new(log_settings(), "");
    world.class(
        "flaky",
        json!({"fail": "transient", "failTimes": "1"}),
        json!({}),
    );
    let pvc = world.claim(claim_of("data", "flaky", P));
    let log = world.ctx.intents.clone().expect("log mode");
    tokio::spawn(log.clone().run());
    world
        .provision(&pvc)
        .await
        .expect_err("transient: try again later");
    assert_eq!(
        log.len(),
        0,
        "nothing built: a waiting claim is recorded again when its turn comes, not kept"
    );
    // The claim goes before the next attempt: nothing is left to recover.
    world.api.remove(&claim_path("data"));
    world
        .claims
        .apply_watcher_event(&watcher::Event::Delete((*pvc).clone()));
    let settled = wasm_provisioner::controller::recover_intents(&world.ctx)
        .await
        .expect("recovered");
    assert_eq!(settled, 0);
    assert!(!world.guest_calls().contains("delete"));
}

#[tokio::test]
async fn a_guest_that_keeps_answering_transient_is_retried_ever_later_without_counting() {
    let (mut world, _log) = World::logged();
    world.class("stuck", json!({"fail": "transient"}), json!({}));
    let pvc = world.claim(claim_of("data", "stuck", P));
    let mut waits = Vec::new();
    for _ in 0..4 {
        let error = world.provision(&pvc).await.expect_err("transient");
        assert!(!error.counts(), "{error}");
        let action = claims::error_policy(pvc.clone(), &error, world.ctx.clone());
        waits.push(requeue_after(&action).expect("requeued"));
    }
    let start = world.ctx.settings.retry_interval_start;
    assert_eq!(waits[0], start, "{waits:?}");
    assert!(
        waits.windows(2).all(|w| w[1] > w[0]),
        "a crowd of waiting claims must not be retried at the start interval forever: {waits:?}"
    );
    assert!(
        world.ctx.claim_book.is_empty() || !world.ctx.claim_book.is_given_up("u-data", 0),
        "never given up"
    );
}

#[tokio::test]
async fn a_claim_whose_class_has_no_turn_free_is_parked_without_a_call_and_woken_when_one_frees() {
    use futures::StreamExt;
    use kube::runtime::reflector::ObjectRef;
    let (mut world, _log) = World::logged();
    world.class(
        "stuck",
        json!({"fail": "transient"}),
        json!({ANN_MAX_IN_FLIGHT: "2"}),
    );
    let retry = world.claim(claim_of("retry", "stuck", P));
    let first = world.claim(claim_of("first", "stuck", P));
    let other = world.claim(claim_of("other", "fast", P));
    let error = world.provision(&retry).await.expect_err("transient");
    claims::error_policy(retry.clone(), &error, world.ctx.clone());
    let mut wakeups = world.ctx.turns.wakeups();
    let stuck = world.ctx.class("stuck").expect("class");
    let held: Vec<_> = (0..world.ctx.turns.limit(&stuck))
        .map(|n| world.turn("stuck", &format!("holder-{n}")).expect("turn"))
        .collect();
    let (calls, requests) = (world.guest_calls(), world.api.requests().len());
    for pvc in [&retry, &first] {
        let action = world.provision(pvc).await.expect("parked");
        assert_eq!(
            requeue_after(&action),
            None,
            "parked, not requeued: {action:?}"
        );
    }
    assert_eq!(world.guest_calls(), calls, "no guest call");
    assert_eq!(world.api.requests().len(), requests, "no request");
    assert_eq!(
        world.ctx.turns.parked(),
        2,
        "a retry and a first attempt alike"
    );
    assert_eq!(
        world.ctx.metrics.waiting(Queue::Claims),
        2,
        "parked claims are in the queue's depth, the retry and the first attempt alike"
    );
    assert_eq!(
        world.ctx.metrics.retries(Queue::Claims),
        1,
        "parking a retry does not count it again"
    );
    world
        .provision(&other)
        .await
        .expect("another class has turns of its own");
    assert!(world.api.get(&pv_path("pvc-u-other")).is_some());
    drop(held);
    let woken: Vec<_> =
        tokio::time::timeout(Duration::from_secs(5), wakeups.by_ref().take(2).collect())
            .await
            .expect("woken");
    assert_eq!(
        woken,
        [ObjectRef::from_obj(&*retry), ObjectRef::from_obj(&*first)],
        "in the order they were parked"
    );
    let calls = world.guest_calls();
    world
        .provision(&first)
        .await
        .expect_err("its turn: the guest called");
    assert_ne!(world.guest_calls(), calls);
}

#[tokio::test]
async fn claims_with_huge_annotations_do_not_fill_the_log() {
    let (mut world, log) = World::logged();
    let mut claims = Vec::new();
    for n in 0..6 {
        let mut claim = claim_of(&format!("big{n}"), "fast", P);
        claim["metadata"]["annotations"]["team.example/notes"] = json!("x".repeat(200 * 1024));
        claims.push(world.claim(claim));
    }
    let reconciles = claims.iter().map(|pvc| world.provision(pvc));
    for result in futures::future::join_all(reconciles).await {
        result.expect("provisioned");
    }
    assert!(log.bytes() < 16 * 1024, "{} bytes", log.bytes());
    for n in 0..6 {
        assert!(world.api.get(&pv_path(&format!("pvc-u-big{n}"))).is_some());
    }
    let writes: Vec<usize> = world
        .api
        .requests()
        .iter()
        .filter(|r| r.path.starts_with(LOGS) && r.method != http::Method::GET)
        .map(|r| r.body.to_string().len())
        .collect();
    assert!(
        writes.iter().all(|bytes| *bytes < 64 * 1024),
        "no write carries the annotations: {writes:?}"
    );
}

#[tokio::test]
async fn node_mode_releases_a_deleted_claim_whose_node_is_gone() {
    use wasm_provisioner::controller::node::{NodeSettings, NodeState};
    let mut world = World::new(settings(), "");
    let node = NodeSettings {
        name: "n1".into(),
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(20),
        immediate_binding: true,
        gone_grace: Duration::ZERO,
    };
    let (nodes, _) = reflector::store();
    let (classes, _) = reflector::store();
    let (volumes, _) = reflector::store();
    let (claims_store, mut claims) = reflector::store();
    let mut node_settings = settings();
    node_settings.node = Some(node.clone());
    let ctx = Arc::new(Context::new(
        world.api.client(),
        world.ctx.plugins(),
        node_settings,
        Caches {
            classes,
            volumes,
            claims: claims_store,
        },
        Metrics::new(),
        Some(NodeState::new(node, nodes)),
    ));
    let mut gone = claim_of("data", "local", P);
    gone["metadata"]["finalizers"] = json!([FINALIZER_CLAIM]);
    gone["metadata"]["deletionTimestamp"] = json!("2026-12-03T00:00:00Z");
    gone["metadata"]["annotations"]["volume.kubernetes.io/selected-node"] = json!("n2");
    let pvc = world.claim(gone);
    claims.apply_watcher_event(&watcher::Event::Apply((*pvc).clone()));
    claims::reconcile(pvc, ctx.clone()).await.expect("released");
    assert!(
        world.finalizers("data").is_empty(),
        "node n2 is gone with its storage: someone must let the claim go"
    );
    assert!(
        world.guest_calls().is_empty(),
        "no guest call for a gone node's storage"
    );
    ctx.recorder.flush(Duration::from_secs(5)).await;
    assert!(
        world
            .api
            .event_reasons()
            .contains(&"ProvisioningAbandoned".to_string())
    );
}

#[tokio::test]
async fn the_queue_behind_a_claim_rides_on_its_write_and_each_turn_is_marked_called() {
    let (mut world, _) = World::logged();
    let claims: Vec<_> = (0..8)
        .map(|n| world.claim(claim_of(&format!("q{n}"), "fast", P)))
        .collect();
    for pvc in &claims {
        world.provision(pvc).await.expect("provisioned");
    }
    let writes: Vec<_> = world
        .api
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with(LOGS) && r.method != http::Method::GET)
        .collect();
    let first = writes[0].body["data"].as_object().expect("data");
    assert_eq!(first.len(), 8, "the seven queued behind ride on the first");
    assert_eq!(
        first
            .values()
            .filter(|text| text.as_str().unwrap_or_default().contains("\"ahead\":true"))
            .count(),
        7,
        "marked recorded ahead: {first:?}"
    );
    // One at a time, each turn's write marks its claim called before its guest is called (a
    // stored mark "ahead" must mean "never called"); turns that come together share a write.
    assert_eq!(intent_writes(&world), 8);
    for n in 0..8 {
        assert!(world.api.get(&pv_path(&format!("pvc-u-q{n}"))).is_some());
    }
}

#[tokio::test]
async fn claims_recorded_ahead_never_fill_the_log_however_many_wait() {
    let (mut world, log) = World::logged();
    world.class("stuck", json!({"fail": "transient"}), json!({}));
    let claims: Vec<_> = (0..2_000)
        .map(|n| world.claim(claim_of(&format!("w{n}"), "stuck", P)))
        .collect();
    // Turns come to claims the log does not hold yet (recorded ahead or not, as the queue goes).
    let mut turns = 0;
    for pvc in &claims {
        if turns == 40 {
            break;
        }
        if log.holds(pvc.metadata.uid.as_deref().unwrap()) {
            continue;
        }
        turns += 1;
        let error = world.provision(pvc).await.expect_err("transient");
        assert_eq!(error.label(), "transient", "{error}");
    }
    assert!(
        log.len() <= 256 + 64,
        "{} entries held for 2,000 waiting claims",
        log.len()
    );
}

/// A repeat of an event whose first one is gone (its create dropped from a full queue or
/// refused, or its TTL passed) is written again whole. Before, its count was patched onto a
/// name that did not exist: "not found", and every repeat for ten minutes was lost (seen with
/// 5,000 claims failing at once).
#[tokio::test]
async fn a_repeated_event_whose_first_is_gone_is_written_again() {
    let world = World::new(settings(), "");
    let recorder = &world.ctx.recorder;
    let claim = k8s_openapi::api::core::v1::ObjectReference {
        kind: Some("PersistentVolumeClaim".into()),
        namespace: Some(NS.into()),
        name: Some("data".into()),
        uid: Some("u-data".into()),
        ..Default::default()
    };
    let events = format!("/api/v1/namespaces/{NS}/events");
    let counts = || async {
        recorder.flush(Duration::from_secs(5)).await;
        world
            .api
            .objects_under(&events)
            .iter()
            .map(|event| event["count"].as_i64().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    let publish = || {
        recorder.publish(
            &claim,
            Event::warning("ProvisioningFailed", EventAction::Provision, "x".into()),
        )
    };
    publish();
    assert_eq!(counts().await, [1]);
    publish();
    assert_eq!(counts().await, [2], "a repeat counts on the first");
    let first = &world.api.objects_under(&events)[0];
    let name = first["metadata"]["name"].as_str().expect("name");
    world.api.remove(&format!("{events}/{name}"));
    publish();
    assert_eq!(counts().await, [3], "written again, with its count");
    publish();
    assert_eq!(counts().await, [4], "and counted on from there");
}

/// A claim given up while it still had a place in its class's queue (parked under an earlier
/// spec, given up again under this one) passes the place on at its next reconcile: the claim
/// parked behind it is woken for the next turn, not the given-up one, which would never take it.
#[tokio::test]
async fn a_given_up_claim_passes_its_place_in_the_queue_on() {
    let mut world = World::new(settings(), "");
    world.class(
        "trapping",
        json!({"fail": "trap"}),
        json!({ANN_MAX_IN_FLIGHT: "1"}),
    );
    let pvc = world.claim(claim_of("data", "trapping", P));
    for _ in 1..=3 {
        world.provision(&pvc).await.expect_err("trap");
    }
    let mut wakeups = world.ctx.turns.wakeups();
    let held = world
        .turn("trapping", "holder")
        .expect("the class's one turn");
    assert!(
        world.turn("trapping", "data").is_none() && world.turn("trapping", "next").is_none(),
        "parked"
    );
    world
        .provision(&pvc)
        .await
        .expect("given up: nothing to do");
    assert_eq!(world.ctx.turns.parked(), 1, "its place is gone");
    drop(held);
    let woken = wakeups.try_recv().ok().map(|claim| claim.name);
    assert_eq!(woken.as_deref(), Some("next"));
}
