//! Ready for operators, proven on a real control plane: `deploy/rbac.yaml` is enough and every verb
//! in it is needed; metrics, health endpoints and JSON logs say what the provisioner does.
//!
//! The cycle every test runs is the provisioner's whole job as `deploy/` configures it
//! (`--add-pv-finalizer`, leader election when the binary has it): a claim whose guest fails once
//! (a repeated event, so a patched event series) and then provisions, the PV's protection
//! finalizer, and the claim's deletion down to PV and storage gone. The baseline runs it as the
//! service account `deploy/rbac.yaml` binds; each `without_*` test binds a spare identity to
//! `deploy/rbac.yaml` minus one verb and shows the cycle then breaks.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::Event as EventV1;
use k8s_openapi::api::core::v1::{Node, PersistentVolume};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client, ResourceExt};
use serde::Deserialize;
use serde_json::json;
use wp_harness::{ControlPlane, Process, RBAC_YAML, wait_for};

use common::e2e::{Fixture, free_port, http_get, uid};
use common::suite::{Suite, Test};
use common::{PluginsDir, dir_guest};

/// How long one step of the cycle may take before the cycle counts as broken.
const STEP: Duration = Duration::from_secs(25);
const PV_FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
const LEASE_NAMESPACE: &str = "wasm-provisioner";

/// The ClusterRole and the leader-election Role of `deploy/rbac.yaml`.
#[derive(Clone)]
struct DeployRbac {
    cluster: Vec<PolicyRule>,
    leases: Vec<PolicyRule>,
}

impl DeployRbac {
    fn load() -> anyhow::Result<DeployRbac> {
        let mut cluster = None;
        let mut leases = None;
        for document in serde_yaml::Deserializer::from_str(RBAC_YAML) {
            let value = serde_yaml::Value::deserialize(document)?;
            match value.get("kind").and_then(|k| k.as_str()) {
                Some("ClusterRole") => {
                    let role: ClusterRole = serde_yaml::from_value(value)?;
                    cluster = role.rules;
                }
                Some("Role") => {
                    let role: Role = serde_yaml::from_value(value)?;
                    leases = role.rules;
                }
                _ => {}
            }
        }
        Ok(DeployRbac {
            cluster: cluster.context("deploy/rbac.yaml has no ClusterRole rules")?,
            leases: leases.context("deploy/rbac.yaml has no Role rules")?,
        })
    }

    /// One variant per verb, API group and resource of every rule: the same RBAC minus that one.
    fn minus_one_variants(&self, with_leases: bool) -> Vec<Variant> {
        let mut variants = Vec::new();
        let sets: [(&str, &Vec<PolicyRule>); 2] =
            [("cluster", &self.cluster), ("leases", &self.leases)];
        for (set, rules) in sets {
            if set == "leases" && !with_leases {
                continue;
            }
            for (index, rule) in rules.iter().enumerate() {
                let resources = rule.resources.clone().unwrap_or_default();
                let what = resources.join("-");
                let mut removals: Vec<(String, PolicyRule)> = Vec::new();
                for verb in &rule.verbs {
                    let mut smaller = rule.clone();
                    smaller.verbs.retain(|v| v != verb);
                    removals.push((format!("{what}_{verb}"), smaller));
                }
                let groups = rule.api_groups.clone().unwrap_or_default();
                if groups.len() > 1 {
                    for group in &groups {
                        let mut smaller = rule.clone();
                        smaller.api_groups =
                            Some(groups.iter().filter(|g| *g != group).cloned().collect());
                        removals.push((format!("{what}_group_{group}"), smaller));
                    }
                }
                if resources.len() > 1 {
                    for resource in &resources {
                        let mut smaller = rule.clone();
                        smaller.resources = Some(
                            resources
                                .iter()
                                .filter(|r| *r != resource)
                                .cloned()
                                .collect(),
                        );
                        removals.push((format!("{what}_resource_{resource}"), smaller));
                    }
                }
                for (name, smaller) in removals {
                    let mut rbac = self.clone();
                    let target = if set == "cluster" {
                        &mut rbac.cluster
                    } else {
                        &mut rbac.leases
                    };
                    if smaller.verbs.is_empty() {
                        target.remove(index);
                    } else {
                        target[index] = smaller;
                    }
                    let removed_check = removed_access(rule, &name);
                    variants.push(Variant {
                        name: name.replace(['.', '/'], "-"),
                        rbac,
                        removed: removed_check,
                    });
                }
            }
        }
        variants
    }
}

