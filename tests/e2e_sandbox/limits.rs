//! The real `run` process under the shipped container limit (`deploy/`: 512 MiB) in a cgroup of
//! its own: attacking guests beside a good one, and a compile bomb dropped into its plugins
//! directory. What counts is what the kernel says: OOM kills, the process' peak resident memory,
//! its descriptors and threads.

use super::*;
use wp_harness::MemoryCgroup;

/// The memory limit of the provisioner container in `deploy/deployment.yaml`.
const CONTAINER_MIB: u64 = 512;

/// The slack of the documented budget (docs/threat-model.md "Host memory").
const SLACK_MIB: u64 = 96;

/// `/proc/<pid>/status` field `key` (kB fields in KiB).
fn status_field(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Samples a process' descriptors and threads, and the compiler children in its cgroup, every
/// 10 ms until stopped.
struct Sampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Samples>>,
}

#[derive(Debug, Default)]
struct Samples {
    fds: usize,
    threads: u64,
    /// Distinct PIDs of `compile-guest` children seen.
    compilers: std::collections::BTreeSet<u32>,
    /// The `oom_score_adj` of each compiler child, as last seen (it sets its own at start).
    compiler_oom_adj: std::collections::BTreeMap<u32, String>,
    /// The largest peak resident memory of a compiler child seen, MiB.
    compiler_hwm_mib: u64,
}

impl Sampler {
    fn start(pid: u32, cgroup: std::path::PathBuf) -> Sampler {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut s = Samples::default();
                while !stop.load(Ordering::Relaxed) {
                    s.fds = s.fds.max(open_fds(pid));
                    s.threads = s.threads.max(status_field(pid, "Threads:"));
                    let procs =
                        std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
                    for child in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
                        let cmdline =
                            std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
                        if !String::from_utf8_lossy(&cmdline).contains("compile-guest") {
                            continue;
                        }
                        s.compilers.insert(child);
                        s.compiler_hwm_mib =
                            s.compiler_hwm_mib.max(status_field(child, "VmHWM:") / 1024);
                        if let Ok(adj) =
                            std::fs::read_to_string(format!("/proc/{child}/oom_score_adj"))
                        {
                            s.compiler_oom_adj.insert(child, adj.trim().to_string());
                        }
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                s
            }
        });
        Sampler {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> Samples {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().expect("once").join().expect("sampler")
    }
}

/// A cgroup limited like the container, or an error naming why this machine cannot make one.
fn container_cgroup(name: &str) -> anyhow::Result<MemoryCgroup> {
    MemoryCgroup::create(name, CONTAINER_MIB << 20).map_err(|error| {
        anyhow::anyhow!(
            "this test needs a writable cgroup (v2 with the memory controller, or v1 memory; root): {error:#}"
        )
    })
}

