//! Untrusted guests in-process: every attack of `guests/attack` against the real host, a
//! well-behaved guest measured before, during and after; the compiled-module cache cold and
//! warm; hot reload through the loader and through real file-system events.

#[path = "sandbox/bomb.rs"]
mod bomb;
mod common;
#[path = "sandbox/disk_work.rs"]
mod disk_work;
#[path = "sandbox/hoards.rs"]
mod hoards;
#[path = "sandbox/locks.rs"]
mod locks;
#[path = "sandbox/logs.rs"]
mod logs;
#[path = "sandbox/node_disk.rs"]
mod node_disk;
#[path = "sandbox/pins.rs"]
mod pins;
#[path = "sandbox/pool.rs"]
mod pool;
#[path = "sandbox/priority.rs"]
mod priority;
#[path = "sandbox/racing_delete.rs"]
mod racing_delete;
#[path = "sandbox/resources.rs"]
mod resources;
#[path = "sandbox/roots.rs"]
mod roots;
#[path = "sandbox/samples.rs"]
mod samples;
#[path = "sandbox/served.rs"]
mod served;

/// Taken by the tests that load the CPU for seconds (a compile bomb, the pin tests' guests
/// compiled again at every swap, a 10^5-entry listing, a 50,000-file volume) and by the one
/// whose attacks run against a deadline, so that they never share the two cores of a CI machine.
pub static CPU_HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use wasm_provisioner::wasm::bindings::types::ProvisionRequest;
use wasm_provisioner::wasm::executor::ExecutorOptions;
use wasm_provisioner::wasm::reload::{self, Loader, WatchOptions};
use wasm_provisioner::wasm::{
    Availability, CallError, EngineOptions, FaultKind, Guest, Plugins, Pooling, WasmEngine,
    load_dir,
};

const ATTACK: &str = "test.wasm-provisioner.dev/attack";
const GOOD: &str = "test.wasm-provisioner.dev/good";

