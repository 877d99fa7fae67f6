//! A pod's process holding an inode lock (a write stuck in the kernel, a listing stuck on a
//! fault) cannot keep a guest call past its deadline, take the guest threads, hold the served
//! index, or delay another guest: a call waiting in the kernel holds only its own thread, its
//! caller gives up on it at the deadline, and what it keeps is charged to its guest.

use super::*;
use common::locks::HeldLock;

/// The node-attack guest on guest threads of its own (`threads` of them), allowed `calls` at a
/// time.
fn attacker(threads: usize, calls: usize) -> (WasmEngine, NodeAttack) {
    let engine = WasmEngine::with_options(&EngineOptions {
        executor: Some(ExecutorOptions {
            threads,
            ..ExecutorOptions::default()
        }),
        ..EngineOptions::default()
    })
    .unwrap();
    let n = NodeAttack::load_on(&engine, &format!("max-concurrency = {calls}"));
    (engine, n)
}

/// How long a call may take against a 2 s deadline: the deadline, the 500 ms the host allows a
/// host call past it, and a second of margin for a loaded machine.
const DEADLINE_AND_MARGIN: Duration = Duration::from_millis(3500);

/// Past this the call is taken to be held by the lock (the test then lets the lock go, so that
/// a failing run ends).
const HELD: Duration = Duration::from_secs(12);

/// Runs `op` of the node-attack guest against a held lock and returns how long it took and
/// how it ended (`None`: still running after [`HELD`]).
async fn locked_call(
    n: &NodeAttack,
    op: &str,
    claim: &str,
) -> (
    Duration,
    Option<Result<wasm_provisioner::wasm::spec::BuiltVolume, CallError>>,
) {
    let started = Instant::now();
    let request = n.request(claim, &[("attack", "locked"), ("op", op)]);
    let outcome = tokio::time::timeout(HELD, n.guest.provision(&request)).await;
    (started.elapsed(), outcome.ok())
}

/// Waits (5 s at most) until nothing the guest's calls left waiting on the lock is charged to
/// it any more, once the lock went.
async fn nothing_left_waiting(n: &NodeAttack, what: &str) {
    let started = Instant::now();
    while n.guest.lingering_operations() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what}: what waited on the lock ended with it"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn expect_deadline(
    what: &str,
    took: Duration,
    outcome: &Option<Result<wasm_provisioner::wasm::spec::BuiltVolume, CallError>>,
) {
    let Some(outcome) = outcome else {
        panic!("{what}: still waiting on the lock after {took:?}, against a 2 s deadline");
    };
    match outcome {
        Err(CallError::Fault { kind, .. }) => assert_eq!(*kind, FaultKind::Deadline, "{what}"),
        other => panic!("{what}: expected a deadline fault, got {other:?}"),
    }
    assert!(
        took < DEADLINE_AND_MARGIN,
        "{what}: ran {took:?} against a 2 s deadline"
    );
}

/// Each call a lock can hold up ends at its deadline as a `deadline` fault, and the thread it
/// left waiting is charged to its guest until the lock goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_on_a_lock_ends_at_its_deadline() {
    let (_engine, n) = attacker(2, 4);
    for (op, mode) in [
        ("write", "file"),
        ("set-times", "file"),
        ("link", "file"),
        ("rename", "file"),
        ("mkdir", "dir"),
        ("list", "dir"),
    ] {
        let file = n.dir().join("file");
        std::fs::write(&file, b"pod data").unwrap();
        std::fs::create_dir_all(n.dir().join("dir")).unwrap();
        let target = if mode == "file" {
            file.clone()
        } else {
            n.dir().join("dir")
        };
        let lock = HeldLock::hold(mode, &target);
        let (took, outcome) = locked_call(&n, op, &format!("locked-{op}")).await;
        println!(
            "{op} with {} locked: {took:?}: {:?}; operations left waiting: {}",
            target.display(),
            outcome.as_ref().map(|o| o.as_ref().map(|_| "served")),
            n.guest.lingering_operations()
        );
        let lingering = n.guest.lingering_operations();
        lock.release();
        expect_deadline(op, took, &outcome);
        assert!(
            lingering >= 1,
            "{op}: the waiting thread is charged to the guest"
        );
        // Once the lock goes, so does the charge.
        nothing_left_waiting(&n, op).await;
        for leftover in ["file.link", "file.renamed", "dir/made"] {
            let path = n.dir().join(leftover);
            if path.is_dir() {
                std::fs::remove_dir(&path).unwrap();
            } else if path.exists() {
                std::fs::remove_file(&path).unwrap();
            }
        }
    }
}

