//! Guests loaded in-process through the host: the real `.wasm` files built from `guests/`,
//! real grant files, real WASI preopens. No cluster.

mod common;

use std::sync::Arc;

use common::*;
use wasm_provisioner::wasm::bindings::types::{DeleteRequest, ProvisionError, VolumeSource};
use wasm_provisioner::wasm::{CallError, FaultKind, Guest, Plugins, WasmEngine, load_dir};

const HOSTPATH: &str = "test.wasm-provisioner.dev/hostpath";
const SCRIPTED: &str = "test.wasm-provisioner.dev/scripted";
const ESCAPE: &str = "test.wasm-provisioner.dev/escape";

struct Fixture {
    _plugins: PluginsDir,
    storage: tempfile::TempDir,
    loaded: Plugins,
}

impl Fixture {
    /// Loads guest `crate_name` serving `provisioner`, with a fresh storage directory.
    fn new(crate_name: &str, provisioner: &str, guest_dir: &str, extra_limits: &str) -> Fixture {
        let storage = tempfile::tempdir().unwrap();
        let plugins = PluginsDir::new();
        plugins.add(
            crate_name,
            crate_name,
            &dir_grant(provisioner, storage.path(), guest_dir, extra_limits),
        );
        let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
        assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
        Fixture {
            _plugins: plugins,
            storage,
            loaded,
        }
    }

    /// The hostpath guest with `ids` (uid and gid ranges) added to its `[volumes]` grant.
    fn owned(ids: &str) -> Fixture {
        let storage = tempfile::tempdir().unwrap();
        let plugins = PluginsDir::new();
        let grant = dir_grant(HOSTPATH, storage.path(), "/volumes", "")
            .replace("[volumes]\n", &format!("[volumes]\n{ids}\n"));
        plugins.add("hostpath", "hostpath", &grant);
        let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
        assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
        Fixture {
            _plugins: plugins,
            storage,
            loaded,
        }
    }

    fn guest(&self, provisioner: &str) -> Arc<Guest> {
        self.loaded.for_provisioner(provisioner).unwrap().clone()
    }

    fn config(&self, provisioner: &str) -> String {
        self.guest(provisioner).grants().config_json.clone()
    }
}

fn host_path_of(source: &VolumeSource) -> String {
    match source {
        VolumeSource::HostPath(h) => h.path.clone(),
        other => panic!("expected hostPath, got {other:?}"),
    }
}

#[tokio::test]
async fn hostpath_provisions_a_directory_idempotently_and_deletes_it() {
    let f = Fixture::new("hostpath", HOSTPATH, "/volumes", "");
    let guest = f.guest(HOSTPATH);
    let req = request(claim("c1"), class(HOSTPATH, &[]), &f.config(HOSTPATH));
    let built = guest.provision(&req).await.expect("provision");
    let dir = f.storage.path().join("pvc-uid-c1");
    assert!(dir.is_dir(), "the guest created {}", dir.display());
    assert_eq!(host_path_of(&built.source), dir.display().to_string());
    assert_eq!(built.capacity, Some(1 << 30));

    let again = guest.provision(&req).await.expect("second provision");
    assert_eq!(again, built, "provision is idempotent for a PV name");
    assert_eq!(std::fs::read_dir(f.storage.path()).unwrap().count(), 1);

    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config: f.config(HOSTPATH),
    };
    guest.delete(&delete).await.expect("delete");
    assert!(!dir.exists(), "delete removed the directory");
    guest
        .delete(&delete)
        .await
        .expect("deleting what is gone is success");
}

