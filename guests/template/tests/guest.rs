//! The guest's own tests, natively on the SDK's fake host: no WebAssembly involved.

use std::path::PathBuf;

use {{crate_name}}::{Guest, NEEDS, RECORDED, VOLUMES};

use wasm_provisioner_sdk::testing::{self, FakeHost};
use wasm_provisioner_sdk::{ProvisionError, Provisioner};

/// A temporary directory standing for the granted directory, seen by guest and node alike.
struct Granted(PathBuf);

impl Granted {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// The grant's `[config]`, as JSON: the node sees the directory where the test does.
    fn config(&self) -> String {
        testing::config(&[("node-dir", &self.0.display().to_string())])
    }

    /// A host granting hostPath volumes in this directory only, which the guest sees as its
    /// declared directory.
    fn host(&self) -> FakeHost {
        let dir = self.0.display().to_string();
        FakeHost::new().dir(VOLUMES, &dir).host_paths(&dir)
    }
}

impl Drop for Granted {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn provisions_a_directory_per_claim_and_deletes_it() {
    let granted = Granted::new("guest-provisions");
    let host = granted.host();
    let class = testing::class("fast", &[]);
    let request = testing::request(testing::claim("team-a", "data"), class, &granted.config());

    let spec = Guest::provision(&request, &host).unwrap();
    let dir = granted.0.join(&request.pv_name);
    assert!(dir.is_dir());
    assert_eq!(
        spec.annotations[&format!("{RECORDED}/dir")],
        request.pv_name
    );
    assert_eq!(
        Guest::provision(&request, &host).unwrap(),
        spec,
        "idempotent"
    );

    let delete = testing::delete_request(testing::volume(&request, &spec), &granted.config());
    Guest::delete(&delete, &host).unwrap();
    assert!(!dir.exists());
    Guest::delete(&delete, &host).unwrap(); // already gone: success
}

#[test]
fn a_spec_the_grants_refuse_creates_nothing() {
    let granted = Granted::new("guest-refused");
    let class = testing::class("fast", &[]);
    let request = testing::request(testing::claim("ns", "data"), class, &granted.config());
    let refusing = FakeHost::new()
        .dir(VOLUMES, &granted.0.display().to_string())
        .host_paths("/elsewhere");
    let error = Guest::provision(&request, &refusing).unwrap_err();
    assert!(matches!(error, ProvisionError::Final(_)), "{error:?}");
    assert_eq!(std::fs::read_dir(&granted.0).unwrap().count(), 0);
}

#[test]
fn typos_in_the_config_are_reported() {
    let class = testing::class("fast", &[]);
    let config = r#"{"node-dir": "/v", "nod-dir": "/v"}"#;
    let request = testing::request(testing::claim("ns", "c"), class, config);
    let error = Guest::provision(&request, &FakeHost::new()).unwrap_err();
    assert!(matches!(&error, ProvisionError::Final(m) if m.contains("unknown field `nod-dir`")));
}

#[test]
fn the_grant_file_grants_what_the_guest_declares() {
    testing::assert_grant_matches(&NEEDS, include_str!("../{{project-name}}.toml"));
}
