//! Claims with a data source (issue 34): a populator's kind is left alone with one Normal
//! event; a copy (of a claim or a snapshot) reaches only a guest that can make it, and is
//! otherwise refused: never provisioned as an empty volume.

use super::*;

fn with_source(name: &str, source: Value) -> Value {
    let mut claim = claim_of(name, "fast", P);
    claim["spec"]["dataSourceRef"] = source.clone();
    claim["spec"]["dataSource"] = source;
    claim
}

#[tokio::test]
async fn a_populators_claim_is_left_alone_with_one_normal_event() {
    let mut world = World::of("hostpath", "/volumes", settings(), "");
    world.class("fast", json!({}), json!({}));
    let source = json!({"apiGroup": "populators.example.com", "kind": "Hello", "name": "h1"});
    let pvc = world.claim(with_source("populated", source));
    world.provision(&pvc).await.expect("left alone");
    let pvc = world.sync_claim("populated");
    world.provision(&pvc).await.expect("left alone again");
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let notes = world.api.event_notes();
    assert_eq!(
        notes
            .iter()
            .filter(|n| n.starts_with("LeftToPopulator:"))
            .count(),
        1,
        "{notes:#?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.contains("Hello (API group populators.example.com)")),
        "{notes:#?}"
    );
    assert!(
        world.api.get(&pv_path("pvc-u-populated")).is_none(),
        "no PV"
    );
    assert!(world.finalizers("populated").is_empty(), "no finalizer");
    assert_eq!(
        std::fs::read_dir(world.storage.path()).unwrap().count(),
        0,
        "the guest was never called"
    );
}

#[tokio::test]
async fn a_copy_the_guest_cannot_make_is_refused_never_provisioned_empty() {
    // legacy-block exports no `cloning` hook (a 0.1.0 guest); nobody restores snapshots.
    let mut world = World::of("legacy_block", "/state", settings(), "");
    world.class("fast", json!({}), json!({}));
    let clone = json!({"kind": "PersistentVolumeClaim", "name": "db"});
    let restore =
        json!({"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"});
    for (name, source) in [("clone", clone), ("restore", restore)] {
        let pvc = world.claim(with_source(name, source));
        world.provision(&pvc).await.expect("a refusal is an answer");
        assert!(
            world.api.get(&pv_path(&format!("pvc-u-{name}"))).is_none(),
            "no PV for {name}"
        );
        assert!(world.finalizers(name).is_empty(), "nothing holds {name}");
    }
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let notes = world.api.event_notes();
    for refused in [
        "this class cannot copy from a PersistentVolumeClaim",
        "this class cannot copy from a VolumeSnapshot",
    ] {
        assert!(
            notes
                .iter()
                .any(|n| n.starts_with("ProvisioningFailed:") && n.contains(refused)),
            "{refused}: {notes:#?}"
        );
    }
    assert!(
        !notes
            .iter()
            .any(|n| n.contains("legacy-block builds nothing")),
        "the guest was never called: {notes:#?}"
    );
}

/// The source claim `db`, provisioned by the hostpath guest and Bound, with a file in it.
async fn bound_source(world: &mut World) -> std::path::PathBuf {
    let pvc = world.claim(claim_of("db", "fast", P));
    world.provision(&pvc).await.expect("source provisioned");
    let mut stored = world.api.get(&claim_path("db")).unwrap();
    stored["spec"]["volumeName"] = json!("pvc-u-db");
    stored["status"] = json!({"phase": "Bound"});
    stored["metadata"]["finalizers"] = json!([]);
    world.claim(stored);
    let dir = world.storage.path().join("pvc-u-db");
    std::fs::write(dir.join("rows"), "42").unwrap();
    dir
}

fn clone_of(name: &str, source: &str) -> Value {
    with_source(
        name,
        json!({"kind": "PersistentVolumeClaim", "name": source}),
    )
}

#[tokio::test]
async fn a_clone_gets_a_copy_and_holds_its_source_only_while_copying() {
    let mut world = World::of("hostpath", "/volumes", settings(), "");
    world.class("fast", json!({}), json!({}));
    bound_source(&mut world).await;
    let before = world.api.calls().len();
    let pvc = world.claim(clone_of("copy", "db"));
    world.provision(&pvc).await.expect("cloned");
    assert!(
        world.api.get(&pv_path("pvc-u-copy")).is_some(),
        "the clone's PV"
    );
    assert_eq!(
        std::fs::read_to_string(world.storage.path().join("pvc-u-copy/rows")).unwrap(),
        "42",
        "the source's data is in the clone"
    );
    let source_patches: Vec<String> = world.api.calls()[before..]
        .iter()
        .filter(|c| c.starts_with(&format!("PATCH {}", claim_path("db"))))
        .cloned()
        .collect();
    assert_eq!(
        source_patches.len(),
        2,
        "held, then let go: {source_patches:?}"
    );
    assert!(
        world.finalizers("db").is_empty(),
        "the source is let go once the copy returned"
    );
}

