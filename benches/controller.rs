//! Controller benchmarks against the local real control plane, printed as tables:
//!
//! * throughput: N claims provisioned (PVs exist, claims Bound) and deleted (PVs gone) by the
//!   provisioner with the hostpath guest, next to the API server's raw rate for the same client
//!   settings (N PVs created and deleted directly with the same QPS, burst and concurrency);
//! * API requests per claim, read from kube-apiserver's own request counters;
//! * memory: the provisioner's RSS with three guests, in an empty cluster and once its caches hold
//!   M claims bound to M PVs (settled to their identity, and whole as an informer keeps them);
//! * start-up: process start to "controller started".
//!
//! `WP_BENCH_CLAIMS` (default 1000) and `WP_BENCH_OBJECTS` (default 10000) size the runs;
//! `WP_BENCH_RUNS` (default 3) processes per memory figure; `WP_BENCH_PARTS` (default `throughput,memory`) picks the parts; `WP_BENCH_PROFILES` (indexes,
//! default all) picks the client profiles.
//! Nothing is asserted; figures go to stdout.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use wasm_provisioner::controller::ratelimit::RateLimiter;
use wp_harness::{ControlPlane, Process, wait_for};

const PROVISIONER: &str = "bench.wasm-provisioner.dev/hostpath";

struct Profile {
    name: &'static str,
    qps: f64,
    burst: u32,
    workers: usize,
    extra: &'static [&'static str],
}

const PROFILES: [Profile; 5] = [
    Profile {
        name: "defaults (qps 50, burst 100, 4 workers)",
        qps: 50.0,
        burst: 100,
        workers: 4,
        extra: &[],
    },
    Profile {
        name: "equal budget (qps 100, burst 200, 4 workers), intent log",
        qps: 100.0,
        burst: 200,
        workers: 4,
        extra: &[],
    },
    Profile {
        name: "equal budget, --intent-record=claim-finalizer",
        qps: 100.0,
        burst: 200,
        workers: 4,
        extra: &["--intent-record=claim-finalizer"],
    },
    Profile {
        name: "equal budget, --intent-record=off (no leak protection)",
        qps: 100.0,
        burst: 200,
        workers: 4,
        extra: &["--intent-record=off"],
    },
    Profile {
        name: "raised (qps 200, burst 400, 16 workers)",
        qps: 200.0,
        burst: 400,
        workers: 16,
        extra: &[],
    },
];

/// The profiles to run: `WP_BENCH_PROFILES` as comma-separated indexes into [`PROFILES`].
fn profiles() -> Vec<(usize, &'static Profile)> {
    let picked: Option<Vec<usize>> = std::env::var("WP_BENCH_PROFILES")
        .ok()
        .map(|v| v.split(',').filter_map(|i| i.trim().parse().ok()).collect());
    PROFILES
        .iter()
        .enumerate()
        .filter(|(i, _)| picked.as_ref().is_none_or(|p| p.contains(i)))
        .collect()
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// kube-apiserver's `apiserver_request_total`, summed by (verb, resource).
async fn request_counts(client: &Client) -> anyhow::Result<BTreeMap<(String, String), f64>> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await?;
    let mut counts = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let (labels, value) = line.rsplit_once(' ').unwrap_or((line, "0"));
        let label = |key: &str| {
            labels
                .split(&format!("{key}=\""))
                .nth(1)
                .and_then(|rest| rest.split('"').next())
                .unwrap_or("")
                .to_string()
        };
        let value: f64 = value.parse().unwrap_or(0.0);
        *counts
            .entry((label("verb"), label("resource")))
            .or_insert(0.0) += value;
    }
    Ok(counts)
}

fn pv(name: &str) -> PersistentVolume {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": format!("/tmp/raw/{name}")},
            "storageClassName": "raw-bench",
        }
    }))
    .expect("PV")
}

