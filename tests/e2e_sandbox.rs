//! Untrusted guests and live plugins against a real control plane: an attacking guest next to
//! a well-behaved one in one provisioner process, and the plugins directory changed under a
//! running controller. Same pattern as `tests/e2e.rs`: one control plane, a world per test.

mod common;
#[path = "e2e_sandbox/grants.rs"]
mod grants;
#[path = "e2e_sandbox/limits.rs"]
mod limits;
#[path = "e2e_sandbox/locks.rs"]
mod locks;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::Api;
use wp_harness::{ControlPlane, Process};

use common::e2e::{Fixture, uid};
use common::{dir_grant, guest_wasm};
use grants::a_moved_grant_never_lets_a_delete_pass_for_gone;
use limits::{
    a_compile_bomb_under_the_containers_memory_limit, attacks_under_the_containers_memory_limit,
    the_oom_killer_takes_the_compiler_not_the_controller,
};
use locks::a_guest_blocked_on_a_pods_lock_never_delays_another_guests_claims;

/// One test's world: the fixture, a plugins directory, storage roots and the provisioner.
struct World {
    fx: Fixture,
    root: tempfile::TempDir,
    plugins: PathBuf,
    process: Option<Process>,
}

fixture_world!(World);

impl World {
    async fn new(cp: Arc<ControlPlane>, name: &str) -> anyhow::Result<World> {
        let fx = Fixture::new(cp, "sandbox", name).await?;
        let root = tempfile::tempdir()?;
        let plugins = root.path().join("plugins");
        std::fs::create_dir(&plugins)?;
        Ok(World {
            fx,
            root,
            plugins,
            process: None,
        })
    }

    /// The provisioner name guest `guest` serves in this test.
    fn provisioner_of(&self, guest: &str) -> String {
        format!("{}-{guest}", self.provisioner)
    }

    fn storage(&self, guest: &str) -> PathBuf {
        self.root.path().join("storage").join(guest)
    }

    /// The grant of guest `name`: its own storage directory, optional extra limits.
    fn grant(&self, name: &str, limits: &str) -> anyhow::Result<String> {
        let storage = self.storage(name);
        std::fs::create_dir_all(&storage)?;
        Ok(dir_grant(
            &self.provisioner_of(name),
            &storage,
            "/state",
            limits,
        ))
    }

    /// Copies guest `crate_name` into the plugins directory as `name`.
    fn install(&self, name: &str, crate_name: &str, limits: &str) -> anyhow::Result<()> {
        std::fs::write(
            self.plugins.join(format!("{name}.toml")),
            self.grant(name, limits)?,
        )?;
        std::fs::copy(
            guest_wasm(crate_name),
            self.plugins.join(format!("{name}.wasm")),
        )?;
        Ok(())
    }

    /// `run` with this world's plugins, one replica (no lease to elect; the intent log lives
    /// where the provisioner's Role is, deploy/rbac.yaml), and `extra`.
    fn command(&self, extra: &[&str]) -> std::process::Command {
        let mut cmd = self.provisioner_command(&self.plugins, self.cp.provisioner_kubeconfig());
        cmd.arg("--leader-election=false")
            .args(["--leader-election-namespace", "wasm-provisioner"])
            .args(["--plugins-debounce", "200ms", "--instance-name", &self.name])
            .args(extra);
        cmd
    }

    fn start(&mut self, extra: &[&str]) -> anyhow::Result<()> {
        self.process = Some(self.spawn("provisioner", self.command(extra))?);
        Ok(())
    }

    /// [`World::start`] inside `cgroup` from the process' first instruction.
    fn start_in(
        &mut self,
        cgroup: &wp_harness::MemoryCgroup,
        extra: &[&str],
    ) -> anyhow::Result<()> {
        let cmd = cgroup.wrap(&self.command(extra));
        self.process = Some(self.spawn("provisioner", cmd)?);
        Ok(())
    }

    /// The hostpath guest as `good`, its volumes in `/volumes` (the path its grant's config names).
    fn install_good(&self) -> anyhow::Result<()> {
        self.install("good", "hostpath", "")?;
        std::fs::write(
            self.plugins.join("good.toml"),
            self.grant("good", "")?
                .replace("\"/state\"", "\"/volumes\""),
        )?;
        Ok(())
    }

