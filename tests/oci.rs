//! Guests through a real OCI registry (Debian's `docker-registry` on loopback) and across an air
//! gap: push and pull by tag and digest, grant pins, slow, stalling, failing and lying
//! registries (a proxy in front of the real one), a 1 GiB layer refused before download, htpasswd
//! auth from a Docker config.json, and save/load tarballs.

mod common;
mod oci_support;

use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use hyper::Method;
use oci_support::*;
use wasm_provisioner::oci::Digest;

/// A real component's bytes: the hostpath sample guest.
fn component() -> Vec<u8> {
    std::fs::read(common::guest_wasm("hostpath")).expect("hostpath.wasm")
}

const GRANT: &str = "# hostpath's grant, as an operator writes it\n[dirs]\n";

/// Pushes the hostpath guest to `registry_addr/guests/hostpath:v1`; (manifest, layer) digests.
fn push(registry_addr: &str, extra: &[&str]) -> (String, String) {
    push_as(registry_addr, "v1", extra)
}

fn push_as(registry_addr: &str, tag: &str, extra: &[&str]) -> (String, String) {
    let work = tempfile::tempdir().unwrap();
    let file = write(work.path(), "hostpath.wasm", component());
    let reference = format!("{registry_addr}/guests/hostpath:{tag}");
    let mut args = vec![
        "push",
        file.to_str().unwrap(),
        &reference,
        "--plain-http",
        registry_addr,
    ];
    args.extend_from_slice(extra);
    let (ok, out, err) = provisioner(&args);
    assert!(ok, "push failed: {err}");
    (line_value(&out, "manifest "), line_value(&out, "layer "))
}

/// `pull REFERENCE --plugins DIR --name hostpath --plain-http ADDR...` plus `extra`.
fn pull(reference: &str, plugins: &Path, plain: &[&str], extra: &[&str]) -> (bool, String, String) {
    let mut args = vec![
        "pull",
        reference,
        "--plugins",
        plugins.to_str().unwrap(),
        "--name",
        "hostpath",
    ];
    for addr in plain {
        args.extend_from_slice(&["--plain-http", addr]);
    }
    args.extend_from_slice(extra);
    provisioner(&args)
}

#[test]
fn push_then_pull_by_tag_and_by_digest_round_trips_the_bytes() {
    let registry = Registry::start(None);
    let (manifest, layer) = push(&registry.addr, &[]);
    let bytes = component();
    assert_eq!(layer, Digest::of(&bytes).to_string());

    let work = tempfile::tempdir().unwrap();
    let grant = write(work.path(), "grant.toml", GRANT);
    let references = [
        format!("{}/guests/hostpath:v1", registry.addr),
        format!("{}/guests/hostpath@{manifest}", registry.addr),
        format!("{}/guests/hostpath:v1@{manifest}", registry.addr),
    ];
    for reference in &references {
        let plugins = tempfile::tempdir().unwrap();
        let (ok, out, err) = pull(
            reference,
            plugins.path(),
            &[&registry.addr],
            &["--grant", grant.to_str().unwrap()],
        );
        assert!(ok, "pull {reference}: {err}");
        assert_eq!(files(plugins.path()), ["hostpath.toml", "hostpath.wasm"]);
        assert_eq!(
            std::fs::read(plugins.path().join("hostpath.wasm")).unwrap(),
            bytes
        );
        assert_eq!(
            std::fs::read_to_string(plugins.path().join("hostpath.toml")).unwrap(),
            GRANT
        );
        let pasted = format!("sha256 = \"{}\"", &layer["sha256:".len()..]);
        assert!(out.contains(&pasted), "{out}");
        assert!(out.contains(&manifest), "{out}");
    }

    // The same component again under another tag: its layer is already there (HEAD answers
    // 200 with its length and no body) and is not uploaded again; the config (a new `created`)
    // is.
    let proxy = Proxy::start(&registry.addr, |_, _| Action::Forward);
    let (_, layer_again) = push_as(&proxy.addr, "v2", &[]);
    assert_eq!(layer_again, layer);
    let uploads: Vec<String> = proxy
        .seen()
        .into_iter()
        .filter(|r| r.starts_with("PUT") && r.contains("/blobs/"))
        .collect();
    assert_eq!(uploads.len(), 1, "{uploads:?}");
    assert!(
        !uploads[0].contains(&layer["sha256:".len()..]),
        "{uploads:?}"
    );

    // A digest the registry does not have is a clear not-found, and nothing is written.
    let plugins = tempfile::tempdir().unwrap();
    let missing = format!(
        "{}/guests/hostpath@sha256:{}",
        registry.addr,
        "0".repeat(64)
    );
    let (ok, _, err) = pull(&missing, plugins.path(), &[&registry.addr], &[]);
    assert!(!ok);
    assert!(err.contains("not found"), "{err}");
    assert!(files(plugins.path()).is_empty());
}

