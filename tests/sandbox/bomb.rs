//! Loading untrusted code is bounded: a compile bomb is compiled in a child process under
//! limits, refused, remembered by its SHA-256, and the other guests keep serving.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compile_bomb_is_refused_in_a_child_and_not_compiled_again() {
    let _alone = super::CPU_HEAVY.lock().await;
    if !in_child(
        "bomb::a_compile_bomb_is_refused_in_a_child_and_not_compiled_again",
        "WP_BOMB_CHILD",
    ) {
        return;
    }
    let size = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let bomb = compile_bomb(
        size("WP_BOMB_FUNCTIONS", 2),
        size("WP_BOMB_LOCALS", 2_000),
        size("WP_BOMB_OPS", 100_000),
    );
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "good",
        "hostpath",
        &dir_grant(GOOD, storage.path(), "/volumes", ""),
    );
    // As `run` builds it, with the limits an operator would give a 512 MiB pod
    // (WP_BOMB_IN_PROCESS=1 compiles here instead, as before: to watch it fail).
    let limits = wasm_provisioner::wasm::compiler::CompileLimits {
        program: env!("CARGO_BIN_EXE_wasm-provisioner").into(),
        memory_mib: 384,
        cpu_seconds: 2,
        timeout: Duration::from_secs(10),
    };
    let compiler = std::env::var_os("WP_BOMB_IN_PROCESS")
        .is_none()
        .then_some(limits);
    let engine = WasmEngine::with_options(&EngineOptions {
        compiler,
        ..EngineOptions::default()
    })
    .unwrap();
    // The good guest is compiled first, alone: the CPU of this process's children counted
    // below is then the bomb's compile child only (counting the good guest's too made the
    // bound depend on how fast the machine compiled hostpath).
    let mut loader = Loader::new(engine, plugins.path().to_owned());
    loader.scan().unwrap();
    std::fs::write(plugins.path().join("bomb.wasm"), &bomb).unwrap();
    std::fs::write(
        plugins.path().join("bomb.toml"),
        "provisioner = \"test.wasm-provisioner.dev/bomb\"",
    )
    .unwrap();
    let base = rss_mib();
    reset_peak_rss();
    let started = Instant::now();
    let children_before = children_cpu();
    let first = loader.scan().unwrap();
    let took = started.elapsed();
    let compiled = children_cpu() - children_before;
    let peak = peak_rss_mib();
    println!(
        "bomb of {} KiB: first scan {took:?} (compiler child {compiled:?} of CPU), RSS base {base} MiB, peak {peak} MiB; problems: {:?}",
        bomb.len() / 1024,
        first.plugins.problems
    );
    let good = first
        .plugins
        .for_provisioner(GOOD)
        .expect("the good guest loaded")
        .clone();
    assert!(
        first
            .plugins
            .for_provisioner("test.wasm-provisioner.dev/bomb")
            .is_none()
    );
    assert!(
        first
            .plugins
            .problems
            .iter()
            .any(|p| p.file.ends_with("bomb.wasm")),
        "the bomb is reported: {:?}",
        first.plugins.problems
    );
    assert!(
        peak <= base + 64,
        "compiling the bomb grew this process from {base} to {peak} MiB"
    );
    // CPU, not wall time (the machine may be busy): the child stops at its 2 CPU seconds.
    assert!(
        compiled <= Duration::from_millis(2500),
        "the compiler child ran {compiled:?} of CPU: the bomb was compiled past its limits"
    );
    // Rescans do not compile it again: no compile child runs (CPU, not wall time).
    let started = Instant::now();
    let children_before = children_cpu();
    let again = loader.scan().unwrap();
    let rescan = started.elapsed();
    let recompiled = children_cpu() - children_before;
    let problem = again
        .plugins
        .problems
        .iter()
        .find(|p| p.file.ends_with("bomb.wasm"))
        .expect("still reported");
    println!("rescan {rescan:?}: {problem}");
    assert!(problem.reason.contains("refused before"), "{problem}");
    assert!(
        recompiled < Duration::from_millis(100),
        "the rescan ran {recompiled:?} of compile children"
    );
    let req = request(
        claim("after-bomb"),
        class(GOOD, &[]),
        &good.grants().config_json,
    );
    good.provision(&req).await.expect("the good guest serves");
}

