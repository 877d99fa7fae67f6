//! High availability against a real control plane: replicas of `wasm-provisioner run` as separate
//! processes sharing one storage directory, leader failover by SIGKILL and SIGTERM, per-claim
//! mode, and an API-server outage longer than the renew deadline.
//!
//! Every replica runs the `scripted` guest with its own grant file whose `[config] instance`
//! names the replica, so `calls.log` (shared) says which replica called the guest and when.
//! Tests run one at a time: they load the 2 cores with hundreds of claims, and one stops the
//! API server.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, PersistentVolume, PersistentVolumeClaim};
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;
use wp_harness::{ControlPlane, Process, wait_for};

use common::PluginsDir;
use common::e2e::Fixture;
use common::suite::{Suite, Test};

const LEASE_NAMESPACE: &str = "wasm-provisioner";
const LEASE_DURATION: Duration = Duration::from_secs(15);
const RETRY_PERIOD: Duration = Duration::from_secs(2);
const RENEW_DEADLINE: Duration = Duration::from_secs(10);

/// One replica: its plugins directory (own grant file, shared storage) and its process.
struct Replica {
    name: String,
    plugins: PluginsDir,
    process: Option<Process>,
}

/// One test's world: the fixture, shared storage, replicas; the lease is named after the namespace.
struct World {
    fx: Fixture,
    storage: tempfile::TempDir,
    replicas: Vec<Replica>,
}

fixture_world!(World);

impl World {
    /// The last lines of every replica's log whose lines mention leases, for failure messages.
    fn replica_log_tails(&self) -> String {
        self.replicas
            .iter()
            .filter_map(|r| r.process.as_ref().map(|p| (r, p)))
            .map(|(r, p)| {
                let log = p.log();
                let lines: Vec<&str> = log.lines().filter(|l| l.contains("lease")).collect();
                let tail = lines[lines.len().saturating_sub(15)..].join("\n");
                format!("\n--- {} ---\n{tail}", r.name)
            })
            .collect()
    }

    async fn new(cp: Arc<ControlPlane>, name: &str, replicas: usize) -> anyhow::Result<World> {
        let fx = Fixture::new(cp, "ha", name).await?;
        let storage = tempfile::tempdir()?;
        let replicas = (1..=replicas)
            .map(|n| {
                let name = format!("r{n}");
                let plugins = PluginsDir::new();
                let grant = common::dir_grant(&fx.provisioner, storage.path(), "/state", "")
                    + &format!("instance = \"{name}\"\n");
                plugins.add("scripted", "scripted", &grant);
                Replica {
                    name,
                    plugins,
                    process: None,
                }
            })
            .collect();
        Ok(World {
            fx,
            storage,
            replicas,
        })
    }

    /// Two replicas, started; returns the world, the leader's identity and its replica index.
    async fn with_leader(
        cp: Arc<ControlPlane>,
        name: &str,
    ) -> anyhow::Result<(World, (String, usize))> {
        let mut w = World::new(cp, name, 2).await?;
        w.start(0, &[])?;
        w.start(1, &[])?;
        let leader = w.wait_leader(Duration::from_secs(30)).await?;
        Ok((w, leader))
    }

    fn lease_name(&self) -> String {
        self.ns.clone()
    }

    /// Starts replica `i` with fast retries, a generous API budget, and election on.
    fn start(&mut self, i: usize, extra: &[&str]) -> anyhow::Result<()> {
        let lease = self.lease_name();
        let replica = &self.replicas[i];
        let mut cmd =
            self.provisioner_command(replica.plugins.path(), self.cp.provisioner_kubeconfig());
        cmd.args(["--kube-api-qps", "200", "--kube-api-burst", "400"])
            .args(["--worker-threads", "16"])
            .args(["--instance-name", &replica.name])
            .args(["--leader-election-namespace", LEASE_NAMESPACE])
            .args(["--leader-election-lease-name", &lease])
            .args(extra)
            .env("RUST_LOG", "info,wasm_provisioner=debug,kube=warn");
        let process = self.fx.spawn(&replica.name, cmd)?;
        self.replicas[i].process = Some(process);
        Ok(())
    }