#[test]
fn the_pushed_manifest_is_the_wasm_oci_format() {
    let registry = Registry::start(None);
    let (manifest_digest, layer) = push(&registry.addr, &[]);
    let url = |path: &str| format!("/v2/guests/hostpath/{path}");
    let get = |path: String| {
        http_get(
            &registry.addr,
            &path,
            "application/vnd.oci.image.manifest.v1+json",
        )
    };
    let manifest_bytes = get(url("manifests/v1"));
    assert_eq!(Digest::of(&manifest_bytes).to_string(), manifest_digest);
    let manifest: serde_json::Value = serde_json::from_slice(&manifest_bytes).unwrap();
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(
        manifest["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        manifest["config"]["mediaType"],
        "application/vnd.wasm.config.v0+json"
    );
    assert_eq!(manifest["layers"].as_array().unwrap().len(), 1);
    assert_eq!(manifest["layers"][0]["mediaType"], "application/wasm");
    assert_eq!(manifest["layers"][0]["digest"], layer.as_str());
    let config_digest = manifest["config"]["digest"].as_str().unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&get(url(&format!("blobs/{config_digest}")))).unwrap();
    assert_eq!(config["architecture"], "wasm");
    assert_eq!(config["os"], "wasip2");
    assert_eq!(config["layerDigests"], serde_json::json!([layer]));
    assert!(config["created"].as_str().unwrap().starts_with("20"));
    // The component's own imports and exports, as wkg lists them.
    let names = |key: &str| -> Vec<String> {
        serde_json::from_value(config["component"][key].clone()).unwrap()
    };
    assert!(
        names("exports")
            .iter()
            .any(|e| e.starts_with("wasm-provisioner:provisioner/")),
        "{config}"
    );
    assert!(!names("imports").is_empty(), "{config}");
}

#[test]
fn a_grant_pinning_another_module_writes_nothing_and_fetches_no_blob() {
    let registry = Registry::start(None);
    push(&registry.addr, &[]);
    let proxy = Proxy::start(&registry.addr, |_, _| Action::Forward);
    let work = tempfile::tempdir().unwrap();
    let other = "ab".repeat(32);
    let grant = write(
        work.path(),
        "grant.toml",
        format!("{GRANT}[module]\nsha256 = \"{other}\"\n"),
    );
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/hostpath:v1", proxy.addr);
    let (ok, _, err) = pull(
        &reference,
        plugins.path(),
        &[&proxy.addr],
        &["--grant", grant.to_str().unwrap()],
    );
    assert!(!ok);
    assert!(
        err.contains(&format!("pins [module] sha256 = \"{other}\"")),
        "{err}"
    );
    assert!(
        files(plugins.path()).is_empty(),
        "{:?}",
        files(plugins.path())
    );
    assert!(
        !proxy.seen().iter().any(|r| r.contains("/blobs/")),
        "{:?}",
        proxy.seen()
    );

    // The same grant pinning the right module installs both files.
    let right = Digest::of(&component());
    let grant = write(
        work.path(),
        "grant.toml",
        format!("{GRANT}[module]\nsha256 = \"{}\"\n", right.hex()),
    );
    let (ok, _, err) = pull(
        &reference,
        plugins.path(),
        &[&proxy.addr],
        &["--grant", grant.to_str().unwrap()],
    );
    assert!(ok, "{err}");
    assert_eq!(files(plugins.path()), ["hostpath.toml", "hostpath.wasm"]);
}

