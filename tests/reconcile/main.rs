//! The controller shell without a cluster: claim and volume reconciles against a fake API server
//! behind a real `kube::Client`, with the real scripted guest from `guests/`. One test per branch,
//! one file per path: `claim_path`, `claim_intents` (the claim side of the intent log),
//! `volume_path`, `recovery` and `log_safety`, `claim_cache` and `relist`, `capabilities`,
//! `expansion`; this
//! file holds the world they share. The whole layer runs in seconds; the end-to-end suites prove
//! the same paths against a real control plane.

mod ahead_of_mark;
mod capabilities;
mod claim_cache;
mod claim_intents;
mod claim_path;
#[path = "../common/mod.rs"]
mod common;
mod data_sources;
mod expansion;
mod fake_api;
mod log_safety;
mod ownership;
mod recovery;
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
use wasm_provisioner::wasm::reload::Loader;
use wasm_provisioner::wasm::{WasmEngine, load_dir};

use common::e2e::{ClaimBuilder, ClassBuilder};
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
        World::with_grant(crate_name, guest_dir, settings, limits, |grant| grant)
    }

    /// [`World::of`], with the grant file text passed through `edit` before it is written.
    fn with_grant(
        crate_name: &str,
        guest_dir: &str,
        settings: Settings,
        limits: &str,
        edit: impl FnOnce(String) -> String,
    ) -> World {
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
            &edit(dir_grant(P, storage.path(), guest_dir, &limits)),
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
                bindable: Default::default(),
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
        let entries = |map: &Value| map.as_object().cloned().unwrap_or_default();
        let mut class = ClassBuilder::new(name, P);
        for (key, value) in entries(&parameters) {
            class = class.param(&key, value.as_str().expect("a string parameter"));
        }
        for (key, value) in entries(&annotations) {
            class = class.annotation(&key, value.as_str().expect("a string annotation"));
        }
        let class = class.uid(&format!("uid-class-{name}")).build();
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
            bindable: Default::default(),
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
    let claim = ClaimBuilder::new(name)
        .stored_as(NS, &format!("u-{name}"))
        .class(class)
        .annotation("volume.beta.kubernetes.io/storage-provisioner", provisioner)
        .build();
    serde_json::to_value(claim).expect("a claim")
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

const LOGS: &str = "/api/v1/namespaces/default/configmaps";

fn intent_writes(world: &World) -> usize {
    world
        .api
        .requests()
        .iter()
        .filter(|r| r.path.starts_with(LOGS) && r.method != http::Method::GET)
        .count()
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