    fn log_of(&self, i: usize) -> String {
        self.replicas[i]
            .process
            .as_ref()
            .map(|p| p.log())
            .unwrap_or_default()
    }

    async fn create_class(&self, params: &[(&str, &str)]) -> anyhow::Result<String> {
        self.class("c").params(params).create().await
    }

    /// Creates `count` claims named `c-<n>` (20 requests at a time).
    async fn create_claims(&self, class: &str, count: usize) -> anyhow::Result<()> {
        self.create_claims_from(class, 0, count).await
    }

    async fn create_claims_from(
        &self,
        class: &str,
        first: usize,
        count: usize,
    ) -> anyhow::Result<()> {
        let claims = self.claims();
        futures::stream::iter(first..first + count)
            .map(|n| {
                let claims = claims.clone();
                let claim: PersistentVolumeClaim = serde_json::from_value(json!({
                    "metadata": {"name": format!("c-{n}"), "namespace": self.ns},
                    "spec": {
                        "storageClassName": class,
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}},
                    }
                }))
                .expect("claim");
                async move { claims.create(&PostParams::default(), &claim).await }
            })
            .buffer_unordered(20)
            .try_collect::<Vec<_>>()
            .await?;
        Ok(())
    }

    async fn wait_all_bound(&self, count: usize, timeout: Duration) -> anyhow::Result<()> {
        wait_for(&format!("{count} claims Bound"), timeout, || async {
            Ok((self.bound_count().await? == count).then_some(()))
        })
        .await
        .with_context(|| self.logs())
    }

    /// PVs whose claim lives in this world's namespace, by claim UID.
    async fn volumes_by_claim(&self) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
        let mut by_claim: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for pv in Api::<PersistentVolume>::all(self.admin.clone())
            .list(&ListParams::default())
            .await?
            .items
        {
            let Some(claim_ref) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) else {
                continue;
            };
            if claim_ref.namespace.as_deref() == Some(self.ns.as_str()) {
                by_claim
                    .entry(claim_ref.uid.clone().unwrap_or_default())
                    .or_default()
                    .push(pv.name_any());
            }
        }
        Ok(by_claim)
    }

    /// Every claim has exactly one PV, named after it, and every storage directory has its PV.
    async fn check_one_pv_each_and_no_orphans(&self, count: usize) -> anyhow::Result<()> {
        let by_claim = self.volumes_by_claim().await?;
        let claims = self.claims().list(&ListParams::default()).await?.items;
        ensure!(claims.len() == count, "{} claims", claims.len());
        for claim in &claims {
            let uid = claim.metadata.uid.clone().unwrap_or_default();
            let pvs = by_claim.get(&uid).cloned().unwrap_or_default();
            ensure!(
                pvs == vec![format!("pvc-{uid}")],
                "claim {} has PVs {pvs:?}",
                claim.name_any()
            );
        }
        let pv_names: BTreeSet<String> = by_claim.values().flatten().cloned().collect();
        let dirs: BTreeSet<String> = std::fs::read_dir(self.storage.path())?
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        let orphans: Vec<&String> = dirs.difference(&pv_names).collect();
        ensure!(orphans.is_empty(), "storage without a PV: {orphans:?}");
        ensure!(
            dirs.len() == count,
            "{} storage directories for {count} claims",
            dirs.len()
        );
        Ok(())
    }

    /// `calls.log` lines as (operation, pv, replica, unix ms).
    fn calls(&self) -> Vec<(String, String, String, u128)> {
        std::fs::read_to_string(self.storage.path().join("calls.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                let mut parts = line.split(' ');
                Some((
                    parts.next()?.to_string(),
                    parts.next()?.to_string(),
                    parts.next()?.to_string(),
                    parts.next()?.parse().ok()?,
                ))
            })
            .collect()
    }

    /// Provision calls per PV name.
    fn provisions_per_pv(&self) -> BTreeMap<String, Vec<String>> {
        let mut per_pv: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (op, pv, replica, _) in self.calls() {
            if op == "provision" {
                per_pv.entry(pv).or_default().push(replica);
            }
        }
        per_pv
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.admin.clone(), LEASE_NAMESPACE)
    }

    async fn holder(&self) -> anyhow::Result<Option<String>> {
        Ok(self
            .leases()
            .get_opt(&self.lease_name())
            .await?
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .filter(|h| !h.is_empty()))
    }

    /// Waits for a leader and returns (its identity, the index of its replica).
    async fn wait_leader(&self, timeout: Duration) -> anyhow::Result<(String, usize)> {
        let identity = wait_for("a leader", timeout, || self.holder())
            .await
            .with_context(|| self.logs())?;
        let index = wait_for("the leader's log line", Duration::from_secs(5), || async {
            Ok((0..self.replicas.len()).find(|&i| {
                self.log_of(i)
                    .lines()
                    .any(|l| l.contains("became leader") && l.contains(&identity))
            }))
        })
        .await?;
        Ok((identity, index))
    }

    /// Waits until someone other than `old` holds the lease; returns the new holder.
    async fn wait_new_holder(&self, old: &str, timeout: Duration) -> anyhow::Result<String> {
        wait_for("a new lease holder", timeout, || async {
            Ok(self.holder().await?.filter(|h| h != old))
        })
        .await
        .with_context(|| self.logs())
    }
}

