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
    std::fs::write(plugins.path().join("bomb.wasm"), &bomb).unwrap();
    std::fs::write(
        plugins.path().join("bomb.toml"),
        "provisioner = \"test.wasm-provisioner.dev/bomb\"",
    )
    .unwrap();
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
    let base = rss_mib();
    reset_peak_rss();
    let mut loader = Loader::new(engine, plugins.path().to_owned());
    let started = Instant::now();
    let first = loader.scan().unwrap();
    let took = started.elapsed();
    let peak = peak_rss_mib();
    println!(
        "bomb of {} KiB: first scan {took:?}, RSS base {base} MiB, peak {peak} MiB; problems: {:?}",
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
    assert!(
        took < Duration::from_secs(8),
        "the first scan took {took:?}: the bomb was compiled past its limits"
    );
    // Rescans do not compile it again.
    let started = Instant::now();
    let again = loader.scan().unwrap();
    let rescan = started.elapsed();
    let problem = again
        .plugins
        .problems
        .iter()
        .find(|p| p.file.ends_with("bomb.wasm"))
        .expect("still reported");
    println!("rescan {rescan:?}: {problem}");
    assert!(problem.reason.contains("refused before"), "{problem}");
    assert!(rescan < Duration::from_secs(2), "rescan took {rescan:?}");
    let req = request(
        claim("after-bomb"),
        class(GOOD, &[]),
        &good.grants().config_json,
    );
    good.provision(&req).await.expect("the good guest serves");
}
