//! Controller benchmarks against the local real control plane, printed as tables:
//!
//! * throughput: N claims provisioned (PVs exist, claims Bound) and deleted (PVs and storage gone) by the
//!   provisioner with the hostpath guest, next to the API server's raw rate for the same client
//!   settings (N PVs created and deleted directly with the same QPS, burst and concurrency);
//! * API requests per claim, read from kube-apiserver's own request counters;
//! * memory: the provisioner's RSS with three guests, in an empty cluster and once its caches hold
//!   M claims bound to M PVs (settled to their identity, and whole as an informer keeps them);
//!   and once the cluster holds M Pending claims of another provisioner's class and M Available
//!   PVs of a static pool (part `foreign`: run it alone, so that the cluster holds only those);
//! * start-up: process start to "controller started".
//!
//! `WP_BENCH_SIZES=1` adds runs of ours on a btrfs grant directory with `sizes = "btrfs"` (every
//! volume a subvolume limited to its claim; a loop-mounted image per run; root), alternating with
//! the plain runs, for the cost of enforced sizes. `WP_BENCH_BINARY` runs another build of the provisioner. `WP_BENCH_DELAY_MS` (default 0) puts the provisioners that many milliseconds (one way) from the API server, through `wp_harness::LatencyProxy`. `WP_BENCH_GO_BINARY` names a build of
//! `sig-storage-lib-external-provisioner`'s hostpath example taking `-kubeconfig`,
//! `-kube-api-qps`, `-kube-api-burst`, `-worker-threads`, `-leader-elect`, `-pv-dir` and
//! `-add-finalizer` (see
//! docs/benchmarks.md): when set, throughput runs it on the same control plane, its runs
//! alternating with ours (at its own defaults, QPS 5 / burst 10, in the "each at its defaults"
//! profile; at ours in the others that it has), and memory adds its RSS in the same states.
//! `WP_BENCH_PREMARKED=1` creates the claims marked for their provisioner, as
//! kube-controller-manager marks them, so that its pace does not bound either program.
//! `WP_KCM_API_QPS` (read by the harness; burst twice that) raises kube-controller-manager's own
//! client budget, 200/s by default, which it spends on marking, binding and releasing alike.
//! `WP_BENCH_BURN=N` keeps N threads spinning during the throughput runs (both cores busy).
//! The load average is printed at the start and the end. `WP_BENCH_CLAIMS` (default 500) and `WP_BENCH_OBJECTS` (default 10000) size the runs;
//! `WP_BENCH_RUNS` (default 3) processes per memory figure; `WP_BENCH_PARTS` (default `throughput,memory`; also `foreign`) picks the parts; `WP_BENCH_PROFILES` (indexes,
//! default all) picks the client profiles.
//! Nothing is asserted; figures go to stdout.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::json;
use wasm_provisioner::controller::ratelimit::RateLimiter;
use wp_harness::{ControlPlane, Process, apply_yaml, wait_for};

const PROVISIONER: &str = "bench.wasm-provisioner.dev/hostpath";

struct Profile {
    name: &'static str,
    qps: f64,
    burst: u32,
    /// Our `--worker-threads`, or `None` for our default (not passed).
    workers: Option<usize>,
    /// The Go library's `-worker-threads` (its default is 4).
    go_workers: usize,
    extra: &'static [&'static str],
    /// Flags the Go example gets beyond its client settings and workers.
    go_extra: &'static [&'static str],
    /// The Go library's client settings in this profile (its example's defaults where ours run
    /// at ours), or `None` where the profile only varies our flags.
    go: Option<(f64, u32)>,
}

impl Profile {
    /// Requests the raw rate keeps in flight: as many as our reconciles.
    fn raw_concurrency(&self) -> usize {
        self.workers
            .unwrap_or(wasm_provisioner::controller::DEFAULT_WORKER_THREADS.into())
    }
}

const PROFILES: [Profile; 10] = [
    Profile {
        name: "each at its defaults (workers: ours 32, Go 4)",
        qps: 50.0,
        burst: 100,
        workers: None,
        go_workers: 4,
        extra: &[],
        go_extra: &[],
        go: Some((5.0, 10)),
    },
    Profile {
        name: "equal budget (qps 100, burst 200; workers: each its default, ours 32, Go 4), intent log",
        qps: 100.0,
        burst: 200,
        workers: None,
        go_workers: 4,
        extra: &[],
        go_extra: &[],
        go: Some((100.0, 200)),
    },
    Profile {
        name: "equal budget, --intent-record=claim-finalizer",
        qps: 100.0,
        burst: 200,
        workers: None,
        go_workers: 4,
        extra: &["--intent-record=claim-finalizer"],
        go_extra: &[],
        go: None,
    },
    Profile {
        name: "equal budget, --intent-record=off (no leak protection)",
        qps: 100.0,
        burst: 200,
        workers: None,
        go_workers: 4,
        extra: &["--intent-record=off"],
        go_extra: &[],
        go: None,
    },
    Profile {
        name: "raised (qps 200, burst 400, 16 workers)",
        qps: 200.0,
        burst: 400,
        workers: Some(16),
        go_workers: 16,
        extra: &[],
        go_extra: &[],
        go: Some((200.0, 400)),
    },
    Profile {
        name: "equal budget, 4 workers each (the Go library's default), intent log",
        qps: 100.0,
        burst: 200,
        workers: Some(4),
        go_workers: 4,
        extra: &[],
        go_extra: &[],
        go: Some((100.0, 200)),
    },
    Profile {
        name: "equal budget, no PV finalizer on either side (ours --add-pv-finalizer=false; the Go library's default)",
        qps: 100.0,
        burst: 200,
        workers: None,
        go_workers: 4,
        extra: &["--add-pv-finalizer=false"],
        go_extra: &[],
        go: Some((100.0, 200)),
    },
    Profile {
        name: "equal budget, --guest-nice 0 (an experiment: guest threads at the controller's priority)",
        qps: 100.0,
        burst: 200,
        workers: None,
        go_workers: 4,
        extra: &["--guest-nice", "0"],
        go_extra: &[],
        go: None,
    },
    Profile {
        name: "equal budget, a PV finalizer on both sides (ours by default; the Go library's AddFinalizer, `-add-finalizer` in the patched example)",
        qps: 100.0,
        burst: 200,
        workers: None,
        go_workers: 4,
        extra: &[],
        go_extra: &["-add-finalizer=true"],
        go: Some((100.0, 200)),
    },
    Profile {
        name: "equal budget, --wait-for-mark (ours looks at a claim only once kube-controller-manager marked it, as the Go library does)",
        qps: 100.0,
        burst: 200,
        workers: None,
        go_workers: 4,
        extra: &["--wait-for-mark"],
        go_extra: &[],
        go: Some((100.0, 200)),
    },
];

/// The provisioner binary the bench runs: this build's, or `WP_BENCH_BINARY` (another build of
/// the project, for figures of two builds taken side by side in one sitting).
fn provisioner_binary() -> std::path::PathBuf {
    std::env::var_os("WP_BENCH_BINARY")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_wasm-provisioner").into())
}