#[test]
fn a_slow_registry_works_within_the_deadline_and_a_stalled_one_times_out() {
    let registry = Registry::start(None);
    push(&registry.addr, &[]);
    let slow = Proxy::start(&registry.addr, |_, _| {
        Action::Delay(Duration::from_millis(400))
    });
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/hostpath:v1", slow.addr);
    let (ok, _, err) = pull(
        &reference,
        plugins.path(),
        &[&slow.addr],
        &["--request-timeout", "10s"],
    );
    assert!(ok, "{err}");
    assert_eq!(files(plugins.path()), ["hostpath.wasm"]);

    let stalled = Proxy::start(&registry.addr, |_, path: &str| {
        if path.contains("/blobs/") {
            Action::Stall
        } else {
            Action::Forward
        }
    });
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/hostpath:v1", stalled.addr);
    let started = Instant::now();
    let (ok, _, err) = pull(
        &reference,
        plugins.path(),
        &[&stalled.addr],
        &["--request-timeout", "2s"],
    );
    let took = started.elapsed();
    assert!(!ok);
    assert!(err.contains("no complete answer within 2s"), "{err}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(files(plugins.path()).is_empty());
}

#[test]
fn server_errors_are_retried_and_a_registry_that_keeps_failing_is_reported() {
    let registry = Registry::start(None);
    push(&registry.addr, &[]);
    let failures = std::sync::atomic::AtomicUsize::new(0);
    let flaky = Proxy::start(&registry.addr, move |_, path: &str| {
        let n = failures.fetch_add(
            path.contains("/manifests/") as usize,
            std::sync::atomic::Ordering::SeqCst,
        );
        if path.contains("/manifests/") && n < 2 {
            Action::Status(503)
        } else {
            Action::Forward
        }
    });
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/hostpath:v1", flaky.addr);
    let (ok, _, err) = pull(&reference, plugins.path(), &[&flaky.addr], &[]);
    assert!(ok, "{err}");
    let manifest_requests = flaky
        .seen()
        .iter()
        .filter(|r| r.contains("/manifests/"))
        .count();
    assert_eq!(manifest_requests, 3, "{:?}", flaky.seen());

    let down = Proxy::start(&registry.addr, |_, _| Action::Status(503));
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/hostpath:v1", down.addr);
    let (ok, _, err) = pull(&reference, plugins.path(), &[&down.addr], &[]);
    assert!(!ok);
    assert!(
        err.contains("503 Service Unavailable after 5 attempt(s)"),
        "{err}"
    );
    assert_eq!(down.seen().len(), 5, "{:?}", down.seen());
    assert!(files(plugins.path()).is_empty());

    // A 404 is not retried.
    let (ok, _, err) = pull(
        &format!("{}/guests/nothing:v1", flaky.addr),
        plugins.path(),
        &[&flaky.addr],
        &[],
    );
    assert!(!ok && err.contains("not found"), "{err}");
    let nothing = flaky
        .seen()
        .iter()
        .filter(|r| r.contains("/nothing/"))
        .count();
    assert_eq!(nothing, 1);
}

#[test]
fn wrong_blob_bytes_are_refused_and_nothing_is_installed() {
    let registry = Registry::start(None);
    let (_, layer) = push(&registry.addr, &[]);
    let liar = Proxy::start(&registry.addr, |method: &Method, path: &str| {
        if method == Method::GET && path.contains("/blobs/") {
            Action::Corrupt
        } else {
            Action::Forward
        }
    });
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/hostpath:v1", liar.addr);
    let (ok, _, err) = pull(&reference, plugins.path(), &[&liar.addr], &[]);
    assert!(!ok);
    assert!(
        err.contains(&format!("blob {layer}: digest mismatch")),
        "{err}"
    );
    assert!(
        files(plugins.path()).is_empty(),
        "{:?}",
        files(plugins.path())
    );
}

#[test]
fn a_one_gib_layer_is_refused_before_any_blob_byte() {
    let registry = Registry::start(None);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.wasm.config.v0+json",
                   "digest": Digest::of(b"{}").to_string(), "size": 2},
        "layers": [{"mediaType": "application/wasm",
                    "digest": format!("sha256:{}", "1".repeat(64)), "size": 1u64 << 30}],
    });
    let body = serde_json::to_vec(&manifest).unwrap();
    let proxy = Proxy::start(&registry.addr, move |_, path: &str| {
        if path.contains("/manifests/") {
            Action::Serve("application/vnd.oci.image.manifest.v1+json", body.clone())
        } else {
            Action::Forward
        }
    });
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/huge:v1", proxy.addr);
    let (ok, _, err) = pull(&reference, plugins.path(), &[&proxy.addr], &[]);
    assert!(!ok);
    assert!(
        err.contains("declares 1073741824 bytes, over the 67108864-byte cap"),
        "{err}"
    );
    assert!(
        !proxy.seen().iter().any(|r| r.contains("/blobs/")),
        "{:?}",
        proxy.seen()
    );
    assert!(files(plugins.path()).is_empty());

    // The cap is the flag's.
    let (ok, _, err) = pull(
        &reference,
        plugins.path(),
        &[&proxy.addr],
        &["--max-module-mib", "2048"],
    );
    assert!(!ok);
    assert!(!err.contains("over the"), "{err}");
}