/// The (verb, group, resource) a variant lost, to confirm the authorizer sees the removal.
fn removed_access(rule: &PolicyRule, name: &str) -> (String, String, String) {
    let group = rule.api_groups.clone().unwrap_or_default();
    let resource = rule.resources.clone().unwrap_or_default();
    let verb = rule
        .verbs
        .iter()
        .find(|v| name.ends_with(&format!("_{v}")))
        .cloned()
        .unwrap_or_else(|| rule.verbs[0].clone());
    let group = group
        .iter()
        .find(|g| name.ends_with(&format!("_group_{g}")))
        .or(group.first())
        .cloned()
        .unwrap_or_default();
    let resource = resource
        .iter()
        .find(|r| name.ends_with(&format!("_resource_{r}")))
        .or(resource.first())
        .cloned()
        .unwrap_or_default();
    (verb, group, resource)
}

#[derive(Clone)]
struct Variant {
    name: String,
    rbac: DeployRbac,
    removed: (String, String, String),
}

/// The spare identities, handed out one test at a time.
struct Identities {
    free: Mutex<Vec<usize>>,
    available: Condvar,
}

impl Identities {
    fn new() -> Identities {
        Identities {
            free: Mutex::new((1..=wp_harness::RESTRICTED_IDENTITIES).collect()),
            available: Condvar::new(),
        }
    }

    fn take(&self) -> usize {
        let mut free = self.free.lock().expect("identities");
        loop {
            if let Some(n) = free.pop() {
                return n;
            }
            free = self.available.wait(free).expect("identities");
        }
    }

    fn give_back(&self, n: usize) {
        self.free.lock().expect("identities").push(n);
        self.available.notify_one();
    }
}

/// Flags of `wasm-provisioner run --help`.
fn run_help() -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args(["run", "--help"])
        .output()
        .expect("run --help");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn has_leader_election() -> bool {
    run_help().contains("--leader-election ") || run_help().contains("--leader-election\n")
}

/// One run of the cycle: its fixture (namespace, provisioner name), guest state and process.
struct Cycle {
    fx: Fixture,
    class: String,
    storage: tempfile::TempDir,
    plugins: PluginsDir,
    process: Process,
    metrics: SocketAddr,
}

fixture_world!(Cycle);