/// The Go library's hostpath example (`sig-storage-lib-external-provisioner`), built with flags
/// for its kubeconfig and client settings: `WP_BENCH_GO_BINARY`, run beside ours when set.
fn go_binary() -> Option<std::path::PathBuf> {
    std::env::var_os("WP_BENCH_GO_BINARY").map(Into::into)
}

/// The provisioner name the Go example has compiled in.
const GO_PROVISIONER: &str = "example.com/hostpath";

/// The Go example's PV annotation names the node it runs on (it deletes only PVs stamped with
/// its own); any name does.
const GO_NODE_NAME: &str = "bench-node";

/// What the Go example needs, as its own `rbac.yaml` grants it (without leader election, which
/// the bench turns off on both sides; with `update` on PVs, which its finalizer's removal needs
/// under `-add-finalizer`, and `patch`, which later versions of the library use for it), bound
/// to spare identity 1 so that both provisioners go through RBAC in the throughput runs.
fn go_rbac(cp: &ControlPlane) -> String {
    format!(
        r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: bench-go-hostpath-provisioner
rules:
  - apiGroups: [""]
    resources: ["persistentvolumes"]
    verbs: ["get", "list", "watch", "create", "delete", "update", "patch"]
  - apiGroups: [""]
    resources: ["persistentvolumeclaims"]
    verbs: ["get", "list", "watch"]
  - apiGroups: ["storage.k8s.io"]
    resources: ["storageclasses"]
    verbs: ["get", "list", "watch"]
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["create", "update", "patch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: bench-go-hostpath-provisioner
subjects:
  - kind: User
    name: "{}"
    apiGroup: rbac.authorization.k8s.io
roleRef:
  kind: ClusterRole
  name: bench-go-hostpath-provisioner
  apiGroup: rbac.authorization.k8s.io
"#,
        cp.restricted_user(1)
    )
}

/// Which provisioner a run measures.
#[derive(Clone, Copy, PartialEq)]
enum Side {
    Ours,
    /// Ours with its volumes on a btrfs grant directory with `sizes = "btrfs"`
    /// (`WP_BENCH_SIZES=1`; root).
    OursSized,
    Go,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::Ours => "wasm-provisioner",
            Side::OursSized => "wasm-provisioner, enforced sizes (btrfs)",
            Side::Go => "Go library",
        }
    }

    /// The provisioner name its StorageClass names.
    fn provisioner(self) -> &'static str {
        match self {
            Side::Ours | Side::OursSized => PROVISIONER,
            Side::Go => GO_PROVISIONER,
        }
    }

    /// (QPS, burst) this side runs with in `p`.
    fn budget(self, p: &Profile) -> (f64, u32) {
        match self {
            Side::Ours | Side::OursSized => (p.qps, p.burst),
            Side::Go => p.go.unwrap_or((p.qps, p.burst)),
        }
    }

    /// What its log says once its caches have synced and it works.
    fn ready_marker(self) -> &'static str {
        match self {
            Side::Ours | Side::OursSized => "caches synced; ready",
            Side::Go => "Started provisioner controller",
        }
    }
}

/// The Go example over `storage` (volumes are `<storage>/<PV name>`), as the user of
/// `kubeconfig`, one replica without leader election (as ours runs in the bench).
fn go_command(
    kubeconfig: &Path,
    storage: &Path,
    qps: f64,
    burst: u32,
    workers: usize,
    extra: &[&str],
) -> std::process::Command {
    let mut cmd = std::process::Command::new(go_binary().expect("WP_BENCH_GO_BINARY"));
    cmd.arg("-kubeconfig")
        .arg(kubeconfig)
        .arg(format!("-kube-api-qps={qps}"))
        .arg(format!("-kube-api-burst={burst}"))
        .arg(format!("-worker-threads={workers}"))
        .arg("-leader-elect=false")
        .arg("-pv-dir")
        .arg(storage)
        .args(extra)
        .env("NODE_NAME", GO_NODE_NAME);
    cmd
}

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
        // Writes the API server refused for a stale resourceVersion, whoever made them: one
        // client's write that races another's update costs the loser a retry.
        if label("code") == "409" {
            *counts
                .entry((
                    format!("{} refused (409)", label("verb")),
                    label("resource"),
                ))
                .or_insert(0.0) += value;
        }
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
        .buffer_unordered(p.raw_concurrency())
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
        .buffer_unordered(p.raw_concurrency())
        .try_collect::<Vec<()>>()
        .await?;
    Ok((create, start.elapsed()))
}

struct Provisioned {
    /// Per claim of [`IDLE_SINGLES`] created one at a time while the provisioner is idle:
    /// POSTed → its PV exists.
    idle_to_pv: Vec<Duration>,
    /// First claim POSTed → every PV exists.
    pvs_exist: Duration,
    /// First claim POSTed → every claim Bound.
    all_bound: Duration,
    /// Claims deleted → every PV gone and every volume's storage deleted (with the intent log the
    /// PV goes first, so its absence alone would flatter us).
    all_gone: Duration,
    /// Per claim: POSTed → its PV exists.
    to_pv: Vec<Duration>,
    /// Per claim: deleted → its PV gone.
    to_gone: Vec<Duration>,
    /// Claims deleted → every PV Released by kube-controller-manager (what deleting waits on).
    all_released: Duration,
    /// Per PV: claims deleted → it was seen Released (its gone time if no Released version was
    /// seen), the pace no provisioner can delete ahead of.
    released: Vec<Duration>,
    /// First claim POSTed → the last one POSTed, and → the last claim kube-controller-manager
    /// marked for its provisioner (the Go library looks at a claim only once it is marked; ours,
    /// by default, as soon as it sees it), and how many claims it marked at all.
    all_posted: Duration,
    all_marked: Duration,
    claims_marked: usize,
    /// API requests per claim, after the provisioner's event queue drained.
    calls_per_claim: BTreeMap<String, f64>,
    /// Writes per claim on the provisioner's main budget (PVs, claims, the intent log).
    writes_per_claim: f64,
    /// The same while deleting.
    delete_writes_per_claim: f64,
    /// CPU seconds each process spent, by phase ("provision": first claim POSTed → all Bound;
    /// "delete": claims deleted → all gone) and process.
    cpu: Vec<CpuSpent>,
}

/// CPU seconds one process spent in one phase of a run.
struct CpuSpent {
    phase: &'static str,
    process: &'static str,
    seconds: f64,
}

/// CPU time (user + system) a process has used so far, from `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which may hold spaces, closed by the last ')'.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // /proc reports ticks of USER_HZ, which the kernel's ABI fixes at 100 on every architecture
    // this runs on (`getconf CLK_TCK`).
    Some(ticks as f64 / 100.0)
}

