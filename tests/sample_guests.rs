//! The sample guests (local-path, nfs-subdir) loaded in-process through the host with their
//! shipped grant files (only the host directories moved to a temporary directory).

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use wasm_provisioner::wasm::bindings::types::{
    AccessMode, DeleteRequest, NodeSelectorOperator, ProvisionError, ProvisionRequest, VolumeSource,
};
use wasm_provisioner::wasm::spec::BuiltVolume;
use wasm_provisioner::wasm::{CallError, Guest, Plugins, WasmEngine, load_dir};

const LOCAL_PATH: &str = "wasm-provisioner.dev/local-path";
const NFS_SUBDIR: &str = "wasm-provisioner.dev/nfs-subdir";

struct Loaded {
    _plugins: PluginsDir,
    storage: tempfile::TempDir,
    plugins: Plugins,
    provisioner: &'static str,
}

impl Loaded {
    /// Loads guest `dir` with its shipped grant file; `host_dir` (the grant's `dirs.host`)
    /// becomes a fresh temporary directory; `more` are further edits of the grant file.
    fn new(dir: &str, provisioner: &'static str, host_dir: &str, more: &[(&str, &str)]) -> Loaded {
        let storage = tempfile::tempdir().unwrap();
        let storage_path = storage.path().display().to_string();
        let mut edits = vec![(host_dir, storage_path.as_str())];
        edits.extend_from_slice(more);
        let plugins = PluginsDir::new();
        plugins.add(dir, &dir.replace('-', "_"), &shipped_grant(dir, &edits));
        let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
        assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
        Loaded {
            _plugins: plugins,
            storage,
            plugins: loaded,
            provisioner,
        }
    }

    fn guest(&self) -> Arc<Guest> {
        self.plugins
            .for_provisioner(self.provisioner)
            .unwrap()
            .clone()
    }

    fn request(&self, params: &[(&str, &str)], node: Option<&str>) -> ProvisionRequest {
        let guest = self.guest();
        let mut req = request(
            claim("data"),
            class(self.provisioner, params),
            &guest.grants().config_json,
        );
        req.selected_node = node.map(str::to_owned);
        req
    }

    async fn provision(&self, req: &ProvisionRequest) -> BuiltVolume {
        self.guest().provision(req).await.expect("provision")
    }

    /// Deletes the volume built for `req` the way the controller would: from the PV alone.
    async fn delete(&self, req: &ProvisionRequest, built: &BuiltVolume) {
        let delete = DeleteRequest {
            volume: as_volume(req, built),
            storage_class: None,
            config: self.guest().grants().config_json.clone(),
        };
        self.guest().delete(&delete).await.expect("delete");
    }

    fn path(&self, relative: &str) -> std::path::PathBuf {
        self.storage.path().join(relative)
    }
}

fn final_message(result: Result<BuiltVolume, CallError>) -> String {
    match result {
        Err(CallError::Guest {
            error: ProvisionError::Final(message),
            ..
        }) => message,
        other => panic!("expected a final error, got {other:?}"),
    }
}

fn local_path() -> Loaded {
    Loaded::new(
        "local-path",
        LOCAL_PATH,
        "/var/lib/wasm-provisioner/local-path/nodes",
        &[],
    )
}

#[tokio::test]
async fn local_path_creates_the_directory_on_the_selected_node_and_pins_the_pv() {
    let lp = local_path();
    let req = lp.request(&[], Some("node-a"));
    let built = lp.provision(&req).await;
    let dir = format!("pvc-{}_ns_data", req.claim.uid);
    let node_path = format!("/opt/local-path-provisioner/{dir}");
    match &built.source {
        VolumeSource::HostPath(h) => assert_eq!(h.path, node_path),
        other => panic!("expected hostPath, got {other:?}"),
    }
    let term = &built.node_affinity[0].requirements[0];
    assert_eq!(term.key, "kubernetes.io/hostname");
    assert!(matches!(term.operator, NodeSelectorOperator::In));
    assert_eq!(term.values, vec!["node-a".to_string()]);
    let on_node = lp.path(&format!("node-a{node_path}"));
    assert!(on_node.is_dir(), "{} created", on_node.display());
    assert_eq!(lp.provision(&req).await, built, "idempotent");

    lp.delete(&req, &built).await;
    assert!(!on_node.exists(), "delete removed the directory");
    assert!(lp.path("node-a").is_dir(), "the node's directory stays");
}