/// Writes two modules that compile for seconds in the child (within `run`'s limits) and are then
/// refused (they export no contract); the size of each.
fn slow_modules(plugins: &PluginsDir) -> usize {
    let size = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let mut bytes = 0;
    for (i, name) in ["slow1", "slow2"].into_iter().enumerate() {
        // Two different modules (one more operation in the second): two compiles.
        let slow = compile_bomb(
            size("WP_SLOW_FUNCTIONS", 2),
            size("WP_SLOW_LOCALS", 2_000),
            size("WP_SLOW_OPS", 80_000) + i,
        );
        bytes = slow.len();
        std::fs::write(plugins.path().join(format!("{name}.wasm")), &slow).unwrap();
        std::fs::write(
            plugins.path().join(format!("{name}.toml")),
            format!("provisioner = \"test.wasm-provisioner.dev/{name}\""),
        )
        .unwrap();
    }
    bytes
}

/// `run`'s limits, with a CPU budget the slow modules stay within.
fn run_limits() -> wasm_provisioner::wasm::compiler::CompileLimits {
    wasm_provisioner::wasm::compiler::CompileLimits {
        program: env!("CARGO_BIN_EXE_wasm-provisioner").into(),
        memory_mib: 1024,
        cpu_seconds: 60,
        timeout: Duration::from_secs(120),
    }
}

/// What a start saw: when the good guest first served, when every slow module was refused, and
/// the set of plugins the good guest first served in.
struct Start {
    good: Duration,
    refused: Option<Duration>,
    first_good: Arc<Plugins>,
    problems: Vec<String>,
    /// Each refused file's problem as first reported (later scans say "refused before").
    first_reports: Vec<String>,
}

/// Every set of plugins a start served, with when.
type Seen = Vec<(Duration, Arc<Plugins>)>;

