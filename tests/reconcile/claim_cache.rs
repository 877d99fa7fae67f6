//! The claim cache against the fake API server: claims of a provisioner no guest here knows stay
//! out of it and are never planned (10,000 foreign claims and volumes leave no trace); settled
//! claims leave it and settled volumes keep only their identity; a plugins reload that serves
//! their provisioner lists the claims again, and they are provisioned from the whole object.

use super::*;
use futures::StreamExt;
use kube::Api;
use tokio::sync::watch;
use wasm_provisioner::controller::claim_watch::{ClaimKeeping, claim_watch};
use wasm_provisioner::wasm::Plugins;

const OTHER: &str = "example.com/other";

/// Runs the claim watch over the fake API server into the world's claim cache, as the
/// controller does; returns the reload sender, the keeping and the names it gave to reconcile.
async fn watching(
    world: &mut World,
) -> (
    watch::Sender<Arc<Plugins>>,
    Arc<ClaimKeeping>,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    let (reload, plugins) = watch::channel(world.ctx.plugins());
    let keeping = Arc::new(ClaimKeeping::new(false, plugins));
    let (_, spare) = reflector::store();
    let writer = std::mem::replace(&mut world.claims, spare);
    let api: Api<PersistentVolumeClaim> = Api::namespaced(world.api.client(), NS);
    let (applied, names) = tokio::sync::mpsc::unbounded_channel();
    let mut stream = Box::pin(claim_watch(api, writer, keeping.clone()));
    tokio::spawn(async move {
        while let Some(item) = stream.next().await {
            if let Ok(claim) = item {
                let _ = applied.send(claim.metadata.name.unwrap_or_default());
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(10), world.ctx.claims.wait_until_ready())
        .await
        .expect("claim cache synced")
        .expect("writer alive");
    (reload, keeping, names)
}

fn other_class(world: &mut World) {
    let class: StorageClass = serde_json::from_value(json!({
        "metadata": {"name": "other", "uid": "uid-class-other"},
        "provisioner": OTHER,
        "reclaimPolicy": "Delete",
    }))
    .expect("class");
    world
        .classes
        .apply_watcher_event(&watcher::Event::Apply(class));
}

fn lists(world: &World) -> usize {
    let list = format!("GET /api/v1/namespaces/{NS}/persistentvolumeclaims");
    world.api.calls().iter().filter(|c| **c == list).count()
}

fn cached(world: &World, name: &str) -> Option<Arc<PersistentVolumeClaim>> {
    world.ctx.claims.get(&ObjectRef::new(name).within(NS))
}

fn drain(names: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> Vec<String> {
    let mut seen = Vec::new();
    while let Ok(name) = names.try_recv() {
        seen.push(name);
    }
    seen.sort();
    seen
}

#[tokio::test]
async fn foreign_claims_stay_out_of_the_cache_and_are_never_planned() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    other_class(&mut world);
    world
        .api
        .put(&claim_path("mine"), claim_of("mine", "fast", P));
    for n in 0..100 {
        let name = format!("foreign-{n}");
        world
            .api
            .put(&claim_path(&name), claim_of(&name, "other", OTHER));
    }
    // kube-controller-manager has not annotated it yet: it may still become ours.
    let mut unannotated = claim_of("unannotated", "other", OTHER);
    unannotated["metadata"]["annotations"] = json!({});
    world.api.put(&claim_path("unannotated"), unannotated);
    let (_reload, keeping, mut names) = watching(&mut world).await;

    assert_eq!(
        drain(&mut names),
        ["mine", "unannotated"],
        "only claims that may be ours are reconciled"
    );
    assert_eq!(
        world.ctx.claims.state().len(),
        2,
        "foreign claims are not cached"
    );
    assert!(cached(&world, "foreign-0").is_none());
    assert_eq!(
        keeping.noted(),
        1,
        "one provisioner noted, not a hundred claims"
    );
    // Everything the controller plans from: a reconcile of every cached claim (a resync), and
    // the class watch's re-check of class `other`.
    for pvc in world.ctx.claims.state() {
        claims::reconcile(pvc, world.ctx.clone())
            .await
            .expect("reconciled");
    }
    let rechecked = claims::claims_of_class(&world.ctx.claims, &world.ctx.class("other").unwrap());
    assert_eq!(rechecked.len(), 1, "{rechecked:?}");
    assert_eq!(rechecked[0].name, "unannotated");
    let calls = world.api.calls();
    assert!(
        !calls.iter().any(|c| c.contains("foreign-")),
        "no request names a foreign claim: {calls:#?}"
    );
    assert!(
        !world.guest_calls().contains("foreign-"),
        "no guest call: {}",
        world.guest_calls()
    );
    assert!(
        world.api.get(&pv_path("pvc-u-mine")).is_some(),
        "ours provisioned"
    );
}

#[tokio::test]
async fn a_reload_that_serves_a_foreign_claim_lists_again_and_provisions_it_whole() {
    let mut world = World::new(settings(), "");
    world.class("fast", json!({}), json!({}));
    other_class(&mut world);
    let mut later = claim_of("later", "other", OTHER);
    later["spec"]["accessModes"] = json!(["ReadWriteMany"]);
    later["spec"]["resources"]["requests"]["storage"] = json!("3Gi");
    world.api.put(&claim_path("later"), later);
    let (reload, keeping, mut names) = watching(&mut world).await;
    assert!(cached(&world, "later").is_none(), "foreign: left out");
    assert!(drain(&mut names).is_empty());
    assert_eq!(lists(&world), 1);

    // A reload that serves nothing noted costs nothing; one that serves `OTHER` lists again.
    reload.send(world.ctx.plugins()).expect("reload");
    let both = PluginsDir::new();
    both.add(
        "scripted",
        "scripted",
        &dir_grant(P, world.storage.path(), "/state", ""),
    )
    .add(
        "other",
        "scripted",
        &dir_grant(OTHER, world.storage.path(), "/state", ""),
    );
    let serving =
        Arc::new(load_dir(&WasmEngine::new().expect("engine"), both.path()).expect("load"));
    assert!(serving.serves(OTHER));
    world.ctx.set_plugins(serving.clone());
    reload.send(serving).expect("reload");
    let name = tokio::time::timeout(Duration::from_secs(10), names.recv())
        .await
        .expect("the claim comes back")
        .expect("stream alive");
    assert_eq!(name, "later");
    assert_eq!(lists(&world), 2, "one LIST, for the reload that serves it");
    assert_eq!(keeping.noted(), 0);
    let pvc = cached(&world, "later").expect("cached whole now");
    let storage = &pvc
        .spec
        .as_ref()
        .unwrap()
        .resources
        .as_ref()
        .unwrap()
        .requests;
    assert_eq!(storage.as_ref().unwrap()["storage"].0, "3Gi");

    claims::reconcile(pvc, world.ctx.clone())
        .await
        .expect("provisioned");
    let pv = world.api.get(&pv_path("pvc-u-later")).expect("PV created");
    assert_eq!(pv["spec"]["capacity"]["storage"], "3Gi", "{pv}");
    assert_eq!(pv["spec"]["accessModes"], json!(["ReadWriteMany"]), "{pv}");
    assert_eq!(
        pv["metadata"]["annotations"]["pv.kubernetes.io/provisioned-by"],
        OTHER
    );
    assert_eq!(pv["spec"]["claimRef"]["uid"], "u-later");
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