/// Good, attacking and node-attacking guests in one `run` process in a 512 MiB cgroup; the
/// host-memory attacks (listings, streams, refused 8 MiB annotations, memory bomb) at their
/// guests' max-concurrency, descriptor hoards, floods and spins. The process is never OOM-killed,
/// its peak resident memory stays within the documented budget, and the good guest's claims bind.
pub(crate) async fn attacks_under_the_containers_memory_limit(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let cgroup = container_cgroup("sandbox-attacks")?;
    let mut w = World::new(cp, "memcg").await?;
    // (guest, crate, limits): the budget is derived from these.
    let guests: &[(&str, &str, u64, usize, &str)] = &[
        ("good", "hostpath", 32, 2, ""),
        ("attack", "attack", 32, 4, ""),
        ("node", "node_attack", 32, 4, "descriptors = 1024"),
    ];
    for (name, krate, memory, calls, extra) in guests {
        let limits = format!("memory-mib = {memory}\nmax-concurrency = {calls}\n{extra}");
        w.install(name, krate, &limits)?;
        let mut grant = w
            .grant(name, &limits)?
            .replace("call-timeout-ms = 5000", "call-timeout-ms = 3000");
        if *name == "good" {
            grant = grant.replace("\"/state\"", "\"/volumes\"");
        }
        std::fs::write(w.plugins.join(format!("{name}.toml")), grant)?;
    }
    let guest_mib: u64 = guests.iter().map(|g| g.2 * g.3 as u64).sum();
    // What the node guest lists and streams: 20,000 entries, and one file.
    let big = w.storage("node").join("big");
    std::fs::create_dir_all(&big)?;
    for i in 0..20_000 {
        std::fs::write(big.join(format!("entry-{i:05}")), "")?;
    }
    std::fs::write(w.storage("node").join("file"), "x")?;

    w.start_in(&cgroup, &["--worker-threads", "12"])?;
    let pid = w.pid();
    let good = w.create_class("good", "good", &[]).await?;
    let mut before = Vec::new();
    for i in 0..4 {
        before.push(w.time_to_bound(&format!("before-{i}"), &good).await?);
    }
    let base = status_field(pid, "VmRSS:") / 1024;
    let budget = base + guest_mib + SLACK_MIB;
    let (fds_base, threads_base) = (open_fds(pid), status_field(pid, "Threads:"));
    cgroup.reset_peak();
    let sampler = Sampler::start(pid, cgroup.path().to_owned());

    // (guest, attack, extra parameters, claims at once, words its event carries; None: binds).
    type Attack<'a> = (
        &'a str,
        &'a str,
        &'a [(&'a str, &'a str)],
        usize,
        Option<&'a [&'a str]>,
    );
    let attacks: &[Attack] = &[
        ("attack", "memory-bomb", &[], 2, Some(&["memory"])),
        ("attack", "spin", &[], 1, Some(&["deadline"])),
        ("attack", "log-flood", &[], 1, None),
        ("attack", "stdout-flood", &[], 1, None),
        (
            "node",
            "listing-hoard",
            &[("dir", "big"), ("count", "400")],
            2,
            Some(&["listings"]),
        ),
        ("node", "stream-hoard", &[], 1, Some(&["descriptors"])),
        ("node", "read-hoard", &[], 2, Some(&["streams"])),
        ("node", "pollable-hoard", &[], 1, Some(&["host resources"])),
        ("node", "preopen-hoard", &[], 1, Some(&["descriptors"])),
        ("node", "fd-hoard", &[], 1, Some(&["descriptors"])),
        ("node", "annotation-hoard", &[], 1, Some(&["refused"])),
        ("node", "log-forge", &[], 1, Some(&["final"])),
    ];
    let mut claims = Vec::new();
    for (guest, attack, params, count, expect) in attacks {
        let mut all = vec![("attack", *attack)];
        all.extend_from_slice(params);
        let class = w.create_class(guest, attack, &all).await?;
        for i in 0..*count {
            let name = format!("{attack}-{i}");
            let uid = w.create_claim(&name, &class).await?;
            claims.push((name, uid, *guest, *expect));
        }
    }
    let mut during = Vec::new();
    for i in 0..6 {
        during.push(w.time_to_bound(&format!("during-{i}"), &good).await?);
    }
    for (name, uid, guest, expect) in &claims {
        match expect {
            Some(words) => {
                let mut words = words.to_vec();
                let named = format!("guest {guest}");
                words.push(&named);
                let message = w.wait_event(uid, "ProvisioningFailed", &words).await?;
                println!(
                    "{name:>18}: {}",
                    message.chars().take(150).collect::<String>()
                );
            }
            None => {
                w.wait_bound(name).await?;
                println!("{name:>18}: bound");
            }
        }
    }
    // The failing attacks are retried (backoff up to 2 s): the host keeps being attacked.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut after = Vec::new();
    for i in 0..4 {
        after.push(w.time_to_bound(&format!("after-{i}"), &good).await?);
    }
    let samples = sampler.finish();
    let peak = status_field(pid, "VmHWM:") / 1024;
    let cgroup_peak = cgroup.peak_bytes()? >> 20;
    let oom_kills = cgroup.oom_kills()?;
    println!(
        "good guest, claim to Bound, median: before {:?}, during attacks {:?}, after {:?}",
        median(before),
        median(during),
        median(after)
    );
    println!(
        "cgroup {:?} {} MiB: oom_kill {oom_kills}, cgroup peak {cgroup_peak} MiB (page cache included); process VmHWM {peak} MiB, budget {budget} MiB = base {base} + guests {guest_mib} + slack {SLACK_MIB}",
        cgroup.version(),
        CONTAINER_MIB
    );
    println!(
        "descriptors {fds_base} -> peak {}; threads {threads_base} -> peak {}",
        samples.fds, samples.threads
    );
    ensure!(
        oom_kills == 0,
        "the OOM killer killed {oom_kills} in the cgroup"
    );
    ensure!(
        w.process.as_mut().is_some_and(|p| p.is_running()),
        "the provisioner is still running"
    );
    ensure!(
        budget <= CONTAINER_MIB,
        "the budget {budget} MiB fits the container's {CONTAINER_MIB} MiB"
    );
    ensure!(
        peak <= budget,
        "peak resident memory {peak} MiB over the budget {budget} MiB"
    );
    // Every call's descriptors are capped (64 + 64 x 3 + 1024 x 4 in flight at most).
    let fd_caps = 64 * 2 + 64 * 4 + 1024 * 4;
    ensure!(
        samples.fds <= fds_base + fd_caps,
        "descriptors {fds_base} -> {} over the calls' caps {fd_caps}",
        samples.fds
    );
    Ok(())
}