/// Hostpath's `uid`/`gid`/`mode` parameters reach the host, which applies them to the volume
/// directory it checked, within the grant's id ranges; nothing outside them is handed out.
#[tokio::test]
async fn hostpath_volumes_get_the_owner_and_mode_the_grant_allows() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let f = Fixture::owned("uids = [\"1000-1999\"]\ngids = [\"1000\"]");
    let guest = f.guest(HOSTPATH);
    let owned = [("uid", "1000"), ("gid", "1000"), ("mode", "0700")];
    let req = request(claim("c1"), class(HOSTPATH, &owned), &f.config(HOSTPATH));
    let built = guest.provision(&req).await.expect("provision");
    let meta = std::fs::metadata(host_path_of(&built.source)).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (1000, 1000));
    assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
    guest
        .provision(&req)
        .await
        .expect("a second provision applies the same again");

    for (params, refused) in [
        (&[("uid", "0")][..], "uid 0 is not granted"),
        (&[("uid", "2000")][..], "uid 2000 is not granted"),
        (&[("gid", "1001")][..], "gid 1001 is not granted"),
        (&[("mode", "17777")][..], "parameter mode"),
    ] {
        let req = request(claim("bad"), class(HOSTPATH, params), &f.config(HOSTPATH));
        let error = guest.provision(&req).await.unwrap_err().to_string();
        assert!(error.contains(refused), "{params:?}: {error}");
    }
    assert!(
        !f.storage.path().join("pvc-uid-bad").exists(),
        "a refused owner leaves no directory"
    );
}

/// A pod that swaps its volume directory for a link to a directory outside the grant before a
/// re-provision (the PV create failed, the guest is called again) cannot steer the host's chown:
/// the walk refuses the link and nothing outside changes.
#[tokio::test]
async fn an_owner_is_never_applied_through_a_planted_link() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let f = Fixture::owned("uids = [\"1000\"]");
    let guest = f.guest(HOSTPATH);
    let outside = tempfile::tempdir().unwrap();
    std::fs::set_permissions(outside.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let before = std::fs::metadata(outside.path()).unwrap();
    let req = request(
        claim("c1"),
        class(HOSTPATH, &[("uid", "1000"), ("mode", "0777")]),
        &f.config(HOSTPATH),
    );
    std::os::unix::fs::symlink(outside.path(), f.storage.path().join("pvc-uid-c1")).unwrap();
    // The guest refuses the existing link itself; the host's walk would refuse it too
    // (src/wasm/nodepath.rs tests the host alone, with a link swapped in after the guest).
    let error = guest.provision(&req).await.unwrap_err().to_string();
    assert!(error.contains("pvc-uid-c1"), "{error}");
    let after = std::fs::metadata(outside.path()).unwrap();
    assert_eq!(
        (after.uid(), after.mode()),
        (before.uid(), before.mode()),
        "the link's target is untouched"
    );
}