#[tokio::test]
async fn a_source_that_cannot_be_copied_fails_the_clone_with_no_pv() {
    let mut world = World::of("hostpath", "/volumes", settings(), "");
    world.class("fast", json!({}), json!({}));
    world.class("other", json!({}), json!({}));
    bound_source(&mut world).await;
    let mut elsewhere = clone_of("elsewhere", "db");
    elsewhere["spec"]["dataSourceRef"]["namespace"] = json!("other-team");
    let mut other_class = claim_of("other-class", "other", P);
    other_class["spec"]["dataSource"] = json!({"kind": "PersistentVolumeClaim", "name": "db"});
    // A claim of the class bound by hand to a static PV (no provisioned-by): not ours to copy.
    world.volume(json!({"metadata": {"name": "static-pv"},
        "spec": {"hostPath": {"path": "/nowhere"}, "storageClassName": "fast"},
        "status": {"phase": "Bound"}}));
    let mut by_hand = claim_of("by-hand", "fast", P);
    by_hand["spec"]["volumeName"] = json!("static-pv");
    by_hand["status"] = json!({"phase": "Bound"});
    world.claim(by_hand);
    for (claim, why) in [
        (
            clone_of("missing", "nope"),
            "source claim ns/nope does not exist",
        ),
        (elsewhere, "is in another namespace"),
        (other_class, "is of class \"fast\", not \"other\""),
        (
            clone_of("static", "by-hand"),
            "provisioned by nobody (a static volume)",
        ),
    ] {
        let name = claim["metadata"]["name"].as_str().unwrap().to_owned();
        let pvc = world.claim(claim);
        let error = world.provision(&pvc).await.unwrap_err().to_string();
        assert!(error.contains(why), "{name}: {error}");
        assert!(world.api.get(&pv_path(&format!("pvc-u-{name}"))).is_none());
    }
    world.ctx.recorder.flush(Duration::from_secs(5)).await;
    let failed = world
        .api
        .event_notes()
        .into_iter()
        .filter(|n| n.starts_with("ProvisioningFailed:") && n.contains("source claim"))
        .count();
    assert_eq!(failed, 4);
    assert!(
        world.finalizers("db").is_empty(),
        "the source was never held"
    );
}

/// A source left holding our finalizer (the process died during the copy) is let go by its
/// next reconcile when no clone of it waits for a volume.
#[tokio::test]
async fn a_source_left_held_by_a_crash_is_let_go() {
    let mut world = World::of("hostpath", "/volumes", settings(), "");
    world.class("fast", json!({}), json!({}));
    bound_source(&mut world).await;
    let mut stored = world.api.get(&claim_path("db")).unwrap();
    stored["metadata"]["finalizers"] = json!(["wasm-provisioner.dev/clone-source"]);
    let pending = world.claim(clone_of("pending", "db"));
    let held = world.claim(stored);
    world.provision(&held).await.expect("reconciled");
    assert_eq!(
        world.finalizers("db"),
        ["wasm-provisioner.dev/clone-source"],
        "kept while a clone of it waits for its volume"
    );
    world.provision(&pending).await.expect("the clone");
    let held = world.sync_claim("db");
    world.provision(&held).await.expect("reconciled again");
    assert!(
        world.finalizers("db").is_empty(),
        "{:?}",
        world.finalizers("db")
    );
}

/// Every instance uses the clone-source finalizer's name: one that does not serve a claim's
/// provisioner never takes it off (another instance's guest may be copying that claim).
#[tokio::test]
async fn another_provisioners_source_keeps_its_finalizer() {
    let mut world = World::of("hostpath", "/volumes", settings(), "");
    world.class("fast", json!({}), json!({}));
    let mut theirs = claim_of("theirs", "fast", "other.example.com/copier");
    theirs["spec"]["volumeName"] = json!("pvc-theirs");
    theirs["status"] = json!({"phase": "Bound"});
    theirs["metadata"]["finalizers"] = json!(["wasm-provisioner.dev/clone-source"]);
    let held = world.claim(theirs);
    world.provision(&held).await.expect("reconciled");
    assert_eq!(
        world.finalizers("theirs"),
        ["wasm-provisioner.dev/clone-source"],
        "not ours to take off"
    );
}
