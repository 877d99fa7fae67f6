//! A pod's process holding an inode lock under the real `run` process: as many calls of one
//! guest blocked on it as there are guest threads (a rename among them, which used to hold the
//! process-wide served index across the system call), and another guest's claims bind in their
//! usual time.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use wp_harness::ControlPlane;

use super::common::locks::HeldLock;
use super::{World, median};

/// Guest threads of the provisioner in this test: each blocked call used to take one.
const GUEST_THREADS: usize = 2;

pub(crate) async fn a_guest_blocked_on_a_pods_lock_never_delays_another_guests_claims(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let mut w = World::new(cp, "locks").await?;
    w.install_good()?;
    w.install("node", "node_attack", "max-concurrency = 4")?;
    let file = w.storage("node").join("file");
    std::fs::write(&file, "pod data")?;
    w.start(&["--guest-threads", &GUEST_THREADS.to_string()])?;
    let good = w.create_class("good", "good", &[]).await?;
    let mut before = Vec::new();
    for i in 0..4 {
        before.push(w.time_to_bound(&format!("before-{i}"), &good).await?);
    }
    let lock = HeldLock::hold("file", &file);
    let mut blocked = Vec::new();
    for op in ["rename", "write"].into_iter().take(GUEST_THREADS) {
        let class = w
            .create_class("node", op, &[("attack", "locked"), ("op", op)])
            .await?;
        blocked.push((op, w.create_claim(&format!("locked-{op}"), &class).await?));
    }
    // Both calls are in the kernel by the time the good claims are made.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut during = Vec::new();
    for i in 0..4 {
        let name = format!("during-{i}");
        let took = tokio::time::timeout(Duration::from_secs(20), w.time_to_bound(&name, &good))
            .await
            .with_context(|| {
                format!(
                    "{name} was not Bound within 20 s while the other guest's calls were blocked"
                )
            })??;
        during.push(took);
    }
    for (op, uid) in &blocked {
        let message = w
            .wait_event(uid, "ProvisioningFailed", &["guest node", "deadline"])
            .await?;
        println!(
            "locked-{op}: {}",
            message.chars().take(160).collect::<String>()
        );
    }
    lock.release();
    let mut after = Vec::new();
    for i in 0..4 {
        after.push(w.time_to_bound(&format!("after-{i}"), &good).await?);
    }
    println!(
        "good claim to Bound, median: before {:?}, with {GUEST_THREADS} calls of another guest blocked on a lock {:?} (max {:?}), after {:?}",
        median(before),
        median(during.clone()),
        during.iter().max().unwrap(),
        median(after)
    );
    Ok(())
}