    /// The provisioner's PID.
    fn pid(&self) -> u32 {
        self.process.as_ref().map(|p| p.pid()).unwrap_or_default()
    }

    fn log(&self) -> String {
        self.process.as_ref().map(|p| p.log()).unwrap_or_default()
    }

    /// Resident memory of the provisioner process, in MiB.
    fn rss_mib(&self) -> u64 {
        let pid = self.process.as_ref().map(|p| p.pid()).unwrap_or_default();
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
            / 1024
    }

    /// A class `<ns>-<suffix>` served by guest `guest`.
    async fn create_class(
        &self,
        guest: &str,
        suffix: &str,
        params: &[(&str, &str)],
    ) -> anyhow::Result<String> {
        self.class(suffix)
            .provisioner(&self.provisioner_of(guest))
            .params(params)
            .create()
            .await
    }

    /// Creates a claim and returns its UID.
    async fn create_claim(&self, name: &str, class: &str) -> anyhow::Result<String> {
        Ok(uid(&self.claim(name).class(class).create().await?))
    }

    async fn wait_bound(&self, claim: &str) -> anyhow::Result<()> {
        self.fx.wait_bound(claim).await.map(drop)
    }

    /// Creates a claim and returns how long it took to be Bound.
    async fn time_to_bound(&self, claim: &str, class: &str) -> anyhow::Result<Duration> {
        let started = Instant::now();
        self.create_claim(claim, class).await?;
        self.wait_bound(claim).await?;
        Ok(started.elapsed())
    }
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

async fn a_misbehaving_guest_never_slows_the_others(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "attack").await?;
    // Four calls at a time, below the worker count (8) so it can never hold every reconcile
    // worker, but twice the machine's cores: four spinning calls would take both CPUs from the
    // control plane and the controller if guest threads did not run at a lower priority.
    let attack_limits = "memory-mib = 32\nmax-concurrency = 4";
    w.install("attack", "attack", attack_limits)?;
    std::fs::write(
        w.plugins.join("attack.toml"),
        w.grant("attack", attack_limits)?
            .replace("call-timeout-ms = 5000", "call-timeout-ms = 1500"),
    )?;
    w.install_good()?;
    w.start(&["--worker-threads", "8"])?;
    let good = w.create_class("good", "good", &[]).await?;

    let mut before = Vec::new();
    for i in 0..4 {
        before.push(w.time_to_bound(&format!("before-{i}"), &good).await?);
    }
    let rss_before = w.rss_mib();

