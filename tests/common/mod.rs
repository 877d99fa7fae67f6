//! Shared test fixtures: real guest `.wasm` files built from `guests/`, plugins directories,
//! and contract records that read like the spec; `e2e` and `suite` are the end-to-end fixture
//! and runner every `tests/e2e*.rs` uses.
#![allow(
    dead_code,
    reason = "each test binary includes these fixtures and uses only some of them"
)]

pub mod btrfs;
pub mod e2e;
pub mod locks;
pub mod suite;
pub mod world;

use std::path::{Path, PathBuf};
use std::sync::Once;

use wasm_provisioner::wasm::bindings::types::*;

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Path of a guest built from `guests/` (crate name with underscores); builds them once per run.
pub fn guest_wasm(name: &str) -> PathBuf {
    static BUILD: Once = Once::new();
    BUILD.call_once(|| {
        let status = std::process::Command::new(env!("CARGO"))
            .args([
                "build",
                "--quiet",
                "--release",
                "--target",
                "wasm32-wasip2",
                "--manifest-path",
            ])
            .arg(repo().join("guests/Cargo.toml"))
            // Where this function looks for them, whatever CARGO_TARGET_DIR says (a benchmark
            // built with another target directory found no guests, or stale ones).
            .arg("--target-dir")
            .arg(repo().join("guests/target"))
            .status()
            .expect("run cargo to build the guests");
        assert!(
            status.success(),
            "building guests/ for wasm32-wasip2 failed"
        );
    });
    let path = repo()
        .join("guests/target/wasm32-wasip2/release")
        .join(format!("{name}.wasm"));
    assert!(
        path.exists(),
        "guest {name} was not built at {}",
        path.display()
    );
    path
}

/// A temporary plugins directory.
pub struct PluginsDir {
    pub dir: tempfile::TempDir,
}

impl PluginsDir {
    pub fn new() -> PluginsDir {
        PluginsDir {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Copies guest `crate_name` in as `NAME.wasm` with grant file `NAME.toml`.
    pub fn add(&self, name: &str, crate_name: &str, grant: &str) -> &Self {
        std::fs::copy(
            guest_wasm(crate_name),
            self.path().join(format!("{name}.wasm")),
        )
        .expect("copy guest");
        std::fs::write(self.path().join(format!("{name}.toml")), grant).expect("write grant");
        self
    }
}

/// A plugins directory with guest `crate_name`, serving `provisioner`, granted `storage` as
/// `guest_dir` ([`dir_grant`]).
pub fn dir_guest(
    crate_name: &str,
    provisioner: &str,
    storage: &Path,
    guest_dir: &str,
) -> PluginsDir {
    let plugins = PluginsDir::new();
    plugins.add(
        crate_name,
        crate_name,
        &dir_grant(provisioner, storage, guest_dir, ""),
    );
    plugins
}

/// A grant file for a guest with one read-write directory `storage` seen as `guest_dir`,
/// hostPath volumes under `storage`, and config telling the guest both paths.
pub fn dir_grant(provisioner: &str, storage: &Path, guest_dir: &str, extra_limits: &str) -> String {
    let s = storage.display();
    format!(
        r#"provisioner = "{provisioner}"
[limits]
call-timeout-ms = 5000
{extra_limits}
[[dirs]]
host = "{s}"
guest = "{guest_dir}"
access = "read-write"
[volumes]
kinds = ["host-path"]
path-prefixes = ["{s}"]
[config]
guest-dir = "{guest_dir}"
node-dir = "{s}"
"#
    )
}

pub fn pair(k: &str, v: &str) -> Pair {
    Pair {
        key: k.into(),
        value: v.into(),
    }
}

/// A claim record: `claim("c1")` in namespace `ns`, 1 GiB, RWO.
pub fn claim(name: &str) -> Claim {
    Claim {
        namespace: "ns".into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        labels: vec![],
        annotations: vec![],
        requested_bytes: 1 << 30,
        limit_bytes: None,
        access_modes: vec![AccessMode::ReadWriteOnce],
        volume_mode: VolumeMode::Filesystem,
        has_selector: false,
        has_data_source: false,
    }
}

/// A class record with parameters.
pub fn class(provisioner: &str, params: &[(&str, &str)]) -> StorageClass {
    StorageClass {
        name: "test".into(),
        provisioner: provisioner.into(),
        parameters: params.iter().map(|(k, v)| pair(k, v)).collect(),
        reclaim_policy: ReclaimPolicy::Delete,
        mount_options: vec![],
        binding_mode: BindingMode::Immediate,
        allowed_topologies: vec![],
    }
}

/// A provision request for `claim` with `class`, PV named `pvc-<uid>`.
pub fn request(claim: Claim, class: StorageClass, config: &str) -> ProvisionRequest {
    ProvisionRequest {
        pv_name: format!("pvc-{}", claim.uid),
        claim,
        storage_class: class,
        selected_node: None,
        config: config.into(),
    }
}

/// The PV the controller would create, as the contract record `delete` gets.
pub fn as_volume(
    req: &ProvisionRequest,
    built: &wasm_provisioner::wasm::spec::BuiltVolume,
) -> Volume {
    let pvc = k8s_openapi::api::core::v1::PersistentVolumeClaim {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(req.claim.name.clone()),
            namespace: Some(req.claim.namespace.clone()),
            uid: Some(req.claim.uid.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    let class = k8s_openapi::api::storage::v1::StorageClass {
        provisioner: req.storage_class.provisioner.clone(),
        ..Default::default()
    };
    let pv = wasm_provisioner::controller::convert::persistent_volume(
        &wasm_provisioner::controller::convert::PvIdentity {
            name: &req.pv_name,
            claim: &pvc,
            class: &class,
            class_name: "test",
            held: false,
        },
        built,
    );
    wasm_provisioner::controller::convert::volume(&pv).unwrap()
}

/// The grant file shipped with guest `dir` (`guests/<dir>/<dir>.toml`), with each `(from, to)`
/// replaced: the operator's edit of host paths, done by a test.
pub fn shipped_grant(dir: &str, replacements: &[(&str, &str)]) -> String {
    let path = repo().join(format!("guests/{dir}/{dir}.toml"));
    let mut text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    for (from, to) in replacements {
        assert!(text.contains(from), "{} has no {from:?}", path.display());
        text = text.replace(from, to);
    }
    text
}

/// A small component whose functions are huge: `functions` bodies of `ops` additions over
/// `locals` locals that all stay live to the end (register pressure for the compiler), as the
/// binary a `.wasm` file holds.
pub fn compile_bomb(functions: usize, locals: usize, ops: usize) -> Vec<u8> {
    use std::fmt::Write as _;
    let mut wat = String::from("(component (core module\n");
    for f in 0..functions {
        write!(
            wat,
            "(func (export \"f{f}\") (param i32) (result i32) (local"
        )
        .unwrap();
        for _ in 0..locals {
            wat.push_str(" i32");
        }
        wat.push_str(")\n");
        let mut x: usize = f * 7919 + 1;
        for _ in 0..ops {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let (a, b, c) = (x % locals, (x >> 20) % locals, (x >> 40) % locals);
            writeln!(wat, "local.get {a} local.get {b} i32.add local.set {c}").unwrap();
        }
        wat.push_str("local.get 0");
        for l in 1..locals {
            write!(wat, " local.get {l} i32.add").unwrap();
        }
        wat.push_str(")\n");
    }
    wat.push_str("))\n");
    wat::parse_str(&wat).expect("the bomb's text parses")
}