/// The processes a run's CPU is counted for: the provisioner under test, the bench itself
/// (client and watches) and the control plane's components.
async fn cpu_sample(cp: &ControlPlane, provisioner: u32) -> Vec<(&'static str, f64)> {
    let mut pids = vec![("provisioner", provisioner), ("bench", std::process::id())];
    pids.extend(cp.component_pids().await);
    pids.into_iter()
        .filter_map(|(name, pid)| Some((name, cpu_seconds(pid)?)))
        .collect()
}

/// What each process spent between two samples.
fn cpu_spent(
    phase: &'static str,
    from: &[(&'static str, f64)],
    to: &[(&'static str, f64)],
) -> Vec<CpuSpent> {
    to.iter()
        .filter_map(|(process, end)| {
            let (_, begin) = from.iter().find(|(p, _)| p == process)?;
            Some(CpuSpent {
                phase,
                process,
                seconds: end - begin,
            })
        })
        .collect()
}

/// When each object was first seen existing (by name) and gone, from one watch: the benchmark
/// reads the cluster the way the provisioner does, without list polling.
#[derive(Default)]
struct Seen {
    applied: HashMap<String, Instant>,
    /// Claims first seen with kube-controller-manager's `storage-provisioner` annotation: what
    /// both programs wait for before they look at a claim.
    marked: HashMap<String, Instant>,
    bound: HashMap<String, Instant>,
    released: HashMap<String, Instant>,
    deleted: HashMap<String, Instant>,
}

fn watch_seen<K>(api: Api<K>, seen: Arc<Mutex<Seen>>) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + serde::Serialize
        + Send
        + Sync
        + 'static,
{
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
        while let Some(event) = events.next().await {
            let now = Instant::now();
            let mut seen = seen.lock().expect("seen");
            match event {
                Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) => {
                    let name = object.meta().name.clone().unwrap_or_default();
                    let phase = serde_json::to_value(&object)
                        .ok()
                        .and_then(|v| v["status"]["phase"].as_str().map(str::to_string));
                    let marked = object.meta().annotations.as_ref().is_some_and(|a| {
                        a.contains_key("volume.beta.kubernetes.io/storage-provisioner")
                    });
                    if marked {
                        seen.marked.entry(name.clone()).or_insert(now);
                    }
                    match phase.as_deref() {
                        Some("Bound") => {
                            seen.bound.entry(name.clone()).or_insert(now);
                        }
                        Some("Released") => {
                            seen.released.entry(name.clone()).or_insert(now);
                        }
                        _ => {}
                    }
                    seen.applied.entry(name).or_insert(now);
                }
                Ok(watcher::Event::Delete(object)) => {
                    let name = object.meta().name.clone().unwrap_or_default();
                    seen.deleted.entry(name).or_insert(now);
                }
                _ => {}
            }
        }
    })
}

/// Claims created one at a time before a run's burst, each once the one before has its PV.
const IDLE_SINGLES: usize = 10;

/// A claim's latency with nothing else to do: [`IDLE_SINGLES`] claims created one at a time,
/// each timed from its POST to its PV seen by the watch; then deleted, and waited for until
/// their PVs and storage are gone, so that the burst after them starts from an idle provisioner.
async fn singles(
    claims: &Api<PersistentVolumeClaim>,
    class: &str,
    pv_seen: &Mutex<Seen>,
    storage: &Path,
) -> anyhow::Result<Vec<Duration>> {
    let mut times = Vec::new();
    let mut names = Vec::new();
    for i in 0..IDLE_SINGLES {
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": format!("single-{i}")},
            "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
        }))?;
        let sent = Instant::now();
        let created = claims.create(&PostParams::default(), &claim).await?;
        let pv = format!("pvc-{}", created.metadata.uid.unwrap_or_default());
        until_seen("a single claim's PV", pv_seen, |s| {
            s.applied.contains_key(&pv)
        })
        .await?;
        times.push(pv_seen.lock().expect("seen").applied[&pv] - sent);
        names.push(pv);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for i in 0..IDLE_SINGLES {
        claims
            .delete(&format!("single-{i}"), &DeleteParams::default())
            .await?;
    }
    until_seen("the single claims' PVs gone", pv_seen, |s| {
        names.iter().all(|pv| s.deleted.contains_key(pv))
    })
    .await?;
    while names.iter().any(|pv| storage.join(pv).exists()) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(times)
}

