//! attack: an adversarial test guest. The class parameter `attack` picks how it misbehaves;
//! without it, it provisions a normal hostPath volume `<node-dir>/<pv>` (and creates
//! `<guest-dir>/<pv>`), so one guest serves both the attacks and the "still serving" checks.
//!
//! ```text
//! provision ─▶ attack? ── spin / host-loop / host-block ───────────▶ never returns (deadline)
//!                      ── memory-bomb / (shadow-)stack-overflow / panic / unreachable ─▶ traps
//!                      ── log-flood / stdout-flood ──▶ floods, then a normal volume
//!                      ── host-owned-keys / huge-* / negative-* / invalid-labels
//!                           ─▶ refused setters ignored, the spec returned anyway
//!                      ── slow-sometimes ─▶ odd attempts busy-wait past the deadline
//!           ─▶ none: mkdir <guest-dir>/<pv>, hostPath <node-dir>/<pv>
//! delete ─▶ rm -r <guest-dir>/<pv>
//! ```

mod attack;

use std::hint::black_box;
use std::io::Write;
use std::time::{Duration, Instant};

wit_bindgen::generate!({
    path: "../../wit",
    world: "provisioner",
});

use attack::{Attack, Plan};
use exports::wasm_provisioner::provisioner::lifecycle::Guest;
use wasm_provisioner::provisioner::host;
use wasm_provisioner::provisioner::types::{
    DeleteRequest, HostPathType, LogLevel, Pair, ProvisionError, ProvisionRequest,
};
use wasm_provisioner::provisioner::volume_builder::VolumeSpec;

#[derive(serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Config {
    guest_dir: String,
    node_dir: String,
}

impl Config {
    fn parse(json: &str) -> Result<Config, ProvisionError> {
        serde_json::from_str(json)
            .map_err(|error| ProvisionError::Final(format!("guest config: {error}")))
    }

    fn guest_path(&self, name: &str) -> String {
        format!("{}/{name}", self.guest_dir.trim_end_matches('/'))
    }

    fn node_path(&self, name: &str) -> String {
        format!("{}/{name}", self.node_dir.trim_end_matches('/'))
    }
}

struct AttackGuest;

impl Guest for AttackGuest {
    fn provision(request: ProvisionRequest) -> Result<VolumeSpec, ProvisionError> {
        let config = Config::parse(&request.config)?;
        let plan = Plan::from_parameters(&request.storage_class.parameters)
            .map_err(ProvisionError::Final)?;
        let Some(attack) = plan.attack else {
            return normal_volume(&config, &request);
        };
        host::log(
            LogLevel::Info,
            "attacking",
            &[pair("attack", attack.name())],
        );
        match attack {
            Attack::Spin => spin(),
            Attack::HostLoop => loop {
                black_box(host::config());
            },
            Attack::HostBlock => {
                std::thread::sleep(Duration::from_secs(3600));
                Err(ProvisionError::Final("woke up after an hour".into()))
            }
            Attack::MemoryBomb => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    let mut chunk = vec![0u8; 1 << 20];
                    chunk[hoard.len() % (1 << 20)] = 1;
                    hoard.push(black_box(chunk));
                }
            }
            Attack::StackOverflow => {
                let result = recurse(black_box(u64::MAX));
                Err(ProvisionError::Final(format!("recursion ended: {result}")))
            }
            Attack::ShadowStackOverflow => {
                let depth = recurse_in_memory(black_box(1));
                Err(ProvisionError::Final(format!("recursion ended at {depth}")))
            }
            Attack::Panic => panic!("attack guest panics on purpose"),
            Attack::Unreachable => unreachable_instruction(),
            Attack::LogFlood => {
                for i in 0..200_000u32 {
                    host::log(LogLevel::Info, "", &[]);
                    if i % 1000 == 0 {
                        host::log(LogLevel::Warn, &"flood ".repeat(10_000), &[]);
                    }
                }
                normal_volume(&config, &request)
            }
            Attack::StdoutFlood => {
                let line = "flood ".repeat(1000);
                let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
                for _ in 0..(16 << 20) / line.len() {
                    let _ = writeln!(out, "{line}");
                    let _ = writeln!(err, "{line}");
                }
                normal_volume(&config, &request)
            }
            Attack::HostOwnedKeys => ignore_refusals(&config, &request, |spec| {
                let _ = spec.annotation("pv.kubernetes.io/provisioned-by", "someone-else");
                let _ = spec.annotation("pv.kubernetes.io/bound-by-controller", "yes");
                let _ = spec.label("kubernetes.io/hostname", "another-node");
                let _ = spec.annotation("wasm-provisioner.dev/owner", "attack");
            }),
            Attack::HugeCapacity => ignore_refusals(&config, &request, |spec| {
                let _ = spec.capacity(u64::MAX);
            }),
            Attack::NegativeCapacity => ignore_refusals(&config, &request, |spec| {
                let _ = spec.capacity(-1i64 as u64);
            }),
            Attack::HugeAnnotations => ignore_refusals(&config, &request, |spec| {
                let _ = spec.annotation("attack.example/huge", &"x".repeat(10_000_000));
                let quarter = "y".repeat(256 * 1024);
                for i in 0..64 {
                    let _ = spec.annotation(&format!("attack.example/a{i}"), &quarter);
                }
            }),
            Attack::InvalidLabels => ignore_refusals(&config, &request, |spec| {
                for key in ["bad key!", "-leading-dash", "a/b/c", "", &"k".repeat(300)] {
                    let _ = spec.label(key, "v");
                }
            }),
            Attack::SlowSometimes => {
                let attempt = count_attempt(&config, &request.pv_name)?;
                if attempt % 2 == 1 {
                    let until = Instant::now() + Duration::from_millis(plan.slow_ms);
                    while Instant::now() < until {
                        black_box(attempt);
                    }
                }
                normal_volume(&config, &request)
            }
        }
    }

    fn delete(request: DeleteRequest) -> Result<(), ProvisionError> {
        let config = Config::parse(&request.config)?;
        let path = config.guest_path(&request.volume.name);
        match std::fs::remove_dir_all(&path) {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(ProvisionError::Transient(format!(
                "removing {path}: {error}"
            ))),
        }
    }
}