/// As many calls blocked on a lock as there are guest threads, one of them a rename (which
/// used to hold the process-wide served index across the system call): another guest's
/// provisions, each checked against that index, go on in their usual time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_blocked_on_every_guest_thread_leave_other_guests_serving() {
    const THREADS: usize = 2;
    let (engine, n) = attacker(THREADS, 4);
    let good_dir = tempfile::tempdir().unwrap();
    let plugins = PluginsDir::new();
    plugins.add(
        "good",
        "hostpath",
        &dir_grant(GOOD, good_dir.path(), "/state", ""),
    );
    let loaded = load_dir(&engine, plugins.path()).unwrap();
    let good = loaded.for_provisioner(GOOD).unwrap().clone();
    let provision_good = |name: String| {
        let good = good.clone();
        let request = request(claim(&name), class(GOOD, &[]), &good.grants().config_json);
        async move {
            let started = Instant::now();
            good.provision(&request)
                .await
                .expect("the good guest serves");
            started.elapsed()
        }
    };
    let mut before = Vec::new();
    for i in 0..5 {
        before.push(provision_good(format!("before-{i}")).await);
    }
    let file = n.dir().join("file");
    std::fs::write(&file, b"pod data").unwrap();
    let lock = HeldLock::hold("file", &file);
    let n = Arc::new(n);
    let blocked: Vec<_> = ["rename", "write"]
        .into_iter()
        .take(THREADS)
        .map(|op| {
            let n = n.clone();
            tokio::spawn(async move { (op, locked_call(&n, op, &format!("blocked-{op}")).await) })
        })
        .collect();
    // Both calls are in the kernel by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut during = Vec::new();
    for i in 0..5 {
        let took = tokio::time::timeout(HELD, provision_good(format!("during-{i}")))
            .await
            .expect("the good guest's provision did not wait for the blocked calls");
        during.push(took);
    }
    for call in blocked {
        let (op, (took, outcome)) = call.await.unwrap();
        println!("blocked {op}: {took:?}");
        expect_deadline(op, took, &outcome);
    }
    lock.release();
    println!(
        "good guest provision median: before {:?}, with {THREADS} calls blocked on every guest thread {:?} (max {:?})",
        median(before),
        median(during.clone()),
        during.iter().max().unwrap()
    );
}

/// A call blocked in the kernel past its deadline keeps its slot (its instance and its thread
/// are still in use): once every slot of the guest is held so, the next call is refused at once
/// with a fault that says why, instead of waiting for the kernel; once the lock goes, the guest
/// serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_stuck_past_their_deadline_keep_their_slots_and_a_full_guest_says_so() {
    const SLOTS: usize = 2;
    let (_engine, n) = attacker(1, SLOTS);
    let file = n.dir().join("file");
    std::fs::write(&file, b"pod data").unwrap();
    let lock = HeldLock::hold("file", &file);
    let n = Arc::new(n);
    let stuck: Vec<_> = (0..SLOTS)
        .map(|i| {
            let n = n.clone();
            tokio::spawn(async move { locked_call(&n, "write", &format!("stuck-{i}")).await })
        })
        .collect();
    for call in stuck {
        let (took, outcome) = call.await.unwrap();
        expect_deadline("write", took, &outcome);
    }
    assert_eq!(n.guest.lingering_operations(), SLOTS);
    let (took, outcome) = locked_call(&n, "write", "refused").await;
    println!("with every slot stuck: {took:?}: {outcome:?}");
    match outcome {
        Some(Err(CallError::Fault { kind, message, .. })) => {
            assert_eq!(kind, FaultKind::Deadline);
            assert!(message.contains("call slots"), "{message}");
        }
        other => panic!("expected a refusal naming the stuck slots, got {other:?}"),
    }
    assert!(
        took < Duration::from_millis(500),
        "refused at once, not after a wait: {took:?}"
    );
    assert!(
        !n.guest.at_capacity(),
        "a claim is not told to wait for slots that only the kernel gives back"
    );
    lock.release();
    nothing_left_waiting(&n, "the stuck calls").await;
    let (_, outcome) = locked_call(&n, "write", "after").await;
    assert!(
        matches!(outcome, Some(Err(CallError::Guest { .. }))),
        "the guest runs calls again (the attack reports what it did): {outcome:?}"
    );
}