/// Waits until `done` holds on what the watch saw (checked every 20 ms, no API requests).
async fn until_seen(
    what: &str,
    seen: &Mutex<Seen>,
    done: impl Fn(&Seen) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(3600);
    while !done(&seen.lock().expect("seen")) {
        anyhow::ensure!(Instant::now() < deadline, "{what}: not within an hour");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Waits until kube-apiserver's count of event POSTs stops moving for 3 s (the provisioner's
/// event queue has drained), at most a minute.
async fn events_drained(admin: &Client) -> anyhow::Result<()> {
    let key = ("POST".to_string(), "events".to_string());
    let mut last = -1.0;
    let mut still = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    while still.elapsed() < Duration::from_secs(3) && Instant::now() < deadline {
        let now = *request_counts(admin).await?.get(&key).unwrap_or(&0.0);
        if now != last {
            still = Instant::now();
            last = now;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// The `q`-quantile of `values` (nearest rank).
fn quantile(values: &mut [Duration], q: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    values.sort_unstable();
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// (min, median, max) of `values`.
fn spread(values: &[Duration]) -> [Duration; 3] {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    [
        sorted[0],
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
    ]
}

fn plugins_with(dir: &Path, storage: &Path, names: &[&str], sized: bool) {
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
        let mut grant = common::dir_grant(&provisioner, storage, "/volumes", "");
        if sized {
            grant = grant.replacen(
                "access = \"read-write\"\n",
                "access = \"read-write\"\nsizes = \"btrfs\"\n",
                1,
            );
        }
        std::fs::write(dir.join(format!("{name}.toml")), grant).unwrap();
    }
}

/// One run of `side` in profile `p`: N claims of a fresh class created, waited for, deleted and
/// waited for, with the same readiness rules for either provisioner.
/// Where the provisioners reach the API server: directly, or (`WP_BENCH_DELAY_MS`, a one-way
/// delay) through a loopback proxy that holds every byte back that long each way and does not
/// throttle. The bench's own client and kube-controller-manager stay direct: the delay is the
/// provisioner's distance from its control plane.
struct Reach {
    ours: std::path::PathBuf,
    go: std::path::PathBuf,
    delay_ms: u64,
    _distant: Option<wp_harness::Distant>,
}

impl Reach {
    async fn new(cp: &ControlPlane) -> anyhow::Result<Reach> {
        let delay_ms = env_usize("WP_BENCH_DELAY_MS", 0) as u64;
        let (ours, go) = (cp.provisioner_kubeconfig(), cp.restricted_kubeconfig(1));
        if delay_ms == 0 {
            return Ok(Reach {
                ours: ours.to_owned(),
                go: go.to_owned(),
                delay_ms,
                _distant: None,
            });
        }
        let distant = wp_harness::Distant::new(cp, Duration::from_millis(delay_ms)).await?;
        Ok(Reach {
            ours: distant.kubeconfig(ours)?,
            go: distant.kubeconfig(go)?,
            delay_ms,
            _distant: Some(distant),
        })
    }
}

async fn provision_run(
    cp: &ControlPlane,
    admin: &Client,
    reach: &Reach,
    n: usize,
    p: &Profile,
    tag: &str,
    side: Side,
) -> anyhow::Result<Provisioned> {
    let plain = tempfile::tempdir()?;
    let sized = (side == Side::OursSized).then(|| common::btrfs::Btrfs::new().with_quotas());
    let storage = sized.as_ref().map_or(plain.path(), |fs| fs.mnt.as_path());
    let plugins = tempfile::tempdir()?;
    let tag = match side {
        Side::Ours => tag.to_string(),
        Side::OursSized => format!("sized-{tag}"),
        Side::Go => format!("go-{tag}"),
    };
    let ns = format!("bench-{tag}");
    create_namespace(admin, &ns).await?;
    let class = format!("bench-{tag}");
    Api::<StorageClass>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": class}, "provisioner": side.provisioner(),
                "reclaimPolicy": "Delete", "volumeBindingMode": "Immediate"}),
            )?,
        )
        .await?;
    let (qps, burst) = side.budget(p);
    let cmd = match side {
        Side::Ours | Side::OursSized => {
            plugins_with(
                plugins.path(),
                storage,
                &["hostpath"],
                side == Side::OursSized,
            );
            let mut cmd = std::process::Command::new(provisioner_binary());
            cmd.args(["run", "--plugins"])
                .arg(plugins.path())
                .arg("--kubeconfig")
                .arg(&reach.ours)
                .args([
                    "--kube-api-qps",
                    &qps.to_string(),
                    "--kube-api-burst",
                    &burst.to_string(),
                ])
                .args(
                    p.workers
                        .iter()
                        .flat_map(|n| ["--worker-threads".to_string(), n.to_string()]),
                )
                .args(p.extra)
                .args(["--leader-election=false"])
                // The intent log lives where the provisioner's Role is (deploy/rbac.yaml).
                .args(["--leader-election-namespace", "wasm-provisioner"])
                // `WP_BENCH_LOG` replaces the filter (to trace a slow claim, say).
                .env(
                    "RUST_LOG",
                    std::env::var("WP_BENCH_LOG").unwrap_or_else(|_| {
                        "warn,wasm_provisioner::controller::start=info,wasm_provisioner::run=info"
                            .into()
                    }),
                );
            cmd
        }
        Side::Go => go_command(&reach.go, storage, qps, burst, p.go_workers, p.go_extra),
    };
    let mut process = Process::spawn(cmd, cp.run_dir().join(format!("bench-{tag}.log")))?;
    wait_for("provisioner ready", Duration::from_secs(120), || async {
        let log = process.log();
        // Our guests compile in the background while the caches sync, and may finish after:
        // a claim before that waits for them (5.3-6.8 s with both cores busy), which is
        // start-up, not a claim's latency.
        let guests_ready = side == Side::Go || log.contains("plugins ready");
        Ok((log.contains(side.ready_marker()) && guests_ready).then_some(()))
    })
    .await
    .with_context(|| process.log_tail(40))?;

    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), &ns);
    let pvs: Api<PersistentVolume> = Api::all(admin.clone());
    let pv_seen = Arc::new(Mutex::new(Seen::default()));
    let claim_seen = Arc::new(Mutex::new(Seen::default()));
    let watches = [
        watch_seen(pvs.clone(), pv_seen.clone()),
        watch_seen(claims.clone(), claim_seen.clone()),
    ];
    let idle_to_pv = singles(&claims, &class, &pv_seen, storage)
        .await
        .with_context(|| process.log_tail(40))?;
    let before = request_counts(admin).await?;
    let cpu_before = cpu_sample(cp, process.pid()).await;
    let start = Instant::now();
    // PV name (pvc-<claim UID>) → when its claim was POSTed; on 8 connections.
    // `WP_BENCH_PREMARKED=1`: created marked for their provisioner, as kube-controller-manager
    // marks a claim once no PV matches it; both programs wait for the mark, and kube-controller-
    // manager's own client budget, spent on binding as PVs appear, sets its pace otherwise.
    let annotations = if env_usize("WP_BENCH_PREMARKED", 0) == 1 {
        json!({"volume.beta.kubernetes.io/storage-provisioner": side.provisioner()})
    } else {
        json!({})
    };
    let posted: Vec<(String, Instant)> = futures::stream::iter(0..n)
        .map(|i| {
            let claims = claims.clone();
            let class = class.clone();
            let annotations = annotations.clone();
            async move {
                let claim: PersistentVolumeClaim = serde_json::from_value(json!({
                    "metadata": {"name": format!("c{i}"), "annotations": annotations},
                    "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
                }))?;
                let sent = Instant::now();
                let created = claims.create(&PostParams::default(), &claim).await?;
                anyhow::Ok((format!("pvc-{}", created.metadata.uid.unwrap_or_default()), sent))
            }
        })
        .buffer_unordered(8)
        .try_collect()
        .await?;
    let names: Vec<&String> = posted.iter().map(|(pv, _)| pv).collect();
    until_seen("all PVs exist", &pv_seen, |s| {
        names.iter().all(|pv| s.applied.contains_key(*pv))
    })
    .await
    .with_context(|| process.log_tail(40))?;
    let pvs_exist = start.elapsed();
    until_seen("all claims Bound", &claim_seen, |s| s.bound.len() >= n).await?;
    // Read once every claim is Bound: a claim kube-controller-manager bound without marking it
    // will not be marked later.
    let (all_posted, all_marked, claims_marked) = {
        let seen = claim_seen.lock().expect("seen");
        let posted_at = posted.iter().map(|(_, sent)| *sent).max();
        let marks: Vec<Instant> = (0..n)
            .filter_map(|i| seen.marked.get(&format!("c{i}")).copied())
            .collect();
        let since = |at: Option<Instant>| at.map_or(Duration::ZERO, |at| at - start);
        (
            since(posted_at),
            since(marks.iter().max().copied()),
            marks.len(),
        )
    };
    let all_bound = start.elapsed();
    let cpu_bound = cpu_sample(cp, process.pid()).await;
    events_drained(admin).await?;
    let after_provision = request_counts(admin).await?;
    let to_pv = {
        let seen = pv_seen.lock().expect("seen");
        posted
            .iter()
            .map(|(pv, sent)| seen.applied[pv] - *sent)
            .collect()
    };

    let cpu_delete = cpu_sample(cp, process.pid()).await;
    let start = Instant::now();
    claims
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    until_seen("all PVs gone", &pv_seen, |s| {
        names.iter().all(|pv| s.deleted.contains_key(*pv))
    })
    .await
    .with_context(|| process.log_tail(40))?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while names.iter().any(|pv| storage.join(pv).exists()) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "storage left after its PV: {}",
            process.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let all_gone = start.elapsed();
    let cpu_gone = cpu_sample(cp, process.pid()).await;
    let mut cpu = cpu_spent("provision", &cpu_before, &cpu_bound);
    cpu.extend(cpu_spent("delete", &cpu_delete, &cpu_gone));
    events_drained(admin).await?;
    let after_delete = request_counts(admin).await?;
    let (to_gone, released) = {
        let seen = pv_seen.lock().expect("seen");
        let gone: Vec<Duration> = names.iter().map(|pv| seen.deleted[*pv] - start).collect();
        let released = names
            .iter()
            .zip(&gone)
            .map(|(pv, gone)| {
                seen.released
                    .get(*pv)
                    .map_or(*gone, |at| at.saturating_duration_since(start))
            })
            .collect::<Vec<_>>();
        (gone, released)
    };
    let all_released = released.iter().max().copied().unwrap_or_default();
    for watch in watches {
        watch.abort();
    }
    process.terminate()?;

    // Requests the provisioner makes (PV writes and finalizer patches, claim patches, its intent
    // log, events); the PV controller in kube-controller-manager updates PVs and claims too, but
    // with PUT, so a PUT of a PV is printed but never counted as the provisioner's write.
    let mut calls_per_claim = BTreeMap::new();
    let (mut writes, mut delete_writes) = (0.0, 0.0);
    for (phase, from, to) in [
        ("provision", &before, &after_provision),
        ("delete", &after_provision, &after_delete),
    ] {
        for (verb, resource, main_budget_write) in [
            ("PATCH", "persistentvolumeclaims", true),
            ("POST", "persistentvolumes", true),
            ("DELETE", "persistentvolumes", true),
            // Our PV finalizer (`--add-pv-finalizer`) comes off with a PATCH once the storage
            // is gone: the second write of a delete.
            ("PATCH", "persistentvolumes", true),
            ("GET", "persistentvolumes", false),
            // kube-controller-manager's status updates, and the Go library's `AddFinalizer`
            // taking its finalizer off (an update of the PV it cached, conflicts included).
            ("PUT", "persistentvolumes", false),
            ("PUT refused (409)", "persistentvolumes", false),
            ("PATCH refused (409)", "persistentvolumes", false),
            ("PUT refused (409)", "persistentvolumeclaims", false),
            ("POST", "configmaps", true),
            ("PUT", "configmaps", true),
            ("PATCH", "configmaps", true),
            // Not on the budget for either side (kube-controller-manager's events are in these
            // counters too), although the Go library's recorder shares its client's limiter
            // where ours has a budget of its own.
            ("POST", "events", false),
            ("PATCH", "events", false),
        ] {
            let key = (verb.to_string(), resource.to_string());
            let delta = to.get(&key).unwrap_or(&0.0) - from.get(&key).unwrap_or(&0.0);
            if delta > 0.0 {
                calls_per_claim.insert(format!("{phase}: {verb} {resource}"), delta / n as f64);
                if main_budget_write {
                    match phase {
                        "provision" => writes += delta / n as f64,
                        _ => delete_writes += delta / n as f64,
                    }
                }
            }
        }
    }
    Ok(Provisioned {
        idle_to_pv,
        pvs_exist,
        all_bound,
        all_gone,
        all_released,
        released,
        all_posted,
        all_marked,
        claims_marked,
        to_pv,
        to_gone,
        calls_per_claim,
        writes_per_claim: writes,
        delete_writes_per_claim: delete_writes,
        cpu,
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

async fn create_namespace(admin: &Client, ns: &str) -> anyhow::Result<()> {
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
        )
        .await?;
    Ok(())
}

/// `wasm-provisioner run` as the cluster admin, one replica, over `plugins` with `cache`.
fn admin_run(
    cp: &ControlPlane,
    plugins: &Path,
    cache: &Path,
    extra: &[&str],
    log: &str,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(provisioner_binary());
    cmd.args(["run", "--plugins"])
        .arg(plugins)
        .arg("--module-cache")
        .arg(cache)
        .arg("--kubeconfig")
        .arg(cp.admin_kubeconfig())
        .args(["--leader-election=false"])
        .args(extra)
        .env("RUST_LOG", log);
    cmd
}

/// A process the memory figures measure: ours (as the cluster admin, one replica) over `plugins`
/// with `cache` and `extra` flags, or the Go library's example (as the cluster admin too, its
/// defaults otherwise, volumes under `storage`).
#[derive(Clone, Copy)]
enum Launch<'a> {
    Ours {
        plugins: &'a Path,
        cache: &'a Path,
        extra: &'a [&'a str],
    },
    Go {
        storage: &'a Path,
    },
}

