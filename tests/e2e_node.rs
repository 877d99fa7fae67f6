//! Node-local deployment against a real control plane: three `wasm-provisioner run
//! --node-deployment` processes as nodes n1..n3, each running the hostpath guest granted its own
//! directory (standing in for that node's disk), as the deploy/rbac.yaml identity.
//!
//! The harness cluster has no kubelets: the tests create the Node objects (the API server accepts
//! them without one) and delete one to simulate a removed node. There is no scheduler either, so
//! WaitForFirstConsumer claims get their `selected-node` from the test.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::{Event, Node, PersistentVolume};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use wp_harness::{ControlPlane, Process, wait_for};

use common::e2e::{Fixture, SELECTED_NODE, WAIT, affinity, pv_name};
use common::{PluginsDir, dir_guest};

const GONE_GRACE: &str = "2s";

/// One node: its name, its "disk" and the instance running on it.
struct NodeInstance {
    name: String,
    disk: tempfile::TempDir,
    _plugins: PluginsDir,
    process: Process,
}

/// One test's world: the fixture and three nodes with an instance each.
struct World {
    fx: Fixture,
    nodes: Vec<NodeInstance>,
}

fixture_world!(World);

impl World {
    async fn new(cp: Arc<ControlPlane>, name: &str) -> anyhow::Result<World> {
        World::with_guest(cp, name, "hostpath", ("100ms", "1s")).await
    }

    /// Three nodes running `guest` (hostpath, or the scripted test guest), each granted its disk,
    /// competing for immediate claims after a wait between `delays.0` and `delays.1`.
    async fn with_guest(
        cp: Arc<ControlPlane>,
        name: &str,
        guest: &str,
        delays: (&str, &str),
    ) -> anyhow::Result<World> {
        let fx = Fixture::new(cp, "node", name).await?;
        let mut nodes = Vec::new();
        for n in 1..=3 {
            let node = format!("{name}-n{n}");
            let object: Node = serde_json::from_value(json!({
                "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}}
            }))?;
            Api::<Node>::all(fx.admin.clone())
                .create(&PostParams::default(), &object)
                .await
                .with_context(|| format!("create node {node}"))?;
            let disk = tempfile::tempdir()?;
            let plugins = dir_guest(guest, &fx.provisioner, disk.path(), "/volumes");
            let mut cmd = fx.provisioner_command(plugins.path(), fx.cp.provisioner_kubeconfig());
            cmd.args(["--node-deployment", "--node-name", &node])
                .args(["--node-deployment-base-delay", delays.0])
                .args(["--node-deployment-max-delay", delays.1])
                .args(["--node-gone-grace", GONE_GRACE])
                .args(["--instance-name", &node])
                .env_remove("NODE_NAME");
            let process = fx.spawn(&node, cmd)?;
            nodes.push(NodeInstance {
                name: node,
                disk,
                _plugins: plugins,
                process,
            });
        }
        Ok(World { fx, nodes })
    }

    /// A class `<ns>-<suffix>` with `binding` and the StorageClass `annotations`.
    async fn create_class(
        &self,
        suffix: &str,
        binding: &str,
        annotations: &[(&str, &str)],
    ) -> anyhow::Result<String> {
        annotations
            .iter()
            .fold(self.class(suffix).binding(binding), |class, (k, v)| {
                class.annotation(k, v)
            })
            .create()
            .await
    }

    /// A 1Gi claim; `node` plays the scheduler's selected-node annotation.
    async fn create_claim(
        &self,
        name: &str,
        class: &str,
        node: Option<&str>,
    ) -> anyhow::Result<()> {
        self.claim(name)
            .class(class)
            .selected_node(node)
            .create()
            .await?;
        Ok(())
    }

    /// The nodes whose disk holds directory `pv`.
    fn disks_holding(&self, pv: &str) -> Vec<&str> {
        self.nodes
            .iter()
            .filter(|n| n.disk.path().join(pv).is_dir())
            .map(|n| n.name.as_str())
            .collect()
    }

    fn node(&self, name: &str) -> &NodeInstance {
        self.nodes.iter().find(|n| n.name == name).expect("node")
    }
}

/// The PV's `kubernetes.io/hostname` node affinity values.
fn pinned_to(pv: &PersistentVolume) -> Vec<String> {
    affinity(pv)
        .into_iter()
        .filter(|(key, _)| key == "kubernetes.io/hostname")
        .flat_map(|(_, values)| values)
        .collect()
}