#[test]
fn a_registry_sending_more_than_the_manifest_declares_is_cut_off() {
    let registry = Registry::start(None);
    let (_, layer) = push(&registry.addr, &[]);
    // The real layer's digest, declared 1000 bytes long; the blob is the real one (larger).
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "config": {"mediaType": "application/vnd.wasm.config.v0+json",
                   "digest": Digest::of(b"{}").to_string(), "size": 2},
        "layers": [{"mediaType": "application/wasm", "digest": layer, "size": 1000}],
    });
    let body = serde_json::to_vec(&manifest).unwrap();
    let proxy = Proxy::start(&registry.addr, move |_, path: &str| {
        if path.contains("/manifests/") {
            Action::Serve("application/vnd.oci.image.manifest.v1+json", body.clone())
        } else {
            Action::Forward
        }
    });
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/hostpath:v1", proxy.addr);
    let (ok, _, err) = pull(&reference, plugins.path(), &[&proxy.addr], &[]);
    assert!(!ok);
    assert!(err.contains("larger than the 1000 bytes allowed"), "{err}");
    assert!(files(plugins.path()).is_empty());
}

#[test]
fn basic_auth_from_a_docker_config_and_a_clear_401_without_it() {
    let registry = Registry::start(Some(("alice", "s3cret")));
    let work = tempfile::tempdir().unwrap();
    let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret");
    let config = write(
        work.path(),
        "config.json",
        format!(
            r#"{{"auths": {{"{}": {{"auth": "{auth}"}}}}}}"#,
            registry.addr
        ),
    );
    let config_flag = ["--registry-config", config.to_str().unwrap()];
    push(&registry.addr, &config_flag);

    let reference = format!("{}/guests/hostpath:v1", registry.addr);
    let plugins = tempfile::tempdir().unwrap();
    let (ok, _, err) = pull(&reference, plugins.path(), &[&registry.addr], &config_flag);
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read(plugins.path().join("hostpath.wasm")).unwrap(),
        component()
    );

    let empty = tempfile::tempdir().unwrap();
    let (ok, _, err) = pull(&reference, empty.path(), &[&registry.addr], &[]);
    assert!(!ok);
    assert!(err.contains("401 Unauthorized"), "{err}");
    assert!(
        err.contains(&format!("no credentials for {}", registry.addr)),
        "{err}"
    );

    // username/password fields, wrong password: refused, and said so.
    let wrong = write(
        work.path(),
        "wrong.json",
        format!(
            r#"{{"auths": {{"http://{}": {{"username": "alice", "password": "nope"}}}}}}"#,
            registry.addr
        ),
    );
    let (ok, _, err) = pull(
        &reference,
        empty.path(),
        &[&registry.addr],
        &["--registry-config", wrong.to_str().unwrap()],
    );
    assert!(!ok);
    assert!(err.contains("refused the credentials"), "{err}");
    assert!(files(empty.path()).is_empty());
}

