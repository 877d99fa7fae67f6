//! Guest overhead: one provision through the wasm host (fresh instance, call, result conversion
//! and validation) against a native Rust implementation of the same hostpath logic. Both create
//! the same directory in the same temporary directory, and both finish with the host's own
//! volume-spec validation. Prints median and p99 in µs and their ratio; asserts nothing.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasm_provisioner::wasm::bindings::VolumeSpecBuilder;
use wasm_provisioner::wasm::bindings::types::{
    AccessMode, HostPathType, NodeSelectorOperator, NodeSelectorRequirement, NodeSelectorTerm,
    ProvisionRequest, ReclaimPolicy,
};
use wasm_provisioner::wasm::engine::{EngineOptions, Pooling};
use wasm_provisioner::wasm::executor::{ExecutorOptions, GuestExecutor};
use wasm_provisioner::wasm::spec::BuiltVolume;
use wasm_provisioner::wasm::{Grants, WasmEngine, load_dir};

const PROVISIONER: &str = "bench.wasm-provisioner.dev/hostpath";

/// No-op round trips to the blocking pool in the trips row: enough to read one trip's cost from
/// (a hostpath provision as `run` makes it makes one, the host's check of the returned path on
/// disk; on the caller's thread, the pooled rows, each filesystem call of the guest is one more,
/// 8-10 in all).
const POOL_TRIPS: usize = 4;

