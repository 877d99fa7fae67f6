//! Digest pins: a grant file's `[module] sha256` decides which bytes may run, at the first load
//! and at every hot reload, and what the guest that served before may still do.

use sha2::{Digest, Sha256};
use wasm_provisioner::wasm::bindings::types::DeleteRequest;
use wasm_provisioner::wasm::reload::Loader;
use wasm_provisioner::wasm::{Availability, WasmEngine};

use super::common::*;

const PINNED: &str = "test.wasm-provisioner.dev/pinned";
const OTHER: &str = "test.wasm-provisioner.dev/other";

fn digest_of(crate_name: &str) -> String {
    hex::encode(Sha256::digest(
        std::fs::read(guest_wasm(crate_name)).unwrap(),
    ))
}

fn pinned_grant(provisioner: &str, storage: &std::path::Path, module: &str) -> String {
    format!(
        "{}\n[module]\n{module}\n",
        dir_grant(provisioner, storage, "/state", "")
    )
}

#[test]
fn a_module_that_is_not_its_pinned_bytes_is_refused_before_it_compiles_and_the_others_serve() {
    // Compiles guests for seconds: not beside the attacks that run against a deadline.
    let _alone = super::CPU_HEAVY.blocking_lock();
    let storage = tempfile::tempdir().unwrap();
    let hostpath = digest_of("hostpath");
    let plugins = PluginsDir::new();
    plugins.add(
        "right",
        "hostpath",
        &pinned_grant(
            OTHER,
            storage.path(),
            &format!("sha256 = \"sha256:{hostpath}\""),
        ),
    );
    // Bytes that do not even compile, pinned to another digest: the refusal is the pin's, so
    // the compiler never saw them.
    std::fs::write(plugins.path().join("wrong.wasm"), b"\0asm not a component").unwrap();
    std::fs::write(
        plugins.path().join("wrong.toml"),
        pinned_grant(PINNED, storage.path(), &format!("sha256 = \"{hostpath}\"")),
    )
    .unwrap();
    let mut loader = Loader::new(WasmEngine::new().unwrap(), plugins.path().to_owned());
    let scan = loader.scan().unwrap();
    assert!(
        scan.plugins.serves(OTHER),
        "the pinned module that matches serves"
    );
    assert!(!scan.plugins.serves(PINNED));
    assert_eq!(
        scan.plugins.problems.len(),
        1,
        "{:?}",
        scan.plugins.problems
    );
    let reason = &scan.plugins.problems[0].reason;
    let actual = hex::encode(Sha256::digest(b"\0asm not a component"));
    assert!(
        reason.contains(&actual) && reason.contains(&hostpath) && reason.contains("pins"),
        "{reason}"
    );
    assert!(
        !reason.contains("compile"),
        "refused before compiling: {reason}"
    );
    assert_eq!(loader.stats().counts().rejections, 1);
}

#[test]
fn a_bad_pin_is_a_grant_error_that_names_the_key() {
    // Compiles guests for seconds: not beside the attacks that run against a deadline.
    let _alone = super::CPU_HEAVY.blocking_lock();
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "short",
        "hostpath",
        &pinned_grant(PINNED, storage.path(), "sha256 = \"abc\""),
    );
    plugins.add(
        "policy",
        "hostpath",
        &pinned_grant(
            OTHER,
            storage.path(),
            "on-mismatch = \"delete-with-last-good\"",
        ),
    );
    let mut loader = Loader::new(WasmEngine::new().unwrap(), plugins.path().to_owned());
    let scan = loader.scan().unwrap();
    assert!(scan.plugins.is_empty());
    let reasons: Vec<_> = scan.plugins.problems.iter().map(|p| &p.reason).collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("module.sha256 must be 64 hex digits")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("module.on-mismatch needs module.sha256 or module.cosign-key")),
        "{reasons:?}"
    );
}

#[test]
fn a_pinned_guest_replaced_by_other_bytes_stops_serving_until_its_bytes_return() {
    // Compiles guests for seconds: not beside the attacks that run against a deadline.
    let _alone = super::CPU_HEAVY.blocking_lock();
    let storage = tempfile::tempdir().unwrap();
    let grant = pinned_grant(
        PINNED,
        storage.path(),
        &format!("sha256 = \"{}\"", digest_of("hostpath")),
    );
    let plugins = PluginsDir::new();
    plugins.add("live", "hostpath", &grant);
    let mut loader = Loader::new(WasmEngine::new().unwrap(), plugins.path().to_owned());
    let first = loader.scan().unwrap();
    assert_eq!(first.plugins.availability(PINNED), Availability::Served);

    // Another (valid, loadable) module under the same grant: refused, and unlike a module that
    // fails to compile, the version before does not serve on: its bytes are no longer what
    // the file holds, and by default nothing deletes either.
    plugins.add("live", "scripted", &grant);
    let swapped = loader.scan().unwrap();
    assert!(swapped.changed);
    match swapped.plugins.availability(PINNED) {
        Availability::Unavailable(why) => assert!(why.contains("unloaded or refused"), "{why}"),
        other => panic!("claims must wait: {other:?}"),
    }
    assert!(
        swapped.plugins.for_deleting(PINNED).is_none(),
        "on-mismatch defaults to wait"
    );
    let reason = &swapped.plugins.problems[0].reason;
    assert!(reason.contains("stops serving"), "{reason}");
    assert_eq!(loader.stats().counts().unloads, 1);

    // The reviewed bytes back: served again.
    plugins.add("live", "hostpath", &grant);
    let back = loader.scan().unwrap();
    assert_eq!(back.plugins.availability(PINNED), Availability::Served);
    assert!(back.plugins.problems.is_empty());
}