impl Cycle {
    /// Starts `wasm-provisioner run` as `kubeconfig` with the flags `deploy/deployment.yaml` uses;
    /// with `node`, as `deploy/node/` runs it (`--node-deployment` on a Node of its own).
    async fn start(
        cp: &Arc<ControlPlane>,
        kubeconfig: &Path,
        tag: &str,
        node: bool,
    ) -> anyhow::Result<Cycle> {
        let fx = Fixture::new(cp.clone(), "ops", tag).await?;
        let storage = tempfile::tempdir()?;
        let plugins = dir_guest("scripted", &fx.provisioner, storage.path(), "/state");
        let metrics = free_port();
        let mut cmd = fx.provisioner_command(plugins.path(), kubeconfig);
        cmd.args(["--add-pv-finalizer", "--log-format", "json"])
            .args(["--metrics-address", &metrics.to_string()])
            .args(["--instance-name", tag]);
        if node {
            let name = fx.ns.clone();
            let object: Node = serde_json::from_value(json!({"metadata": {"name": name}}))?;
            match Api::<Node>::all(fx.admin.clone())
                .create(&PostParams::default(), &object)
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.is_already_exists() => {}
                Err(error) => return Err(error).context("create node"),
            }
            cmd.args(["--node-deployment", "--node-name", &name])
                .args(["--node-deployment-base-delay", "100ms"])
                .args(["--node-deployment-max-delay", "300ms"])
                .env_remove("NODE_NAME");
        }
        if has_leader_election() {
            // Per-claim mode uses get, create, update and delete of leases; list and watch are
            // the whole-controller campaign's lease watch, so those variants run that mode.
            // The intent log (configmaps) is written in leader mode only.
            let watching = tag.ends_with("leases-list")
                || tag.ends_with("leases-watch")
                || tag.contains("configmaps");
            let mode = if watching { "leader" } else { "per-claim" };
            cmd.args([
                "--leader-election=true",
                &format!("--leader-election-mode={mode}"),
                "--leader-election-namespace",
                LEASE_NAMESPACE,
                "--leader-election-lease-name",
                &fx.ns,
            ]);
        }
        let process = fx.spawn("provisioner", cmd)?;
        // The guest takes 2.5 s, longer than the default 2 s retry period, so every per-claim
        // lease is renewed (a lease `update`) while its claim is worked on.
        // The class allows expansion, so the cycle grows its claim too (claims/status patch).
        let mut class = fx
            .class("c")
            .params(&[("fail", "final"), ("failTimes", "1"), ("delayMs", "2500")])
            .allow_expansion();
        if node {
            // Node mode deletes only PVs pinned to the instance's node.
            class = class.param("pinToSelectedNode", "true");
        }
        let class = class.create().await?;
        Ok(Cycle {
            fx,
            class,
            storage,
            plugins,
            process,
            metrics,
        })
    }

    /// Runs the whole cycle on claim `name`; the error names the step that did not happen.
    async fn run(&self, name: &str) -> anyhow::Result<()> {
        let claim = self.claim(name).class(&self.class).create().await?;
        let uid = uid(&claim);
        let claims = self.claims();
        let pv_name = wait_for(&format!("claim {name} Bound"), STEP, || async {
            let c = claims.get(name).await?;
            let bound = c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
            Ok(bound.then(|| c.spec.and_then(|s| s.volume_name)).flatten())
        })
        .await?;
        let pvs: Api<PersistentVolume> = Api::all(self.admin.clone());
        wait_for("the PV protection finalizer", STEP, || async {
            let pv = pvs.get(&pv_name).await?;
            Ok(pv
                .finalizers()
                .iter()
                .any(|f| f == PV_FINALIZER)
                .then_some(()))
        })
        .await?;
        let events: Api<EventV1> = Api::namespaced(self.admin.clone(), &self.ns);
        wait_for(
            "events Provisioning (a series of 2), ProvisioningFailed, ProvisioningSucceeded",
            STEP,
            || async {
                let list = events.list(&ListParams::default()).await?;
                let about: Vec<&EventV1> = list
                    .items
                    .iter()
                    .filter(|e| e.involved_object.uid.as_deref() == Some(&uid))
                    .collect();
                let reason = |r: &str| {
                    about
                        .iter()
                        .find(|e| e.reason.as_deref() == Some(r))
                        .copied()
                };
                let series = reason("Provisioning")
                    .and_then(|e| e.count)
                    .is_some_and(|count| count >= 2);
                Ok((series
                    && reason("ProvisioningFailed").is_some()
                    && reason("ProvisioningSucceeded").is_some())
                .then_some(()))
            },
        )
        .await?;
        self.resize(name, "2Gi").await?;
        wait_for(&format!("claim {name} grown to 2Gi"), STEP, || async {
            let c = claims.get(name).await?;
            let capacity = c.status.and_then(|s| s.capacity).unwrap_or_default();
            Ok((capacity.get("storage").map(|q| q.0.as_str()) == Some("2Gi")).then_some(()))
        })
        .await?;
        self.claims().delete(name, &DeleteParams::default()).await?;
        wait_for(&format!("PV {pv_name} deleted"), STEP, || async {
            Ok(pvs.get_opt(&pv_name).await?.is_none().then_some(()))
        })
        .await?;
        let dir = self.storage.path().join(&pv_name);
        wait_for("storage deleted", STEP, || async {
            Ok((!dir.exists()).then_some(()))
        })
        .await?;
        Ok(())
    }

    fn log(&self) -> String {
        self.process.log_tail(60)
    }
}