/// Re-runs test `name` in a child process with `env` set (a process of its own: its own
/// descriptor limit, peak memory and global state); true when this *is* the child.
fn in_child(name: &str, env: &str) -> bool {
    if std::env::var_os(env).is_some() {
        return true;
    }
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(env, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    println!("{text}{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "the child failed");
    assert!(text.contains("1 passed"), "the child ran the test");
    false
}

/// Resident memory of this process, in MiB.
fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        / 1024
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

/// What an attack must end in.
#[derive(Debug, Clone, Copy)]
enum Expect {
    Fault(FaultKind),
    Rejected(&'static str),
    Serves,
}

fn check(attack: &str, expect: Expect, outcome: &Result<impl std::fmt::Debug, CallError>) {
    match (expect, outcome) {
        (
            Expect::Fault(kind),
            Err(
                error @ CallError::Fault {
                    kind: got, guest, ..
                },
            ),
        ) => {
            assert_eq!(*got, kind, "{attack}: {error}");
            assert_eq!(guest, "attack", "{attack}: the error names the guest");
            assert!(
                error.to_string().contains(kind.as_str()),
                "{attack}: the message names the kind: {error}"
            );
        }
        (Expect::Rejected(why), Err(error @ CallError::Rejected { message, .. })) => {
            assert!(message.contains(why), "{attack}: {error}");
            assert!(error.to_string().contains("guest attack"), "{error}");
        }
        (Expect::Serves, Ok(_)) => {}
        (expect, outcome) => panic!("{attack}: expected {expect:?}, got {outcome:?}"),
    }
}

/// Runs in a child process of its own: its resident memory before and after the attacks is
/// this test's alone, not moved by the other tests of the binary running beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attack_is_contained_and_the_other_guest_keeps_serving() {
    let _alone = CPU_HEAVY.lock().await;
    if !in_child(
        "every_attack_is_contained_and_the_other_guest_keeps_serving",
        "WP_ATTACKS_CHILD",
    ) {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let attack_dir = root.path().join("attack");
    let good_dir = root.path().join("good");
    std::fs::create_dir_all(&attack_dir).unwrap();
    std::fs::create_dir_all(&good_dir).unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "attack",
        "attack",
        &dir_grant(ATTACK, &attack_dir, "/state", "").replace(
            "call-timeout-ms = 5000",
            "call-timeout-ms = 1500\nmemory-mib = 32",
        ),
    );
    plugins.add(
        "good",
        "hostpath",
        &dir_grant(GOOD, &good_dir, "/volumes", ""),
    );
    // As `run` builds it: guest code on threads of its own, at a lower priority.
    let engine = WasmEngine::with_options(&EngineOptions {
        executor: Some(ExecutorOptions::default()),
        ..EngineOptions::default()
    })
    .unwrap();
    println!("pooling allocator: {}", engine.pooling());
    let loaded = load_dir(&engine, plugins.path()).unwrap();
    assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
    let attacker = loaded.for_provisioner(ATTACK).unwrap().clone();
    let good = loaded.for_provisioner(GOOD).unwrap().clone();
    let attack_config = attacker.grants().config_json.clone();
    let good_config = good.grants().config_json.clone();

    // The well-behaved guest provisions continuously; each sample is tagged with the phase.
    let phase = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let samples: Arc<Mutex<Vec<(usize, Duration)>>> = Arc::default();
    let worker = tokio::spawn({
        let (good, phase, stop, samples) =
            (good.clone(), phase.clone(), stop.clone(), samples.clone());
        async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let req = request(claim(&format!("g{n}")), class(GOOD, &[]), &good_config);
                let started = Instant::now();
                good.provision(&req)
                    .await
                    .expect("the good guest keeps serving");
                let p = phase.load(Ordering::Relaxed);
                samples.lock().unwrap().push((p, started.elapsed()));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_before = rss_mib();
    phase.store(1, Ordering::Relaxed);

    let cases: &[(&str, Expect)] = &[
        ("spin", Expect::Fault(FaultKind::Deadline)),
        ("host-loop", Expect::Fault(FaultKind::Deadline)),
        ("host-block", Expect::Fault(FaultKind::Deadline)),
        ("memory-bomb", Expect::Fault(FaultKind::Memory)),
        ("stack-overflow", Expect::Fault(FaultKind::StackOverflow)),
        ("shadow-stack-overflow", Expect::Fault(FaultKind::Trap)),
        ("panic", Expect::Fault(FaultKind::Panic)),
        ("unreachable", Expect::Fault(FaultKind::Trap)),
        ("log-flood", Expect::Serves),
        ("stdout-flood", Expect::Serves),
        ("host-owned-keys", Expect::Rejected("refused")),
        ("huge-capacity", Expect::Rejected("capacity")),
        ("negative-capacity", Expect::Rejected("capacity")),
        // More than one host call may carry: the call faults before the host holds it.
        ("huge-annotations", Expect::Fault(FaultKind::Host)),
        ("invalid-labels", Expect::Rejected("refused")),
    ];
    for (attack, expect) in cases {
        let req = request(
            claim(attack),
            class(ATTACK, &[("attack", attack)]),
            &attack_config,
        );
        let started = Instant::now();
        let outcome = attacker.provision(&req).await;
        println!(
            "{attack:>18}: {:>6} ms  {}",
            started.elapsed().as_millis(),
            match &outcome {
                Ok(_) => "served".to_string(),
                Err(e) => e.to_string().chars().take(150).collect(),
            }
        );
        check(attack, *expect, &outcome);
    }
    // Slow only sometimes: the first attempt misses the deadline, the retry succeeds.
    let slow = request(
        claim("slow"),
        class(ATTACK, &[("attack", "slow-sometimes"), ("slowMs", "5000")]),
        &attack_config,
    );
    check(
        "slow-sometimes #1",
        Expect::Fault(FaultKind::Deadline),
        &attacker.provision(&slow).await,
    );
    check(
        "slow-sometimes #2",
        Expect::Serves,
        &attacker.provision(&slow).await,
    );
    // Path escapes are the escape guest's job (tests/guests.rs); here: nothing was written
    // next to the granted directories.
    let mut outside: Vec<String> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    outside.sort();
    assert_eq!(
        outside,
        ["attack", "good"],
        "nothing created outside the grants"
    );

    phase.store(2, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    worker.await.unwrap();
    let rss_after = rss_mib();

    let samples = samples.lock().unwrap().clone();
    let by_phase = |p| -> Vec<Duration> {
        samples
            .iter()
            .filter(|(q, _)| *q == p)
            .map(|(_, d)| *d)
            .collect()
    };
    let (before, during, after) = (by_phase(0), by_phase(1), by_phase(2));
    println!(
        "good guest provision latency, median (calls): before {:?} ({}), during attacks {:?} ({}), after {:?} ({})",
        median(before.clone()),
        before.len(),
        median(during.clone()),
        during.len(),
        median(after.clone()),
        after.len()
    );
    println!("resident memory: {rss_before} MiB before the attacks, {rss_after} MiB after");
    assert!(
        !during.is_empty() && !after.is_empty(),
        "the good guest served during and after"
    );
    // Loose bound: a 32 MiB memory bomb, 64 MiB floods and a 10 MB annotation leave nothing
    // behind once their stores are gone.
    assert!(
        rss_after < rss_before + 64,
        "memory returned near baseline: {rss_before} MiB -> {rss_after} MiB"
    );
}

#[test]
fn the_module_cache_makes_warm_starts_fast_and_never_fails() {
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    for (name, crate_name) in [
        ("hostpath", "hostpath"),
        ("scripted", "scripted"),
        ("attack", "attack"),
        ("escape", "escape"),
    ] {
        let provisioner = format!("test.wasm-provisioner.dev/{name}");
        plugins.add(
            name,
            crate_name,
            &dir_grant(&provisioner, storage.path(), "/state", ""),
        );
    }
    let cache_dir = tempfile::tempdir().unwrap();
    let options = EngineOptions {
        pooling: Pooling::Auto,
        module_cache: Some(cache_dir.path().to_owned()),
        executor: None,
        compiler: None,
    };
    let start = |label: &str| {
        let started = Instant::now();
        let engine = WasmEngine::with_options(&options).unwrap();
        let loaded = load_dir(&engine, plugins.path()).unwrap();
        let took = started.elapsed();
        assert_eq!(loaded.len(), 4, "{:?}", loaded.problems);
        let stats = &engine.module_cache().unwrap().stats;
        let counts = (
            stats.hits.load(Ordering::Relaxed),
            stats.misses.load(Ordering::Relaxed),
            stats.stale.load(Ordering::Relaxed),
        );
        println!(
            "{label}: 4 guests ready in {} ms (cache hits, misses, stale: {counts:?})",
            took.as_millis()
        );
        counts
    };
    assert_eq!(start("cold start"), (0, 4, 0));
    assert_eq!(start("warm start"), (4, 0, 0));
    // Corrupt one entry and truncate another: both are misses that recompile, never failures.
    let mut entries: Vec<_> = std::fs::read_dir(cache_dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    let mut bytes = std::fs::read(&entries[0]).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&entries[0], bytes).unwrap();
    std::fs::write(&entries[1], b"short").unwrap();
    assert_eq!(start("after corrupting two entries"), (2, 0, 2));
    assert_eq!(start("healed"), (4, 0, 0));
}

#[test]
fn precompiled_artifacts_in_the_plugins_directory_are_refused() {
    let plugins = PluginsDir::new();
    let engine = WasmEngine::new().unwrap();
    let native = engine
        .engine()
        .precompile_component(&std::fs::read(guest_wasm("hostpath")).unwrap())
        .unwrap();
    std::fs::write(plugins.path().join("native.cwasm"), &native).unwrap();
    std::fs::write(plugins.path().join("disguised.wasm"), &native).unwrap();
    std::fs::write(
        plugins.path().join("disguised.toml"),
        "provisioner = \"x/y\"",
    )
    .unwrap();
    let loaded = load_dir(&engine, plugins.path()).unwrap();
    assert!(loaded.is_empty());
    for file in ["native.cwasm", "disguised.wasm"] {
        let problem = loaded
            .problems
            .iter()
            .find(|p| p.file.ends_with(file))
            .unwrap_or_else(|| panic!("{file} reported: {:?}", loaded.problems));
        assert!(problem.reason.contains("precompiled"), "{problem}");
    }
    // The cache may not share the plugins directory.
    let options = EngineOptions {
        pooling: Pooling::Off,
        module_cache: Some(plugins.path().join("cache")),
        executor: None,
        compiler: None,
    };
    let engine = WasmEngine::with_options(&options).unwrap();
    let err = engine
        .module_cache()
        .unwrap()
        .check_separate_from(plugins.path())
        .unwrap_err();
    assert!(err.to_string().contains("overlaps"), "{err}");
}

fn sha_of(plugins: &Plugins, provisioner: &str) -> String {
    plugins
        .for_provisioner(provisioner)
        .unwrap()
        .sha256()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_validates_before_swapping_and_in_flight_calls_finish_on_their_version() {
    const LIVE: &str = "test.wasm-provisioner.dev/live";
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    let grant = dir_grant(LIVE, storage.path(), "/state", "");
    plugins.add("live", "scripted", &grant);
    let mut loader = Loader::new(WasmEngine::new().unwrap(), plugins.path().to_owned());
    let stats = loader.stats();
    let first = loader.scan().unwrap();
    assert!(first.changed);
    let v1 = first.plugins.for_provisioner(LIVE).unwrap().clone();
    assert!(
        !loader.scan().unwrap().changed,
        "nothing changed, nothing reloaded"
    );

    // A slow call starts on version 1.
    let config = v1.grants().config_json.clone();
    let slow = tokio::spawn({
        let v1 = v1.clone();
        let req = request(claim("slow"), class(LIVE, &[("delayMs", "1500")]), &config);
        async move { v1.provision(&req).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;

    // A broken new version is refused; version 1 keeps serving.
    std::fs::write(plugins.path().join("live.wasm"), b"\0asm broken").unwrap();
    let broken = loader.scan().unwrap();
    assert_eq!(sha_of(&broken.plugins, LIVE), v1.sha256());
    let problem = &broken.plugins.problems[0];
    assert!(
        problem
            .reason
            .contains("still serving the previous version"),
        "{problem}"
    );

    // A good new version replaces it.
    plugins.add("live", "hostpath", &grant);
    let swapped = loader.scan().unwrap();
    assert!(swapped.changed && swapped.plugins.problems.is_empty());
    assert_ne!(sha_of(&swapped.plugins, LIVE), v1.sha256());
    slow.await
        .unwrap()
        .expect("the call in flight finished on the version it started with");

    // Removed: unloaded, its provisioner remembered as gone; back: served again.
    std::fs::remove_file(plugins.path().join("live.wasm")).unwrap();
    let gone = loader.scan().unwrap();
    assert!(matches!(
        gone.plugins.availability(LIVE),
        Availability::Unavailable(_)
    ));
    assert!(matches!(
        gone.plugins.availability("x/never"),
        Availability::Unknown
    ));
    plugins.add("live", "scripted", &grant);
    let back = loader.scan().unwrap();
    assert_eq!(back.plugins.availability(LIVE), Availability::Served);
    let counts = stats.counts();
    println!("{counts:?}");
    assert_eq!(
        (
            counts.loads,
            counts.reloads,
            counts.rejections,
            counts.unloads
        ),
        (2, 1, 1, 1)
    );

    // A twin claiming a served provisioner does not take it over.
    plugins.add("twin", "hostpath", &grant);
    let twin = loader.scan().unwrap();
    assert_eq!(twin.plugins.availability(LIVE), Availability::Served);
    assert_eq!(twin.plugins.for_provisioner(LIVE).unwrap().name(), "live");
    assert!(
        twin.plugins
            .problems
            .iter()
            .any(|p| p.reason.contains("already served by live.wasm"))
    );
}

/// Waits up to 20 s for the watcher to publish a set of plugins that satisfies `check`.
fn wait_for_plugins(
    latest: &Mutex<Option<Arc<Plugins>>>,
    what: &str,
    check: impl Fn(&Plugins) -> bool,
) -> Arc<Plugins> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(p) = latest.lock().unwrap().clone().filter(|p| check(p)) {
            return p;
        }
        assert!(Instant::now() < deadline, "watcher never published: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn copy_in(dir: &Path, name: &str, crate_name: &str, grant: &str) {
    std::fs::copy(guest_wasm(crate_name), dir.join(format!("{name}.wasm"))).unwrap();
    std::fs::write(dir.join(format!("{name}.toml")), grant).unwrap();
}

#[test]
fn the_watcher_follows_copies_partial_writes_and_configmap_symlink_swaps() {
    const W: &str = "test.wasm-provisioner.dev/watched";
    const CM: &str = "test.wasm-provisioner.dev/configmap";
    let storage = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let loader = Loader::new(WasmEngine::new().unwrap(), dir.path().to_owned());
    let stats = loader.stats();
    let latest: Arc<Mutex<Option<Arc<Plugins>>>> = Arc::default();
    let options = WatchOptions {
        // Only events drive this test: the safety-net rescan is out of the way.
        rescan: Duration::from_secs(3600),
        debounce: Duration::from_millis(500),
    };
    let _watcher = reload::watch(loader, options, {
        let latest = latest.clone();
        move |p| *latest.lock().unwrap() = Some(p)
    })
    .unwrap();

    // A module copied in slowly, in two halves: the debounce waits for it to settle.
    let grant = dir_grant(W, storage.path(), "/state", "");
    std::fs::write(dir.path().join("w.toml"), &grant).unwrap();
    let bytes = std::fs::read(guest_wasm("hostpath")).unwrap();
    let (a, b) = bytes.split_at(bytes.len() / 2);
    std::fs::write(dir.path().join("w.wasm"), a).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.path().join("w.wasm"))
        .unwrap();
    std::io::Write::write_all(&mut file, b).unwrap();
    drop(file);
    wait_for_plugins(&latest, "w loaded", |p| p.serves(W));
    assert_eq!(
        stats.counts().rejections,
        0,
        "the half-written module was never tried"
    );

    // A ConfigMap volume: files are symlinks into `..data`, which is swapped atomically.
    let cm_grant = dir_grant(CM, storage.path(), "/state", "");
    let publish = |version: &str, crate_name: &str| {
        let data = dir.path().join(version);
        std::fs::create_dir(&data).unwrap();
        copy_in(&data, "cm", crate_name, &cm_grant);
        let tmp = dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(version, &tmp).unwrap();
        std::fs::rename(&tmp, dir.path().join("..data")).unwrap();
    };
    publish("..2026_01", "hostpath");
    for file in ["cm.wasm", "cm.toml"] {
        std::os::unix::fs::symlink(format!("..data/{file}"), dir.path().join(file)).unwrap();
    }
    let v1 = wait_for_plugins(&latest, "cm loaded", |p| p.serves(CM));
    let v1_sha = v1.for_provisioner(CM).unwrap().sha256().to_string();
    publish("..2026_02", "scripted");
    wait_for_plugins(&latest, "cm swapped", |p| {
        p.for_provisioner(CM)
            .is_some_and(|g: &Arc<Guest>| g.sha256() != v1_sha)
    });
    std::fs::remove_file(dir.path().join("w.wasm")).unwrap();
    let gone = wait_for_plugins(&latest, "w unloaded", |p| !p.serves(W));
    assert!(matches!(gone.availability(W), Availability::Unavailable(_)));
    println!("{:?}", stats.counts());
}

// ---- Guests that attack the node (guests/node-attack; docs/threat-model.md) ----

const NODE: &str = "test.wasm-provisioner.dev/node-attack";

/// The node-attack guest loaded over a granted directory of its own.
struct NodeAttack {
    storage: tempfile::TempDir,
    _plugins: PluginsDir,
    guest: Arc<Guest>,
}

impl NodeAttack {
    fn load(extra_limits: &str) -> NodeAttack {
        NodeAttack::load_with(extra_limits, |grant| grant)
    }

    fn load_with(extra_limits: &str, edit: impl FnOnce(String) -> String) -> NodeAttack {
        NodeAttack::load_with_on(&WasmEngine::new().unwrap(), extra_limits, edit)
    }

    /// On `engine` (guest threads of its own, say).
    fn load_on(engine: &WasmEngine, extra_limits: &str) -> NodeAttack {
        NodeAttack::load_with_on(engine, extra_limits, |grant| grant)
    }

    fn load_with_on(
        engine: &WasmEngine,
        extra_limits: &str,
        edit: impl FnOnce(String) -> String,
    ) -> NodeAttack {
        let storage = tempfile::tempdir().unwrap();
        let plugins = PluginsDir::new();
        let grant = dir_grant(NODE, storage.path(), "/state", extra_limits)
            .replace("call-timeout-ms = 5000", "call-timeout-ms = 2000");
        plugins.add("node-attack", "node_attack", &edit(grant));
        let loaded = load_dir(engine, plugins.path()).unwrap();
        assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
        let guest = loaded.for_provisioner(NODE).unwrap().clone();
        NodeAttack {
            storage,
            _plugins: plugins,
            guest,
        }
    }

    fn dir(&self) -> &Path {
        self.storage.path()
    }

    fn request(&self, claim_name: &str, params: &[(&str, &str)]) -> ProvisionRequest {
        request(
            claim(claim_name),
            class(NODE, params),
            &self.guest.grants().config_json,
        )
    }

    async fn provision(
        &self,
        claim_name: &str,
        params: &[(&str, &str)],
    ) -> Result<wasm_provisioner::wasm::spec::BuiltVolume, CallError> {
        self.guest
            .provision(&self.request(claim_name, params))
            .await
    }
}

fn is_link(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

fn rejected_message(outcome: Result<impl std::fmt::Debug, CallError>) -> String {
    match outcome {
        Err(error @ CallError::Rejected { .. }) => {
            assert!(error.to_string().contains("guest node-attack"), "{error}");
            error.to_string()
        }
        other => panic!("expected the host to reject the volume, got {other:?}"),
    }
}

fn final_message(outcome: Result<impl std::fmt::Debug, CallError>) -> String {
    match outcome {
        Err(CallError::Guest {
            error: wasm_provisioner::wasm::ProvisionError::Final(message),
            ..
        }) => message,
        other => panic!("expected a final error from the guest, got {other:?}"),
    }
}

/// The guest's own record of what it tried (the `attack.example/did` annotation or final text).
fn did(outcome: &Result<wasm_provisioner::wasm::spec::BuiltVolume, CallError>) -> String {
    match outcome {
        Ok(built) => built
            .annotations
            .get("attack.example/did")
            .cloned()
            .unwrap_or_default(),
        Err(error) => error.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_cannot_create_a_symlink_the_kubelet_would_follow() {
    let n = NodeAttack::load("");
    for attack in ["relative-link", "intermediate-link"] {
        let outcome = n.provision(attack, &[("attack", attack)]).await;
        let did = did(&outcome);
        println!("{attack}: {did}");
        assert!(
            did.contains("symlink") && !did.contains(": ok"),
            "{attack}: symlink-at was allowed: {did}"
        );
        outcome.expect("nothing planted, so the (empty) path itself is fine");
    }
    for name in ["pvc-uid-relative-link", "sub"] {
        assert!(!is_link(&n.dir().join(name)), "{name} is a link");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returned_path_with_a_link_in_any_component_is_rejected_before_the_pv() {
    let n = NodeAttack::load("");
    // Links planted by someone else (a tenant's pod, an earlier version of the guest).
    std::os::unix::fs::symlink("../../../../etc", n.dir().join("pvc-uid-rel")).unwrap();
    std::os::unix::fs::symlink("/", n.dir().join("sub")).unwrap();
    let message = rejected_message(n.provision("rel", &[("attack", "relative-link")]).await);
    assert!(
        message.contains("symbolic link") && message.contains("pvc-uid-rel"),
        "{message}"
    );
    let message = rejected_message(n.provision("mid", &[("attack", "intermediate-link")]).await);
    assert!(
        message.contains("symbolic link") && message.contains("/sub"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_call_cannot_swap_a_served_directory_for_a_link() {
    let n = NodeAttack::load("");
    n.provision("served", &[]).await.expect("a clean volume");
    let served = n.dir().join("pvc-uid-served");
    assert!(served.is_dir());
    // A link a tenant's pod planted inside its own volume, which lies in the guest's preopen.
    std::fs::create_dir(n.dir().join("pvc-tenant")).unwrap();
    std::os::unix::fs::symlink("/etc", n.dir().join("pvc-tenant/evil")).unwrap();
    let message = final_message(
        n.provision(
            "swapper",
            &[
                ("attack", "swap"),
                ("target", "pvc-uid-served"),
                ("planted", "pvc-tenant/evil"),
            ],
        )
        .await,
    );
    println!("swap: {message}");
    assert!(
        !is_link(&served),
        "the served path became a link: {message}"
    );
    assert_eq!(
        message.matches(": ok").count(),
        0,
        "nothing worked, not even moving the served directory away: {message}"
    );
    assert!(served.is_dir(), "the served directory stayed");
    assert!(
        is_link(&n.dir().join("pvc-tenant/evil")),
        "the tenant's link stayed where it was"
    );

    for attack in ["rename-planted", "link-planted"] {
        let outcome = n
            .provision(
                attack,
                &[("attack", attack), ("planted", "pvc-tenant/evil")],
            )
            .await;
        println!("{attack}: {}", did(&outcome));
        assert!(
            !is_link(&n.dir().join(format!("pvc-uid-{attack}"))),
            "{attack}: a link reached the volume path"
        );
        assert!(
            !did(&outcome).contains(": ok"),
            "{attack}: {}",
            did(&outcome)
        );
    }
}

/// Open descriptors of this whole process: only for a test that runs in a process of its own
/// ([`in_child`]), where nothing else opens any.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Threads of this process blocked in `open(2)` of a FIFO (no partner yet): the kernel's wait
/// channel is `wait_for_partner` (or `fifo_open`, where it is inlined). What a FIFO attack would
/// leave behind, and nothing else: the other tests of this binary running beside it, and the
/// blocking pool's idle workers, come and go without moving it (counting `/proc/self/task`
/// did: "12 -> 16" in a cold `.ci/test`).
fn threads_blocked_in_fifo_open() -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut blocked: Vec<u32> = tasks
        .filter_map(|task| {
            let task = task.ok()?;
            let wchan = std::fs::read_to_string(task.path().join("wchan")).ok()?;
            matches!(wchan.trim(), "wait_for_partner" | "fifo_open")
                .then(|| task.file_name().to_str()?.parse().ok())
                .flatten()
        })
        .collect();
    blocked.sort_unstable();
    blocked
}

/// Threads blocked in a FIFO open now and still 200 ms later (a thread blocked for good stays).
async fn threads_stuck_in_fifo_open() -> Vec<u32> {
    let first = threads_blocked_in_fifo_open();
    if first.is_empty() {
        return first;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = threads_blocked_in_fifo_open();
    first.into_iter().filter(|t| again.contains(t)).collect()
}

/// What the rest of a test binary does beside a test: threads that start and stay (other
/// tests' runtimes, idle pool workers) and descriptors other tests hold. Dropped at the end.
struct Neighbours {
    _files: Vec<std::fs::File>,
    _dir: tempfile::TempDir,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Neighbours {
    fn start(threads: usize, files: usize) -> Neighbours {
        let dir = tempfile::tempdir().unwrap();
        let files = (0..files)
            .map(|i| std::fs::File::create(dir.path().join(format!("n{i}"))).unwrap())
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::park_timeout(Duration::from_millis(20));
                    }
                })
            })
            .collect();
        Neighbours {
            _files: files,
            _dir: dir,
            stop,
            threads,
        }
    }
}

impl Drop for Neighbours {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_in_the_preopen_cannot_block_a_host_thread() {
    let n = NodeAttack::load("");
    let fifo = n.dir().join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o666),
        0,
    )
    .unwrap();
    // The check sees a thread blocked in a FIFO open: one of our own, released by a writer.
    let probe = n.dir().join("probe");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &probe,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o666),
        0,
    )
    .unwrap();
    let reader = std::thread::spawn({
        let probe = probe.clone();
        move || drop(std::fs::File::open(probe))
    });
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = threads_stuck_in_fifo_open().await;
        if !seen.is_empty() {
            break;
        }
    }
    assert_eq!(seen.len(), 1, "the probe's blocked open is seen: {seen:?}");
    drop(
        std::fs::OpenOptions::new()
            .write(true)
            .open(&probe)
            .unwrap(),
    );
    reader.join().unwrap();
    assert!(threads_stuck_in_fifo_open().await.is_empty());
    // Filesystem calls run on the blocking pool: the FIFO must not block a thread there either.
    n.provision("warm", &[]).await.unwrap();
    let threads_before = std::fs::read_dir("/proc/self/task").unwrap().count();
    // The rest of the suite, as it runs beside this test: threads that start and stay.
    let neighbours = Neighbours::start(4, 0);
    for i in 0..5 {
        let started = Instant::now();
        let message = final_message(n.provision(&format!("f{i}"), &[("attack", "fifo")]).await);
        let took = started.elapsed();
        println!("fifo #{i}: {took:?}: {message}");
        assert!(
            took < Duration::from_millis(1000),
            "the call returned promptly: {took:?}"
        );
        assert!(
            message.contains("open fifo") && !message.contains(": ok"),
            "{message}"
        );
    }
    let blocked = threads_stuck_in_fifo_open().await;
    println!(
        "threads: {threads_before} before, {} after five FIFO opens and 4 neighbours' threads; blocked in a FIFO open: {blocked:?}",
        std::fs::read_dir("/proc/self/task").unwrap().count()
    );
    assert!(blocked.is_empty(), "threads left blocked: {blocked:?}");
    drop(neighbours);
}

/// Descriptors of this process open on `dir` or below it: what a guest granted `dir` holds.
/// Other tests' descriptors (their own directories, sockets, pipes) never count.
fn fds_under(dir: &Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target.starts_with(dir))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_hoarding_is_its_own_fault_and_the_descriptors_come_back() {
    let n = NodeAttack::load("descriptors = 64");
    n.provision("warm", &[]).await.unwrap();
    let dir = n.dir().canonicalize().unwrap();
    let before = fds_under(&dir);
    // The check sees descriptors on the directory: three of our own.
    let own: Vec<std::fs::File> = (0..3).map(|_| std::fs::File::open(&dir).unwrap()).collect();
    assert_eq!(
        fds_under(&dir),
        before + 3,
        "the check sees descriptors on {dir:?}"
    );
    drop(own);
    // The rest of the suite, as it runs beside this test: descriptors opened and kept.
    let neighbours = Neighbours::start(0, 16);
    let started = Instant::now();
    let outcome = n.provision("hoard", &[("attack", "fd-hoard")]).await;
    println!("fd-hoard in {:?}: {outcome:?}", started.elapsed());
    match &outcome {
        Err(error @ CallError::Fault { kind, guest, .. }) => {
            assert_eq!(*kind, FaultKind::Descriptors, "{error}");
            assert_eq!(guest, "node-attack");
            assert!(error.to_string().contains("descriptors"), "{error}");
        }
        other => panic!("expected a descriptors fault, got {other:?}"),
    }
    // The last close of what the guest opened runs on the blocking pool: give it a moment.
    let mut after = fds_under(&dir);
    for _ in 0..20 {
        if after <= before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = fds_under(&dir);
    }
    println!(
        "descriptors on the guest's directory: {before} before, {after} after the hoarding call ({} in the whole process, 16 of them a neighbour's)",
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    );
    assert!(after <= before, "descriptors returned: {before} -> {after}");
    drop(neighbours);
    // The same guest's next call is unaffected.
    n.provision("after", &[])
        .await
        .expect("the next call serves");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_bound_nfs_exports_csi_handles_reclaim_policy_and_the_node() {
    let n = NodeAttack::load_with("", |grant| {
        grant.replace(
            "kinds = [\"host-path\"]",
            "kinds = [\"host-path\", \"nfs\", \"csi\"]\nnfs-servers = [\"nfs.example.com\"]\ncsi-drivers = [\"csi.example.com\"]\nnfs-exports = { \"nfs.example.com\" = [\"/exports/tenant-a\"] }\ncsi-volume-handles = { \"csi.example.com\" = [\"tenant-a-*\"] }",
        )
    });
    let nfs = |path: &'static str| [("attack", "nfs-export"), ("path", path)];
    n.provision("nfs-ok", &nfs("/exports/tenant-a/v1"))
        .await
        .expect("a granted export");
    for path in ["/", "/exports/tenant-b/v1", "/exports/tenant-a-other"] {
        let message = final_message(n.provision("nfs-bad", &nfs(path)).await);
        assert!(message.contains("not granted"), "{path}: {message}");
    }
    let csi = |handle: &'static str| [("attack", "csi-handle"), ("handle", handle)];
    n.provision("csi-ok", &csi("tenant-a-7"))
        .await
        .expect("a granted handle");
    let message = final_message(n.provision("csi-bad", &csi("tenant-b-7")).await);
    assert!(
        message.contains("matches none of the granted patterns"),
        "{message}"
    );
    let message = rejected_message(n.provision("recycle", &[("attack", "recycle")]).await);
    assert!(message.contains("Recycle"), "{message}");
    // Node affinity must name the node the scheduler selected.
    let mut req = n.request("pinned", &[("attack", "other-node"), ("node", "node-b")]);
    req.selected_node = Some("node-a".into());
    let message = rejected_message(n.guest.provision(&req).await);
    assert!(message.contains("selected node"), "{message}");
    req.selected_node = Some("node-b".into());
    n.guest
        .provision(&req)
        .await
        .expect("pinned to the selected node");
}

#[test]
fn a_grant_directory_over_the_plugins_directory_or_the_cache_is_refused() {
    let plugins = PluginsDir::new();
    plugins.add(
        "self-writer",
        "hostpath",
        &dir_grant(GOOD, plugins.path(), "/volumes", ""),
    );
    let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
    assert!(loaded.is_empty());
    assert!(
        loaded
            .problems
            .iter()
            .any(|p| p.reason.contains("overlaps")),
        "{:?}",
        loaded.problems
    );
    let cache = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "cache-writer",
        "hostpath",
        &dir_grant(GOOD, cache.path(), "/volumes", ""),
    );
    let engine = WasmEngine::with_options(&EngineOptions {
        module_cache: Some(cache.path().to_owned()),
        ..EngineOptions::default()
    })
    .unwrap();
    let loaded = load_dir(&engine, plugins.path()).unwrap();
    assert!(
        loaded
            .problems
            .iter()
            .any(|p| p.reason.contains("overlaps")),
        "{:?}",
        loaded.problems
    );
}

/// Peak resident memory of this process in MiB (VmHWM), after resetting it when the kernel lets us.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        / 1024
}

/// Slack over `memory-mib x max-concurrency` the host may use while guests hoard: per call, one
/// copy of the largest value in flight (a host call's string, at most 1 MiB: the hostcall fuel),
/// the store, instance and WASI state, and allocator slack. Documented in docs/threat-model.md.
const RSS_SLACK_MIB: u64 = 96;

/// Runs in a child process of its own: four concurrent calls of a 32 MiB guest each try to
/// pass one 24 MiB string to the host. What a host call may carry is capped (1 MiB), not the
/// guest's memory: before, each call's value was copied into the host whole, a second 24 MiB
/// per call beside the guest's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_host_call_carries_at_most_a_mebibyte() {
    if !in_child("one_host_call_carries_at_most_a_mebibyte", "WP_RSS_CHILD") {
        return;
    }
    let n = NodeAttack::load("memory-mib = 32\nmax-concurrency = 4");
    n.provision("warm", &[]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let base = rss_mib();
    reset_peak_rss();
    let flood = [("attack", "value-flood")];
    let outcomes =
        futures::future::join_all((0..4).map(|i| n.provision(["f0", "f1", "f2", "f3"][i], &flood)))
            .await;
    let peak = peak_rss_mib();
    let budget = base + 32 * 4 + 32;
    println!(
        "RSS: base {base} MiB, peak {peak} MiB during four 24 MiB host calls, budget {budget} MiB"
    );
    for outcome in outcomes {
        match outcome {
            Err(CallError::Fault { message, .. }) => println!("fault: {message}"),
            other => panic!("a 24 MiB host call must fault, got {other:?}"),
        }
    }
    assert!(
        peak <= budget,
        "peak RSS {peak} MiB over the budget {budget} MiB"
    );
}

/// Runs in a child process of its own (so no other test shares its peak): two concurrent calls
/// of a 32 MiB guest each pass 96 refused 512 KiB annotations to the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hoarding_guests_keep_host_memory_within_their_grants() {
    if !in_child(
        "hoarding_guests_keep_host_memory_within_their_grants",
        "WP_RSS_CHILD",
    ) {
        return;
    }
    let n = NodeAttack::load("memory-mib = 32\nmax-concurrency = 2");
    n.provision("warm", &[]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let base = rss_mib();
    reset_peak_rss();
    let attack = [("attack", "annotation-hoard")];
    let (a, b) = tokio::join!(n.provision("h1", &attack), n.provision("h2", &attack));
    let peak = peak_rss_mib();
    let budget = base + 32 * 2 + RSS_SLACK_MIB;
    println!(
        "RSS: base {base} MiB, peak {peak} MiB during two hoarding calls, budget {budget} MiB (base + 32 MiB x 2 + {RSS_SLACK_MIB} MiB slack)"
    );
    for outcome in [a, b] {
        let message = rejected_message(outcome);
        assert!(message.contains("refused"), "{message}");
        assert!(
            message.len() < 2048,
            "the refusal message is bounded: {} bytes",
            message.len()
        );
    }
    assert!(
        peak <= budget,
        "peak RSS {peak} MiB over the budget {budget} MiB"
    );
}