fn distribution(per_pv: &BTreeMap<String, Vec<String>>) -> BTreeMap<String, usize> {
    let mut by_replica = BTreeMap::new();
    for replicas in per_pv.values() {
        for r in replicas {
            *by_replica.entry(r.clone()).or_insert(0) += 1;
        }
    }
    by_replica
}

async fn two_replicas_200_claims_only_the_leader_calls_guests(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let (w, (_, leader)) = World::with_leader(cp, "leader-200").await?;
    let class = w.create_class(&[]).await?;
    let started = Instant::now();
    w.create_claims(&class, 200).await?;
    w.wait_all_bound(200, Duration::from_secs(300)).await?;
    let elapsed = started.elapsed();
    println!(
        "    200 claims bound in {:.1} s ({:.1} claims/s), 2 replicas, leader mode",
        elapsed.as_secs_f64(),
        200.0 / elapsed.as_secs_f64()
    );
    w.check_one_pv_each_and_no_orphans(200).await?;
    let per_pv = w.provisions_per_pv();
    ensure!(per_pv.len() == 200, "{} PVs provisioned", per_pv.len());
    let repeated: Vec<_> = per_pv.iter().filter(|(_, r)| r.len() != 1).collect();
    ensure!(
        repeated.is_empty(),
        "guest called more than once: {repeated:?}"
    );
    let callers: BTreeSet<&String> = per_pv.values().flatten().collect();
    let leader_name = &w.replicas[leader].name;
    ensure!(
        callers == BTreeSet::from([leader_name]),
        "only the leader {leader_name} called the guest: {:?}",
        distribution(&per_pv)
    );
    let standby = 1 - leader;
    ensure!(
        !w.log_of(standby).contains("became leader"),
        "the standby never led"
    );
    Ok(())
}