/// Binds identity `n` to exactly `rbac` and waits until the authorizer applies it.
async fn bind(
    cp: &ControlPlane,
    admin: &Client,
    n: usize,
    variant: &Variant,
) -> anyhow::Result<()> {
    let name = format!("ops-{}", variant.name);
    let user = cp.restricted_user(n);
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": variant.rbac.cluster,
    }))?;
    Api::<ClusterRole>::all(admin.clone())
        .create(&PostParams::default(), &role)
        .await?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}],
    }))?;
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await?;
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
        "rules": variant.rbac.leases,
    }))?;
    Api::<Role>::namespaced(admin.clone(), LEASE_NAMESPACE)
        .create(&PostParams::default(), &role)
        .await?;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": LEASE_NAMESPACE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}],
    }))?;
    Api::<RoleBinding>::namespaced(admin.clone(), LEASE_NAMESPACE)
        .create(&PostParams::default(), &binding)
        .await?;
    // Effective when the lost verb is denied and a kept one allowed (the cache lags writes).
    let (verb, group, resource) = &variant.removed;
    let reviews: Api<SubjectAccessReview> = Api::all(admin.clone());
    let allowed = |verb: String, group: String, resource: String| {
        let reviews = reviews.clone();
        let user = user.clone();
        async move {
            let review: SubjectAccessReview = serde_json::from_value(json!({
                "spec": {
                    "user": user,
                    "groups": ["system:authenticated"],
                    "resourceAttributes": {"verb": verb, "group": group, "resource": resource, "namespace": LEASE_NAMESPACE},
                }
            }))?;
            let answer = reviews.create(&PostParams::default(), &review).await?;
            anyhow::Ok(answer.status.is_some_and(|s| s.allowed))
        }
    };
    wait_for(
        "the variant's RBAC in effect",
        Duration::from_secs(30),
        || async {
            let lost = allowed(verb.clone(), group.clone(), resource.clone()).await?;
            let kept = allowed(
                "list".into(),
                String::new(),
                "persistentvolumeclaims".into(),
            )
            .await?
                || allowed("watch".into(), String::new(), "persistentvolumes".into()).await?;
            Ok((!lost && kept).then_some(()))
        },
    )
    .await
}

async fn unbind(admin: &Client, variant: &Variant) {
    let name = format!("ops-{}", variant.name);
    let dp = DeleteParams::default();
    let _ = Api::<ClusterRoleBinding>::all(admin.clone())
        .delete(&name, &dp)
        .await;
    let _ = Api::<ClusterRole>::all(admin.clone())
        .delete(&name, &dp)
        .await;
    let _ = Api::<RoleBinding>::namespaced(admin.clone(), LEASE_NAMESPACE)
        .delete(&name, &dp)
        .await;
    let _ = Api::<Role>::namespaced(admin.clone(), LEASE_NAMESPACE)
        .delete(&name, &dp)
        .await;
}

/// `deploy/rbac.yaml` minus one verb: the cycle must break, and the log must show why.
async fn without(
    cp: Arc<ControlPlane>,
    ids: Arc<Identities>,
    variant: Variant,
) -> anyhow::Result<()> {
    let admin = cp.admin_client().await?;
    let n = tokio::task::spawn_blocking({
        let ids = ids.clone();
        move || ids.take()
    })
    .await?;
    let outcome = async {
        bind(&cp, &admin, n, &variant).await?;
        let kubeconfig = cp.restricted_kubeconfig(n).to_owned();
        let tag = format!("w-{}", variant.name).replace('_', "-").to_lowercase();
        // The node verbs are only used in node-local mode: run that cycle for them.
        let node = variant.name.starts_with("nodes_");
        let mut cycle = Cycle::start(&cp, &kubeconfig, &tag, node).await?;
        let result = cycle.run("data").await;
        // A clean stop: a replica deletes its empty intent log on the way out (configmaps
        // delete), so that verb is part of the cycle too.
        if cycle.process.terminate_within(Duration::from_secs(20)).is_err() {
            cycle.process.kill();
        }
        let log = cycle.process.log();
        let refused = log.contains("forbidden") || log.contains("Forbidden");
        match result {
            // Without `watch` kube-runtime's watcher falls back to re-listing after a backoff,
            // so a short cycle can still finish; the refused requests show the verb is used.
            Ok(()) if refused => {
                eprintln!(
                    "without {}: the cycle finished only by degraded polling; the provisioner logged refused requests",
                    variant.name
                );
                Ok(())
            }
            Ok(()) => bail!(
                "the cycle completed without {:?} and nothing was refused: that permission is not needed and should leave deploy/rbac.yaml",
                variant.removed
            ),
            Err(step) => {
                ensure!(
                    refused,
                    "the cycle broke ({step:#}) but the log shows no forbidden request:\n{}",
                    cycle.log()
                );
                eprintln!("without {}: {step:#}", variant.name);
                Ok(())
            }
        }
    }
    .await;
    unbind(&admin, &variant).await;
    ids.give_back(n);
    outcome
}

