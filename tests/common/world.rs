//! The world of an end-to-end test with one guest: its fixture, the guest's storage and plugins
//! directory, and the provisioner process, with what tests of the scripted guest ask of it (its
//! call log, its "started" markers). `tests/e2e.rs` and `tests/e2e_intents.rs` share it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use wp_harness::{ControlPlane, Process};

use super::PluginsDir;
use super::e2e::{Fixture, SELECTED_NODE, pv_name};

/// One test's world: the fixture, one guest with its storage and plugins directory, and the
/// provisioner process.
pub struct World {
    pub fx: Fixture,
    /// The guest's granted directory.
    pub storage: tempfile::TempDir,
    pub plugins: PluginsDir,
    pub process: Option<Process>,
}

crate::fixture_world!(World);

impl World {
    /// A world whose guest is `crate_name` from `guests/`.
    pub async fn new(
        cp: Arc<ControlPlane>,
        suite: &str,
        name: &str,
        crate_name: &str,
    ) -> anyhow::Result<World> {
        let fx = Fixture::new(cp, suite, name).await?;
        let storage = tempfile::tempdir()?;
        let guest_dir = if crate_name == "hostpath" {
            "/volumes"
        } else {
            "/state"
        };
        let plugins = super::dir_guest(crate_name, &fx.provisioner, storage.path(), guest_dir);
        Ok(World {
            fx,
            storage,
            plugins,
            process: None,
        })
    }

    /// Starts `wasm-provisioner run` as the provisioner identity (or `kubeconfig`), fast retries.
    pub fn start_as(&mut self, kubeconfig: &Path, extra: &[&str]) -> anyhow::Result<()> {
        let instance = self.name.clone();
        self.launch(kubeconfig, &instance, "provisioner", extra)
    }

    pub fn start(&mut self, extra: &[&str]) -> anyhow::Result<()> {
        let kubeconfig = self.cp.provisioner_kubeconfig().to_owned();
        self.start_as(&kubeconfig, extra)
    }

    /// [`World::start`] as replica `instance` (its name in events and logs, and its intent
    /// log's), with `extra` flags.
    pub fn start_instance(&mut self, instance: &str, extra: &[&str]) -> anyhow::Result<()> {
        let kubeconfig = self.cp.provisioner_kubeconfig().to_owned();
        self.launch(&kubeconfig, instance, instance, extra)
    }

    fn launch(
        &mut self,
        kubeconfig: &Path,
        instance: &str,
        label: &str,
        extra: &[&str],
    ) -> anyhow::Result<()> {
        let mut cmd = self.provisioner_command(self.plugins.path(), kubeconfig);
        cmd.args(["--create-pv-retry-count", "2"])
            .args(["--create-pv-retry-interval", "200ms"])
            .args(["--instance-name", instance])
            // Election is on, as in production; each world has its own lease.
            .args(["--leader-election-namespace", "wasm-provisioner"])
            .args(["--leader-election-lease-name", &self.ns])
            .args(extra);
        self.process = Some(self.spawn(label, cmd)?);
        Ok(())
    }

    /// A started world whose scripted guest is at work on claim `data` (its storage created), and
    /// will be for `delay_ms` more.
    pub async fn guest_at_work(
        cp: Arc<ControlPlane>,
        suite: &str,
        name: &str,
        delay_ms: u32,
    ) -> anyhow::Result<(World, PersistentVolumeClaim)> {
        World::guest_at_work_as(cp, suite, name, delay_ms, &[]).await
    }

    /// [`World::guest_at_work`] with extra provisioner flags.
    pub async fn guest_at_work_as(
        cp: Arc<ControlPlane>,
        suite: &str,
        name: &str,
        delay_ms: u32,
        extra: &[&str],
    ) -> anyhow::Result<(World, PersistentVolumeClaim)> {
        let mut w = World::new(cp, suite, name, "scripted").await?;
        w.start(extra)?;
        let class = w
            .class("slow")
            .param("delayMs", &delay_ms.to_string())
            .create()
            .await?;
        let claim = w.claim("data").class(&class).create().await?;
        w.wait_guest_started(&pv_name(&claim)).await?;
        Ok((w, claim))
    }

    /// Lines of the scripted guest's call log.
    pub fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.storage.path().join("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// How many calls of `operation` (`provision`, `delete`) the scripted guest logged.
    pub fn count_calls(&self, operation: &str) -> usize {
        let prefix = format!("{operation} ");
        self.calls()
            .iter()
            .filter(|l| l.starts_with(&prefix))
            .count()
    }

    /// Sets `volume.kubernetes.io/selected-node`, as the scheduler would.
    pub async fn select_node(&self, claim: &str, node: &str) -> anyhow::Result<()> {
        let patch = json!({"metadata": {"annotations": {SELECTED_NODE: node}}});
        self.claims()
            .patch(claim, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    pub fn storage_of(&self, pv_name: &str) -> PathBuf {
        self.storage.path().join(pv_name)
    }

    /// Waits until the scripted guest started provisioning `pv` (its `.started` marker).
    pub async fn wait_guest_started(&self, pv: &str) -> anyhow::Result<()> {
        let marker = self.storage.path().join(format!("{pv}.started"));
        self.wait_file("guest started", &marker).await
    }
}