/// local-path clones in the sandbox: the copy lands on the source's node, pinned there; a clone
/// the scheduler placed on another node is refused and creates nothing.
#[tokio::test]
async fn local_path_clones_on_the_source_node_only() {
    use wasm_provisioner::wasm::bindings::cloning::CloneSource;
    let lp = local_path();
    let source_req = lp.request(&[], Some("node-a"));
    let source_built = lp.provision(&source_req).await;
    let source_dir = lp.path(&format!(
        "node-a/opt/local-path-provisioner/pvc-{}_ns_data",
        source_req.claim.uid
    ));
    std::fs::write(source_dir.join("rows"), "42").unwrap();
    let source = CloneSource {
        namespace: "ns".into(),
        name: "data".into(),
        uid: source_req.claim.uid.clone(),
        volume: as_volume(&source_req, &source_built),
    };
    let guest = lp.guest();
    let mut copy_req = request(
        claim("copy"),
        class(LOCAL_PATH, &[]),
        &guest.grants().config_json,
    );
    copy_req.selected_node = Some("node-a".into());
    let built = guest
        .provision_clone(&copy_req, &source)
        .await
        .expect("clone");
    let VolumeSource::HostPath(copy) = &built.source else {
        panic!("{:?}", built.source)
    };
    assert_eq!(
        std::fs::read_to_string(lp.path(&format!("node-a{}/rows", copy.path))).unwrap(),
        "42"
    );
    assert_eq!(
        built.node_affinity[0].requirements[0].values,
        vec!["node-a".to_string()]
    );

    let mut elsewhere = request(
        claim("elsewhere"),
        class(LOCAL_PATH, &[]),
        &guest.grants().config_json,
    );
    elsewhere.selected_node = Some("node-b".into());
    let message = final_message(guest.provision_clone(&elsewhere, &source).await);
    assert!(
        message.contains("node-a") && message.contains("node-b"),
        "{message}"
    );
    assert!(!lp.path("node-b").exists(), "nothing created on node-b");
}

#[tokio::test]
async fn local_path_local_volumes_refusals_and_ungranted_node_paths() {
    let lp = local_path();
    let req = lp.request(&[("volumeType", "local")], Some("node-b"));
    let built = lp.provision(&req).await;
    assert!(
        matches!(&built.source, VolumeSource::Local(l) if l.path.starts_with("/opt/local-path-provisioner/"))
    );

    let no_node = final_message(lp.guest().provision(&lp.request(&[], None)).await);
    assert!(no_node.contains("WaitForFirstConsumer"), "{no_node}");
    let mut rwx = lp.request(&[], Some("node-a"));
    rwx.claim.access_modes = vec![AccessMode::ReadWriteMany];
    let message = final_message(lp.guest().provision(&rwx).await);
    assert!(message.contains("ReadWriteOnce"), "{message}");
    // A node path the operator did not grant as a PV prefix is refused by the host's builder
    // before the guest creates anything.
    let narrow = Loaded::new(
        "local-path",
        LOCAL_PATH,
        "/var/lib/wasm-provisioner/local-path/nodes",
        &[(
            r#"path-prefixes = ["/opt/local-path-provisioner"]"#,
            r#"path-prefixes = ["/srv"]"#,
        )],
    );
    let message = final_message(
        narrow
            .guest()
            .provision(&narrow.request(&[], Some("node-a")))
            .await,
    );
    assert!(
        message.contains("outside the granted prefixes"),
        "{message}"
    );
    assert_eq!(std::fs::read_dir(narrow.storage.path()).unwrap().count(), 0);
}