/// The API server's raw rate for one client: N PV creates, then N deletes.
async fn raw_rate(
    client: &Client,
    n: usize,
    p: &Profile,
    tag: &str,
) -> anyhow::Result<(Duration, Duration)> {
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let limiter = Arc::new(RateLimiter::new(p.qps, p.burst));
    let names: Vec<String> = (0..n).map(|i| format!("raw-{tag}-{i}")).collect();
    let start = Instant::now();
    futures::stream::iter(names.iter())
        .map(|name| {
            let (pvs, limiter) = (pvs.clone(), limiter.clone());
            async move {
                limiter.acquire().await;
                pvs.create(&PostParams::default(), &pv(name))
                    .await
                    .map(|_| ())
            }
        })
        .buffer_unordered(p.workers)
        .try_collect::<Vec<()>>()
        .await?;
    let create = start.elapsed();
    let start = Instant::now();
    futures::stream::iter(names.iter())
        .map(|name| {
            let (pvs, limiter) = (pvs.clone(), limiter.clone());
            async move {
                limiter.acquire().await;
                pvs.delete(name, &DeleteParams::default()).await.map(|_| ())
            }
        })
        .buffer_unordered(p.workers)
        .try_collect::<Vec<()>>()
        .await?;
    Ok((create, start.elapsed()))
}

struct Provisioned {
    pvs_exist: Duration,
    all_bound: Duration,
    all_gone: Duration,
    calls_per_claim: BTreeMap<String, f64>,
}

fn plugins_with(dir: &Path, storage: &Path, names: &[&str]) {
    for (i, name) in names.iter().enumerate() {
        let provisioner = if i == 0 {
            PROVISIONER.to_string()
        } else {
            format!("{PROVISIONER}-{i}")
        };
        std::fs::copy(
            common::guest_wasm("hostpath"),
            dir.join(format!("{name}.wasm")),
        )
        .unwrap();
        std::fs::write(
            dir.join(format!("{name}.toml")),
            common::dir_grant(&provisioner, storage, "/volumes", ""),
        )
        .unwrap();
    }
}

async fn provision_run(
    cp: &ControlPlane,
    admin: &Client,
    n: usize,
    p: &Profile,
    tag: &str,
) -> anyhow::Result<Provisioned> {
    let storage = tempfile::tempdir()?;
    let plugins = tempfile::tempdir()?;
    plugins_with(plugins.path(), storage.path(), &["hostpath"]);
    let ns = format!("bench-{tag}");
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
        )
        .await?;
    let class = format!("bench-{tag}");
    Api::<StorageClass>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": class}, "provisioner": PROVISIONER, "reclaimPolicy": "Delete"}))?,
        )
        .await?;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"));
    cmd.args(["run", "--plugins"])
        .arg(plugins.path())
        .arg("--kubeconfig")
        .arg(cp.provisioner_kubeconfig())
        .args([
            "--kube-api-qps",
            &p.qps.to_string(),
            "--kube-api-burst",
            &p.burst.to_string(),
        ])
        .args(["--worker-threads", &p.workers.to_string()])
        .args(p.extra)
        .args(["--leader-election=false"])
        // The intent log lives where the provisioner's Role is (deploy/rbac.yaml).
        .args(["--leader-election-namespace", "wasm-provisioner"])
        .env("RUST_LOG", "warn");
    let mut process = Process::spawn(cmd, cp.run_dir().join(format!("bench-{tag}.log")))?;
    let before = request_counts(admin).await?;

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), &ns);
    let pvs: Api<PersistentVolume> = Api::all(admin.clone());
    let start = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let claims = claims.clone();
            let class = class.clone();
            async move {
                let claim: PersistentVolumeClaim = serde_json::from_value(json!({
                    "metadata": {"name": format!("c{i}")},
                    "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
                }))?;
                claims.create(&PostParams::default(), &claim).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await?;
    let ours = |list: &[PersistentVolume]| {
        list.iter()
            .filter(|p| {
                p.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("pv.kubernetes.io/provisioned-by"))
                    .map(String::as_str)
                    == Some(PROVISIONER)
            })
            .count()
    };
    let long = Duration::from_secs(3600);
    wait_for("all PVs exist", long, || async {
        let list = pvs.list(&ListParams::default()).await?.items;
        Ok((ours(&list) >= n).then_some(()))
    })
    .await
    .with_context(|| process.log_tail(40))?;
    let pvs_exist = start.elapsed();
    wait_for("all claims Bound", long, || async {
        let list = claims.list(&ListParams::default()).await?.items;
        let bound = list
            .iter()
            .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
            .count();
        Ok((bound >= n).then_some(()))
    })
    .await?;
    let all_bound = start.elapsed();
    let after_provision = request_counts(admin).await?;

    let start = Instant::now();
    claims
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    wait_for("all PVs gone", long, || async {
        let list = pvs.list(&ListParams::default()).await?.items;
        Ok((ours(&list) == 0).then_some(()))
    })
    .await
    .with_context(|| process.log_tail(40))?;
    let all_gone = start.elapsed();
    let after_delete = request_counts(admin).await?;
    process.terminate()?;

    // Requests the provisioner makes (PV writes, claim patches, events); the PV controller in
    // kube-controller-manager updates PVs and claims too, but with PUT, not POST/PATCH/DELETE.
    let mut calls_per_claim = BTreeMap::new();
    for (phase, from, to) in [
        ("provision", &before, &after_provision),
        ("delete", &after_provision, &after_delete),
    ] {
        for (verb, resource) in [
            ("PATCH", "persistentvolumeclaims"),
            ("POST", "persistentvolumes"),
            ("DELETE", "persistentvolumes"),
            ("GET", "persistentvolumes"),
            ("POST", "events"),
        ] {
            let key = (verb.to_string(), resource.to_string());
            let delta = to.get(&key).unwrap_or(&0.0) - from.get(&key).unwrap_or(&0.0);
            if delta > 0.0 {
                calls_per_claim.insert(format!("{phase}: {verb} {resource}"), delta / n as f64);
            }
        }
    }
    Ok(Provisioned {
        pvs_exist,
        all_bound,
        all_gone,
        calls_per_claim,
    })
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// One provisioner process over `plugins` until its RSS settles: (start to "controller started",
/// settled RSS in KiB).
async fn settled_rss(
    cp: &ControlPlane,
    plugins: &Path,
    cache: &Path,
    extra: &[&str],
    tag: &str,
) -> anyhow::Result<(Duration, u64)> {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"));
    cmd.args(["run", "--plugins"])
        .arg(plugins)
        .arg("--module-cache")
        .arg(cache)
        .arg("--kubeconfig")
        .arg(cp.admin_kubeconfig())
        .args(["--leader-election=false"])
        .args(extra)
        .env("RUST_LOG", "info");
    let start = Instant::now();
    let mut process = Process::spawn(cmd, cp.run_dir().join(format!("bench-memory-{tag}.log")))?;
    wait_for("controller started", Duration::from_secs(120), || async {
        Ok(process.log().contains("controller started").then_some(()))
    })
    .await?;
    let started = start.elapsed();
    // The claim and PV caches fill after start; RSS has settled once it moved < 512 KiB in 5 s.
    let (mut last, mut settled) = (0, Instant::now());
    while settled.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = rss_kib(process.pid()).unwrap_or(0);
        if now.abs_diff(last) > 512 {
            settled = Instant::now();
        }
        last = now;
    }
    process.terminate()?;
    Ok((started, last))
}