async fn sigkill_of_the_leader_mid_load_fails_over_without_duplicates_or_orphans(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let (mut w, (old, leader)) = World::with_leader(cp, "sigkill").await?;
    // Slow provisioning keeps work in flight when the leader dies.
    let class = w.create_class(&[("delayMs", "1000")]).await?;
    let count = 80;
    w.create_claims(&class, count).await?;
    wait_for(
        "a quarter of the guest calls",
        Duration::from_secs(120),
        || async { Ok((w.calls().len() >= count / 4).then_some(())) },
    )
    .await
    .with_context(|| w.logs())?;
    w.replicas[leader].process.as_mut().expect("leader").kill();
    let killed = Instant::now();
    let in_flight = w.calls().len();
    let new = w
        .wait_new_holder(
            &old,
            LEASE_DURATION + RETRY_PERIOD + Duration::from_secs(10),
        )
        .await?;
    let takeover = killed.elapsed();
    let bound = w.bound_count().await?;
    println!(
        "    SIGKILL takeover: {:.2} s (bound: lease duration {} s + retry period {} s); at the kill {in_flight} of {count} guest calls made, {bound} claims bound when the new leader took over",
        takeover.as_secs_f64(),
        LEASE_DURATION.as_secs(),
        RETRY_PERIOD.as_secs()
    );
    ensure!(
        takeover <= LEASE_DURATION + RETRY_PERIOD + Duration::from_millis(500),
        "takeover took {takeover:?}"
    );
    ensure!(new != old);
    w.wait_all_bound(count, Duration::from_secs(240)).await?;
    w.check_one_pv_each_and_no_orphans(count).await?;
    let survivor = &w.replicas[1 - leader].name;
    let after: Vec<_> = w.calls().into_iter().skip(in_flight).collect();
    ensure!(
        after.iter().all(|(_, _, r, _)| r == survivor),
        "after the kill only the survivor calls guests: {after:?}"
    );
    Ok(())
}

async fn sigterm_hands_the_lease_over_within_2_seconds(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let (mut w, (old, leader)) = World::with_leader(cp, "sigterm").await?;
    let class = w.create_class(&[]).await?;
    w.create_claims(&class, 5).await?;
    w.wait_all_bound(5, Duration::from_secs(60)).await?;
    let terminated = Instant::now();
    let process = w.replicas[leader].process.as_mut().expect("leader");
    process.send_sigterm();
    let new = w.wait_new_holder(&old, Duration::from_secs(20)).await?;
    let takeover = terminated.elapsed();
    let status = w.replicas[leader]
        .process
        .as_mut()
        .expect("leader")
        .terminate_async(Duration::from_secs(30))
        .await?;
    println!("    SIGTERM takeover: {:.3} s", takeover.as_secs_f64());
    ensure!(
        status.success(),
        "the old leader exits 0 after SIGTERM: {status}"
    );
    ensure!(
        takeover < Duration::from_secs(2),
        "takeover took {takeover:?}"
    );
    ensure!(
        w.log_of(leader).contains("released the lease"),
        "{}",
        w.log_of(leader)
    );
    // The new leader works: one more claim, provisioned by the other replica.
    w.create_claims_from(&class, 5, 1).await?;
    w.wait_all_bound(6, Duration::from_secs(60)).await?;
    let survivor = &w.replicas[1 - leader].name;
    let last = w.calls().into_iter().last().expect("calls");
    ensure!(&last.2 == survivor, "the new leader provisioned: {last:?}");
    // The lease tells the story: a LeaderElection event for each change.
    let lease = w.leases().get(&w.lease_name()).await?;
    let events: Api<Event> = Api::namespaced(w.admin.clone(), LEASE_NAMESPACE);
    let notes: Vec<String> = events
        .list(&ListParams::default().fields(&format!(
            "involvedObject.uid={}",
            lease.metadata.uid.clone().unwrap_or_default()
        )))
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("LeaderElection"))
        .filter_map(|e| e.message)
        .collect();
    ensure!(
        notes.iter().any(|n| n == &format!("{old} stopped leading"))
            && notes.iter().any(|n| n == &format!("{new} became leader")),
        "{notes:?}"
    );
    Ok(())
}