#[tokio::test]
async fn local_path_per_node_hooks_serve_only_the_local_node() {
    let lp = Loaded::new(
        "local-path",
        LOCAL_PATH,
        "/var/lib/wasm-provisioner/local-path/nodes",
        &[(r#"# local-node = "node-1""#, r#"local-node = "node-a""#)],
    );
    let guest = lp.guest();
    assert_eq!(
        guest.contract().hooks.len(),
        4,
        "qualifier, deletion-guard, cloning and expansion"
    );
    let mut mine = claim("mine");
    mine.annotations
        .push(pair("volume.kubernetes.io/selected-node", "node-a"));
    let mut theirs = claim("theirs");
    theirs
        .annotations
        .push(pair("volume.kubernetes.io/selected-node", "node-b"));
    let class = class(LOCAL_PATH, &[]);
    assert!(guest.should_provision(&mine, &class).await.unwrap());
    assert!(!guest.should_provision(&theirs, &class).await.unwrap());

    let req = lp.request(&[], Some("node-a"));
    let built = lp.provision(&req).await;
    assert!(guest.should_delete(&as_volume(&req, &built)).await.unwrap());
    let other = lp.request(&[], Some("node-b"));
    let other_built = lp.provision(&other).await;
    assert!(
        !guest
            .should_delete(&as_volume(&other, &other_built))
            .await
            .unwrap()
    );
}

fn nfs_subdir(more: &[(&str, &str)]) -> Loaded {
    Loaded::new("nfs-subdir", NFS_SUBDIR, "/persistentvolumes", more)
}

#[tokio::test]
async fn nfs_subdir_builds_an_nfs_pv_and_archives_by_default() {
    let nfs = nfs_subdir(&[]);
    let mut req = nfs.request(&[], None);
    req.storage_class.mount_options = vec!["nfsvers=4.1".into()];
    let built = nfs.provision(&req).await;
    let dir = format!("ns-data-pvc-{}", req.claim.uid);
    match &built.source {
        VolumeSource::Nfs(n) => {
            assert_eq!(n.server, "nfs.example.com");
            assert_eq!(n.path, format!("/srv/nfs/k8s/{dir}"));
        }
        other => panic!("expected nfs, got {other:?}"),
    }
    assert_eq!(built.mount_options, Some(vec!["nfsvers=4.1".to_string()]));
    assert!(nfs.path(&dir).is_dir());
    nfs.delete(&req, &built).await;
    assert!(!nfs.path(&dir).exists());
    assert!(
        nfs.path(&format!("archived-{dir}")).is_dir(),
        "archived (the default)"
    );
}

/// nfs-subdir clones in the sandbox, within its export.
#[tokio::test]
async fn nfs_subdir_clones_within_its_export() {
    use wasm_provisioner::wasm::bindings::cloning::CloneSource;
    let nfs = nfs_subdir(&[]);
    let source_req = nfs.request(&[], None);
    let source_built = nfs.provision(&source_req).await;
    std::fs::write(
        nfs.path(&format!("ns-data-pvc-{}/rows", source_req.claim.uid)),
        "42",
    )
    .unwrap();
    let source = CloneSource {
        namespace: "ns".into(),
        name: "data".into(),
        uid: source_req.claim.uid.clone(),
        volume: as_volume(&source_req, &source_built),
    };
    let guest = nfs.guest();
    let copy_req = request(
        claim("copy"),
        class(NFS_SUBDIR, &[]),
        &guest.grants().config_json,
    );
    let built = guest
        .provision_clone(&copy_req, &source)
        .await
        .expect("clone");
    assert!(
        matches!(&built.source, VolumeSource::Nfs(n) if n.path.ends_with(&format!("ns-copy-pvc-{}", copy_req.claim.uid)))
    );
    assert_eq!(
        std::fs::read_to_string(nfs.path(&format!("ns-copy-pvc-{}/rows", copy_req.claim.uid)))
            .unwrap(),
        "42"
    );
}

#[tokio::test]
async fn nfs_subdir_sub_folder_patterns_retain_and_delete_without_a_class() {
    let nfs = nfs_subdir(&[]);
    let req = nfs.request(&[("pathPattern", "${.PVC.namespace}/${.PVC.name}")], None);
    let built = nfs.provision(&req).await;
    std::fs::write(nfs.path("ns/data/file"), b"data").unwrap();
    nfs.delete(&req, &built).await;
    assert!(
        Path::new(&nfs.path("archived-ns-data/file")).is_file(),
        "sub-folder archived with its data"
    );
    assert!(!nfs.path("ns").exists(), "empty parent pruned");

    let retain = nfs.request(
        &[("onDelete", "retain"), ("archiveOnDelete", "false")],
        None,
    );
    let built = nfs.provision(&retain).await;
    nfs.delete(&retain, &built).await;
    assert!(
        nfs.path(&format!("ns-data-pvc-{}", retain.claim.uid))
            .is_dir(),
        "retained"
    );

    let mut delete = nfs.request(&[("onDelete", "delete")], None);
    delete.claim = claim("other");
    delete.pv_name = format!("pvc-{}", delete.claim.uid);
    let built = nfs.provision(&delete).await;
    nfs.delete(&delete, &built).await;
    let left: Vec<_> = std::fs::read_dir(nfs.storage.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left.len(),
        2,
        "only the archive and the retained directory remain: {left:?}"
    );
}

#[tokio::test]
async fn nfs_subdir_refuses_servers_the_operator_did_not_grant() {
    let nfs = nfs_subdir(&[(
        r#"nfs-servers = ["nfs.example.com"]"#,
        r#"nfs-servers = ["other.example.com"]"#,
    )]);
    let message = final_message(nfs.guest().provision(&nfs.request(&[], None)).await);
    assert!(message.contains("not granted"), "{message}");
    assert_eq!(
        std::fs::read_dir(nfs.storage.path()).unwrap().count(),
        0,
        "nothing created"
    );
}

/// `deploy/examples`' classes with the shipped grant files, through the offline command a user
/// runs: what the README and `deploy/` show is what the guests do.
#[test]
fn the_deploy_examples_provision_with_the_shipped_grants() {
    let storage = tempfile::tempdir().unwrap();
    let s = storage.path().display().to_string();
    let plugins = PluginsDir::new();
    plugins.add(
        "local-path",
        "local_path",
        &shipped_grant(
            "local-path",
            &[("/var/lib/wasm-provisioner/local-path/nodes", &s)],
        ),
    );
    plugins.add(
        "nfs-subdir",
        "nfs_subdir",
        &shipped_grant("nfs-subdir", &[("/persistentvolumes", &s)]),
    );
    let examples = repo().join("deploy/examples");
    let run = |class: &str, node: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
            .arg("provision")
            .arg("--plugins")
            .arg(plugins.path())
            .arg("--class")
            .arg(examples.join(class))
            .arg("--claim")
            .arg(examples.join("claim.yaml"))
            .args(node)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{class}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    let pv = run("local-path-storageclass.yaml", &["--node", "node-1"]);
    for want in [
        "local-path.wasm-provisioner.dev/node: node-1",
        "path: /opt/local-path-provisioner/pvc-",
        "- node-1",
    ] {
        assert!(pv.contains(want), "missing {want:?} in:\n{pv}");
    }
    let pv = run("nfs-subdir-storageclass.yaml", &[]);
    for want in [
        "server: nfs.example.com",
        "path: /srv/nfs/k8s/default-data-pvc-",
        "- nfsvers=4.1",
        "on-delete: archive",
    ] {
        assert!(pv.contains(want), "missing {want:?} in:\n{pv}");
    }
}

const HOSTPATH: &str = "wasm-provisioner.dev/hostpath";

/// The refusal of a delete whose storage lies outside the guest's current grants.
fn refused_message(result: Result<(), CallError>) -> String {
    match result {
        Err(error @ CallError::Refused { .. }) => error.to_string(),
        other => panic!("expected the host to refuse the delete, got {other:?}"),
    }
}

/// Issue 32: a grant whose directory was moved (or whose export changed) while volumes lay
/// there. Before, the guest looked in the new directory, found nothing and answered "already
/// gone": the PV would be deleted and the data kept, silently. Now the host refuses the delete
/// before calling the guest, naming where the storage is, and nothing is touched.
#[tokio::test]
async fn a_delete_of_storage_outside_the_current_grants_is_refused_and_nothing_touched() {
    let hostpath_dir = "/var/lib/wasm-provisioner/hostpath";
    let before = Loaded::new("hostpath", HOSTPATH, hostpath_dir, &[]);
    let req = before.request(&[], None);
    let built = before.provision(&req).await;
    let data = before.path(&format!("{}/data", req.pv_name));
    std::fs::write(&data, b"keep me").unwrap();
    // The operator points the grant at another directory; the volume stays where it was.
    let moved = Loaded::new("hostpath", HOSTPATH, hostpath_dir, &[]);
    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config: moved.guest().grants().config_json.clone(),
    };
    let message = refused_message(moved.guest().delete(&delete).await);
    let old_path = before.path(&req.pv_name).display().to_string();
    for words in [
        "the host refused to call guest hostpath",
        old_path.as_str(),
        "outside the guest's current grants",
        "moved or its [[dirs]] entry dropped",
        "release-finalizers",
    ] {
        assert!(message.contains(words), "{words:?} in {message}");
    }
    assert_eq!(std::fs::read(&data).unwrap(), b"keep me", "nothing deleted");
    // The grant as it was still deletes it.
    before.delete(&req, &built).await;
    assert!(!data.exists());

    // An NFS export the grant no longer covers.
    let nfs = nfs_subdir(&[]);
    let req = nfs.request(&[], None);
    let built = nfs.provision(&req).await;
    let dir = nfs.path(&format!("ns-data-pvc-{}", req.claim.uid));
    let moved = nfs_subdir(&[("/srv/nfs/k8s", "/srv/nfs/elsewhere")]);
    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config: moved.guest().grants().config_json.clone(),
    };
    let message = refused_message(moved.guest().delete(&delete).await);
    assert!(
        message.contains("NFS export nfs.example.com:/srv/nfs/k8s/ns-data-pvc-"),
        "{message}"
    );
    assert!(dir.is_dir(), "the NFS directory stays");

    // The path is shown escaped: a PV's text cannot forge an event.
    let mut volume = as_volume(&req, &built);
    volume.source =
        VolumeSource::HostPath(wasm_provisioner::wasm::bindings::types::HostPathSource {
            path: "/elsewhere/\u{202e}gpj.exe\nforged".into(),
            kind: wasm_provisioner::wasm::bindings::types::HostPathType::Directory,
        });
    let delete = DeleteRequest {
        volume,
        storage_class: None,
        config: nfs.guest().grants().config_json.clone(),
    };
    let message = refused_message(nfs.guest().delete(&delete).await);
    assert!(
        !message.contains('\u{202e}') && !message.contains('\n'),
        "{message:?}"
    );
}