/// A clone made by the host for the guest (`host.copy-tree`): files, directories and modes
/// copied, links recreated with their text (a link to the node's /etc stays a link, its target
/// never read), a FIFO left out, granted owners kept; a source owned by an id outside the
/// grant, or too large for `clone-timeout-ms`, fails and leaves no staging directory behind.
#[tokio::test]
async fn hostpath_clones_through_the_host_and_stops_at_its_budget() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use wasm_provisioner::wasm::bindings::cloning::CloneSource;
    let f = Fixture::owned("uids = [\"1000-1999\"]\ngids = [\"1000-1999\"]");
    let guest = f.guest(HOSTPATH);
    let config = f.config(HOSTPATH);
    assert!(config.contains("\"node-dir\""), "{config}");
    let source_req = request(claim("db"), class(HOSTPATH, &[]), &config);
    let source_built = guest.provision(&source_req).await.expect("source");
    let source_dir = std::path::PathBuf::from(host_path_of(&source_built.source));
    std::fs::create_dir(source_dir.join("tables")).unwrap();
    std::fs::write(source_dir.join("tables/rows"), "42").unwrap();
    let mode = |path: std::path::PathBuf, mode| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    mode(source_dir.join("tables"), 0o750);
    mode(source_dir.join("tables/rows"), 0o640);
    std::os::unix::fs::chown(source_dir.join("tables/rows"), Some(1000), Some(1001)).unwrap();
    std::os::unix::fs::symlink("/etc", source_dir.join("etc-link")).unwrap();
    std::os::unix::fs::symlink("tables/rows", source_dir.join("latest")).unwrap();
    let fifo = std::process::Command::new("mkfifo")
        .arg(source_dir.join("fifo"))
        .status()
        .unwrap();
    assert!(fifo.success());
    let source = CloneSource {
        namespace: "ns".into(),
        name: "db".into(),
        uid: "uid-db".into(),
        volume: as_volume(&source_req, &source_built),
    };
    let copy_req = request(claim("copy"), class(HOSTPATH, &[]), &config);
    let built = guest
        .provision_clone(&copy_req, &source)
        .await
        .expect("clone");
    let copy_dir = std::path::PathBuf::from(host_path_of(&built.source));
    let rows = copy_dir.join("tables/rows");
    assert_eq!(std::fs::read_to_string(&rows).unwrap(), "42");
    let meta = |path: std::path::PathBuf| std::fs::symlink_metadata(path).unwrap();
    assert_eq!(meta(copy_dir.join("tables")).mode() & 0o7777, 0o750);
    assert_eq!(
        (
            meta(rows.clone()).mode() & 0o7777,
            meta(rows.clone()).uid(),
            meta(rows).gid()
        ),
        (0o640, 1000, 1001)
    );
    assert_eq!(
        std::fs::read_link(copy_dir.join("etc-link")).unwrap(),
        std::path::Path::new("/etc")
    );
    assert_eq!(
        std::fs::read_link(copy_dir.join("latest")).unwrap(),
        std::path::Path::new("tables/rows")
    );
    assert!(std::fs::symlink_metadata(copy_dir.join("fifo")).is_err());

    let leftovers = |name: &str| -> Vec<String> {
        std::fs::read_dir(f.storage.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|entry| entry.contains(name))
            .collect()
    };
    // An owner the grant does not let this guest hand out fails the clone, naming it.
    std::os::unix::fs::chown(source_dir.join("tables/rows"), Some(999), None).unwrap();
    let foreign_req = request(claim("foreign"), class(HOSTPATH, &[]), &config);
    let error = guest
        .provision_clone(&foreign_req, &source)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tables/rows is owned by uid 999") && error.contains("widen them"),
        "{error}"
    );
    assert!(
        leftovers("foreign").is_empty(),
        "{:?}",
        leftovers("foreign")
    );
    std::os::unix::fs::chown(source_dir.join("tables/rows"), Some(1000), None).unwrap();

    for i in 0..20_000 {
        std::fs::write(source_dir.join(format!("f{i}")), "x").unwrap();
    }
    let slow_req = request(
        claim("slow"),
        class(HOSTPATH, &[]),
        &config.replace("\"node-dir\"", "\"clone-timeout-ms\":20,\"node-dir\""),
    );
    let error = guest
        .provision_clone(&slow_req, &source)
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("out of time after"), "{error}");
    assert!(
        leftovers("slow").is_empty(),
        "a cut-short copy left {:?}",
        leftovers("slow")
    );
}

/// What a hostile pod leaves in its volume (found on a real node by tests/e2e_kubelet.rs): a
/// 100-level tree, a FIFO and a symlink to the node's /etc. The delete removes all of it within
/// the guest's descriptor limit (64 by default; std's `remove_dir_all` held one per level) and
/// follows no link.
#[tokio::test]
async fn hostpath_deletes_a_planted_tree_deeper_than_its_descriptor_limit() {
    let f = Fixture::new("hostpath", HOSTPATH, "/volumes", "");
    let guest = f.guest(HOSTPATH);
    let req = request(claim("deep"), class(HOSTPATH, &[]), &f.config(HOSTPATH));
    let built = guest.provision(&req).await.expect("provision");
    let dir = std::path::PathBuf::from(host_path_of(&built.source));
    let mut deep = dir.join("deep");
    for _ in 0..100 {
        deep = deep.join("d");
    }
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(deep.join("leaf"), "planted").unwrap();
    std::os::unix::fs::symlink("/etc", dir.join("etc-link")).unwrap();
    let fifo = std::process::Command::new("mkfifo")
        .arg(dir.join("fifo"))
        .status()
        .unwrap();
    assert!(fifo.success());
    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config: f.config(HOSTPATH),
    };
    guest
        .delete(&delete)
        .await
        .expect("delete of a planted tree");
    assert!(!dir.exists(), "delete removed {}", dir.display());
    assert!(
        std::path::Path::new("/etc/hostname").exists()
            || std::path::Path::new("/etc/passwd").exists()
    );
}