// Exported only from WebAssembly: the export names (`wasm-provisioner:provisioner/...`) are not
// valid symbol names for a native cdylib, which `cargo test` also links.
#[cfg(target_arch = "wasm32")]
export!(AttackGuest);

/// The well-behaved path: a directory in the granted dir, described as a hostPath volume.
fn normal_volume(
    config: &Config,
    request: &ProvisionRequest,
) -> Result<VolumeSpec, ProvisionError> {
    let guest_path = config.guest_path(&request.pv_name);
    std::fs::create_dir_all(&guest_path)
        .map_err(|error| ProvisionError::Transient(format!("creating {guest_path}: {error}")))?;
    let spec = VolumeSpec::new();
    spec.host_path(
        &config.node_path(&request.pv_name),
        HostPathType::DirectoryOrCreate,
    )
    .map_err(|error| ProvisionError::Final(format!("{error:?}")))?;
    Ok(spec)
}

/// A normal volume with `misbehave` applied on top, every refusal ignored: the host's check of
/// the returned spec has to catch it.
fn ignore_refusals(
    config: &Config,
    request: &ProvisionRequest,
    misbehave: impl FnOnce(&VolumeSpec),
) -> Result<VolumeSpec, ProvisionError> {
    let spec = normal_volume(config, request)?;
    misbehave(&spec);
    Ok(spec)
}

/// Counts calls for a PV in `<guest-dir>/<pv>.attempts`; the first call is 1.
fn count_attempt(config: &Config, pv: &str) -> Result<u64, ProvisionError> {
    let path = config.guest_path(&format!("{pv}.attempts"));
    let previous: u64 = std::fs::read_to_string(&path)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(0);
    std::fs::write(&path, format!("{}\n", previous + 1))
        .map_err(|error| ProvisionError::Transient(format!("writing {path}: {error}")))?;
    Ok(previous + 1)
}

fn spin() -> ! {
    let mut n = 0u64;
    loop {
        n = black_box(n.wrapping_add(1));
    }
}

/// Recursion the optimiser cannot turn into a loop, whose frames live on wasm's own stack
/// (locals only, nothing in linear memory): it overflows the engine's stack limit.
#[inline(never)]
fn recurse(n: u64) -> u64 {
    if n == 0 {
        return 1;
    }
    let below = recurse(n - 1);
    below.wrapping_mul(n) ^ (n >> 3)
}

/// Recursion whose frames keep a buffer in linear memory (Rust's shadow stack): it runs off the
/// bottom of the shadow stack, an out-of-bounds access, before wasm's own stack is exhausted.
fn recurse_in_memory(n: u64) -> u64 {
    let frame = black_box([n; 32]);
    if frame[0] == u64::MAX {
        return 0;
    }
    recurse_in_memory(frame[1] + 1) + frame[2]
}

#[cfg(target_arch = "wasm32")]
fn unreachable_instruction() -> ! {
    core::arch::wasm32::unreachable()
}

#[cfg(not(target_arch = "wasm32"))]
fn unreachable_instruction() -> ! {
    std::process::abort()
}

fn pair(key: &str, value: &str) -> Pair {
    Pair {
        key: key.to_owned(),
        value: value.to_owned(),
    }
}