    // (attack, words the ProvisioningFailed event must carry); None: the volume binds.
    let attacks: &[(&str, Option<&[&str]>)] = &[
        ("spin", Some(&["guest attack", "deadline"])),
        (
            "host-block",
            Some(&["guest attack", "deadline", "blocked in a host call"]),
        ),
        ("memory-bomb", Some(&["guest attack", "memory", "32 MiB"])),
        ("stack-overflow", Some(&["guest attack", "stack-overflow"])),
        ("panic", Some(&["guest attack", "panic"])),
        ("unreachable", Some(&["guest attack", "trap"])),
        ("host-owned-keys", Some(&["guest attack", "refused"])),
        // More than one host call may carry (1 MiB): the call faults.
        ("huge-annotations", Some(&["guest attack", "too much data"])),
        ("log-flood", None),
        ("stdout-flood", None),
    ];
    let mut attack_claims = Vec::new();
    for (attack, expect) in attacks {
        let class = w
            .create_class("attack", attack, &[("attack", attack)])
            .await?;
        let uid = w.create_claim(&format!("attack-{attack}"), &class).await?;
        attack_claims.push((attack, uid, expect));
        if *attack == "spin" {
            // Every concurrency slot spinning until its deadline, over and over (retries).
            for i in 0..3 {
                w.create_claim(&format!("spin-extra-{i}"), &class).await?;
            }
        }
    }
    let mut during = Vec::new();
    for i in 0..4 {
        during.push(w.time_to_bound(&format!("during-{i}"), &good).await?);
    }
    for (attack, uid, expect) in &attack_claims {
        match expect {
            Some(words) => {
                let message = w.wait_event(uid, "ProvisioningFailed", words).await?;
                println!(
                    "{attack:>16}: {}",
                    message.chars().take(160).collect::<String>()
                );
            }
            None => {
                w.wait_bound(&format!("attack-{attack}")).await?;
                println!("{attack:>16}: bound (flood bounded, call served)");
            }
        }
    }
    let mut after = Vec::new();
    for i in 0..4 {
        after.push(w.time_to_bound(&format!("after-{i}"), &good).await?);
    }
    let rss_after = w.rss_mib();
    println!(
        "good guest, claim to Bound, median: before {:?}, during attacks {:?}, after {:?}",
        median(before),
        median(during),
        median(after)
    );
    println!(
        "provisioner resident memory: {rss_before} MiB before the attacks, {rss_after} MiB after"
    );
    ensure!(
        w.process.as_mut().is_some_and(|p| p.is_running()),
        "the provisioner survived every attack"
    );
    let mut outside: Vec<String> = std::fs::read_dir(w.root.path().join("storage"))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    outside.sort();
    ensure!(
        outside == ["attack", "good"],
        "nothing outside the grants: {outside:?}"
    );
    // Loose: the process also grows its caches (claims, events) and malloc keeps freed arenas;
    // tests/sandbox.rs measures the guest memory itself returning to baseline.
    ensure!(
        rss_after < rss_before + 128,
        "memory back near baseline: {rss_before} -> {rss_after} MiB"
    );
    Ok(())
}