/// Drops a compile bomb (10 MiB of text, 2 functions of 100,000 additions over 2,000 locals;
/// WP_BOMB_FUNCTIONS, _LOCALS, _OPS change its shape) and its grant into the plugins directory.
fn drop_bomb(w: &World) -> anyhow::Result<Vec<u8>> {
    let size = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let bomb = common::compile_bomb(
        size("WP_BOMB_FUNCTIONS", 2),
        size("WP_BOMB_LOCALS", 2_000),
        size("WP_BOMB_OPS", 100_000),
    );
    std::fs::write(
        w.plugins.join("bomb.toml"),
        "provisioner = \"e2e.wasm-provisioner.dev/bomb\"\n",
    )?;
    std::fs::write(w.plugins.join("bomb.wasm"), &bomb)?;
    Ok(bomb)
}

/// A compile bomb dropped into the plugins directory of a `run` process in a 512 MiB cgroup,
/// with the shipped compile limits: the process survives, the bomb is refused and, across
/// rescans, never compiled again (compiler children counted in the cgroup), the compiler child
/// is the OOM killer's first choice, and the good guest serves throughout.
pub(crate) async fn a_compile_bomb_under_the_containers_memory_limit(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let cgroup = container_cgroup("sandbox-bomb")?;
    let mut w = World::new(cp, "bomb").await?;
    w.install_good()?;
    w.start_in(&cgroup, &["--plugins-rescan-interval", "2s"])?;
    let pid = w.pid();
    let good = w.create_class("good", "good", &[]).await?;
    let mut before = Vec::new();
    for i in 0..3 {
        before.push(w.time_to_bound(&format!("before-{i}"), &good).await?);
    }
    let sampler = Sampler::start(pid, cgroup.path().to_owned());
    let rss_before = status_field(pid, "VmRSS:") / 1024;
    let bomb = drop_bomb(&w)?;
    let dropped = Instant::now();
    // Served while the bomb compiles.
    let mut during = Vec::new();
    for i in 0..3 {
        during.push(w.time_to_bound(&format!("during-{i}"), &good).await?);
    }
    w.wait("the bomb refused", || async {
        Ok(w.log()
            .lines()
            .any(|l| l.contains("plugin not loaded") && l.contains("bomb.wasm"))
            .then_some(()))
    })
    .await?;
    let refused_after = dropped.elapsed();
    // A changed grant makes the loader look at the bomb again: refused by its SHA-256.
    std::fs::write(
        w.plugins.join("bomb.toml"),
        "provisioner = \"e2e.wasm-provisioner.dev/bomb\"\n# touched\n",
    )?;
    w.wait("the bomb refused before", || async {
        Ok(w.log().contains("refused before").then_some(()))
    })
    .await?;
    // A few periodic rescans (every 2 s).
    tokio::time::sleep(Duration::from_secs(7)).await;
    let mut after = Vec::new();
    for i in 0..3 {
        after.push(w.time_to_bound(&format!("after-{i}"), &good).await?);
    }
    let samples = sampler.finish();
    let oom_kills = cgroup.oom_kills()?;
    let log = w.log();
    let first_refusals = log
        .lines()
        .filter(|l| {
            l.contains("plugin not loaded")
                && l.contains("bomb.wasm")
                && !l.contains("refused before")
        })
        .count();
    let refusals: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("plugin not loaded") && l.contains("bomb.wasm"))
        .collect();
    println!(
        "bomb of {} KiB: refused {refused_after:?} after it was dropped; compiler children {:?} (oom_score_adj {:?}, peak {} MiB); cgroup oom_kill {oom_kills}; provisioner RSS {rss_before} MiB before, VmHWM {} MiB",
        bomb.len() / 1024,
        samples.compilers,
        samples.compiler_oom_adj,
        samples.compiler_hwm_mib,
        status_field(pid, "VmHWM:") / 1024
    );
    for line in &refusals {
        println!("  {}", line.chars().take(300).collect::<String>());
    }
    println!(
        "good guest, claim to Bound, median: before {:?}, while compiling {:?}, after {:?}",
        median(before),
        median(during),
        median(after)
    );
    ensure!(
        w.process.as_mut().is_some_and(|p| p.is_running()),
        "the provisioner survived the bomb (cgroup oom_kill {oom_kills})"
    );
    ensure!(
        samples.compilers.len() == 1,
        "the bomb was compiled once, not again on rescans: {:?}",
        samples.compilers
    );
    ensure!(
        samples.compiler_oom_adj.values().all(|adj| adj == "1000"),
        "the compiler child is the OOM killer's first choice: {:?}",
        samples.compiler_oom_adj
    );
    ensure!(
        first_refusals == 1,
        "one refusal after compiling, the rest by SHA-256: {refusals:?}"
    );
    Ok(())
}