/// Peak and current resident set size of a process, in KiB, from /proc.
fn rss_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// The baseline: the deployed identity runs the cycle; health, metrics and logs tell the story.
async fn deploy_rbac_runs_the_cycle_with_health_metrics_and_logs(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let kubeconfig = cp.provisioner_kubeconfig().to_owned();
    let cycle = Cycle::start(&cp, &kubeconfig, "baseline", false).await?;
    let address = cycle.metrics;
    wait_for("/healthz 200", STEP, || async {
        Ok(matches!(http_get(address, "/healthz").await, Ok((200, _))).then_some(()))
    })
    .await
    .with_context(|| cycle.log())?;
    wait_for("/readyz 200", STEP, || async {
        Ok(matches!(http_get(address, "/readyz").await, Ok((200, _))).then_some(()))
    })
    .await
    .with_context(|| cycle.log())?;
    for round in 0..3 {
        cycle
            .run(&format!("data-{round}"))
            .await
            .with_context(|| cycle.log())?;
    }
    let log = cycle.process.log();
    ensure!(
        !log.contains("forbidden") && !log.contains("Forbidden"),
        "the deployed RBAC refused a request:\n{}",
        cycle.log()
    );
    let (status, metrics) = http_get(address, "/metrics").await?;
    ensure!(status == 200, "/metrics answered {status}");
    let class = &cycle.class;
    for expected in [
        format!("controller_persistentvolumeclaim_provision_total{{class=\"{class}\",source=\"\"}} 3"),
        format!("controller_persistentvolumeclaim_provision_failed_total{{class=\"{class}\",source=\"\"}} 3"),
        format!("controller_persistentvolumeclaim_provision_duration_seconds_count{{class=\"{class}\",source=\"\"}} 3"),
        format!("controller_persistentvolume_delete_total{{class=\"{class}\"}} 3"),
        format!("controller_persistentvolume_delete_duration_seconds_count{{class=\"{class}\"}} 3"),
        "wasm_provisioner_guest_calls_total{guest=\"scripted\",operation=\"provision\",outcome=\"final\"} 3".into(),
        "wasm_provisioner_guest_calls_total{guest=\"scripted\",operation=\"provision\",outcome=\"ok\"} 3".into(),
        "wasm_provisioner_guest_calls_total{guest=\"scripted\",operation=\"delete\",outcome=\"ok\"} 3".into(),
        "wasm_provisioner_reconcile_errors_total{controller=\"claims\",kind=\"final\"} 3".into(),
        "wasm_provisioner_guests_loaded 1".into(),
    ] {
        ensure!(metrics.contains(&expected), "missing {expected} in\n{metrics}");
    }
    // Deleting never fails on the happy path (a conflict with the pv-protection controller once
    // made every delete fail once and call the guest twice; these series showed it).
    ensure!(
        !metrics.contains("controller_persistentvolume_delete_failed_total{"),
        "a delete failed:\n{metrics}"
    );
    for series in [
        "workqueue_adds_total{name=\"claims\"}",
        "workqueue_retries_total{name=\"claims\"}",
        "workqueue_work_duration_seconds_count{name=\"volumes\"}",
    ] {
        ensure!(metrics.contains(series), "missing {series}");
    }
    // JSON logs: the success lines carry the operation's span with every identifying field.
    let line = |message: &str| -> anyhow::Result<serde_json::Value> {
        let text = log
            .lines()
            .find(|l| l.contains(&format!("\"message\":\"{message}\"")))
            .with_context(|| format!("no JSON log line {message:?} in\n{}", cycle.log()))?;
        Ok(serde_json::from_str(text)?)
    };
    let provisioned = line("provisioned")?;
    let span = &provisioned["span"];
    ensure!(span["name"] == "claim", "{provisioned}");
    ensure!(
        span["namespace"] == cycle.ns.as_str() && span["class"] == class.as_str(),
        "{provisioned}"
    );
    ensure!(
        span["claim"]
            .as_str()
            .is_some_and(|c| c.starts_with("data-")),
        "{provisioned}"
    );
    ensure!(
        span["pv"].as_str().is_some_and(|p| p.starts_with("pvc-")) && span["guest"] == "scripted",
        "{provisioned}"
    );
    let deleted = line("volume deleted")?;
    let span = &deleted["span"];
    ensure!(
        span["name"] == "volume" && span["class"] == class.as_str(),
        "{deleted}"
    );
    ensure!(
        span["namespace"] == cycle.ns.as_str() && span["guest"] == "scripted",
        "{deleted}"
    );
    ensure!(
        span["pv"].as_str().is_some_and(|p| p.starts_with("pvc-")),
        "{deleted}"
    );
    if let Some((peak, now)) = rss_kib(cycle.process.pid()) {
        let profile = if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        };
        eprintln!(
            "MEASURED provisioner RSS after 3 cycles ({profile} test build, 1 guest): peak {} MiB, now {} MiB",
            peak / 1024,
            now / 1024
        );
    }
    Ok(())
}