async fn plugins_change_under_a_running_controller(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let mut w = World::new(cp, "reload").await?;
    let limits = "";
    w.install("live", "attack", limits)?;
    w.start(&[])?;
    let class = w.create_class("live", "live", &[]).await?;
    let first_uid = w.create_claim("first", &class).await?;
    w.wait_bound("first").await?;

    // Removed: the next claim waits with an event, and goes ahead once the guest is back; so
    // does the deletion of a released volume.
    std::fs::remove_file(w.plugins.join("live.wasm"))?;
    w.wait("unload logged", || async {
        Ok(w.log().contains("plugin unloaded").then_some(()))
    })
    .await?;
    let pvs: Api<PersistentVolume> = Api::all(w.admin.clone());
    let released = format!("pvc-{first_uid}");
    w.claims().delete("first", &Default::default()).await?;
    let released_uid = pvs.get(&released).await?.metadata.uid.unwrap_or_default();
    let message = w
        .wait_event(
            &released_uid,
            "WaitingForGuest",
            &[&w.provisioner_of("live")],
        )
        .await?;
    println!("released while unloaded: {message}");
    let uid = w.create_claim("waiting", &class).await?;
    let message = w
        .wait_event(&uid, "WaitingForGuest", &[&w.provisioner_of("live")])
        .await?;
    println!("while unloaded: {message}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let phase = w
        .claims()
        .get("waiting")
        .await?
        .status
        .and_then(|s| s.phase);
    ensure!(
        phase.as_deref() == Some("Pending"),
        "still waiting: {phase:?}"
    );
    let back = Instant::now();
    std::fs::copy(guest_wasm("attack"), w.plugins.join("live.wasm"))?;
    w.wait_bound("waiting").await?;
    println!(
        "guest back: waiting claim Bound {:?} after the file returned",
        back.elapsed()
    );
    w.wait_pv_gone(&released).await?;

    // A broken new version is refused and the old one keeps serving.
    std::fs::write(
        w.plugins.join("live.wasm"),
        b"\0asm definitely not a component",
    )?;
    w.wait("rejection logged", || async {
        Ok(w.log()
            .contains("still serving the previous version")
            .then_some(()))
    })
    .await?;
    w.time_to_bound("after-broken", &class).await?;

    // A good new version (another build) replaces it.
    std::fs::copy(guest_wasm("hostpath"), w.plugins.join("live.wasm"))?;
    w.wait("reload logged", || async {
        Ok(w.log().contains("plugin reloaded").then_some(()))
    })
    .await?;
    Ok(())
}

/// Issue 23: a claim of a provisioner no guest serves is left out of the claim cache (its
/// identity is not even kept); a guest for it added later makes the controller list the claims
/// again, and the claim is provisioned.
async fn a_claim_left_out_as_foreign_is_provisioned_once_a_guest_serves_it(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "foreign").await?;
    w.install("present", "attack", "")?;
    w.start(&[])?;
    let class = w.create_class("late", "late", &[]).await?;
    w.create_claim("early", &class).await?;
    // kube-controller-manager names the class's provisioner on the claim: foreign to us now.
    let provisioner = w.provisioner_of("late");
    w.wait("the claim names its provisioner", || async {
        let claim = w.claims().get("early").await?;
        let annotations = claim.metadata.annotations.unwrap_or_default();
        Ok(
            (annotations.get("volume.beta.kubernetes.io/storage-provisioner")
                == Some(&provisioner))
            .then_some(()),
        )
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let phase = w.claims().get("early").await?.status.and_then(|s| s.phase);
    ensure!(
        phase.as_deref() == Some("Pending"),
        "no guest serves it yet: {phase:?}"
    );
    let added = Instant::now();
    w.install("late", "attack", "")?;
    w.wait_bound("early").await?;
    println!(
        "foreign claim Bound {:?} after its guest was added",
        added.elapsed()
    );
    ensure!(
        w.log().contains("listing claims again"),
        "the reload re-listed the claims"
    );
    Ok(())
}

/// Issue 14: a PV whose hostPath passes through a link would hand a pod whatever the link
/// points at (the kubelet follows it). The guest cannot create one, and a link someone else
/// planted is caught on disk before the PV is created.
async fn a_guest_cannot_hand_a_pod_the_node_through_a_symlink(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "symlink").await?;
    w.install("node", "node_attack", "")?;
    // A link a tenant's pod (or an earlier guest) left in the granted directory.
    std::os::unix::fs::symlink("/", w.storage("node").join("sub"))?;
    w.start(&[])?;
    let planted = w
        .create_class("node", "intermediate", &[("attack", "intermediate-link")])
        .await?;
    let uid = w.create_claim("through-planted-link", &planted).await?;
    let message = w
        .wait_event(
            &uid,
            "ProvisioningFailed",
            &["guest node", "symbolic link", "/sub"],
        )
        .await?;
    println!("intermediate link: {message}");
    let pvs: Api<PersistentVolume> = Api::all(w.admin.clone());
    ensure!(
        pvs.get_opt(&format!("pvc-{uid}")).await?.is_none(),
        "no PV was created through the link"
    );
    // The guest's own attempt: symlink-at is refused, the volume binds to a plain path.
    let relative = w
        .create_class("node", "relative", &[("attack", "relative-link")])
        .await?;
    let uid = w.create_claim("own-link", &relative).await?;
    w.wait_bound("own-link").await?;
    let pv = pvs.get(&format!("pvc-{uid}")).await?;
    let path = pv
        .spec
        .and_then(|s| s.host_path)
        .map(|h| h.path)
        .unwrap_or_default();
    let did = pv
        .metadata
        .annotations
        .unwrap_or_default()
        .remove("attack.example/did")
        .unwrap_or_default();
    println!("relative link: PV path {path}, guest reports {did}");
    ensure!(!did.contains(": ok"), "symlink-at was allowed: {did}");
    ensure!(
        !std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()),
        "the PV's path {path} is not a link"
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::suite::run(
        "sandbox end-to-end",
        &["attack", "node_attack"],
        Duration::from_secs(240),
        e2e_tests![
            a_misbehaving_guest_never_slows_the_others,
            plugins_change_under_a_running_controller,
            a_claim_left_out_as_foreign_is_provisioned_once_a_guest_serves_it,
            a_guest_cannot_hand_a_pod_the_node_through_a_symlink,
            attacks_under_the_containers_memory_limit,
            a_compile_bomb_under_the_containers_memory_limit,
            the_oom_killer_takes_the_compiler_not_the_controller,
            a_guest_blocked_on_a_pods_lock_never_delays_another_guests_claims,
            a_moved_grant_never_lets_a_delete_pass_for_gone,
        ],
    )
}
