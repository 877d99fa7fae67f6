//! Deleting a volume a pod filled with many files: the hostpath guest's delete through the host
//! (real `.wasm`, in-process) of a plain directory (a walk that unlinks every entry) against a
//! volume in a size-enforcing btrfs directory (`host.destroy-volume`: the subvolume deleted
//! whole; the kernel's cleaner frees its extents afterwards, in the background). `WP_BENCH_FILES` files (default
//! 1,000,000) in 1,000 directories, `WP_BENCH_RUNS` runs (default 3) of each, alternating, on
//! the same loop-mounted btrfs. Prints min / median / max; asserts nothing. Root.
//!
//! `WP_BENCH_PART=provision`: what the host spends per volume instead: `WP_BENCH_VOLUMES`
//! (default 200) provisions through the guest into a plain directory and into a size-enforcing
//! one, alternating, one at a time and then `WP_BENCH_IN_FLIGHT` (default 3, the controller's
//! turns) at once; then the sized steps alone, timed one by one (subvolume create, the mark,
//! the rename, the limit), to say where a sized volume's extra time goes.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::btrfs::Btrfs;
use common::{PluginsDir, as_volume, claim, class, dir_grant, request};
use wasm_provisioner::wasm::bindings::types::DeleteRequest;
use wasm_provisioner::wasm::{Guest, Plugins, WasmEngine, load_dir};

const PROVISIONER: &str = "bench.wasm-provisioner.dev/hostpath";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The hostpath guest on `storage`, with `sizes = "btrfs"` when `sized`.
fn load(storage: &Path, sized: bool) -> (PluginsDir, Plugins) {
    let plugins = PluginsDir::new();
    let mut grant = dir_grant(PROVISIONER, storage, "/volumes", "call-timeout-ms = 600000");
    grant = grant.replacen("call-timeout-ms = 5000\n", "", 1);
    if sized {
        grant = grant.replacen(
            "access = \"read-write\"\n",
            "access = \"read-write\"\nsizes = \"btrfs\"\n",
            1,
        );
    }
    plugins.add("hostpath", "hostpath", &grant);
    let loaded = load_dir(&WasmEngine::new().unwrap(), plugins.path()).unwrap();
    assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
    (plugins, loaded)
}

/// Provisions a volume, fills it with `files` files (as a pod would, from outside the guest),
/// and times the guest's delete of it.
async fn one(guest: &Arc<Guest>, storage: &Path, name: &str, files: usize) -> Duration {
    let req = request(
        claim(name),
        class(PROVISIONER, &[]),
        &guest.grants().config_json,
    );
    let built = guest.provision(&req).await.expect("provision");
    let dir = storage.join(&req.pv_name);
    let per_dir = 1000;
    for d in 0..files.div_ceil(per_dir) {
        let sub = dir.join(format!("d{d}"));
        std::fs::create_dir(&sub).unwrap();
        for f in 0..per_dir.min(files - d * per_dir) {
            std::fs::File::create(sub.join(format!("f{f}"))).unwrap();
        }
    }
    rustix::fs::sync();
    let delete = DeleteRequest {
        volume: as_volume(&req, &built),
        storage_class: None,
        config: guest.grants().config_json.clone(),
    };
    let started = Instant::now();
    guest.delete(&delete).await.expect("delete");
    let took = started.elapsed();
    assert!(!dir.exists());
    took
}

fn spread(d: Vec<Duration>) -> String {
    spread_in(d, 1.0)
}

/// min / median / max of `d` in seconds times `scale`, two decimals.
fn spread_in(mut d: Vec<Duration>, scale: f64) -> String {
    d.sort();
    let s = |d: Duration| format!("{:.2}", d.as_secs_f64() * scale);
    format!(
        "{} / {} / {}",
        s(d[0]),
        s(d[d.len() / 2]),
        s(d[d.len() - 1])
    )
}

/// The hostpath guest twice on one btrfs: on a plain directory and on a size-enforcing one.
struct Side {
    plain_dir: std::path::PathBuf,
    sized_dir: std::path::PathBuf,
    plain: Arc<Guest>,
    sized: Arc<Guest>,
    /// The plugins directories, kept while the guests run.
    _plugins: (PluginsDir, PluginsDir),
}

impl Side {
    fn on(fs: &Btrfs) -> Side {
        let plain_dir = fs.mnt.join("plain");
        let sized_dir = fs.mnt.join("sized");
        std::fs::create_dir(&plain_dir).unwrap();
        std::fs::create_dir(&sized_dir).unwrap();
        let (p1, plain) = load(&plain_dir, false);
        let (p2, sized) = load(&sized_dir, true);
        Side {
            plain: plain.for_provisioner(PROVISIONER).unwrap().clone(),
            sized: sized.for_provisioner(PROVISIONER).unwrap().clone(),
            plain_dir,
            sized_dir,
            _plugins: (p1, p2),
        }
    }
}

/// The load average, as /proc/loadavg says it.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// One provision through the guest: the call, the on-disk check and (sized) the volume.
async fn provision_one(guest: &Arc<Guest>, name: &str) -> Duration {
    let req = request(
        claim(name),
        class(PROVISIONER, &[]),
        &guest.grants().config_json,
    );
    let started = Instant::now();
    guest.provision(&req).await.expect("provision");
    started.elapsed()
}

