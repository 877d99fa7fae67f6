//! Guests the running provisioner fetches itself: a grant naming a `[module] source` and no
//! module yet, a real registry, claims provisioned once the module has landed.

use std::sync::Arc;

use anyhow::ensure;
use wp_harness::ControlPlane;

use super::SUITE;
use super::common::world::World;
use super::oci_support::{Registry, provisioner};

pub async fn a_guest_fetched_from_its_source_provisions(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let registry = Registry::start(None);
    let reference = format!("{}/guests/hostpath:e2e", registry.addr);
    let module = super::common::guest_wasm("hostpath");
    let (pushed, _, err) = provisioner(&[
        "push",
        module.to_str().unwrap(),
        &reference,
        "--plain-http",
        &registry.addr,
    ]);
    ensure!(pushed, "push: {err}");
    let mut w = World::new(cp, SUITE, "fetch", "hostpath").await?;
    // The plugins directory holds the grant only, naming where the module is.
    let dir = w.plugins.path().to_owned();
    std::fs::remove_file(dir.join("hostpath.wasm"))?;
    let grant = std::fs::read_to_string(dir.join("hostpath.toml"))?;
    std::fs::write(
        dir.join("hostpath.toml"),
        format!("{grant}\n[module]\nsource = \"{reference}\"\n"),
    )?;
    w.start(&["--plain-http", &registry.addr, "--fetch-interval", "1s"])?;
    let class = w.class("fetched").create().await?;
    w.claim("data").class(&class).create().await?;
    w.wait_bound("data").await?;
    ensure!(
        std::fs::read(dir.join("hostpath.wasm"))? == std::fs::read(&module)?,
        "the fetched module is the pushed one"
    );
    ensure!(
        std::fs::read_to_string(dir.join(".hostpath.source"))?.trim() == reference,
        "the source it came from is recorded"
    );
    Ok(())
}