/// Starts as `run` does (first scan, then the watcher) and waits until the good guest serves
/// and `refusals` slow modules are refused (or 150 s).
fn start_like_run(plugins: &Path, cache: Option<&Path>, refusals: usize) -> Start {
    let engine = WasmEngine::with_options(&EngineOptions {
        compiler: Some(run_limits()),
        module_cache: cache.map(Path::to_owned),
        ..EngineOptions::default()
    })
    .unwrap();
    let started = Instant::now();
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let mut loader = Loader::new(engine, plugins.to_owned())
        .compiling_in_background()
        .unwrap();
    let first = loader.scan().unwrap();
    seen.lock()
        .unwrap()
        .push((started.elapsed(), Arc::new(first.plugins)));
    let sink = seen.clone();
    let _watcher = reload::watch(
        loader,
        WatchOptions {
            rescan: Duration::from_secs(1),
            debounce: Duration::from_millis(100),
        },
        move |plugins| sink.lock().unwrap().push((started.elapsed(), plugins)),
    )
    .unwrap();
    let refused = |p: &Plugins| {
        p.problems
            .iter()
            .filter(|p| p.file.to_string_lossy().contains("slow"))
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(150);
    loop {
        let seen = seen.lock().unwrap();
        let good = seen.iter().find(|(_, p)| p.serves(GOOD));
        let done = seen.iter().find(|(_, p)| refused(p) >= refusals);
        if let (Some((good, first_good)), Some((refused, last))) = (good, done) {
            let mut first_reports: Vec<String> = Vec::new();
            for problem in seen.iter().flat_map(|(_, p)| p.problems.iter()) {
                let file = problem.file.display().to_string();
                if !first_reports.iter().any(|r| r.starts_with(&file)) {
                    first_reports.push(problem.to_string());
                }
            }
            return Start {
                good: *good,
                refused: (refusals > 0).then_some(*refused),
                first_good: first_good.clone(),
                problems: last.problems.iter().map(|p| p.to_string()).collect(),
                first_reports,
            };
        }
        assert!(Instant::now() < deadline, "nothing settled within 150 s");
        drop(seen);
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_guest_serves_while_slow_modules_still_compile() {
    let _alone = super::CPU_HEAVY.lock().await;
    if !in_child(
        "bomb::a_good_guest_serves_while_slow_modules_still_compile",
        "WP_SLOW_CHILD",
    ) {
        return;
    }
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "good",
        "hostpath",
        &dir_grant(GOOD, storage.path(), "/volumes", ""),
    );
    let alone = start_like_run(plugins.path(), None, 0);
    let slow_bytes = slow_modules(&plugins);
    let children_before = children_cpu();
    let beside = start_like_run(plugins.path(), None, 2);
    let children_cpu = children_cpu() - children_before;
    let refused = beside.refused.expect("both refused");
    println!(
        "good guest serving after {:?} alone, {:?} beside two slow modules of {} KiB (refused after {refused:?}; \
         compile children {children_cpu:?} of CPU over those {refused:?}); problems: {:#?}",
        alone.good,
        beside.good,
        slow_bytes / 1024,
        beside.problems
    );
    assert_eq!(beside.problems.len(), 2, "both slow modules refused");
    // The first report of a compile says why it failed, not that it failed before.
    for problem in &beside.first_reports {
        assert!(
            !problem.contains("refused before"),
            "the first refusal hides its reason: {problem}"
        );
    }
    // The order, not a time: the good guest served before either slow module was decided.
    let decided: Vec<String> = beside
        .first_good
        .problems
        .iter()
        .map(|p| p.to_string())
        .collect();
    assert!(
        decided.is_empty() && beside.good < refused,
        "the good guest waited for the slow modules: serving at {:?}, refused at {refused:?}, already decided {decided:?}",
        beside.good
    );
    // The compile children together never took more than one CPU.
    assert!(
        children_cpu.as_secs_f64() <= refused.as_secs_f64() * 1.1,
        "compile children used {children_cpu:?} of CPU in {refused:?}"
    );
    let req = request(
        claim("beside-slow"),
        class(GOOD, &[]),
        &beside
            .first_good
            .for_provisioner(GOOD)
            .unwrap()
            .grants()
            .config_json,
    );
    beside
        .first_good
        .for_provisioner(GOOD)
        .unwrap()
        .provision(&req)
        .await
        .expect("the good guest serves");
}

/// CPU time of this process' reaped children (the compile children of the test process), from
/// `cutime` and `cstime` in /proc/self/stat (clock ticks of 10 ms).
fn children_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    // Fields 16 and 17 of stat(5), counted from the state (field 3) here.
    let ticks: u64 = fields[13].parse::<u64>().unwrap() + fields[14].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_refused_once_is_not_compiled_again_at_the_next_start() {
    let _alone = super::CPU_HEAVY.lock().await;
    if !in_child(
        "bomb::a_module_refused_once_is_not_compiled_again_at_the_next_start",
        "WP_REFUSED_CHILD",
    ) {
        return;
    }
    let storage = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "good",
        "hostpath",
        &dir_grant(GOOD, storage.path(), "/volumes", ""),
    );
    slow_modules(&plugins);
    let cache = tempfile::tempdir().unwrap();
    let first = start_like_run(plugins.path(), Some(cache.path()), 2);
    let children_before = children_cpu();
    let again = start_like_run(plugins.path(), Some(cache.path()), 2);
    let compiled = children_cpu() - children_before;
    println!(
        "first start: slow modules refused after {:?}; restart with the same cache: refused after {:?}, \
         compile children {compiled:?} of CPU; problems: {:#?}",
        first.refused.unwrap(),
        again.refused.unwrap(),
        again.problems
    );
    for problem in &again.problems {
        assert!(
            problem.contains("refused before"),
            "compiled again at the restart: {problem}"
        );
    }
    assert!(
        compiled < Duration::from_millis(500),
        "compile children ran {compiled:?} at the restart"
    );
}