/// Issue 31, the leftover: a file name that is not UTF-8, which a pod can create, failed the
/// host's listing (`illegal-byte-sequence`) and the volume could never be deleted. The listing
/// now hands the guest a stand-in the host maps back; the SDK's delete removes such files and
/// directories, deeper than the walk's stack too (moved up by `rename-at`), and nothing else.
#[tokio::test]
async fn a_volume_holding_names_that_are_not_utf8_is_deleted() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let hp = Loaded::new(
        "hostpath",
        HOSTPATH,
        "/var/lib/wasm-provisioner/hostpath",
        &[],
    );
    let req = hp.request(&[], None);
    let built = hp.provision(&req).await;
    let volume = hp.path(&req.pv_name);
    let raw = |bytes: &[u8]| OsStr::from_bytes(bytes).to_owned();
    std::fs::write(volume.join(raw(b"latin1-caf\xe9")), b"x").unwrap();
    std::fs::write(volume.join(raw(b"\\x41\xff")), b"x").unwrap();
    let mut deep = volume.join(raw(b"dir-\xfe"));
    for level in 0..20u8 {
        deep = deep.join(raw(&[b'd', 0x80 + level]));
    }
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(deep.join(raw(b"bottom-\xff")), b"x").unwrap();
    // Beside the volume, with the very name a stand-in decodes to: never touched.
    let neighbour = hp.path(&format!("{}-neighbour", req.pv_name));
    std::fs::create_dir(&neighbour).unwrap();
    std::fs::write(neighbour.join(raw(b"latin1-caf\xe9")), b"keep").unwrap();

    hp.delete(&req, &built).await;
    assert!(!volume.exists(), "the volume is gone");
    assert_eq!(
        std::fs::read(neighbour.join(raw(b"latin1-caf\xe9"))).unwrap(),
        b"keep"
    );
}

