//! Hostile pods against the trusted sample guests: colliding tenants, a directory with someone
//! else's data, and volumes a pod made deep or huge, which must still be deletable.

use super::*;
use wasm_provisioner::wasm::bindings::types::DeleteRequest;

/// The hostpath guest over a granted directory of its own, with `limits` added.
fn hostpath(storage: &Path, limits: &str) -> (PluginsDir, Arc<Guest>) {
    let plugins = PluginsDir::new();
    plugins.add(
        "hostpath",
        "hostpath",
        &dir_grant(GOOD, storage, "/volumes", limits),
    );
    let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
    let guest = loaded.for_provisioner(GOOD).expect("loaded").clone();
    (plugins, guest)
}

fn claim_in(namespace: &str, name: &str) -> wasm_provisioner::wasm::bindings::types::Claim {
    let mut claim = claim(&format!("{namespace}.{name}"));
    claim.namespace = namespace.into();
    claim.name = name.into();
    claim
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_class_keeps_tenants_apart_and_never_adopts_data() {
    let storage = tempfile::tempdir().unwrap();
    let (_plugins, guest) = hostpath(storage.path(), "");
    let config = guest.grants().config_json.clone();
    // The shipped example class's pattern.
    let example =
        std::fs::read_to_string(repo().join("deploy/examples/hostpath-storageclass.yaml")).unwrap();
    let pattern = example
        .lines()
        .find_map(|l| l.trim().strip_prefix("pathPattern: "))
        .unwrap()
        .trim_matches('"')
        .to_owned();
    let params = [("pathPattern", pattern.as_str())];
    let a = request(claim_in("team-a", "x"), class(GOOD, &params), &config);
    let b = request(claim_in("team", "a-x"), class(GOOD, &params), &config);
    let path = |built: &wasm_provisioner::wasm::spec::BuiltVolume| match &built.source {
        wasm_provisioner::wasm::bindings::types::VolumeSource::HostPath(h) => h.path.clone(),
        other => panic!("{other:?}"),
    };
    let (pa, pb) = (
        path(&guest.provision(&a).await.expect("team-a/x")),
        path(&guest.provision(&b).await.expect("team/a-x")),
    );
    println!("team-a/x -> {pa}, team/a-x -> {pb}");
    assert_ne!(pa, pb, "two tenants share a directory");
    // Data left in a directory (a retained volume) is never handed to a new claim.
    std::fs::create_dir_all(storage.path().join("team-c/old")).unwrap();
    std::fs::write(storage.path().join("team-c/old/secret"), b"tenant data").unwrap();
    let c = request(claim_in("team-c", "old"), class(GOOD, &params), &config);
    let message = match guest.provision(&c).await {
        Err(CallError::Guest { error, .. }) => format!("{error:?}"),
        other => panic!("adopted a directory holding data: {other:?}"),
    };
    println!("existing data: {message}");
    assert!(message.contains("not adopted"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_a_pod_made_deep_or_huge_are_still_deleted() {
    let _alone = super::CPU_HEAVY.lock().await;
    let storage = tempfile::tempdir().unwrap();
    let (_plugins, guest) = hostpath(storage.path(), "memory-mib = 16\ndescriptors = 64");
    let config = guest.grants().config_json.clone();
    for (what, depth, files) in [("deep", 100, 10), ("huge", 1, 50_000)] {
        let req = request(claim(what), class(GOOD, &[]), &config);
        let built = guest.provision(&req).await.expect("provisioned");
        // The pod's doing.
        let mut dir = storage.path().join(&req.pv_name);
        for level in 0..depth {
            dir = dir.join(format!("level-{level}"));
        }
        std::fs::create_dir_all(&dir).unwrap();
        let long = "f".repeat(100);
        for i in 0..files {
            std::fs::write(dir.join(format!("{long}-{i}")), b"x").unwrap();
        }
        let started = Instant::now();
        let outcome = guest
            .delete(&DeleteRequest {
                volume: as_volume(&req, &built),
                storage_class: None,
                config: config.clone(),
            })
            .await;
        println!(
            "{what} ({depth} levels, {files} files): {:?} in {:?}",
            outcome,
            started.elapsed()
        );
        outcome.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(!storage.path().join(&req.pv_name).exists(), "{what}: gone");
    }
}