fn host_path(pv: &PersistentVolume) -> PathBuf {
    PathBuf::from(
        pv.spec
            .as_ref()
            .and_then(|s| s.host_path.as_ref())
            .map(|h| h.path.clone())
            .unwrap_or_default(),
    )
}

/// WaitForFirstConsumer claims with different selected nodes: each is provisioned by its node's
/// instance, on its node's disk, pinned to its node; deleting a claim removes only its node's
/// directory.
async fn claims_are_provisioned_and_deleted_on_their_own_node(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::new(cp, "wffc").await?;
    let class = w.create_class("local", "WaitForFirstConsumer", &[]).await?;
    let mut bound = Vec::new();
    for node in w.nodes.iter().map(|n| n.name.clone()).collect::<Vec<_>>() {
        let claim = format!("on-{node}");
        w.create_claim(&claim, &class, Some(&node)).await?;
        bound.push((claim, node));
    }
    let mut pvs = Vec::new();
    for (claim, node) in &bound {
        let pv = w.wait_bound(claim).await?;
        let name = pv.name_any();
        ensure!(
            pinned_to(&pv) == [node.clone()],
            "PV {name} pinned to {:?}, not {node}",
            pinned_to(&pv)
        );
        ensure!(
            host_path(&pv).starts_with(w.node(node).disk.path()),
            "PV {name} points at {}, not into {node}'s disk",
            host_path(&pv).display()
        );
        ensure!(
            w.disks_holding(&name) == [node.as_str()],
            "directory {name} is on {:?}, expected only {node}",
            w.disks_holding(&name)
        );
        pvs.push(name);
    }
    // The events on each claim come from its node's instance only (--instance-name = node).
    let events: Api<Event> = Api::namespaced(w.admin.clone(), &w.ns);
    let list = events.list(&ListParams::default()).await?;
    for (claim, node) in &bound {
        let reporters: Vec<String> = list
            .items
            .iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(claim.as_str()))
            .filter(|e| {
                e.reason
                    .as_deref()
                    .is_some_and(|r| r.starts_with("Provisioning"))
            })
            .map(|e| e.reporting_instance.clone().unwrap_or_default())
            .collect();
        ensure!(
            !reporters.is_empty() && reporters.iter().all(|r| r == node),
            "{claim}: provisioning events from {reporters:?}, expected only {node}"
        );
    }
    // Delete one claim at a time: only its node's directory goes.
    for (k, ((claim, node), pv)) in bound.iter().zip(&pvs).enumerate() {
        w.claims().delete(claim, &DeleteParams::default()).await?;
        w.wait_pv_gone(pv).await?;
        ensure!(
            w.disks_holding(pv).is_empty(),
            "{pv} still on {:?} after its claim was deleted",
            w.disks_holding(pv)
        );
        for (later, later_pv) in bound.iter().zip(&pvs).skip(k + 1) {
            ensure!(
                w.disks_holding(later_pv) == [later.1.as_str()],
                "deleting {claim} on {node} touched {later_pv} on {}",
                later.1
            );
        }
    }
    Ok(())
}

/// Immediate-binding claims: the instances compete to set selected-node, exactly one wins per
/// claim and provisions it on its disk; a class that opts out is left alone by every node.
async fn an_immediate_claim_is_provisioned_exactly_once(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::new(cp, "imm").await?;
    let opted_out = w
        .create_class(
            "opt-out",
            "Immediate",
            &[("wasm-provisioner.dev/node-immediate-binding", "false")],
        )
        .await?;
    w.create_claim("left-alone", &opted_out, None).await?;
    immediate_claims_each_picked_once(&w).await?;
    // The opted-out claim saw the same instances for as long as six claims took to bind (each
    // with a 0.1-1 s wait), and more than the longest wait: no node picked it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let left = w.claims().get("left-alone").await?;
    ensure!(
        !left.annotations().contains_key(SELECTED_NODE),
        "a node picked the opted-out claim"
    );
    ensure!(
        left.spec.and_then(|s| s.volume_name).is_none(),
        "the opted-out claim was provisioned"
    );
    Ok(())
}

