//! The shared instance pool: guests at their `max-concurrency` can never hold all of it, so
//! another guest always gets an instance at once (issue 21: each call may use 32 core instances
//! of one shared pool; a few guests at their caps could exhaust it for everyone).

use super::*;

/// Two guests granted 64 calls at a time (2 x 64 x 32 units: the whole pool of 4,096) next to
/// a guest of the default grant. Every call of every hog that loaded blocks in a host call until
/// its 4 s deadline; the good guest's claim is served while all of them still hold their slots.
/// Before the ledger both hogs loaded and the good guest waited for a hog's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_at_their_caps_leave_the_pool_to_the_others() {
    const HOG_CALLS: usize = 64;
    // 128 instantiations at once: not next to a test measuring a deadline.
    let _alone = super::CPU_HEAVY.lock().await;
    let root = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    let good_dir = root.path().join("good");
    std::fs::create_dir_all(&good_dir).unwrap();
    plugins.add(
        "good",
        "hostpath",
        &dir_grant(GOOD, &good_dir, "/volumes", ""),
    );
    for hog in ["hog-a", "hog-b"] {
        let dir = root.path().join(hog);
        std::fs::create_dir_all(&dir).unwrap();
        plugins.add(
            hog,
            "attack",
            &dir_grant(
                &format!("test.wasm-provisioner.dev/{hog}"),
                &dir,
                "/state",
                &format!("max-concurrency = {HOG_CALLS}"),
            )
            .replace("call-timeout-ms = 5000", "call-timeout-ms = 4000"),
        );
    }
    let engine = WasmEngine::with_options(&EngineOptions {
        pooling: Pooling::On,
        executor: Some(ExecutorOptions::default()),
        ..EngineOptions::default()
    })
    .unwrap();
    let loaded = load_dir(&engine, plugins.path()).unwrap();
    println!("problems: {:?}", loaded.problems);
    let good = loaded.for_provisioner(GOOD).expect("the good guest loads");
    let hogs: Vec<Guest> = ["hog-a", "hog-b"]
        .iter()
        .filter_map(|hog| loaded.for_provisioner(&format!("test.wasm-provisioner.dev/{hog}")))
        .map(|hog| Guest::clone(hog))
        .collect();
    assert!(!hogs.is_empty(), "a hog loads: {:?}", loaded.problems);
    for problem in &loaded.problems {
        assert!(
            problem.reason.contains("units of the instance pool"),
            "only the pool refuses a hog: {problem}"
        );
    }

    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut calls = Vec::new();
    for hog in &hogs {
        let config = hog.grants().config_json.clone();
        for i in 0..HOG_CALLS {
            let (hog, config, in_flight) = (hog.clone(), config.clone(), in_flight.clone());
            in_flight.fetch_add(1, Ordering::SeqCst);
            calls.push(tokio::spawn(async move {
                let provisioner = hog.grants().provisioner.clone();
                let req = request(
                    claim(&format!("block-{i}")),
                    class(&provisioner, &[("attack", "host-block")]),
                    &config,
                );
                let outcome = hog.provision(&req).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                outcome
            }));
        }
    }
    // Every hog slot taken, and a moment to instantiate and block.
    while !hogs.iter().all(Guest::at_capacity) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let holding = in_flight.load(Ordering::SeqCst);
    let started = Instant::now();
    let req = request(
        claim("while-hogged"),
        class(GOOD, &[]),
        &good.grants().config_json,
    );
    good.provision(&req).await.expect("the good guest serves");
    let took = started.elapsed();
    let still = in_flight.load(Ordering::SeqCst);
    println!(
        "{} hog(s) x {HOG_CALLS} calls blocked ({holding} in flight); the good guest's claim took {took:?}, {still} hog calls still in flight after it",
        hogs.len()
    );
    assert_eq!(holding, hogs.len() * HOG_CALLS);
    assert_eq!(
        still, holding,
        "the good guest got an instance only after a hog's call ended ({took:?})"
    );
    for call in calls {
        match call.await.unwrap() {
            Err(CallError::Fault {
                kind: FaultKind::Deadline,
                ..
            }) => {}
            other => panic!("a hog call ends at its deadline: {other:?}"),
        }
    }
}