#[tokio::test]
async fn hostpath_archives_on_delete_and_follows_path_patterns() {
    let f = Fixture::new("hostpath", HOSTPATH, "/volumes", "");
    let guest = f.guest(HOSTPATH);
    let params = [
        ("archiveOnDelete", "true"),
        ("pathPattern", "${pvc.namespace}-${pvc.name}"),
    ];
    let req = request(claim("data"), class(HOSTPATH, &params), &f.config(HOSTPATH));
    let built = guest.provision(&req).await.expect("provision");
    assert!(f.storage.path().join("ns-data").is_dir());
    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config: f.config(HOSTPATH),
    };
    guest.delete(&delete).await.expect("delete");
    assert!(!f.storage.path().join("ns-data").exists());
    assert!(
        f.storage.path().join("archived-ns-data").is_dir(),
        "archived, not deleted"
    );
}

#[tokio::test]
async fn hostpath_reports_bad_parameters_as_final_errors() {
    let f = Fixture::new("hostpath", HOSTPATH, "/volumes", "");
    let guest = f.guest(HOSTPATH);
    for params in [
        [("archiveOnDelete", "maybe")],
        [("pathPattern", "../${pvc.name}")],
    ] {
        let req = request(claim("c"), class(HOSTPATH, &params), &f.config(HOSTPATH));
        match guest.provision(&req).await {
            Err(CallError::Guest {
                error: ProvisionError::Final(m),
                ..
            }) => assert!(m.contains(params[0].0), "{m}"),
            other => panic!("expected a final error for {params:?}, got {other:?}"),
        }
    }
    assert_eq!(
        std::fs::read_dir(f.storage.path()).unwrap().count(),
        0,
        "nothing created"
    );
}

#[tokio::test]
async fn host_path_outside_the_granted_prefix_is_refused_when_built() {
    let f = Fixture::new("scripted", SCRIPTED, "/state", "");
    let guest = f.guest(SCRIPTED);
    let req = request(
        claim("c"),
        class(SCRIPTED, &[("hostPath", "/etc")]),
        &f.config(SCRIPTED),
    );
    match guest.provision(&req).await {
        Err(CallError::Guest {
            error: ProvisionError::Final(m),
            ..
        }) => {
            assert!(m.contains("outside the granted prefixes"), "{m}")
        }
        other => panic!("expected the builder to refuse /etc, got {other:?}"),
    }
}