/// Six immediate claims: each bound, on exactly one disk (the node its claim names), pinned
/// there, picked by exactly one successful patch and one `NodeSelected` event.
async fn immediate_claims_each_picked_once(w: &World) -> anyhow::Result<()> {
    let class = w.create_class("immediate", "Immediate", &[]).await?;
    let claims: Vec<String> = (1..=6).map(|i| format!("imm-{i}")).collect();
    let started = Instant::now();
    for claim in &claims {
        w.create_claim(claim, &class, None).await?;
    }
    let mut winners = BTreeMap::<String, usize>::new();
    for claim in &claims {
        let pv = w.wait_bound(claim).await?;
        let name = pv.name_any();
        let live = w.claims().get(claim).await?;
        let selected = live
            .annotations()
            .get(SELECTED_NODE)
            .cloned()
            .context("no selected-node on a bound immediate claim")?;
        ensure!(
            w.disks_holding(&name) == [selected.as_str()],
            "{claim}: directory on {:?}, selected node {selected}",
            w.disks_holding(&name)
        );
        ensure!(
            pinned_to(&pv) == [selected.clone()],
            "{claim}: PV pinned to {:?}",
            pinned_to(&pv)
        );
        *winners.entry(selected).or_default() += 1;
    }
    eprintln!(
        "6 immediate claims bound in {:?}; winners per node: {winners:?}",
        started.elapsed()
    );
    // What competing cost: successful picks and lost races (409 conflicts) per instance.
    let mut picks = 0;
    for n in &w.nodes {
        let log = n.process.log();
        let picked = log.matches("picked this node").count();
        let conflicts = log.matches("changed while competing").count();
        picks += picked;
        eprintln!("MEASURED {}: {picked} picks, {conflicts} conflicts", n.name);
    }
    ensure!(
        picks == claims.len(),
        "{picks} successful picks for {} claims",
        claims.len()
    );
    // Every instance's NodeSelected events: one per claim in total, not one per instance.
    let events: Api<Event> = Api::namespaced(w.admin.clone(), &w.ns);
    let list = events.list(&ListParams::default()).await?;
    for claim in &claims {
        let picked: u32 = list
            .items
            .iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(claim.as_str()))
            .filter(|e| e.reason.as_deref() == Some("NodeSelected"))
            .map(|e| e.count.unwrap_or(1) as u32)
            .sum();
        ensure!(picked == 1, "{claim}: {picked} NodeSelected events");
    }
    Ok(())
}

/// All instances wait the same time, so their selected-node patches race at the API server:
/// the resourceVersion precondition lets one through per claim (the others get conflicts, or
/// see the winner's update first). Conflicts are printed, not asserted: timing decides them.
async fn simultaneous_competitors_still_pick_once(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let w = World::with_guest(cp, "race", "hostpath", ("500ms", "500ms")).await?;
    immediate_claims_each_picked_once(&w).await
}

/// A Released PV whose node was removed: after the grace period another instance deletes the PV
/// without calling the guest (the node's disk is gone), with an event saying so.
async fn a_removed_nodes_volume_is_deleted_with_an_event(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "gone").await?;
    let class = w.create_class("local", "WaitForFirstConsumer", &[]).await?;
    let gone = w.nodes[2].name.clone();
    w.create_claim("doomed", &class, Some(&gone)).await?;
    let pv = w.wait_bound("doomed").await?.name_any();
    ensure!(w.disks_holding(&pv) == [gone.as_str()]);
    // The node goes, and its instance with it.
    w.nodes[2].process.kill();
    Api::<Node>::all(w.admin.clone())
        .delete(&gone, &DeleteParams::default())
        .await?;
    w.claims()
        .delete("doomed", &DeleteParams::default())
        .await?;
    w.wait_pv_gone(&pv).await?;
    let events: Api<Event> = Api::namespaced(w.admin.clone(), "default");
    let event = wait_for("a VolumeDeletedNodeGone event on the PV", WAIT, || async {
        let list = events.list(&ListParams::default()).await?;
        Ok(list.items.into_iter().find(|e| {
            e.involved_object.name.as_deref() == Some(pv.as_str())
                && e.reason.as_deref() == Some("VolumeDeletedNodeGone")
        }))
    })
    .await?;
    let message = event.message.unwrap_or_default();
    ensure!(
        message.contains(&gone) && message.contains("without cleaning up"),
        "event message: {message}"
    );
    ensure!(event.type_.as_deref() == Some("Warning"));
    let reporter = event
        .source
        .and_then(|s| s.host)
        .or(event.reporting_instance)
        .unwrap_or_default();
    eprintln!("deleted by {reporter:?}: {message}");
    // No guest ran: the gone node's "disk" (still here in the test) keeps the directory.
    ensure!(
        w.disks_holding(&pv) == [gone.as_str()],
        "the directory was touched: {:?}",
        w.disks_holding(&pv)
    );
    // The surviving nodes still serve their own claims.
    let alive = w.nodes[0].name.clone();
    w.create_claim("after", &class, Some(&alive)).await?;
    let pv = w.wait_bound("after").await?.name_any();
    ensure!(w.disks_holding(&pv) == [alive.as_str()]);
    Ok(())
}