#[test]
fn the_bearer_token_flow_gets_a_token_from_the_realm_with_the_credentials() {
    let registry = Registry::start(None);
    push(&registry.addr, &[]);
    let realm = std::sync::Arc::new(std::sync::OnceLock::<String>::new());
    let proxy_realm = realm.clone();
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("robot:t0ken")
    );
    // A token service at /token (Basic credentials in, a token out) and a registry that takes
    // only that token, as Docker Hub, GHCR and Harbor work.
    let proxy = Proxy::with_headers(&registry.addr, move |_, path: &str, headers| {
        let authorization = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if path.starts_with("/token") {
            return if authorization == basic {
                Action::Serve("application/json", br#"{"token":"T-123"}"#.to_vec())
            } else {
                Action::Status(401)
            };
        }
        if authorization == "Bearer T-123" {
            Action::Forward
        } else {
            Action::Challenge(format!(
                r#"Bearer realm="http://{}/token",service="test-registry",scope="repository:guests/hostpath:pull""#,
                proxy_realm.get().unwrap()
            ))
        }
    });
    realm.set(proxy.addr.clone()).unwrap();
    let work = tempfile::tempdir().unwrap();
    let config = write(
        work.path(),
        "config.json",
        format!(
            r#"{{"auths": {{"{}": {{"username": "robot", "password": "t0ken"}}}}}}"#,
            proxy.addr
        ),
    );
    let reference = format!("{}/guests/hostpath:v1", proxy.addr);
    let plugins = tempfile::tempdir().unwrap();
    let (ok, _, err) = pull(
        &reference,
        plugins.path(),
        &[&proxy.addr],
        &["--registry-config", config.to_str().unwrap()],
    );
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read(plugins.path().join("hostpath.wasm")).unwrap(),
        component()
    );
    let tokens: Vec<String> = proxy
        .seen()
        .into_iter()
        .filter(|r| r.contains("/token"))
        .collect();
    // One token for the manifest and the blob alike.
    assert_eq!(
        tokens,
        ["GET /token?service=test-registry&scope=repository%3Aguests%2Fhostpath%3Apull"]
    );

    // Without credentials the token service refuses: a clear 401.
    let empty = tempfile::tempdir().unwrap();
    let (ok, _, err) = pull(&reference, empty.path(), &[&proxy.addr], &[]);
    assert!(!ok);
    assert!(err.contains("401 Unauthorized"), "{err}");
    assert!(files(empty.path()).is_empty());
}

#[test]
fn https_with_a_custom_ca() {
    let certs = tempfile::tempdir().unwrap();
    let (ca, certificate, key) = test_ca(certs.path());
    let registry = Registry::start_with(None, Some((&certificate, &key)));
    let ca_flag = ["--ca-file", ca.to_str().unwrap()];
    let work = tempfile::tempdir().unwrap();
    let file = write(work.path(), "hostpath.wasm", component());
    let reference = format!("{}/guests/hostpath:v1", registry.addr);
    let mut args = vec!["push", file.to_str().unwrap(), &reference];
    args.extend_from_slice(&ca_flag);
    let (ok, _, err) = provisioner(&args);
    assert!(ok, "{err}");

    let plugins = tempfile::tempdir().unwrap();
    let (ok, _, err) = pull(&reference, plugins.path(), &[], &ca_flag);
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read(plugins.path().join("hostpath.wasm")).unwrap(),
        component()
    );

    // Without the CA the certificate is refused, at once (not retried).
    let empty = tempfile::tempdir().unwrap();
    let (ok, _, err) = pull(&reference, empty.path(), &[], &[]);
    assert!(!ok);
    assert!(
        err.contains("UnknownIssuer")
            && err.contains("after 1 attempt(s)")
            && err.contains("--ca-file"),
        "{err}"
    );
    assert!(files(empty.path()).is_empty());
}

#[test]
fn without_plain_http_the_client_speaks_tls_once_and_says_what_to_try() {
    let registry = Registry::start(None);
    push(&registry.addr, &[]);
    let plugins = tempfile::tempdir().unwrap();
    let reference = format!("{}/guests/hostpath:v1", registry.addr);
    // Without --plain-http the client speaks TLS to a plain HTTP server and fails.
    let (ok, _, err) = pull(
        &reference,
        plugins.path(),
        &[],
        &["--request-timeout", "5s"],
    );
    assert!(!ok, "{err}");
    assert!(
        err.contains("after 1 attempt(s)"),
        "a TLS failure is not retried: {err}"
    );
    assert!(err.contains("needs --plain-http HOST:PORT"), "{err}");
    assert!(files(plugins.path()).is_empty());
}

