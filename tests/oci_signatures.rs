//! Signed guests through a real registry: a key pair and a signature made by openssl, stored
//! the way `cosign sign --key` stores them (a `sha256-<manifest>.sig` tag whose simple signing
//! payload layer carries the signature annotation), verified by `pull` against the key the
//! grant pins, kept beside the module, carried by `save`/`load`, and checked again by the host
//! at load. (cosign itself is not packaged for this machine; its on-registry format is.)

mod common;
#[allow(
    dead_code,
    reason = "the registry tests' helpers; this file uses the registry and files ones"
)]
mod oci_support;

use std::path::Path;
use std::process::Command;

use base64::Engine as _;
use oci_support::*;
use wasm_provisioner::config::RegistryArgs;
use wasm_provisioner::oci::{Digest, Reference, cosign};

fn openssl(args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A P-256 key pair as cosign makes one: (private key file, cosign.pub text).
fn key_pair(dir: &Path, name: &str) -> (std::path::PathBuf, String) {
    let private = dir.join(format!("{name}.key"));
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        private.to_str().unwrap(),
    ]);
    let public = openssl(&["pkey", "-in", private.to_str().unwrap(), "-pubout"]);
    (private, String::from_utf8(public).unwrap())
}

/// Signs the manifest `manifest_hex` of `repository` with `private`, as cosign does, and pushes
/// the signature to `<repository>:sha256-<hex>.sig`.
async fn sign(registry_addr: &str, repository: &str, manifest_hex: &str, private: &Path) {
    let work = tempfile::tempdir().unwrap();
    let payload = cosign::payload_for(&format!("{registry_addr}/{repository}"), manifest_hex);
    let payload_file = write(work.path(), "payload.json", &payload);
    let signature = openssl(&[
        "dgst",
        "-sha256",
        "-sign",
        private.to_str().unwrap(),
        payload_file.to_str().unwrap(),
    ]);
    let signature = base64::engine::general_purpose::STANDARD.encode(signature);
    let config = b"{}".to_vec();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": Digest::of(&config).as_str(), "size": config.len()},
        "layers": [{"mediaType": cosign::PAYLOAD_MEDIA_TYPE,
                    "digest": Digest::of(payload.as_bytes()).as_str(), "size": payload.len(),
                    "annotations": {cosign::SIGNATURE_ANNOTATION: signature}}]
    });
    let mut client = wasm_provisioner::oci::commands::registry(&RegistryArgs {
        registry_config: None,
        ca_file: None,
        plain_http: vec![registry_addr.to_string()],
        max_module_mib: 64,
        request_timeout: std::time::Duration::from_secs(30),
    })
    .unwrap();
    let reference = Reference::parse(&format!("{registry_addr}/{repository}:x")).unwrap();
    for blob in [config, payload.into_bytes()] {
        let digest = Digest::of(&blob);
        client
            .push_blob(&reference, blob.into(), &digest)
            .await
            .unwrap();
    }
    client
        .push_manifest(
            &reference,
            &cosign::signature_tag(manifest_hex),
            serde_json::to_vec(&manifest).unwrap().into(),
            "application/vnd.oci.image.manifest.v1+json",
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn a_guest_signed_with_the_pinned_key_is_pulled_saved_loaded_and_served_and_no_other() {
    let registry = Registry::start(None);
    let addr = registry.addr.as_str();
    let work = tempfile::tempdir().unwrap();
    let module = work.path().join("hostpath.wasm");
    std::fs::copy(common::guest_wasm("hostpath"), &module).unwrap();
    let reference = format!("{addr}/guests/hostpath:v1");
    let (ok, pushed, err) = provisioner(&[
        "push",
        module.to_str().unwrap(),
        &reference,
        "--plain-http",
        addr,
    ]);
    assert!(ok, "{err}");
    let manifest = line_value(&pushed, "manifest ");
    let manifest_hex = manifest.trim_start_matches("sha256:").to_string();

    let (trusted, trusted_pub) = key_pair(work.path(), "trusted");
    let (_, stranger_pub) = key_pair(work.path(), "stranger");
    let storage = tempfile::tempdir().unwrap();
    let grant_text = format!(
        "{}\n[module]\ncosign-key = \"cosign.pub\"\n",
        common::dir_grant("test.dev/signed", storage.path(), "/volumes", "")
    );
    let grant = write(work.path(), "hostpath.toml", &grant_text);
    let pull = |plugins: &Path| {
        provisioner(&[
            "pull",
            &reference,
            "--plugins",
            plugins.to_str().unwrap(),
            "--name",
            "hostpath",
            "--grant",
            grant.to_str().unwrap(),
            "--plain-http",
            addr,
        ])
    };

    // Not signed yet: nothing is written.
    write(work.path(), "cosign.pub", &trusted_pub);
    let plugins = tempfile::tempdir().unwrap();
    let (ok, _, err) = pull(plugins.path());
    assert!(!ok && err.contains("no cosign signature"), "{err}");
    assert!(
        files(plugins.path()).is_empty(),
        "{:?}",
        files(plugins.path())
    );

    // Signed by the trusted key, but the grant pins another: refused, nothing written.
    sign(addr, "guests/hostpath", &manifest_hex, &trusted).await;
    write(work.path(), "cosign.pub", &stranger_pub);
    let (ok, _, err) = pull(plugins.path());
    assert!(
        !ok && err.contains("does not verify with the pinned key"),
        "{err}"
    );
    assert!(
        files(plugins.path()).is_empty(),
        "{:?}",
        files(plugins.path())
    );

    // The pinned key signed it: installed with its evidence, and the host serves it.
    write(work.path(), "cosign.pub", &trusted_pub);
    write(plugins.path(), "cosign.pub", &trusted_pub);
    let (ok, out, err) = pull(plugins.path());
    assert!(ok, "{out}{err}");
    assert_eq!(
        files(plugins.path()),
        [
            ".hostpath.sig.json",
            "cosign.pub",
            "hostpath.toml",
            "hostpath.wasm"
        ]
    );
    let engine = wasm_provisioner::wasm::WasmEngine::new().unwrap();
    let served = wasm_provisioner::wasm::load_dir(&engine, plugins.path()).unwrap();
    assert!(served.serves("test.dev/signed"), "{:?}", served.problems);

    // The host's own fetcher, for a grant naming this source: nothing to do while the evidence
    // verifies; evidence that no longer does (here: a stranger's) is fetched again.
    write(
        plugins.path(),
        "hostpath.toml",
        format!("{grant_text}source = \"{reference}\"\n"),
    );
    write(plugins.path(), ".hostpath.source", &reference);
    let mut fetcher = wasm_provisioner::oci::fetch::Fetcher::new(
        plugins.path().to_owned(),
        wasm_provisioner::oci::commands::registry(&RegistryArgs {
            registry_config: None,
            ca_file: None,
            plain_http: vec![addr.to_string()],
            max_module_mib: 64,
            request_timeout: std::time::Duration::from_secs(30),
        })
        .unwrap(),
    );
    assert_eq!(fetcher.pass().await, []);
    let good_evidence = std::fs::read(plugins.path().join(".hostpath.sig.json")).unwrap();
    let stranger = serde_json::json!({"manifest": "{}", "payload": "{}", "signature": "AAAA"});
    write(plugins.path(), ".hostpath.sig.json", stranger.to_string());
    let healed = fetcher.pass().await;
    assert!(
        matches!(&healed[..], [wasm_provisioner::oci::fetch::Outcome::Fetched { because, .. }]
            if because.contains("does not verify")),
        "{healed:?}"
    );
    assert_eq!(
        std::fs::read(plugins.path().join(".hostpath.sig.json")).unwrap(),
        good_evidence
    );
    let served = wasm_provisioner::wasm::load_dir(&engine, plugins.path()).unwrap();
    assert!(served.serves("test.dev/signed"), "{:?}", served.problems);

    // Across an air gap: the tarball carries the evidence; the host behind it serves.
    let tarball = work.path().join("guests.tar");
    let (ok, _, err) = provisioner(&[
        "save",
        "--plugins",
        plugins.path().to_str().unwrap(),
        "--out",
        tarball.to_str().unwrap(),
        "hostpath",
    ]);
    assert!(ok, "{err}");
    let offline = tempfile::tempdir().unwrap();
    write(offline.path(), "cosign.pub", &trusted_pub);
    let (ok, _, err) = provisioner(&[
        "load",
        tarball.to_str().unwrap(),
        "--plugins",
        offline.path().to_str().unwrap(),
    ]);
    assert!(ok, "{err}");

    // `save --pull` from a directory holding only the grant (and the key): the pulled module's
    // own signature goes into the tarball, verified against the grant's key.
    let staging = tempfile::tempdir().unwrap();
    write(staging.path(), "hostpath.toml", &grant_text);
    write(staging.path(), "cosign.pub", &trusted_pub);
    let pulled_tarball = work.path().join("pulled.tar");
    let (ok, _, err) = provisioner(&[
        "save",
        "--plugins",
        staging.path().to_str().unwrap(),
        "--out",
        pulled_tarball.to_str().unwrap(),
        "--pull",
        &format!("hostpath={reference}"),
        "--plain-http",
        addr,
    ]);
    assert!(ok, "{err}");
    drop(registry);
    let behind_the_gap = tempfile::tempdir().unwrap();
    write(behind_the_gap.path(), "cosign.pub", &trusted_pub);
    let (ok, _, err) = provisioner(&[
        "load",
        pulled_tarball.to_str().unwrap(),
        "--plugins",
        behind_the_gap.path().to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    for dir in [offline.path(), behind_the_gap.path()] {
        let served = wasm_provisioner::wasm::load_dir(&engine, dir).unwrap();
        assert!(served.serves("test.dev/signed"), "{:?}", served.problems);
    }

    // Other bytes beside that evidence: refused at load.
    std::fs::copy(
        common::guest_wasm("scripted"),
        offline.path().join("hostpath.wasm"),
    )
    .unwrap();
    let refused = wasm_provisioner::wasm::load_dir(&engine, offline.path()).unwrap();
    assert!(!refused.serves("test.dev/signed"));
    assert!(
        refused.problems[0]
            .reason
            .contains("the signed manifest names module"),
        "{:?}",
        refused.problems
    );
}
