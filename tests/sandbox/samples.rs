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

/// A pod's tree of any depth (past the descriptor cap, past PATH_MAX) and any number of entries
/// is deleted, in one call or over a few that each leave less (50,000 files: two 5 s calls in a
/// debug build).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_a_pod_made_deep_or_huge_are_still_deleted() {
    let _alone = super::CPU_HEAVY.lock().await;
    let storage = tempfile::tempdir().unwrap();
    let (_plugins, guest) = hostpath(storage.path(), "memory-mib = 16\ndescriptors = 64");
    let config = guest.grants().config_json.clone();
    // (what, levels, length of a directory name, files at the bottom)
    for (what, depth, name_len, files) in [
        ("deep", 100, 8, 10),
        ("past-path-max", 40, 200, 10),
        ("huge", 1, 8, 50_000),
    ] {
        let req = request(claim(what), class(GOOD, &[]), &config);
        let built = guest.provision(&req).await.expect("provisioned");
        // The pod's doing, grown from the top: no path past PATH_MAX can be created in one go.
        let (bottom, up) = (storage.path().join("bottom"), storage.path().join("up"));
        std::fs::create_dir(&bottom).unwrap();
        let long = "f".repeat(100);
        for i in 0..files {
            std::fs::write(bottom.join(format!("{long}-{i}")), b"x").unwrap();
        }
        for level in (1..depth).rev() {
            std::fs::create_dir(&up).unwrap();
            std::fs::rename(&bottom, up.join(format!("{level:0>name_len$}"))).unwrap();
            std::fs::rename(&up, &bottom).unwrap();
        }
        std::fs::rename(&bottom, storage.path().join(&req.pv_name).join("top")).unwrap();
        let volume = storage.path().join(&req.pv_name);
        let started = Instant::now();
        // As the controller does: a delete that meets its deadline is tried again, and each
        // attempt must leave less behind than the one before.
        let mut attempts = Vec::new();
        let mut left = entries_below(&volume);
        let outcome = loop {
            let outcome = guest
                .delete(&DeleteRequest {
                    volume: as_volume(&req, &built),
                    storage_class: None,
                    config: config.clone(),
                })
                .await;
            attempts.push(format!("{outcome:?}"));
            match outcome {
                Err(CallError::Fault {
                    kind: FaultKind::Deadline,
                    ..
                }) if attempts.len() < 4 => {
                    let now = entries_below(&volume);
                    assert!(now < left, "{what}: no progress ({now} entries left)");
                    left = now;
                }
                outcome => break outcome,
            }
        };
        println!(
            "{what} ({depth} levels of {name_len}-byte names, {files} files): {} attempts in {:?}: {}",
            attempts.len(),
            started.elapsed(),
            attempts.join("; ")
        );
        outcome.unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(!volume.exists(), "{what}: gone");
    }
}

/// Files and directories below `dir`, however deep (0 once it is gone).
pub(super) fn entries_below(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.file_type() {
            Ok(t) if t.is_dir() => 1 + entries_below(&entry.path()),
            _ => 1,
        })
        .sum()
}