#[test]
fn save_and_load_round_trip_and_a_tampered_tarball_is_refused() {
    let from = tempfile::tempdir().unwrap();
    let bytes = component();
    write(from.path(), "hostpath.wasm", &bytes);
    write(from.path(), "hostpath.toml", GRANT);
    write(from.path(), "other.wasm", b"\0asm\x0d\0\x01\0");
    let work = tempfile::tempdir().unwrap();
    let tarball = work.path().join("plugins.tar");
    let (ok, out, err) = provisioner(&[
        "save",
        "--plugins",
        from.path().to_str().unwrap(),
        "--out",
        tarball.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!(
            "saved hostpath {} (with its grant)",
            Digest::of(&bytes)
        )),
        "{out}"
    );

    let to = tempfile::tempdir().unwrap();
    let (ok, out, err) = provisioner(&[
        "load",
        tarball.to_str().unwrap(),
        "--plugins",
        to.path().to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("loaded other"), "{out}");
    assert_eq!(
        files(to.path()),
        ["hostpath.toml", "hostpath.wasm", "other.wasm"]
    );
    assert_eq!(
        std::fs::read(to.path().join("hostpath.wasm")).unwrap(),
        bytes
    );
    assert_eq!(
        std::fs::read_to_string(to.path().join("hostpath.toml")).unwrap(),
        GRANT
    );

    // Only the named plugins.
    let one = work.path().join("one.tar");
    let (ok, _, err) = provisioner(&[
        "save",
        "--plugins",
        from.path().to_str().unwrap(),
        "--out",
        one.to_str().unwrap(),
        "other",
    ]);
    assert!(ok, "{err}");
    let to = tempfile::tempdir().unwrap();
    let (ok, _, err) = provisioner(&[
        "load",
        one.to_str().unwrap(),
        "--plugins",
        to.path().to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(files(to.path()), ["other.wasm"]);

    // One byte of hostpath.wasm changed inside the tarball: refused, nothing written.
    let mut tampered = std::fs::read(&tarball).unwrap();
    let at = tampered
        .windows(bytes.len().min(4096))
        .position(|w| w == &bytes[..bytes.len().min(4096)])
        .expect("the module's bytes in the tarball");
    tampered[at + bytes.len() / 2] ^= 0x01;
    let bad = write(work.path(), "tampered.tar", tampered);
    let to = tempfile::tempdir().unwrap();
    let (ok, _, err) = provisioner(&[
        "load",
        bad.to_str().unwrap(),
        "--plugins",
        to.path().to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("hostpath.wasm digest mismatch"), "{err}");
    assert!(files(to.path()).is_empty(), "{:?}", files(to.path()));
}

#[test]
fn save_can_pull_into_the_tarball_with_the_directory_s_grant() {
    let registry = Registry::start(None);
    let (_, layer) = push(&registry.addr, &[]);
    let from = tempfile::tempdir().unwrap();
    let pinned = format!(
        "{GRANT}[module]\nsha256 = \"{}\"\n",
        &layer["sha256:".len()..]
    );
    write(from.path(), "hostpath.toml", &pinned);
    let work = tempfile::tempdir().unwrap();
    let tarball = work.path().join("pulled.tar");
    let pull_spec = format!("hostpath={}/guests/hostpath:v1", registry.addr);
    let (ok, out, err) = provisioner(&[
        "save",
        "--plugins",
        from.path().to_str().unwrap(),
        "--out",
        tarball.to_str().unwrap(),
        "--pull",
        &pull_spec,
        "--plain-http",
        &registry.addr,
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("saved hostpath {layer} (with its grant)")),
        "{out}"
    );
    // Nothing was installed into the directory the grant came from.
    assert_eq!(files(from.path()), ["hostpath.toml"]);

    let to = tempfile::tempdir().unwrap();
    let (ok, _, err) = provisioner(&[
        "load",
        tarball.to_str().unwrap(),
        "--plugins",
        to.path().to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(
        std::fs::read(to.path().join("hostpath.wasm")).unwrap(),
        component()
    );
    assert_eq!(
        std::fs::read_to_string(to.path().join("hostpath.toml")).unwrap(),
        pinned
    );
}