#[tokio::test]
async fn with_delete_with_last_good_the_last_matching_module_deletes_and_serves_no_claim() {
    // Compiles guests for seconds: not beside the attacks that run against a deadline.
    let _alone = super::CPU_HEAVY.lock().await;
    let storage = tempfile::tempdir().unwrap();
    let good = digest_of("hostpath");
    let grant = pinned_grant(
        PINNED,
        storage.path(),
        &format!("sha256 = \"{good}\"\non-mismatch = \"delete-with-last-good\""),
    );
    let plugins = PluginsDir::new();
    plugins.add("live", "hostpath", &grant);
    let mut loader = Loader::new(WasmEngine::new().unwrap(), plugins.path().to_owned());
    let first = loader.scan().unwrap();
    let v1 = first.plugins.for_provisioner(PINNED).unwrap().clone();
    let config = v1.grants().config_json.clone();
    let req = request(claim("kept"), class(PINNED, &[]), &config);
    let built = v1
        .provision(&req)
        .await
        .expect("provisioned by the reviewed module");

    plugins.add("live", "scripted", &grant);
    let swapped = loader.scan().unwrap();
    assert!(
        swapped.plugins.for_provisioner(PINNED).is_none(),
        "no claim is served"
    );
    match swapped.plugins.availability(PINNED) {
        Availability::Unavailable(why) => assert!(why.contains("only deletes"), "{why}"),
        other => panic!("claims must wait: {other:?}"),
    }
    let deleter = swapped
        .plugins
        .for_deleting(PINNED)
        .expect("the last good module deletes");
    assert_eq!(deleter.sha256(), good);
    // Rescanning the same mismatch keeps it as it is (no second unload).
    assert!(!loader.scan().unwrap().changed);
    assert_eq!(loader.stats().counts().unloads, 1);
    let volume_dir = storage.path().join("pvc-uid-kept");
    assert!(volume_dir.is_dir(), "{}", volume_dir.display());
    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config,
    };
    deleter
        .delete(&delete)
        .await
        .expect("deleted by the last good module");
    assert!(!volume_dir.exists());

    // The reviewed bytes back under the same grant: served again, not only deleting.
    plugins.add("live", "hostpath", &grant);
    let restored = loader.scan().unwrap();
    assert_eq!(
        restored.plugins.availability(PINNED),
        Availability::Served,
        "{:?}",
        restored.plugins.problems
    );
    plugins.add("live", "scripted", &grant);
    assert!(!loader.scan().unwrap().plugins.serves(PINNED));

    // A grant that pins the new bytes has not vouched for the old: nothing deletes for it
    // until the file matches (the new bytes are not loaded while the old stay in place).
    let scripted = digest_of("scripted");
    plugins.add(
        "live",
        "hostpath",
        &pinned_grant(
            PINNED,
            storage.path(),
            &format!("sha256 = \"{scripted}\"\non-mismatch = \"delete-with-last-good\""),
        ),
    );
    let repinned = loader.scan().unwrap();
    assert!(repinned.plugins.for_deleting(PINNED).is_none());
}

/// A P-256 key pair, its public half as cosign.pub (PEM), and signatures in cosign's format.
struct CosignKey {
    pair: ring::signature::EcdsaKeyPair,
    pem: String,
}