#[tokio::test]
async fn escape_attempts_stay_inside_the_preopen() {
    let f = Fixture::new("escape", ESCAPE, "/state", "");
    let guest = f.guest(ESCAPE);
    let outside = f.storage.path().parent().unwrap().join("escaped.txt");
    for attempt in ["dotdot", "symlink"] {
        let req = request(
            claim(attempt),
            class(ESCAPE, &[("attempt", attempt)]),
            &f.config(ESCAPE),
        );
        match guest.provision(&req).await {
            Err(CallError::Guest {
                error: ProvisionError::Final(m),
                ..
            }) => {
                assert!(m.starts_with("contained"), "{attempt}: {m}")
            }
            other => panic!("{attempt}: expected containment, got {other:?}"),
        }
    }
    assert!(
        !outside.exists(),
        "nothing written next to the granted directory"
    );
    assert!(!std::path::Path::new("/escaped-abs.txt").exists());
    for attempt in ["host-path-outside", "source-not-granted"] {
        let req = request(
            claim(attempt),
            class(ESCAPE, &[("attempt", attempt)]),
            &f.config(ESCAPE),
        );
        match guest.provision(&req).await {
            Err(CallError::Guest {
                error: ProvisionError::Final(m),
                ..
            }) => {
                assert!(
                    m.contains("refused")
                        && (m.contains("not granted") || m.contains("outside the granted")),
                    "{attempt}: {m}"
                )
            }
            other => panic!("{attempt}: expected a refusal, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn typed_errors_and_faults_are_distinct() {
    let f = Fixture::new("scripted", SCRIPTED, "/state", "");
    let guest = f.guest(SCRIPTED);
    let cases = [
        ("final", "final"),
        ("transient", "transient"),
        ("reschedule", "reschedule"),
        ("in-background", "in-background"),
        ("ignored", "ignored"),
    ];
    for (i, (fail, want)) in cases.iter().enumerate() {
        let req = request(
            claim(&format!("c{i}")),
            class(SCRIPTED, &[("fail", fail)]),
            &f.config(SCRIPTED),
        );
        let error = guest.provision(&req).await.expect_err(fail);
        let got = match &error {
            CallError::Guest {
                error: ProvisionError::Final(_),
                ..
            } => "final",
            CallError::Guest {
                error: ProvisionError::Transient(_),
                ..
            } => "transient",
            CallError::Guest {
                error: ProvisionError::Reschedule(_),
                ..
            } => "reschedule",
            CallError::Guest {
                error: ProvisionError::InBackground(_),
                ..
            } => "in-background",
            CallError::Guest {
                error: ProvisionError::Ignored(_),
                ..
            } => "ignored",
            other => panic!("{fail}: {other:?}"),
        };
        assert_eq!(got, *want);
    }
    let req = request(
        claim("trap"),
        class(SCRIPTED, &[("fail", "trap")]),
        &f.config(SCRIPTED),
    );
    match guest.provision(&req).await {
        Err(CallError::Fault {
            kind: FaultKind::Panic,
            message,
            ..
        }) => assert!(message.contains("panicked"), "{message}"),
        other => panic!("expected a panic fault, got {other:?}"),
    }
    // The guest still serves after a trap: every call has a fresh instance.
    let ok = request(claim("after"), class(SCRIPTED, &[]), &f.config(SCRIPTED));
    guest
        .provision(&ok)
        .await
        .expect("a trap does not poison the guest");
}

#[tokio::test]
async fn a_runaway_guest_hits_its_deadline() {
    let f = Fixture::new("scripted", SCRIPTED, "/state", "");
    // The fixture's grant gives 5 s; an infinite loop must end there, not hang the test.
    let guest = f.guest(SCRIPTED);
    let req = request(
        claim("spin"),
        class(SCRIPTED, &[("spinForever", "true")]),
        &f.config(SCRIPTED),
    );
    let started = std::time::Instant::now();
    match guest.provision(&req).await {
        Err(CallError::Fault {
            kind: FaultKind::Deadline,
            ..
        }) => {}
        other => panic!("expected a deadline fault, got {other:?}"),
    }
    println!("runaway guest stopped after {:?}", started.elapsed());
}

#[tokio::test]
async fn hooks_default_when_absent_and_run_when_present() {
    let h = Fixture::new("hostpath", HOSTPATH, "/volumes", "");
    let hostpath = h.guest(HOSTPATH);
    assert_eq!(
        hostpath
            .contract()
            .hooks
            .iter()
            .map(|h| h.as_str())
            .collect::<Vec<_>>(),
        ["cloning", "expansion"]
    );
    assert!(
        !hostpath.supports_block().await.unwrap(),
        "no block hook: no block"
    );
    assert!(
        hostpath
            .should_provision(&claim("c"), &class(HOSTPATH, &[]))
            .await
            .unwrap()
    );

    let s = Fixture::new("scripted", SCRIPTED, "/state", "");
    let scripted = s.guest(SCRIPTED);
    assert_eq!(scripted.contract().hooks.len(), 6);
    assert!(scripted.supports_block().await.unwrap());
    let mut skipped = claim("c");
    skipped
        .annotations
        .push(pair("scripted.wasm-provisioner.dev/skip", "true"));
    assert!(
        !scripted
            .should_provision(&skipped, &class(SCRIPTED, &[]))
            .await
            .unwrap()
    );
    assert!(
        scripted
            .should_provision(&claim("d"), &class(SCRIPTED, &[]))
            .await
            .unwrap()
    );
}

/// What each guest serves beyond a plain claim: declared by the `capabilities` hook, read from
/// `block-support` for a guest built before it (it still loads), nothing without either.
#[tokio::test]
async fn capabilities_come_from_the_hook_or_the_old_block_hook() {
    use wasm_provisioner::wasm::capabilities::{Capabilities, Capability};
    let h = Fixture::new("hostpath", HOSTPATH, "/volumes", "");
    assert_eq!(
        h.guest(HOSTPATH).capabilities().await.unwrap(),
        Capabilities::NONE.with(Capability::Clone),
        "hostpath clones (its cloning hook), and declares no block, no selector"
    );
    let s = Fixture::new("scripted", SCRIPTED, "/state", "");
    let scripted = s.guest(SCRIPTED).capabilities().await.unwrap();
    assert!(scripted.has(Capability::Block) && scripted.has(Capability::Selector));
    const LEGACY: &str = "test.wasm-provisioner.dev/legacy-block";
    let l = Fixture::new("legacy_block", LEGACY, "/state", "");
    let legacy = l.guest(LEGACY);
    assert_eq!(
        legacy
            .contract()
            .hooks
            .iter()
            .map(|h| h.as_str())
            .collect::<Vec<_>>(),
        ["block-support"]
    );
    assert_eq!(
        legacy.capabilities().await.unwrap(),
        Capabilities::NONE.with(Capability::Block),
        "a guest built before the capabilities hook keeps its block claims, and no more"
    );
}

#[tokio::test]
async fn bad_files_are_reported_and_the_others_still_load() {
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "good",
        "hostpath",
        &dir_grant(HOSTPATH, storage.path(), "/volumes", ""),
    );
    std::fs::write(
        plugins.path().join("garbage.wasm"),
        b"\0asm this is not a component",
    )
    .unwrap();
    std::fs::write(
        plugins.path().join("garbage.toml"),
        "provisioner = \"x/garbage\"",
    )
    .unwrap();
    std::fs::copy(guest_wasm("hostpath"), plugins.path().join("nogrant.wasm")).unwrap();
    plugins.add("old", "contract_v2", "provisioner = \"x/v2\"");
    plugins.add(
        "badgrant",
        "hostpath",
        "provisioner = \"x/y\"\nnetwork = true",
    );
    plugins.add("twin-a", "scripted", "provisioner = \"x/twin\"");
    plugins.add("twin-b", "scripted", "provisioner = \"x/twin\"");

    let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
    assert!(loaded.serves(HOSTPATH), "the good guest serves");
    assert_eq!(loaded.len(), 1, "only the good guest serves");
    let problem = |file: &str| {
        loaded
            .problems
            .iter()
            .find(|p| p.file.file_name().unwrap() == file)
            .unwrap_or_else(|| panic!("no problem reported for {file}: {:?}", loaded.problems))
            .reason
            .clone()
    };
    assert!(
        problem("garbage.wasm").contains("does not compile"),
        "{}",
        problem("garbage.wasm")
    );
    assert!(problem("nogrant.wasm").contains("no grant file"));
    let old = problem("old.wasm");
    assert!(
        old.contains("@0.2.0") && old.contains("@0.1.3") && old.contains("rebuild"),
        "{old}"
    );
    assert!(problem("badgrant.toml").contains("network"));
    let twin = problem("twin-a.wasm");
    assert!(
        twin.contains("twin-a.wasm") && twin.contains("twin-b.wasm"),
        "{twin}"
    );
    assert!(problem("twin-b.wasm").contains("claimed by more than one guest"));
}
