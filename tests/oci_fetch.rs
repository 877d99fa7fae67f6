//! The running host's own fetches (`[module] source` in a grant) against a real registry: a
//! missing module is fetched and served, nothing is fetched when nothing changed, a registry
//! that is down leaves the module that serves in place and backs off, a grant naming a new
//! source is fetched at once, and a fetched module that is not the pinned one writes nothing.

mod common;
#[allow(
    dead_code,
    reason = "the registry tests' helpers; this file uses a few"
)]
mod oci_support;

use std::path::Path;
use std::time::Duration;

use oci_support::*;
use wasm_provisioner::config::RegistryArgs;
use wasm_provisioner::oci::Digest;
use wasm_provisioner::oci::fetch::{Fetcher, Outcome};
use wasm_provisioner::wasm::{WasmEngine, load_dir};

const SERVED: &str = "test.dev/fetched";

fn push(registry: &str, crate_name: &str, tag: &str) -> String {
    let reference = format!("{registry}/guests/fetched:{tag}");
    let module = common::guest_wasm(crate_name);
    let (ok, _, err) = provisioner(&[
        "push",
        module.to_str().unwrap(),
        &reference,
        "--plain-http",
        registry,
    ]);
    assert!(ok, "{err}");
    reference
}

fn fetcher(dir: &Path, plain_http: &[&str]) -> Fetcher {
    let registry = wasm_provisioner::oci::commands::registry(&RegistryArgs {
        registry_config: None,
        ca_file: None,
        plain_http: plain_http.iter().map(|s| s.to_string()).collect(),
        max_module_mib: 64,
        request_timeout: Duration::from_secs(5),
    })
    .unwrap();
    Fetcher::new(dir.to_owned(), registry)
}

fn grant(storage: &Path, module: &str) -> String {
    format!(
        "{}\n[module]\n{module}\n",
        common::dir_grant(SERVED, storage, "/volumes", "")
    )
}

fn module_digest(dir: &Path) -> Digest {
    Digest::of(&std::fs::read(dir.join("guest.wasm")).unwrap())
}

fn digest_of(crate_name: &str) -> Digest {
    Digest::of(&std::fs::read(common::guest_wasm(crate_name)).unwrap())
}

fn serves(dir: &Path) -> bool {
    let plugins = load_dir(&WasmEngine::new().unwrap(), dir).unwrap();
    plugins.serves(SERVED)
}

#[tokio::test]
async fn a_source_is_fetched_once_and_a_registry_that_is_down_leaves_the_serving_module() {
    let registry = Registry::start(None);
    let other = Registry::start(None);
    let v1 = push(&registry.addr, "hostpath", "v1");
    let elsewhere = push(&other.addr, "scripted", "v2");
    let storage = tempfile::tempdir().unwrap();
    let plugins = tempfile::tempdir().unwrap();
    let dir = plugins.path();
    write(
        dir,
        "guest.toml",
        grant(storage.path(), &format!("source = \"{v1}\"")),
    );
    let mut fetcher = fetcher(dir, &[&registry.addr, &other.addr]);

    let first = fetcher.pass().await;
    assert!(
        matches!(&first[..], [Outcome::Fetched { because, .. }] if because.contains("missing")),
        "{first:?}"
    );
    assert_eq!(module_digest(dir), digest_of("hostpath"));
    assert_eq!(files(dir), [".guest.source", "guest.toml", "guest.wasm"]);
    assert!(serves(dir));
    assert_eq!(fetcher.pass().await, [], "nothing changed, nothing fetched");

    // The grant moves to a tag while the registry is down: the module in place stays and
    // serves; the failure backs off (the next pass does not knock again at once).
    let v2 = format!("{}/guests/fetched:v2", registry.addr);
    drop(registry);
    write(
        dir,
        "guest.toml",
        grant(storage.path(), &format!("source = \"{v2}\"")),
    );
    let down = fetcher.pass().await;
    assert!(matches!(&down[..], [Outcome::Failed { .. }]), "{down:?}");
    assert_eq!(module_digest(dir), digest_of("hostpath"));
    assert_eq!(files(dir), [".guest.source", "guest.toml", "guest.wasm"]);
    assert!(serves(dir), "the last good module serves on");
    assert_eq!(fetcher.pass().await, [], "backing off");

    // A registry that answers, named by the grant: fetched at once (a new source starts afresh).
    write(
        dir,
        "guest.toml",
        grant(storage.path(), &format!("source = \"{elsewhere}\"")),
    );
    let fetched = fetcher.pass().await;
    assert!(
        matches!(&fetched[..], [Outcome::Fetched { because, .. }] if because.contains("source is now")),
        "{fetched:?}"
    );
    assert_eq!(module_digest(dir), digest_of("scripted"));
}

#[tokio::test]
async fn a_source_whose_module_is_not_the_pinned_one_writes_nothing() {
    let registry = Registry::start(None);
    let v1 = push(&registry.addr, "scripted", "v1");
    let storage = tempfile::tempdir().unwrap();
    let plugins = tempfile::tempdir().unwrap();
    let dir = plugins.path();
    let pinned = digest_of("hostpath");
    write(
        dir,
        "guest.toml",
        grant(
            storage.path(),
            &format!("source = \"{v1}\"\nsha256 = \"{}\"", pinned.hex()),
        ),
    );
    let outcome = fetcher(dir, &[&registry.addr]).pass().await;
    match &outcome[..] {
        [Outcome::Failed { error, .. }] => assert!(error.contains("pins"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(files(dir), ["guest.toml"], "nothing written");

    // The pinned module pushed under that tag: fetched.
    push(&registry.addr, "hostpath", "v1");
    let outcome = fetcher(dir, &[&registry.addr]).pass().await;
    assert!(
        matches!(&outcome[..], [Outcome::Fetched { .. }]),
        "{outcome:?}"
    );
    assert_eq!(module_digest(dir), pinned);
    assert!(serves(dir));
}
