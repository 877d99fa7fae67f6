//! Deleting a volume a pod filled with many files: the hostpath guest's delete through the host
//! (real `.wasm`, in-process) of a plain directory (a walk that unlinks every entry) against a
//! volume in a size-enforcing btrfs directory (`host.destroy-volume`: the subvolume deleted
//! whole; the kernel's cleaner frees its extents afterwards, in the background). `WP_BENCH_FILES` files (default
//! 1,000,000) in 1,000 directories, `WP_BENCH_RUNS` runs (default 3) of each, alternating, on
//! the same loop-mounted btrfs. Prints min / median / max; asserts nothing. Root.

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

fn spread(mut d: Vec<Duration>) -> String {
    d.sort();
    let s = |d: Duration| format!("{:.2}", d.as_secs_f64());
    format!(
        "{} / {} / {}",
        s(d[0]),
        s(d[d.len() / 2]),
        s(d[d.len() - 1])
    )
}

#[tokio::main]
async fn main() {
    let files = env_usize("WP_BENCH_FILES", 1_000_000);
    let runs = env_usize("WP_BENCH_RUNS", 3);
    println!(
        "deleting a volume holding {files} files in {} directories, {runs} runs each, alternating; load {}",
        files.div_ceil(1000),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let fs = Btrfs::of(16 << 30).with_quotas();
    let plain_dir = fs.mnt.join("plain");
    let sized_dir = fs.mnt.join("sized");
    std::fs::create_dir(&plain_dir).unwrap();
    std::fs::create_dir(&sized_dir).unwrap();
    let (_p1, plain) = load(&plain_dir, false);
    let (_p2, sized) = load(&sized_dir, true);
    let (plain, sized) = (
        plain.for_provisioner(PROVISIONER).unwrap().clone(),
        sized.for_provisioner(PROVISIONER).unwrap().clone(),
    );
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
    println!(
        "load at the end {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
}
