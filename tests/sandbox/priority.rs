//! A guest call runs at the controller's priority for its first slice of CPU only: a guest
//! spinning until its deadline goes on on the nicer threads, where it takes only CPU nobody
//! else wants (`src/wasm/executor.rs`).

use super::*;

/// What one thread of this process is doing: its name, whether it is running or runnable,
/// and its nice level.
fn threads() -> Vec<(String, bool, i32)> {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ...`: the name may hold spaces, so read after its last ')'.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let name = head.split_once('(').map_or("", |(_, name)| name).to_owned();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // After the name: state is field 3 of stat, nice field 19.
        let running = fields.first() == Some(&"R");
        let nice = fields.get(16).and_then(|n| n.parse().ok()).unwrap_or(0);
        found.push((name, running, nice));
    }
    found
}

/// Runs in a child process of its own, so that no other test's guest threads are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_call_goes_on_at_the_lower_priority() {
    if !in_child(
        "priority::a_spinning_call_goes_on_at_the_lower_priority",
        "WP_PRIORITY_CHILD",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "attack",
        "attack",
        &dir_grant(ATTACK, dir.path(), "/state", "")
            .replace("call-timeout-ms = 5000", "call-timeout-ms = 2000"),
    );
    // As `run` builds it (guest threads 10 steps nicer than the controller's).
    let engine = WasmEngine::with_options(&EngineOptions {
        executor: Some(ExecutorOptions::default()),
        ..EngineOptions::default()
    })
    .unwrap();
    let loaded = load_dir(&engine, plugins.path()).unwrap();
    let guest = loaded.for_provisioner(ATTACK).unwrap().clone();
    let own_nice = threads()
        .into_iter()
        .find(|(name, ..)| name.starts_with("priority"))
        .map_or(0, |(_, _, nice)| nice);
    let request = request(
        claim("spinner"),
        class(ATTACK, &[("attack", "spin")]),
        &guest.grants().config_json,
    );
    let spinning = tokio::spawn({
        let guest = guest.clone();
        async move { guest.provision(&request).await }
    });
    // Past its first slice, then watched for a second.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (mut nicer, mut first, mut samples) = (0, 0, 0);
    for _ in 0..100 {
        samples += 1;
        for (name, running, nice) in threads() {
            match name.as_str() {
                "wasm-guest" if running && nice == (own_nice + 10).min(19) => nicer += 1,
                "wasm-call" if running => first += 1,
                _ => {}
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "while the guest spun: a nicer thread running in {nicer} of {samples} samples, a first-slice thread in {first}"
    );
    assert!(
        nicer >= samples * 9 / 10,
        "the spinning call runs on a thread 10 steps nicer ({nicer} of {samples} samples)"
    );
    assert!(
        first <= samples / 10,
        "and not at the controller's priority ({first} of {samples} samples)"
    );
    match spinning.await.unwrap() {
        Err(CallError::Fault { kind, .. }) => assert_eq!(kind, FaultKind::Deadline),
        other => panic!("the spin ends at its deadline: {other:?}"),
    }
}