/// Two replicas with the deployed RBAC: one leads; when it dies the other takes over.
async fn leader_election_hands_over_with_deploy_rbac(cp: Arc<ControlPlane>) -> anyhow::Result<()> {
    let kubeconfig = cp.provisioner_kubeconfig().to_owned();
    let mut first = Cycle::start(&cp, &kubeconfig, "le", false).await?;
    first.run("before").await.with_context(|| first.log())?;
    // A second replica of the same provisioner, same lease.
    let mut cmd = first.provisioner_command(first.plugins.path(), &kubeconfig);
    cmd.args(["--add-pv-finalizer", "--log-format", "json"])
        .args(["--instance-name", "le-2"])
        .args(["--leader-election=true"])
        .args(["--leader-election-namespace", LEASE_NAMESPACE])
        .args(["--leader-election-lease-name", &first.ns]);
    let mut second = first.spawn("le-2", cmd)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    first.process.kill();
    // The standby acquires the expired lease and serves the next claim.
    let result = async {
        first.claim("after").class(&first.class).create().await?;
        let claims = first.claims();
        wait_for(
            "claim after Bound by the new leader",
            Duration::from_secs(90),
            || async {
                let c = claims.get("after").await?;
                Ok((c.status.and_then(|s| s.phase).as_deref() == Some("Bound")).then_some(()))
            },
        )
        .await
    }
    .await;
    let log = second.log_tail(40);
    let logs = [first.process.log(), second.log()];
    second.kill();
    result.with_context(|| log)?;
    // The lease watch (instant takeover) and every lease verb must be allowed by deploy/rbac.yaml.
    for (replica, log) in logs.iter().enumerate() {
        let refused: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("forbidden") || l.contains("Forbidden"))
            .take(5)
            .collect();
        ensure!(
            refused.is_empty(),
            "replica {} got forbidden responses with the deployed RBAC:\n{}",
            replica + 1,
            refused.join("\n")
        );
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let rbac = match DeployRbac::load() {
        Ok(rbac) => rbac,
        Err(error) => {
            eprintln!("deploy/rbac.yaml: {error:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let leader_election = has_leader_election();
    // Identities are admin on an attached cluster, so RBAC cannot be proven there.
    let attached = std::env::var_os(wp_harness::ATTACH_KUBECONFIG_ENV).is_some();
    if attached {
        eprintln!("attached to WP_KUBECONFIG: identities are admin there, so RBAC is not proven");
    }
    let mut tests = vec![
        Test::new(
            "deploy_rbac_runs_the_cycle_with_health_metrics_and_logs",
            |cp| Box::pin(deploy_rbac_runs_the_cycle_with_health_metrics_and_logs(cp)),
        ),
        // Only meaningful when the binary elects leaders (`run --help` has the flags).
        Test::new("leader_election_hands_over_with_deploy_rbac", |cp| {
            Box::pin(leader_election_hands_over_with_deploy_rbac(cp))
        })
        .ignored_if(!leader_election),
    ];
    let ids = Arc::new(Identities::new());
    for variant in rbac.minus_one_variants(leader_election) {
        let ids = ids.clone();
        let name = format!("without_{}", variant.name);
        tests.push(
            Test::new(name, move |cp| Box::pin(without(cp, ids, variant))).ignored_if(attached),
        );
    }
    let suite = Suite {
        what: "operator",
        guests: &["scripted"],
        timeout: Duration::from_secs(240),
        one_at_a_time: false,
    };
    common::suite::run_suite(suite, tests)
}