impl CosignKey {
    fn new() -> CosignKey {
        use base64::Engine as _;
        use ring::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).unwrap();
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref(), &rng)
            .unwrap();
        let mut der = hex::decode("3059301306072a8648ce3d020106082a8648ce3d030107034200").unwrap();
        der.extend_from_slice(pair.public_key().as_ref());
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        let pem = format!("-----BEGIN PUBLIC KEY-----\n{b64}\n-----END PUBLIC KEY-----\n");
        CosignKey { pair, pem }
    }

    /// The evidence `pull` keeps for an artifact whose wasm layer is `module`.
    fn evidence_for(&self, module: &[u8]) -> String {
        use base64::Engine as _;
        use wasm_provisioner::oci::cosign;
        let manifest = format!(
            r#"{{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","layers":[{{"mediaType":"application/wasm","digest":"sha256:{}","size":{}}}]}}"#,
            hex::encode(Sha256::digest(module)),
            module.len()
        );
        let payload = cosign::payload_for(
            "registry.local/guests/pinned",
            &hex::encode(Sha256::digest(manifest.as_bytes())),
        );
        let signature = self
            .pair
            .sign(&ring::rand::SystemRandom::new(), payload.as_bytes())
            .unwrap();
        serde_json::to_string(&cosign::Evidence {
            manifest,
            payload,
            signature: base64::engine::general_purpose::STANDARD.encode(signature.as_ref()),
        })
        .unwrap()
    }
}

/// A grant naming a cosign key loads a module only with evidence of that key's signature of
/// an artifact whose layer is those bytes: no evidence, another key's, or evidence of other
/// bytes is refused like a wrong digest, and the guest serving before stops serving.
#[test]
fn a_grant_with_a_cosign_key_loads_only_modules_its_key_signed() {
    // Compiles guests for seconds: not beside the attacks that run against a deadline.
    let _alone = super::CPU_HEAVY.blocking_lock();
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    let key = CosignKey::new();
    std::fs::write(plugins.path().join("cosign.pub.pem"), &key.pem).unwrap();
    let grant = pinned_grant(PINNED, storage.path(), "cosign-key = \"cosign.pub.pem\"");
    let hostpath = std::fs::read(guest_wasm("hostpath")).unwrap();
    let evidence = plugins.path().join(".live.sig.json");
    let mut loader = Loader::new(WasmEngine::new().unwrap(), plugins.path().to_owned());

    plugins.add("live", "hostpath", &grant);
    let unsigned = loader.scan().unwrap();
    assert!(!unsigned.plugins.serves(PINNED));
    let reason = &unsigned.plugins.problems[0].reason;
    assert!(
        reason.contains("signature evidence") && reason.contains("cannot be read"),
        "{reason}"
    );

    std::fs::write(&evidence, CosignKey::new().evidence_for(&hostpath)).unwrap();
    let stranger = loader.scan().unwrap();
    assert!(!stranger.plugins.serves(PINNED));
    assert!(
        stranger.plugins.problems[0]
            .reason
            .contains("does not verify with the pinned key"),
        "{:?}",
        stranger.plugins.problems
    );

    std::fs::write(&evidence, key.evidence_for(&hostpath)).unwrap();
    let signed = loader.scan().unwrap();
    assert!(
        signed.plugins.serves(PINNED),
        "{:?}",
        signed.plugins.problems
    );

    // Other bytes under the same evidence: the signed manifest names another module.
    plugins.add("live", "scripted", &grant);
    let swapped = loader.scan().unwrap();
    assert!(!swapped.plugins.serves(PINNED));
    let reason = &swapped.plugins.problems[0].reason;
    assert!(
        reason.contains("the signed manifest names module"),
        "{reason}"
    );
    assert!(reason.contains("stops serving"), "{reason}");
}

/// A grant that lacks what the module declares it needs still loads (the grant file decides),
/// and the load says what is missing, in the log and as a counted warning.
#[test]
fn a_grant_lacking_a_declared_need_loads_with_a_counted_warning() {
    // Compiles guests for seconds: not beside the attacks that run against a deadline.
    let _alone = super::CPU_HEAVY.blocking_lock();
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    let lacking = dir_grant(PINNED, storage.path(), "/state", "")
        .replace("kinds = [\"host-path\"]", "kinds = []");
    plugins.add("lacking", "hostpath", &lacking);
    plugins.add(
        "granted",
        "scripted",
        &dir_grant(OTHER, storage.path(), "/state", ""),
    );
    let metrics = wasm_provisioner::metrics::Metrics::new();
    let engine = WasmEngine::new().unwrap().with_metrics(metrics.clone());
    let loaded = wasm_provisioner::wasm::load_dir(&engine, plugins.path()).unwrap();
    assert_eq!(loaded.len(), 2, "{:?}", loaded.problems);
    let exposed = metrics.encode();
    let series: Vec<&str> = exposed
        .lines()
        .filter(|l| l.starts_with("wasm_provisioner_plugin_warnings_total{"))
        .filter(|l| l.contains("warning=\"needs\""))
        .collect();
    // hostpath builds host-path volumes, which this grant does not allow (its directory, at
    // /state by its guest-dir config, is granted).
    assert_eq!(
        series,
        ["wasm_provisioner_plugin_warnings_total{guest=\"lacking\",warning=\"needs\"} 1"],
        "{exposed}"
    );
}