/// M claims bound to M PVs (pre-bound both ways; kube-controller-manager completes the binding),
/// as in a cluster whose volumes are all in use. Returns how many claims are Bound.
async fn bound_pairs(admin: &Client, ns: &str, m: usize) -> anyhow::Result<usize> {
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
        )
        .await?;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), ns);
    let pvs: Api<PersistentVolume> = Api::all(admin.clone());
    futures::stream::iter(0..m)
        .map(|i| {
            let (claims, pvs) = (claims.clone(), pvs.clone());
            async move {
                let name = format!("m{i}");
                let claim: PersistentVolumeClaim = serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": {"app": "bench"}},
                    "spec": {"storageClassName": "raw-bench", "volumeName": format!("mem-{i}"),
                             "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
                }))?;
                claims.create(&PostParams::default(), &claim).await?;
                let mut volume = pv(&format!("mem-{i}"));
                volume.spec.as_mut().expect("spec").claim_ref = Some(serde_json::from_value(
                    json!({"kind": "PersistentVolumeClaim", "apiVersion": "v1", "namespace": ns, "name": name}),
                )?);
                pvs.create(&PostParams::default(), &volume).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(64)
        .try_collect::<Vec<()>>()
        .await?;
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let bound = claims
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|c| c.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound"))
            .count();
        if bound >= m || Instant::now() > deadline {
            return Ok(bound);
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// Settled RSS over `runs` processes: (min, median, max) in KiB.
async fn rss_runs(
    cp: &ControlPlane,
    plugins: &Path,
    cache: &Path,
    extra: &[&str],
    tag: &str,
    runs: usize,
) -> anyhow::Result<[u64; 3]> {
    let mut all = Vec::new();
    for run in 0..runs {
        all.push(
            settled_rss(cp, plugins, cache, extra, &format!("{tag}-{run}"))
                .await?
                .1,
        );
    }
    all.sort_unstable();
    Ok([all[0], all[all.len() / 2], all[all.len() - 1]])
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n = env_usize("WP_BENCH_CLAIMS", 1000);
    let m = env_usize("WP_BENCH_OBJECTS", 10_000);
    let parts = std::env::var("WP_BENCH_PARTS").unwrap_or_else(|_| "throughput,memory".into());
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);
    common::guest_wasm("hostpath");
    let cp = ControlPlane::start().await?;
    let admin = cp.admin_client().await?;
    println!(
        "machine: {} cores, {}",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        uname()
    );
    if part("throughput") {
        throughput(&cp, &admin, n).await?;
    }
    if part("memory") {
        memory(&cp, &admin, m).await?;
    }
    Ok(())
}

async fn throughput(cp: &ControlPlane, admin: &Client, n: usize) -> anyhow::Result<()> {
    println!(
        "\nthroughput: {n} claims, hostpath guest, kube-apiserver/kube-controller-manager v1.20.2 on loopback\n"
    );
    println!(
        "| client settings | raw PV creates/s | provisions/s (PVs exist) | ratio | claims Bound/s | raw PV deletes/s | deletes/s (PVs gone) | ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut calls = Vec::new();
    for (i, profile) in profiles() {
        let (raw_create, raw_delete) = raw_rate(admin, n, profile, &i.to_string()).await?;
        let run = provision_run(cp, admin, n, profile, &i.to_string()).await?;
        let (rc, rd) = (rate(n, raw_create), rate(n, raw_delete));
        let (pc, pd) = (rate(n, run.pvs_exist), rate(n, run.all_gone));
        println!(
            "| {} | {rc:.1} | {pc:.1} | {:.2} | {:.1} | {rd:.1} | {pd:.1} | {:.2} |",
            profile.name,
            pc / rc,
            rate(n, run.all_bound),
            pd / rd
        );
        calls.push((profile.name, run.calls_per_claim));
    }
    println!(
        "\nprovisioner API requests per claim (kube-apiserver's apiserver_request_total deltas):\n"
    );
    for (profile, calls) in calls {
        let list: Vec<String> = calls.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
        println!("- {profile}: {}", list.join(", "));
    }
    Ok(())
}

async fn memory(cp: &ControlPlane, admin: &Client, m: usize) -> anyhow::Result<()> {
    let runs = env_usize("WP_BENCH_RUNS", 3);
    let storage = tempfile::tempdir()?;
    let plugins = tempfile::tempdir()?;
    let cache = tempfile::tempdir()?;
    plugins_with(
        plugins.path(),
        storage.path(),
        &["guest-a", "guest-b", "guest-c"],
    );
    // Start-up twice with one module cache: the first compiles (cold), the second deserializes.
    let (cold, _) = settled_rss(cp, plugins.path(), cache.path(), &[], "cold").await?;
    let (warm, _) = settled_rss(cp, plugins.path(), cache.path(), &[], "warm").await?;
    let empty = rss_runs(cp, plugins.path(), cache.path(), &[], "empty", runs).await?;
    let started = Instant::now();
    let bound = bound_pairs(admin, "bench-memory", m).await?;
    let filled = started.elapsed();
    let settled = rss_runs(cp, plugins.path(), cache.path(), &[], "settled", runs).await?;
    let whole = rss_runs(
        cp,
        plugins.path(),
        cache.path(),
        &["--cache-whole-objects"],
        "whole",
        runs,
    )
    .await?;
    println!(
        "\nmemory and start-up: three guests loaded; {m} claims bound to {m} PVs ({bound} Bound, made in {:.0} s); {runs} processes each\n",
        filled.as_secs_f64()
    );
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!("| figure | min | median | max |");
    println!("|---|---:|---:|---:|");
    for (what, [lo, mid, hi]) in [
        ("RSS, no claims or PVs in the cluster", empty),
        (
            "RSS, caches full (settled objects as their identity: default)",
            settled,
        ),
        (
            "RSS, caches full (whole objects, as an informer: `--cache-whole-objects`)",
            whole,
        ),
    ] {
        println!(
            "| {what} | {:.1} MiB | {:.1} MiB | {:.1} MiB |",
            mib(lo),
            mib(mid),
            mib(hi)
        );
    }
    println!(
        "| process start → controller started, module cache cold (3 guests compiled) | {:.0} ms | | |",
        cold.as_secs_f64() * 1e3
    );
    println!(
        "| process start → controller started, module cache warm | {:.0} ms | | |",
        warm.as_secs_f64() * 1e3
    );
    Ok(())
}

fn uname() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default()
}