async fn per_claim_mode_three_replicas_200_claims_spread_exactly_once(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "per-claim", 3).await?;
    for i in 0..3 {
        w.start(i, &["--leader-election-mode", "per-claim"])?;
    }
    let class = w.create_class(&[]).await?;
    // Let all three replicas sync their caches before the claims arrive.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let started = Instant::now();
    w.create_claims(&class, 200).await?;
    w.wait_all_bound(200, Duration::from_secs(300)).await?;
    let elapsed = started.elapsed();
    w.check_one_pv_each_and_no_orphans(200).await?;
    let per_pv = w.provisions_per_pv();
    let repeated: Vec<_> = per_pv.iter().filter(|(_, r)| r.len() != 1).collect();
    ensure!(
        repeated.is_empty(),
        "guest called more than once: {repeated:?}"
    );
    ensure!(per_pv.len() == 200, "{} PVs provisioned", per_pv.len());
    let spread = distribution(&per_pv);
    println!(
        "    200 claims bound in {:.1} s ({:.1} claims/s), 3 replicas, per-claim mode; provisions per replica: {spread:?}",
        elapsed.as_secs_f64(),
        200.0 / elapsed.as_secs_f64()
    );
    ensure!(
        spread.len() > 1,
        "work spread over more than one replica: {spread:?}"
    );
    // Per-claim leases are deleted when their reconcile ends.
    let leases = w.leases();
    wait_for(
        "per-claim leases deleted",
        Duration::from_secs(30),
        || async {
            let left = leases
                .list(&ListParams::default().labels("wasm-provisioner.dev/lock=claim"))
                .await?
                .items
                .into_iter()
                .filter(|l| l.name_any().starts_with(&w.lease_name()))
                .count();
            Ok((left == 0).then_some(()))
        },
    )
    .await
    .with_context(|| format!("replica logs: {}", w.replica_log_tails()))?;
    Ok(())
}

async fn an_apiserver_outage_longer_than_the_renew_deadline_never_has_two_writers(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let (mut w, _) = World::with_leader(cp.clone(), "outage").await?;
    let class = w.create_class(&[("delayMs", "200")]).await?;
    w.create_claims(&class, 30).await?;
    wait_for("some claims bound", Duration::from_secs(60), || async {
        Ok((w.bound_count().await? >= 5).then_some(()))
    })
    .await?;
    let outage = RENEW_DEADLINE + Duration::from_secs(6);
    cp.stop_apiserver().await?;
    tokio::time::sleep(outage).await;
    cp.start_apiserver().await?;
    println!("    API server was down for {} s", outage.as_secs());
    w.wait_all_bound(30, Duration::from_secs(180)).await?;
    for replica in &mut w.replicas {
        ensure!(
            replica.process.as_mut().expect("running").is_running(),
            "replica {} kept running through the outage",
            replica.name
        );
    }
    w.check_one_pv_each_and_no_orphans(30).await?;
    // Guest calls in time order: the caller changes only when leadership changes hands.
    let mut calls = w.calls();
    calls.sort_by_key(|c| c.3);
    let switches = calls.windows(2).filter(|p| p[0].2 != p[1].2).count();
    let terms: usize = (0..2)
        .map(|i| w.log_of(i).matches("became leader").count())
        .sum();
    let lost: usize = (0..2)
        .map(|i| w.log_of(i).matches("lost the lease").count())
        .sum();
    println!("    leadership terms: {terms}, leases lost: {lost}, caller switches: {switches}");
    ensure!(
        switches < terms,
        "two replicas called guests in the same term: {switches} switches over {terms} terms"
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    let suite = Suite {
        what: "HA",
        guests: &["scripted"],
        timeout: Duration::from_secs(420),
        // One at a time: each test loads both cores, and the outage test stops the API server.
        one_at_a_time: true,
    };
    let tests: Vec<(&str, common::suite::TestFn)> = e2e_tests![
        two_replicas_200_claims_only_the_leader_calls_guests,
        sigkill_of_the_leader_mid_load_fails_over_without_duplicates_or_orphans,
        sigterm_hands_the_lease_over_within_2_seconds,
        per_claim_mode_three_replicas_200_claims_spread_exactly_once,
        an_apiserver_outage_longer_than_the_renew_deadline_never_has_two_writers,
    ];
    let tests = tests
        .into_iter()
        .map(|(name, test)| Test::new(name, test))
        .collect();
    common::suite::run_suite(suite, tests)
}