/// The hostpath guest's provision, written natively against the same builder the host uses.
fn native_provision(request: &ProvisionRequest, grants: &Grants, storage: &Path) -> BuiltVolume {
    let dir = storage.join(&request.pv_name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut spec = VolumeSpecBuilder::default();
    spec.capacity(request.claim.requested_bytes).unwrap();
    spec.access_modes(request.claim.access_modes.clone())
        .unwrap();
    spec.reclaim_policy(request.storage_class.reclaim_policy);
    spec.mount_options(request.storage_class.mount_options.clone())
        .unwrap();
    spec.host_path(
        grants,
        dir.display().to_string(),
        HostPathType::DirectoryOrCreate,
    )
    .unwrap();
    if let Some(node) = &request.selected_node {
        spec.node_affinity(vec![NodeSelectorTerm {
            requirements: vec![NodeSelectorRequirement {
                key: "kubernetes.io/hostname".into(),
                operator: NodeSelectorOperator::In,
                values: vec![node.clone()],
            }],
        }])
        .unwrap();
    }
    spec.annotation(
        "hostpath.wasm-provisioner.dev/dir".into(),
        request.pv_name.clone(),
    )
    .unwrap();
    spec.finish(grants).expect("valid spec")
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn summarize(mut samples: Vec<Duration>) -> (f64, f64) {
    samples.sort();
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

fn main() {
    let iterations: usize = std::env::var("WP_BENCH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let storage = tempfile::tempdir().unwrap();
    let plugins = common::PluginsDir::new();
    plugins.add(
        "hostpath",
        "hostpath",
        &common::dir_grant(PROVISIONER, storage.path(), "/volumes", ""),
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    // `WP_BENCH_ONLY_AS_RUN=1`: only the call as `run` makes it, untimed: the loop to run under a
    // profiler (callgrind, strace -c) for where a call's time goes.
    let only_as_run = std::env::var("WP_BENCH_ONLY_AS_RUN").is_ok_and(|v| v == "1");
    let mut guests = Vec::new();
    // What `run` uses (pooling, guest calls on threads of their own) and the two allocators alone.
    let paths = [
        (Pooling::Off, None),
        (Pooling::On, None),
        (Pooling::On, Some(ExecutorOptions::default())),
    ];
    for (pooling, executor) in paths.into_iter().skip(if only_as_run { 2 } else { 0 }) {
        let engine = WasmEngine::with_options(&EngineOptions {
            pooling,
            module_cache: None,
            executor,
            compiler: None,
        })
        .expect("engine");
        let loaded = load_dir(&engine, plugins.path()).unwrap();
        let label = match (pooling, engine.pooling(), executor.is_some()) {
            (Pooling::On, true, false) => "wasm host, pooling allocator",
            (Pooling::On, true, true) => "wasm host, pooling, on the guest threads (as `run`)",
            (Pooling::On, false, _) => "wasm host, pooling unavailable (on-demand)",
            _ => "wasm host, on-demand allocation",
        };
        guests.push((label, loaded.for_provisioner(PROVISIONER).unwrap().clone()));
    }
    let grants = guests[0].1.grants().clone();

    let mut claim = common::claim("bench");
    claim.access_modes = vec![AccessMode::ReadWriteOnce];
    let mut request = common::request(claim, common::class(PROVISIONER, &[]), &grants.config_json);
    request.selected_node = Some("node-1".into());
    request.storage_class.reclaim_policy = ReclaimPolicy::Delete;

    // The same native call, hopped onto threads like the guest executor's: what the hop costs
    // alone. Its inputs are shared, so no clone of them is timed.
    let hop = GuestExecutor::new(ExecutorOptions::default()).expect("executor");
    let inputs = Arc::new((request.clone(), grants.clone(), storage.path().to_owned()));
    let native_hopped = || {
        let inputs = inputs.clone();
        runtime
            .block_on(hop.run(async move {
                let (request, grants, storage) = &*inputs;
                native_provision(request, grants, storage)
            }))
            .expect("the native call ran")
    };

    if only_as_run {
        let (_, guest) = guests.last().expect("the as-`run` guest");
        for _ in 0..iterations {
            std::hint::black_box(runtime.block_on(guest.provision(&request)).unwrap());
        }
        println!("{iterations} calls as `run` makes them");
        return;
    }
    // The hop plus four no-op round trips to the guest executor's blocking pool, where the
    // host's check of a returned path goes (and every filesystem call of a guest called off the
    // executor): what one such trip costs.
    let pool_trips = || {
        runtime
            .block_on(hop.run(async {
                for _ in 0..POOL_TRIPS {
                    tokio::task::spawn_blocking(|| ()).await.expect("no-op");
                }
            }))
            .expect("the trips ran")
    };
    // Warm up every path (first directory creation, caches, lazy init).
    for _ in 0..50 {
        for (_, guest) in &guests {
            runtime.block_on(guest.provision(&request)).unwrap();
        }
        native_provision(&request, &grants, storage.path());
        native_hopped();
        pool_trips();
    }
    let mut wasm: Vec<Vec<Duration>> = vec![Vec::with_capacity(iterations); guests.len()];
    let mut native = Vec::with_capacity(iterations);
    let mut hopped = Vec::with_capacity(iterations);
    let mut trips = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        // Interleave so every path sees the same machine noise.
        for (i, (_, guest)) in guests.iter().enumerate() {
            let t = Instant::now();
            let built = runtime.block_on(guest.provision(&request)).unwrap();
            wasm[i].push(t.elapsed());
            std::hint::black_box(built);
        }
        let t = Instant::now();
        let built = native_provision(&request, &grants, storage.path());
        native.push(t.elapsed());
        std::hint::black_box(built);
        let t = Instant::now();
        let built = native_hopped();
        hopped.push(t.elapsed());
        std::hint::black_box(built);
        let t = Instant::now();
        pool_trips();
        trips.push(t.elapsed());
    }
    let (native_median, native_p99) = summarize(native);
    println!("guest overhead: hostpath provision, {iterations} calls per path, interleaved");
    println!("| path | median µs | p99 µs | median / native | p99 / native |");
    println!("|---|---:|---:|---:|---:|");
    for ((label, _), samples) in guests.iter().zip(wasm) {
        let (median, p99) = summarize(samples);
        println!(
            "| {label} (fresh instance per call) | {median:.1} | {p99:.1} | {:.2}× | {:.2}× |",
            median / native_median,
            p99 / native_p99
        );
    }
    println!("| native Rust, same logic | {native_median:.1} | {native_p99:.1} | 1.00× | 1.00× |");
    let (median, p99) = summarize(hopped);
    println!(
        "| native Rust, hopped onto guest-executor threads | {median:.1} | {p99:.1} | {:.2}× | {:.2}× |",
        median / native_median,
        p99 / native_p99
    );
    let (trips_median, trips_p99) = summarize(trips);
    println!(
        "| a no-op hopped onto the guest threads with {POOL_TRIPS} no-op blocking-pool round trips in it (the host's check of the path is one; off the executor, each guest filesystem call too) | {trips_median:.1} | {trips_p99:.1} | — | — |"
    );
}
