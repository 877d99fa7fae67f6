//! Host resources a guest can make the host keep without opening a single extra descriptor:
//! streams of one file each reading in the background, pollables, handles of its granted
//! directories. Each counts against the call, with the grant's caps at the most they allow.

use super::*;

/// Runs in a child process of its own (its peak memory is this test's alone). One call of a
/// 32 MiB guest whose grant allows the most descriptors a grant may (4,096) opens one file and
/// makes 20,000 read streams of it, starting a 64 KiB read on each; then pollables and
/// granted-directory handles by the thousand. Before, the streams alone took the process from
/// ~30 MiB to 1.3 GiB: one descriptor, so no cap saw them, and every pending read kept its
/// buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pollables_and_handles_stay_within_the_call_budget() {
    let _alone = super::CPU_HEAVY.lock().await;
    if !in_child(
        "hoards::streams_pollables_and_handles_stay_within_the_call_budget",
        "WP_HOARD_CHILD",
    ) {
        return;
    }
    let n = NodeAttack::load("memory-mib = 32\ndescriptors = 4096");
    std::fs::write(n.dir().join("file"), vec![7u8; 1 << 20]).unwrap();
    n.provision("warm", &[]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let base = rss_mib();
    reset_peak_rss();
    for attack in ["read-hoard", "pollable-hoard", "preopen-hoard"] {
        let started = Instant::now();
        let outcome = n.provision(attack, &[("attack", attack)]).await;
        let peak = peak_rss_mib();
        println!(
            "{attack}: {:?} in {:?}; RSS base {base} MiB, peak so far {peak} MiB",
            outcome.as_ref().map(|_| "served"),
            started.elapsed()
        );
        match &outcome {
            Err(error @ CallError::Fault { kind, .. }) => {
                assert_eq!(*kind, FaultKind::Descriptors, "{attack}: {error}")
            }
            other => panic!("{attack}: expected a descriptors fault, got {other:?}"),
        }
        n.provision(&format!("{attack}-after"), &[])
            .await
            .expect("the next call serves");
    }
    let peak = peak_rss_mib();
    let budget = base + 32 + RSS_SLACK_MIB;
    println!("hoards: RSS base {base} MiB, peak {peak} MiB, budget {budget} MiB");
    assert!(peak <= budget, "peak RSS {peak} MiB over {budget} MiB");
}