/// Issue 32, the guest's side: where the host's check passes but the guest cannot see the
/// storage, the guest says so instead of "already gone". local-path: the node's directory is
/// not mounted here (before: "deleting the volume without cleanup", Ok). hostpath: its grant
/// now shows the directory under another guest path than its config's `guest-dir` (before: the
/// path was in no preopen, found "not there", Ok). Both keep the data.
#[tokio::test]
async fn a_guest_that_cannot_see_where_the_storage_is_fails_the_delete() {
    let lp = local_path();
    let req = lp.request(&[], Some("node-a"));
    let built = lp.provision(&req).await;
    let node = lp.path("node-a");
    let unmounted = lp.path("node-a.unmounted");
    std::fs::rename(&node, &unmounted).unwrap();
    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config: lp.guest().grants().config_json.clone(),
    };
    let message = match lp.guest().delete(&delete).await {
        Err(CallError::Guest {
            error: ProvisionError::Final(message),
            ..
        }) => message,
        other => panic!("expected a final error, got {other:?}"),
    };
    assert!(message.contains("not taken for gone"), "{message}");
    assert!(std::fs::read_dir(&unmounted).unwrap().count() > 0);
    std::fs::rename(&unmounted, &node).unwrap();
    lp.delete(&req, &built).await;

    let hostpath_dir = "/var/lib/wasm-provisioner/hostpath";
    let hp = Loaded::new("hostpath", HOSTPATH, hostpath_dir, &[]);
    let req = hp.request(&[], None);
    let built = hp.provision(&req).await;
    // The same directory, granted under another guest path than the config's guest-dir.
    let storage = hp.storage.path().display().to_string();
    let plugins = PluginsDir::new();
    plugins.add(
        "hostpath",
        "hostpath",
        &shipped_grant(
            "hostpath",
            &[
                (hostpath_dir, &storage),
                ("guest = \"/volumes\"", "guest = \"/elsewhere\""),
            ],
        ),
    );
    let moved = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
    let guest = moved.for_provisioner(HOSTPATH).unwrap().clone();
    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config: guest.grants().config_json.clone(),
    };
    let message = match guest.delete(&delete).await {
        Err(CallError::Guest {
            error: ProvisionError::Final(message),
            ..
        }) => message,
        other => panic!("expected a final error, got {other:?}"),
    };
    assert!(
        message.contains("/volumes") && message.contains("not taken for gone"),
        "{message}"
    );
    assert!(hp.path(&req.pv_name).is_dir(), "the volume stays");
}