/// Guests loaded beside the good one in the OOM test (name, crate).
const GUESTS_THAT_WEIGH: [(&str, &str); 5] = [
    ("local", "local_path"),
    ("nfs", "nfs_subdir"),
    ("scripted", "scripted"),
    ("attack", "attack"),
    ("node", "node_attack"),
];

/// When the compiler child and the controller together reach the container's limit, the
/// kernel's OOM killer takes the child, even though the controller is the larger process (its
/// default choice): the limit is lowered to what the warm controller uses plus 16 MiB, a bomb
/// is dropped in, and the kernel must pick. The controller survives, the bomb is refused as
/// killed, and the good guest serves once the limit is back. Without the child's
/// `oom_score_adj` of 1000, the kernel took the controller.
pub(crate) async fn the_oom_killer_takes_the_compiler_not_the_controller(
    cp: Arc<ControlPlane>,
) -> anyhow::Result<()> {
    let cgroup = container_cgroup("sandbox-oom")?;
    let mut w = World::new(cp, "oom").await?;
    w.install_good()?;
    // More guests loaded make a controller larger than a compiler child near its start.
    for (name, krate) in GUESTS_THAT_WEIGH {
        w.install(name, krate, "")?;
    }
    w.start_in(&cgroup, &["--plugins-rescan-interval", "1s"])?;
    let pid = w.pid();
    let good = w.create_class("good", "good", &[]).await?;
    w.time_to_bound("before", &good).await?;
    let controller_mib = status_field(pid, "VmRSS:") / 1024;
    let tight = cgroup.current_bytes()? + (16 << 20);
    cgroup.set_limit(tight)?;
    let sampler = Sampler::start(pid, cgroup.path().to_owned());
    drop_bomb(&w)?;
    let refused = w
        .wait("the bomb refused", || async {
            Ok(w.log()
                .lines()
                .find(|l| l.contains("plugin not loaded") && l.contains("bomb.wasm"))
                .map(|l| l.chars().take(300).collect::<String>()))
        })
        .await;
    let samples = sampler.finish();
    let oom_kills = cgroup.oom_kills()?;
    let survived = w.process.as_mut().is_some_and(|p| p.is_running());
    println!(
        "limit {} MiB (controller RSS {controller_mib} MiB); compiler children {:?}, peak {} MiB; cgroup oom_kill {oom_kills}; controller alive: {survived}; {refused:?}",
        tight >> 20,
        samples.compilers,
        samples.compiler_hwm_mib,
    );
    ensure!(
        survived,
        "the OOM killer took the controller (oom_kill {oom_kills})"
    );
    let refused = refused?;
    ensure!(
        oom_kills >= 1,
        "the kernel had to choose: oom_kill {oom_kills}"
    );
    ensure!(
        samples.compiler_hwm_mib < controller_mib,
        "the child ({} MiB) was the larger process, so size alone would have picked it; the test decides nothing",
        samples.compiler_hwm_mib
    );
    ensure!(
        refused.contains("killed"),
        "the refusal says the compiler was killed: {refused}"
    );
    cgroup.set_limit(CONTAINER_MIB << 20)?;
    w.time_to_bound("after", &good).await?;
    Ok(())
}