fn spread_ms(d: Vec<Duration>) -> String {
    spread_in(d, 1000.0)
}

/// `WP_BENCH_PART=provision` (see the module docs).
async fn provision_part(fs: &Btrfs) {
    use std::os::fd::AsFd as _;
    use wasm_provisioner::sizes::SizeBackend;
    let volumes = env_usize("WP_BENCH_VOLUMES", 200);
    let in_flight = env_usize("WP_BENCH_IN_FLIGHT", 3);
    let Side {
        sized_dir,
        plain,
        sized,
        _plugins,
        ..
    } = Side::on(fs);
    let (mut plain_one, mut sized_one) = (Vec::new(), Vec::new());
    for i in 0..volumes {
        plain_one.push(provision_one(&plain, &format!("p{i}")).await);
        sized_one.push(provision_one(&sized, &format!("s{i}")).await);
    }
    let batch = |guest: Arc<Guest>, prefix: &'static str| async move {
        let started = Instant::now();
        let mut next = 0;
        while next < volumes {
            let mut calls = Vec::new();
            for i in next..(next + in_flight).min(volumes) {
                let guest = guest.clone();
                calls.push(tokio::spawn(async move {
                    provision_one(&guest, &format!("{prefix}{i}")).await
                }));
            }
            next += in_flight;
            for call in calls {
                call.await.unwrap();
            }
        }
        started.elapsed()
    };
    let plain_batch = batch(plain.clone(), "pb").await;
    let sized_batch = batch(sized.clone(), "sb").await;
    println!(
        "| volumes | one at a time, ms per provision (min / median / max) | {in_flight} in flight, {volumes} volumes, s |"
    );
    println!("|---|---:|---:|");
    println!(
        "| plain directory | {} | {:.2} |",
        spread_ms(plain_one),
        plain_batch.as_secs_f64()
    );
    println!(
        "| subvolume with a limit | {} | {:.2} |",
        spread_ms(sized_one),
        sized_batch.as_secs_f64()
    );
    // The sized steps alone, as sized::make and sized::limit take them.
    let parent = std::fs::File::open(&sized_dir).unwrap();
    let mut steps: [Vec<Duration>; 5] = Default::default();
    for i in 0..volumes {
        let (staging, name) = (format!(".step{i}.sizing"), format!("step{i}"));
        let t = Instant::now();
        std::fs::create_dir(sized_dir.join(&name)).unwrap();
        std::fs::remove_dir(sized_dir.join(&name)).unwrap();
        steps[0].push(t.elapsed());
        let t = Instant::now();
        let volume = SizeBackend::Btrfs
            .create(parent.as_fd(), &staging, u64::MAX - 1)
            .unwrap();
        steps[1].push(t.elapsed());
        let t = Instant::now();
        rustix::fs::fsetxattr(
            &volume,
            "trusted.wasm-provisioner.volume",
            name.as_bytes(),
            rustix::fs::XattrFlags::CREATE,
        )
        .unwrap();
        steps[2].push(t.elapsed());
        let t = Instant::now();
        rustix::fs::renameat_with(
            &parent,
            staging.as_str(),
            &parent,
            name.as_str(),
            rustix::fs::RenameFlags::NOREPLACE,
        )
        .unwrap();
        steps[3].push(t.elapsed());
        let t = Instant::now();
        SizeBackend::Btrfs.set_limit(&volume, 1 << 30).unwrap();
        steps[4].push(t.elapsed());
    }
    println!("| step of a sized volume | ms (min / median / max) |");
    println!("|---|---:|");
    let names = [
        "mkdir + rmdir (the guest's directory, replaced)",
        "subvolume create with its qgroup 1/<id> (create, assign, limit)",
        "the mark (fsetxattr)",
        "the rename into place",
        "the PV's limit (qgroup limit)",
    ];
    for (name, times) in names.iter().zip(steps) {
        println!("| {name} | {} |", spread_ms(times));
    }
}

#[tokio::main]
async fn main() {
    if std::env::var("WP_BENCH_PART").as_deref() == Ok("provision") {
        println!("provisioning, plain vs sized; load {}", load_average());
        let fs = Btrfs::of(16 << 30).with_quotas();
        provision_part(&fs).await;
        return;
    }
    let files = env_usize("WP_BENCH_FILES", 1_000_000);
    let runs = env_usize("WP_BENCH_RUNS", 3);
    println!(
        "deleting a volume holding {files} files in {} directories, {runs} runs each, alternating; load {}",
        files.div_ceil(1000),
        load_average()
    );
    let fs = Btrfs::of(16 << 30).with_quotas();
    let Side {
        plain_dir,
        sized_dir,
        plain,
        sized,
        _plugins,
    } = Side::on(&fs);
    let (mut walked, mut destroyed) = (Vec::new(), Vec::new());
    for run in 0..runs {
        walked.push(one(&plain, &plain_dir, &format!("plain-{run}"), files).await);
        destroyed.push(one(&sized, &sized_dir, &format!("sized-{run}"), files).await);
    }
    println!("| volume | delete, s (min / median / max) |");
    println!("|---|---:|");
    println!(
        "| plain directory (the guest's walk) | {} |",
        spread(walked)
    );
    println!(
        "| subvolume (`host.destroy-volume`; extents freed after, in the kernel) | {} |",
        spread(destroyed)
    );
    println!("load at the end {}", load_average());
}