impl Launch<'_> {
    /// The command, and what its log says once it has started.
    fn command(&self, cp: &ControlPlane) -> (std::process::Command, &'static str) {
        match *self {
            Launch::Ours {
                plugins,
                cache,
                extra,
            } => (
                admin_run(cp, plugins, cache, extra, "info"),
                "controller started",
            ),
            Launch::Go { storage } => (
                go_command(cp.admin_kubeconfig(), storage, 5.0, 10, 4, &[]),
                Side::Go.ready_marker(),
            ),
        }
    }
}

/// One process until its RSS settles: (start to "controller started" or, for the Go library,
/// to its controller started after its caches synced, settled RSS in KiB).
async fn settled_rss(
    cp: &ControlPlane,
    launch: Launch<'_>,
    tag: &str,
) -> anyhow::Result<(Duration, u64)> {
    let (cmd, marker) = launch.command(cp);
    let start = Instant::now();
    let mut process = Process::spawn(cmd, cp.run_dir().join(format!("bench-memory-{tag}.log")))?;
    wait_for("controller started", Duration::from_secs(120), || async {
        Ok(process.log().contains(marker).then_some(()))
    })
    .await
    .with_context(|| process.log_tail(40))?;
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
    create_namespace(admin, ns).await?;
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

/// With the cluster full of other objects: process start → ready, and a new claim's POST → its
/// PV, over `runs` processes.
async fn first_pv_runs(
    cp: &ControlPlane,
    admin: &Client,
    plugins: &Path,
    cache: &Path,
    runs: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let ns = "bench-first";
    create_namespace(admin, ns).await?;
    Api::<StorageClass>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "bench-first"}, "provisioner": PROVISIONER, "reclaimPolicy": "Delete"}))?,
        )
        .await?;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), ns);
    let pvs: Api<PersistentVolume> = Api::all(admin.clone());
    let (mut ready, mut first) = (Vec::new(), Vec::new());
    for run in 0..runs {
        let cmd = admin_run(
            cp,
            plugins,
            cache,
            &["--leader-election-namespace", "wasm-provisioner"],
            "warn,wasm_provisioner::controller::start=info",
        );
        let start = Instant::now();
        let mut process = Process::spawn(cmd, cp.run_dir().join(format!("bench-first-{run}.log")))?;
        wait_for("provisioner ready", Duration::from_secs(300), || async {
            Ok(process.log().contains("caches synced; ready").then_some(()))
        })
        .await?;
        ready.push(start.elapsed());
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": format!("first-{run}")},
            "spec": {"storageClassName": "bench-first", "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
        }))?;
        let sent = Instant::now();
        let created = claims.create(&PostParams::default(), &claim).await?;
        let pv = format!("pvc-{}", created.metadata.uid.unwrap_or_default());
        wait_for("the new claim's PV", Duration::from_secs(120), || async {
            Ok(pvs.get_opt(&pv).await?.map(|_| ()))
        })
        .await
        .with_context(|| process.log_tail(40))?;
        first.push(sent.elapsed());
        process.terminate()?;
    }
    Ok((ready, first))
}