/// A claim deleted while its node's guest is still provisioning: only that node finishes it (its
/// finalizer keeps the claim until that node's storage is gone); no other node calls its guest.
async fn a_claim_deleted_mid_provision_is_finished_by_its_node_only(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let w = World::with_guest(cp, "mid", "scripted", ("100ms", "1s")).await?;
    let class = w
        .class("slow")
        .params(&[("delayMs", "3000"), ("pinToSelectedNode", "true")])
        .wait_for_first_consumer()
        .create()
        .await?;
    let owner = w.nodes[0].name.clone();
    let claim = w
        .claim("short-lived")
        .class(&class)
        .selected_node(Some(&owner))
        .create()
        .await?;
    let pv = pv_name(&claim);
    let started = w.node(&owner).disk.path().join(format!("{pv}.started"));
    w.wait_file("the owner's guest to start provisioning", &started)
        .await?;
    w.claims()
        .delete("short-lived", &DeleteParams::default())
        .await?;
    w.wait_claim_gone("short-lived").await?;
    ensure!(
        w.disks_holding(&pv).is_empty(),
        "storage left on {:?}; the owner's guest calls:\n{}\n{}",
        w.disks_holding(&pv),
        std::fs::read_to_string(w.node(&owner).disk.path().join("calls.log")).unwrap_or_default(),
        w.logs()
    );
    ensure!(
        w.pvs().get_opt(&pv).await?.is_none(),
        "a PV was created for the deleted claim"
    );
    let owner_calls =
        std::fs::read_to_string(w.node(&owner).disk.path().join("calls.log")).unwrap_or_default();
    let owner_calls: Vec<&str> = owner_calls
        .lines()
        .filter(|l| l.contains(&pv))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    ensure!(
        owner_calls == ["provision", "delete"],
        "one provision and one cleanup, no second round after the claim was gone: {owner_calls:?}"
    );
    for n in &w.nodes {
        let calls = std::fs::read_to_string(n.disk.path().join("calls.log")).unwrap_or_default();
        let touched = calls.lines().any(|l| l.contains(&pv));
        ensure!(
            touched == (n.name == owner),
            "{} called its guest for {pv}: {touched}\n{calls}",
            n.name
        );
    }
    Ok(())
}

/// An instance whose --node-name names no Node refuses to start, and says why.
async fn a_mistyped_node_name_stops_the_instance(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let fx = Fixture::new(cp, "node", "typo").await?;
    let disk = tempfile::tempdir()?;
    let plugins = dir_guest("hostpath", &fx.provisioner, disk.path(), "/volumes");
    let mut cmd = fx.provisioner_command(plugins.path(), fx.cp.provisioner_kubeconfig());
    cmd.args(["--node-deployment", "--node-name", "no-such-node"])
        .env_remove("NODE_NAME");
    let mut process = fx.spawn("no-such-node", cmd)?;
    let status = wait_for("the instance to exit", WAIT, || {
        let status = process.exit_status();
        async move { Ok(status) }
    })
    .await?;
    ensure!(!status.success(), "exited with {status}");
    let log = process.log();
    ensure!(
        log.contains("node \"no-such-node\" does not exist"),
        "log does not say why: {log}"
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::suite::run(
        "node-deployment",
        &["hostpath", "scripted"],
        Duration::from_secs(180),
        e2e_tests![
            claims_are_provisioned_and_deleted_on_their_own_node,
            an_immediate_claim_is_provisioned_exactly_once,
            a_removed_nodes_volume_is_deleted_with_an_event,
            a_mistyped_node_name_stops_the_instance,
            a_claim_deleted_mid_provision_is_finished_by_its_node_only,
            simultaneous_competitors_still_pick_once,
        ],
    )
}