/// Settled RSS over `runs` processes: (min, median, max) in KiB.
async fn rss_runs(
    cp: &ControlPlane,
    launch: Launch<'_>,
    tag: &str,
    runs: usize,
) -> anyhow::Result<[u64; 3]> {
    let mut all = Vec::new();
    for run in 0..runs {
        all.push(settled_rss(cp, launch, &format!("{tag}-{run}")).await?.1);
    }
    all.sort_unstable();
    Ok([all[0], all[all.len() / 2], all[all.len() - 1]])
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n = env_usize("WP_BENCH_CLAIMS", 500);
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
    println!("load average at the start: {}", loadavg());
    if part("throughput") {
        throughput(&cp, &admin, n).await?;
    }
    if part("memory") {
        memory(&cp, &admin, m).await?;
    }
    if part("foreign") {
        foreign(&cp, &admin, m).await?;
    }
    println!("\nload average at the end: {}", loadavg());
    Ok(())
}

/// `/proc/loadavg` as it reads (1, 5 and 15 minutes, runnable/all tasks, last PID).
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.trim().to_string())
        .unwrap_or_default()
}

/// Threads that keep cores busy (`WP_BENCH_BURN`) while the runs go: both programs then share
/// what is left, as on a node with other work. Stopped when dropped.
struct CpuBurner {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuBurner {
    fn start(threads: usize) -> CpuBurner {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        CpuBurner { stop, threads }
    }
}

impl Drop for CpuBurner {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

async fn throughput(cp: &ControlPlane, admin: &Client, n: usize) -> anyhow::Result<()> {
    let runs = env_usize("WP_BENCH_RUNS", 3);
    let go = go_binary().is_some();
    let sizes = env_usize("WP_BENCH_SIZES", 0) == 1;
    if go {
        apply_yaml(admin, &go_rbac(cp)).await?;
    }
    let reach = Reach::new(cp).await?;
    let burners = env_usize("WP_BENCH_BURN", 0);
    let _burn = CpuBurner::start(burners);
    println!(
        "\nthroughput: {n} claims POSTed on 8 connections, hostpath guest, kube-apiserver/kube-controller-manager v1.20.2 on loopback{}{}{}; \
         timed from the provisioner's readiness; {runs} runs per profile (min / median / max){}\n",
        if reach.delay_ms > 0 {
            format!(
                ", the provisioners {} ms away (one way, a delaying proxy; no throttling)",
                reach.delay_ms
            )
        } else {
            String::new()
        },
        if burners > 0 {
            format!(", {burners} threads of the bench spinning on the same cores throughout")
        } else {
            String::new()
        },
        if env_usize("WP_BENCH_PREMARKED", 0) == 1 {
            ", the claims created marked for their provisioner (as kube-controller-manager marks them)"
        } else {
            ""
        },
        if go {
            "; the Go library's hostpath example on the same control plane, its runs alternating with ours (ours, Go, ours, Go ...)"
        } else {
            ""
        }
    );
    println!(
        "| provisioner | client settings | QPS / burst | all PVs exist, s | PVs/s (median) | claim → PV p50 / p90 / p99, ms | all claims Bound, s | all PVs and storage gone, s | deletes/s (median) | delete → PV gone p50 / p99, ms | raw PV creates/s | ceiling at its writes/claim, s | delete ceiling at its writes/claim, s |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut calls = Vec::new();
    let mut delete_extras = Vec::new();
    let mut released = Vec::new();
    let mut idle = Vec::new();
    let mut marked = Vec::new();
    let mut cpu = Vec::new();
    for (i, profile) in profiles() {
        let (raw_create, _) = raw_rate(admin, n, profile, &i.to_string()).await?;
        let mut sides = vec![Side::Ours];
        if sizes {
            sides.push(Side::OursSized);
        }
        if go && profile.go.is_some() {
            sides.push(Side::Go);
        }
        let mut results: Vec<Vec<Provisioned>> = sides.iter().map(|_| Vec::new()).collect();
        for run in 0..runs {
            for (side, results) in sides.iter().zip(results.iter_mut()) {
                results.push(
                    provision_run(cp, admin, &reach, n, profile, &format!("{i}-{run}"), *side)
                        .await?,
                );
            }
        }
        for (side, results) in sides.iter().zip(results) {
            let (qps, burst) = side.budget(profile);
            let secs = |d: Duration| d.as_secs_f64();
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            let triple = |f: fn(&Provisioned) -> Duration| {
                let [lo, mid, hi] = spread(&results.iter().map(f).collect::<Vec<_>>());
                (
                    format!("{:.1} / {:.1} / {:.1}", secs(lo), secs(mid), secs(hi)),
                    mid,
                )
            };
            let (exist, exist_mid) = triple(|r| r.pvs_exist);
            let (bound, _) = triple(|r| r.all_bound);
            let (gone, gone_mid) = triple(|r| r.all_gone);
            let mut to_pv: Vec<Duration> = results.iter().flat_map(|r| r.to_pv.clone()).collect();
            let mut to_gone: Vec<Duration> =
                results.iter().flat_map(|r| r.to_gone.clone()).collect();
            let last = results.last().expect("one run at least");
            // The fastest any client making this many writes per claim could go on this budget.
            let writes = last.writes_per_claim;
            let ceiling_at = |writes: f64| ((n as f64 * writes - burst as f64).max(0.0)) / qps;
            let ceiling = ceiling_at(writes);
            let delete_writes = last.delete_writes_per_claim;
            let delete_ceiling = ceiling_at(delete_writes);
            // The raw rate was measured at our budget only.
            let raw = if (qps, burst) == (profile.qps, profile.burst) {
                format!("{:.1}", rate(n, raw_create))
            } else {
                "—".to_string()
            };
            println!(
                "| {} | {} | {qps} / {burst} | {exist} | {:.1} | {:.0} / {:.0} / {:.0} | {bound} | {gone} | {:.1} | {:.0} / {:.0} | {raw} | {ceiling:.1} ({writes:.2} writes) | {delete_ceiling:.1} ({delete_writes:.2} writes) |",
                side.label(),
                profile.name,
                rate(n, exist_mid),
                ms(quantile(&mut to_pv, 0.5)),
                ms(quantile(&mut to_pv, 0.9)),
                ms(quantile(&mut to_pv, 0.99)),
                rate(n, gone_mid),
                ms(quantile(&mut to_gone, 0.5)),
                ms(quantile(&mut to_gone, 0.99)),
            );
            let label = format!("{}, {}", side.label(), profile.name);
            calls.push((label.clone(), last.calls_per_claim.clone()));
            // The delete's writes on the budget beyond the PV's DELETE: the same writes the
            // delete ceiling counts, so what is a write is decided in one place.
            let deletes = last
                .calls_per_claim
                .get("delete: DELETE persistentvolumes")
                .copied()
                .unwrap_or_default();
            delete_extras.push((label.clone(), delete_writes - deletes));
            cpu.push((label.clone(), cpu_medians(&results)));
            // Deletes wait on kube-controller-manager's releases: the floor is the fastest this
            // many writes per delete could go on this budget, none before its PV was Released.
            let floors: Vec<Duration> = results
                .iter()
                .map(|r| {
                    wp_harness::budget_floor(
                        &r.released,
                        r.delete_writes_per_claim,
                        qps,
                        f64::from(burst),
                    )
                })
                .collect();
            let [floor_lo, floor_mid, floor_hi] = spread(&floors);
            let mut lags: Vec<Duration> = results
                .iter()
                .flat_map(|r| {
                    r.to_gone
                        .iter()
                        .zip(&r.released)
                        .map(|(gone, released)| gone.saturating_sub(*released))
                })
                .collect();
            released.push((
                label.clone(),
                format!(
                    "{} | {:.1} / {:.1} / {:.1} | {gone} ({:.2}x the floor) | {:.0} / {:.0}",
                    triple(|r| r.all_released).0,
                    secs(floor_lo),
                    secs(floor_mid),
                    secs(floor_hi),
                    secs(gone_mid) / secs(floor_mid).max(f64::EPSILON),
                    ms(quantile(&mut lags, 0.5)),
                    ms(quantile(&mut lags, 0.99)),
                ),
            ));
            let mut counts: Vec<usize> = results.iter().map(|r| r.claims_marked).collect();
            counts.sort_unstable();
            marked.push((
                label.clone(),
                triple(|r| r.all_posted).0,
                triple(|r| r.all_marked).0,
                counts,
            ));
            idle.push((
                label,
                results
                    .iter()
                    .flat_map(|r| r.idle_to_pv.iter().copied())
                    .collect::<Vec<_>>(),
            ));
        }
    }
    println!(
        "\nAPI requests per claim (kube-apiserver's apiserver_request_total deltas, last run, after the event queue drained; \
         writes on the budget: PV, claim and intent-log writes; events, kube-controller-manager's included, are not counted as writes, although the Go library's share its client's limiter; \
         nor are PUTs of PVs, kube-controller-manager's status updates, among which the Go library's AddFinalizer takes its finalizer off):\n"
    );
    for (profile, calls) in &calls {
        let list: Vec<String> = calls.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
        println!("- {profile}: {}", list.join(", "));
    }
    println!(
        "\nWrites a delete makes beyond the PV's DELETE (what deleting safely costs: our PV finalizer's PATCH once the storage is gone, intent-log writes), per delete:\n"
    );
    for (profile, extra) in &delete_extras {
        println!("- {profile}: {extra:.2}");
    }
    println!(
        "\nDeleting against kube-controller-manager's releases (no provisioner can delete a PV before it is Released), from the claims' deletion: \
         every PV Released, s | the budget's floor at the writes per delete, each PV's writes no sooner than its release (round trips not counted), s | every PV and its storage gone, s | a PV's Released → gone, p50 / p99 ms:\n"
    );
    for (profile, times) in released {
        println!("- {profile}: {times}");
    }
    println!(
        "\nFirst claim POSTed → the last one POSTed, and → the last claim marked for its provisioner by kube-controller-manager (the Go library looks at a claim only once marked; ours, unless --wait-for-mark, as soon as it sees it), s; and how many of the {n} claims it marked, per run:\n"
    );
    for (profile, posted, marked, counts) in marked {
        println!(
            "- {profile}: all POSTed {posted}; last marked {marked}; claims marked {counts:?}"
        );
    }
    println!(
        "\nCPU seconds spent by each process (median over the runs): provisioning (first claim POSTed → every claim Bound) | deleting (claims deleted → every PV and its storage gone); all of them share the same two cores:\n"
    );
    for (profile, spent) in cpu {
        let list: Vec<String> = spent
            .iter()
            .map(|(process, provision, delete)| format!("{process} {provision:.2} | {delete:.2}"))
            .collect();
        println!("- {profile}: {}", list.join(", "));
    }
    println!(
        "\nA single claim created while the provisioner is idle → its PV, ms ({IDLE_SINGLES} per run, one at a time, before each run's burst; p50 / p99 over every run):\n"
    );
    for (profile, mut times) in idle {
        println!(
            "- {profile}: {:.0} / {:.0}",
            quantile(&mut times, 0.5).as_secs_f64() * 1000.0,
            quantile(&mut times, 0.99).as_secs_f64() * 1000.0
        );
    }
    Ok(())
}

/// Per process, the median CPU seconds of its provisioning and its deleting over the runs.
fn cpu_medians(results: &[Provisioned]) -> Vec<(&'static str, f64, f64)> {
    let median = |phase: &str, process: &str| {
        let mut values: Vec<f64> = results
            .iter()
            .flat_map(|r| &r.cpu)
            .filter(|c| c.phase == phase && c.process == process)
            .map(|c| c.seconds)
            .collect();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or_default()
    };
    let mut processes: Vec<&'static str> = Vec::new();
    for spent in results.iter().flat_map(|r| &r.cpu) {
        if !processes.contains(&spent.process) {
            processes.push(spent.process);
        }
    }
    processes
        .into_iter()
        .map(|p| (p, median("provision", p), median("delete", p)))
        .collect()
}

async fn memory(cp: &ControlPlane, admin: &Client, m: usize) -> anyhow::Result<()> {
    let runs = env_usize("WP_BENCH_RUNS", 3);
    let (_storage, plugins, cache) = three_guests()?;
    let go_storage = tempfile::tempdir()?;
    let ours = |extra| Launch::Ours {
        plugins: plugins.path(),
        cache: cache.path(),
        extra,
    };
    let go = go_binary().map(|_| Launch::Go {
        storage: go_storage.path(),
    });
    // Start-up twice with one module cache: the first compiles (cold), the second deserializes.
    let (cold, _) = settled_rss(cp, ours(&[]), "cold").await?;
    let (warm, _) = settled_rss(cp, ours(&[]), "warm").await?;
    let empty = rss_runs(cp, ours(&[]), "empty", runs).await?;
    let go_empty = match go {
        Some(go) => Some(rss_runs(cp, go, "go-empty", runs).await?),
        None => None,
    };
    let started = Instant::now();
    let bound = bound_pairs(admin, "bench-memory", m).await?;
    let filled = started.elapsed();
    let settled = rss_runs(cp, ours(&[]), "settled", runs).await?;
    let go_settled = match go {
        Some(go) => Some(rss_runs(cp, go, "go-settled", runs).await?),
        None => None,
    };
    let whole = rss_runs(cp, ours(&["--cache-whole-objects"]), "whole", runs).await?;
    let (ready, first) = first_pv_runs(cp, admin, plugins.path(), cache.path(), runs).await?;
    println!(
        "\nmemory and start-up: three guests loaded; {m} claims bound to {m} PVs ({bound} Bound, made in {:.0} s); {runs} processes each\n",
        filled.as_secs_f64()
    );
    let mut rows = vec![
        ("RSS, no claims or PVs in the cluster", empty),
        (
            "RSS, caches full (default: settled claims dropped, settled PVs as their identity)",
            settled,
        ),
        (
            "RSS, caches full (whole objects, as an informer: `--cache-whole-objects`)",
            whole,
        ),
    ];
    if let (Some(go_empty), Some(go_settled)) = (go_empty, go_settled) {
        rows.push((
            "Go library's hostpath example: RSS, no claims or PVs in the cluster",
            go_empty,
        ));
        rows.push((
            "Go library's hostpath example: RSS, the same bound pairs cached (its informers, synced)",
            go_settled,
        ));
    }
    print_rss_rows(&rows);
    for (what, values) in [
        (
            "process start → ready (caches synced), with the bound pairs in the cluster",
            &ready,
        ),
        (
            "a new claim POSTed → its PV exists, with the bound pairs in the cluster",
            &first,
        ),
    ] {
        let [lo, mid, hi] = spread(values);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "| {what} | {:.0} ms | {:.0} ms | {:.0} ms |",
            ms(lo),
            ms(mid),
            ms(hi)
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

/// The plugins directory of the memory figures (three guests, their storage beside it) and an
/// empty module cache, kept alive by the caller.
fn three_guests() -> anyhow::Result<(tempfile::TempDir, tempfile::TempDir, tempfile::TempDir)> {
    let storage = tempfile::tempdir()?;
    let plugins = tempfile::tempdir()?;
    let cache = tempfile::tempdir()?;
    plugins_with(
        plugins.path(),
        storage.path(),
        &["guest-a", "guest-b", "guest-c"],
        false,
    );
    Ok((storage, plugins, cache))
}

/// The header and one row per figure of an RSS table (min, median, max in KiB, printed in MiB).
fn print_rss_rows(rows: &[(&str, [u64; 3])]) {
    let mib = |kib: u64| kib as f64 / 1024.0;
    println!("| figure | min | median | max |");
    println!("|---|---:|---:|---:|");
    for (what, [lo, mid, hi]) in rows {
        println!(
            "| {what} | {:.1} MiB | {:.1} MiB | {:.1} MiB |",
            mib(*lo),
            mib(*mid),
            mib(*hi)
        );
    }
}

/// The provisioner's RSS once the cluster holds `m` Pending claims of a class whose provisioner
/// no loaded guest serves and `m` Available PVs of a static local-PV pool (no provisioner made
/// them): nothing in the cluster is ours.
async fn foreign(cp: &ControlPlane, admin: &Client, m: usize) -> anyhow::Result<()> {
    let runs = env_usize("WP_BENCH_RUNS", 3);
    let (_storage, plugins, cache) = three_guests()?;
    let started = Instant::now();
    let (pending, available) = foreign_objects(admin, "bench-foreign", m).await?;
    let filled = started.elapsed();
    let ours = |extra| Launch::Ours {
        plugins: plugins.path(),
        cache: cache.path(),
        extra,
    };
    let default = rss_runs(cp, ours(&[]), "foreign", runs).await?;
    let whole = rss_runs(cp, ours(&["--cache-whole-objects"]), "foreign-whole", runs).await?;
    println!(
        "\nmemory, nothing ours: three guests loaded; {m} Pending claims of another provisioner's class ({pending} Pending, annotated) and {m} Available PVs of a static pool ({available} Available), made in {:.0} s; {runs} processes each\n",
        filled.as_secs_f64()
    );
    print_rss_rows(&[
        (
            "RSS, caches full (default: foreign claims left out, static PVs as their identity)",
            default,
        ),
        (
            "RSS, caches full (whole objects: `--cache-whole-objects`)",
            whole,
        ),
    ]);
    Ok(())
}

/// `m` claims of class `bench-foreign` (provisioner `example.com/not-served`, annotated as
/// kube-controller-manager does) and `m` local PVs of class `local-pool` on one node, none
/// bound; returns how many claims are Pending and PVs Available once the PV controller has seen
/// them.
async fn foreign_objects(admin: &Client, ns: &str, m: usize) -> anyhow::Result<(usize, usize)> {
    create_namespace(admin, ns).await?;
    Api::<StorageClass>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "bench-foreign"},
                "provisioner": "example.com/not-served", "reclaimPolicy": "Delete"}))?,
        )
        .await?;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(admin.clone(), ns);
    let pvs: Api<PersistentVolume> = Api::all(admin.clone());
    futures::stream::iter(0..m)
        .map(|i| {
            let (claims, pvs) = (claims.clone(), pvs.clone());
            async move {
                let claim: PersistentVolumeClaim = serde_json::from_value(json!({
                    "metadata": {"name": format!("f{i}"), "labels": {"app": "bench"},
                                 "annotations": {"volume.beta.kubernetes.io/storage-provisioner": "example.com/not-served"}},
                    "spec": {"storageClassName": "bench-foreign", "accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": "1Gi"}}},
                }))?;
                claims.create(&PostParams::default(), &claim).await?;
                let volume: PersistentVolume = serde_json::from_value(json!({
                    "metadata": {"name": format!("local-{i}"), "labels": {"pool": "local"}},
                    "spec": {
                        "capacity": {"storage": "100Gi"},
                        "accessModes": ["ReadWriteOnce"],
                        "persistentVolumeReclaimPolicy": "Retain",
                        "storageClassName": "local-pool",
                        "volumeMode": "Filesystem",
                        "local": {"path": format!("/mnt/disks/disk-{i}")},
                        "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-1"]}
                        ]}]}},
                    }
                }))?;
                pvs.create(&PostParams::default(), &volume).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(64)
        .try_collect::<Vec<()>>()
        .await?;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let phase_count = |phases: Vec<Option<String>>, want: &str| {
            phases.iter().filter(|p| p.as_deref() == Some(want)).count()
        };
        let pending = phase_count(
            claims
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .map(|c| c.status.and_then(|s| s.phase))
                .collect(),
            "Pending",
        );
        let available = phase_count(
            pvs.list(&ListParams::default().labels("pool=local"))
                .await?
                .items
                .into_iter()
                .map(|p| p.status.and_then(|s| s.phase))
                .collect(),
            "Available",
        );
        if (pending >= m && available >= m) || Instant::now() > deadline {
            return Ok((pending, available));
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
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
