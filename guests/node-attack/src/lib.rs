//! node-attack: an adversarial test guest that goes for the node, not for its own sandbox. The
//! class parameter `attack` picks the attack; it reports what the host let it do in its
//! result, so tests can assert each hole is closed.
//!
//! ```text
//! relative-link      symlink <pv> -> ../../../../etc, hostPath <node-dir>/<pv>
//! intermediate-link  symlink sub -> ../../../.., hostPath <node-dir>/sub/<pv>
//! swap               rename <target> away, symlink <target> -> /etc, rename <planted> to <target>
//! rename-planted     rename <planted> (a pod's link) to <pv>, hostPath <node-dir>/<pv>
//! link-planted       hard-link <planted> to <pv>, hostPath <node-dir>/<pv>
//! fifo               open <fifo> (a pod's FIFO) for reading
//! fd-hoard           open the granted directory until something says no
//! annotation-hoard   96 annotations of 512 KiB each, every refusal ignored
//! value-flood        one host.log message of <mib> MiB (default 24): more than one host call
//!                    may carry
//! nfs-export         an NFS volume on <server> at <path> (another export of a granted server)
//! csi-handle         a CSI volume of <driver> with <handle> (another tenant's volume)
//! recycle            a normal volume with reclaim policy Recycle
//! other-node         a normal volume pinned to <node> (comma-separated: several nodes in one
//!                    term), whatever node the scheduler chose
//! stream-hoard       open <file>, make a read stream, drop the descriptor; again and again
//! listing-hoard      open <count> listings of <dir> (default: until refused), read none
//! read-hoard         open <file> once, then <count> (default 20,000) read streams of it, each
//!                    with a 64 KiB read started and kept
//! pollable-hoard     one read stream of <file>, then <count> pollables of it, kept
//! preopen-hoard      ask for the granted directories <count> times, keep every handle
//! locked             one filesystem call <op> that a lock held by another process can stop:
//!                    write, set-times, link, rename (of <file>), mkdir, list (in <dir>)
//! list-all           read every entry of <dir>, <passes> times (default once)
//! disk-work          one filesystem call whose work grows with what is on disk, on <file>:
//!                    <op> = set-size (to 0), open-truncate, unlink, close-unlinked (open,
//!                    unlink, then drop the last descriptor), sync
//! log-forge          host.log text, a field, stdout and a final error with newlines, `\r`,
//!                    escapes, line separators and a bidi override that would forge a log line
//! path               mkdir -p <guest-dir>/<path>, hostPath <node-dir>/<path> (nesting, the prefix)
//! renames            each `from>to` of <renames> (`;`-separated) in order, directories included
//! none               mkdir <guest-dir>/<pv>, hostPath <node-dir>/<pv>
//! ```
//!
//! Whatever the host let through is returned as `final` "did: ..." or as the volume itself; a
//! test expects the host's refusal.

use std::hint::black_box;

wit_bindgen::generate!({
    path: "../../wit",
    world: "provisioner",
});

use exports::wasm_provisioner::provisioner::lifecycle::Guest;
use wasm_provisioner::provisioner::types::{
    DeleteRequest, HostPathType, NodeSelectorOperator, NodeSelectorRequirement, NodeSelectorTerm,
    Pair, ProvisionError, ProvisionRequest, ReclaimPolicy,
};
use wasm_provisioner::provisioner::volume_builder::VolumeSpec;

#[derive(serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
struct Config {
    guest_dir: String,
    node_dir: String,
}

impl Config {
    fn guest_path(&self, name: &str) -> String {
        format!("{}/{name}", self.guest_dir.trim_end_matches('/'))
    }

    fn node_path(&self, name: &str) -> String {
        format!("{}/{name}", self.node_dir.trim_end_matches('/'))
    }
}

fn parameter<'p>(parameters: &'p [Pair], key: &str) -> Option<&'p str> {
    parameters
        .iter()
        .find(|p| p.key == key)
        .map(|p| p.value.as_str())
}

struct NodeAttack;

impl Guest for NodeAttack {
    fn provision(request: ProvisionRequest) -> Result<VolumeSpec, ProvisionError> {
        let config: Config = serde_json::from_str(&request.config)
            .map_err(|error| ProvisionError::Final(format!("guest config: {error}")))?;
        let params = &request.storage_class.parameters;
        let pv = request.pv_name.as_str();
        let planted = parameter(params, "planted").unwrap_or("planted");
        let mut did = Vec::new();
        let mut note = |what: String, outcome: Result<(), String>| {
            did.push(match outcome {
                Ok(()) => format!("{what}: ok"),
                Err(error) => format!("{what}: {error}"),
            })
        };
        let attack = parameter(params, "attack").unwrap_or("none");
        match attack {
            "relative-link" => {
                note(
                    format!("symlink {pv} -> ../../../../etc"),
                    symlink(&config, "../../../../etc", pv),
                );
                host_path(&config.node_path(pv), did)
            }
            "intermediate-link" => {
                note(
                    "symlink sub -> ../../../..".into(),
                    symlink(&config, "../../../..", "sub"),
                );
                host_path(&config.node_path(&format!("sub/{pv}")), did)
            }
            "swap" => {
                let target = parameter(params, "target").unwrap_or("served");
                let away = format!("{target}.away");
                note(
                    format!("rename {target} {away}"),
                    rename(&config, target, &away),
                );
                note(
                    format!("symlink {target} -> /etc"),
                    symlink(&config, "/etc", target),
                );
                note(
                    format!("symlink {target} -> ../../../../etc"),
                    symlink(&config, "../../../../etc", target),
                );
                note(
                    format!("rename {planted} {target}"),
                    rename(&config, planted, target),
                );
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "rename-planted" => {
                note(
                    format!("rename {planted} {pv}"),
                    rename(&config, planted, pv),
                );
                host_path(&config.node_path(pv), did)
            }
            "link-planted" => {
                let outcome = std::fs::hard_link(config.guest_path(planted), config.guest_path(pv))
                    .map_err(|e| e.to_string());
                note(format!("link {planted} {pv}"), outcome);
                host_path(&config.node_path(pv), did)
            }
            "fifo" => {
                let fifo = parameter(params, "fifo").unwrap_or("fifo");
                let outcome = std::fs::File::open(config.guest_path(fifo))
                    .map(drop)
                    .map_err(|e| e.to_string());
                note(format!("open {fifo}"), outcome);
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "fd-hoard" => {
                let mut held = Vec::new();
                let error = loop {
                    match std::fs::File::open(&config.guest_dir) {
                        Ok(file) => held.push(file),
                        Err(error) => break error,
                    }
                    if held.len() >= 1_000_000 {
                        break std::io::Error::other("a million descriptors and counting");
                    }
                };
                Err(ProvisionError::Final(format!(
                    "did: opened {} descriptors, then: {error}",
                    held.len()
                )))
            }
            "annotation-hoard" => {
                let spec = normal_volume(&config, pv)?;
                let value = "\u{1}".repeat(512 << 10);
                for i in 0..96 {
                    let _ =
                        spec.annotation(&format!("attack.example/hoard-{i}"), black_box(&value));
                }
                Ok(spec)
            }
            "nfs-export" => {
                let spec = VolumeSpec::new();
                let server = parameter(params, "server").unwrap_or("nfs.example.com");
                let path = parameter(params, "path").unwrap_or("/");
                spec.nfs(server, path, false)
                    .map_err(|error| ProvisionError::Final(format!("refused: {error:?}")))?;
                Ok(spec)
            }
            "csi-handle" => {
                let spec = VolumeSpec::new();
                let driver = parameter(params, "driver").unwrap_or("csi.example.com");
                let handle = parameter(params, "handle").unwrap_or("another-tenants-volume");
                spec.csi(driver, handle, None, false, &[])
                    .map_err(|error| ProvisionError::Final(format!("refused: {error:?}")))?;
                Ok(spec)
            }
            "recycle" => {
                let spec = normal_volume(&config, pv)?;
                spec.reclaim_policy(ReclaimPolicy::Recycle);
                Ok(spec)
            }
            "other-node" => {
                let spec = normal_volume(&config, pv)?;
                let node = parameter(params, "node").unwrap_or("another-node");
                spec.node_affinity(&[NodeSelectorTerm {
                    requirements: vec![NodeSelectorRequirement {
                        key: "kubernetes.io/hostname".into(),
                        operator: NodeSelectorOperator::In,
                        values: node.split(',').map(str::to_owned).collect(),
                    }],
                }])
                .map_err(|error| ProvisionError::Final(format!("refused: {error:?}")))?;
                Ok(spec)
            }
            "path" => {
                let path = parameter(params, "path").unwrap_or_default();
                let guest_path = config.guest_path(path);
                let outcome = std::fs::create_dir_all(&guest_path).map_err(|e| e.to_string());
                note(format!("mkdir -p {path}"), outcome);
                host_path(config.node_path(path).trim_end_matches('/'), did)
            }
            "renames" => {
                for step in parameter(params, "renames").unwrap_or_default().split(';') {
                    if let Some((from, to)) = step.split_once('>') {
                        note(format!("rename {from} {to}"), rename(&config, from, to));
                    }
                }
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "stream-hoard" => {
                let file = parameter(params, "file").unwrap_or("file");
                let outcome = hoard::streams(&config, file);
                note(format!("streams of {file}"), outcome);
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "listing-hoard" => {
                let dir = parameter(params, "dir").unwrap_or("");
                let count = parameter(params, "count").and_then(|c| c.parse().ok());
                let outcome = hoard::listings(&config, dir, count.unwrap_or(usize::MAX));
                note(format!("listings of {dir:?}"), outcome);
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "read-hoard" | "pollable-hoard" | "preopen-hoard" => {
                let file = parameter(params, "file").unwrap_or("file");
                let count = parameter(params, "count").and_then(|c| c.parse().ok());
                let count = count.unwrap_or(20_000);
                let outcome = match attack {
                    "read-hoard" => hoard::reads(&config, file, count),
                    "pollable-hoard" => hoard::pollables(&config, file, count),
                    _ => hoard::preopens(count),
                };
                note(format!("{attack} x{count}"), outcome);
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "locked" => {
                let op = parameter(params, "op").unwrap_or("write");
                let file = parameter(params, "file").unwrap_or("file");
                let dir = parameter(params, "dir").unwrap_or("dir");
                note(op.to_string(), hoard::locked(&config, op, file, dir));
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "list-all" => {
                let dir = parameter(params, "dir").unwrap_or("");
                let passes: usize = parameter(params, "passes")
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(1);
                for pass in 1..=passes {
                    let outcome = std::fs::read_dir(config.guest_path(dir))
                        .and_then(|entries| entries.map(|e| e.map(drop)).count_ok());
                    note(
                        format!("list {dir:?} ({pass} of {passes})"),
                        outcome.map(drop).map_err(|e| e.to_string()),
                    );
                }
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "disk-work" => {
                let file = parameter(params, "file").unwrap_or("file");
                let op = parameter(params, "op").unwrap_or("set-size");
                note(format!("{op} {file}"), disk_work(&config, op, file));
                Err(ProvisionError::Final(format!("did: {}", did.join("; "))))
            }
            "value-flood" => {
                let mib: usize = parameter(params, "mib")
                    .and_then(|m| m.parse().ok())
                    .unwrap_or(24);
                let text = "x".repeat(mib << 20);
                wasm_provisioner::provisioner::host::log(
                    wasm_provisioner::provisioner::types::LogLevel::Info,
                    black_box(&text),
                    &[],
                );
                Err(ProvisionError::Final(format!(
                    "did: passed {mib} MiB in one host call"
                )))
            }
            "log-forge" => {
                // A newline, a carriage return and a terminal escape start a forged line; a line
                // separator (U+2028) does where JSON or a viewer breaks there, and a
                // right-to-left override (U+202E) shows what follows reversed.
                let forged = "\n2026-01-01T00:00:00.000000Z  INFO wasm_provisioner: FORGED line\r\u{1b}[2K\u{2028}2026-01-01T00:00:00.000000Z  INFO wasm_provisioner: FORGED separator\u{2029}\u{202e}desrever";
                wasm_provisioner::provisioner::host::log(
                    wasm_provisioner::provisioner::types::LogLevel::Warn,
                    &format!("guest text{forged}"),
                    &[Pair {
                        key: "k".into(),
                        value: format!("v{forged}"),
                    }],
                );
                println!(
                    "stdout text\rFORGED carriage return\u{2028}FORGED separator\u{202e}desrever"
                );
                Err(ProvisionError::Final(format!("final{forged}")))
            }
            "none" => normal_volume(&config, pv),
            other => Err(ProvisionError::Final(format!("unknown attack {other:?}"))),
        }
    }

    fn delete(request: DeleteRequest) -> Result<(), ProvisionError> {
        let config: Config = serde_json::from_str(&request.config)
            .map_err(|error| ProvisionError::Final(format!("guest config: {error}")))?;
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

// Exported only from WebAssembly: the export names are not valid symbol names natively.
#[cfg(target_arch = "wasm32")]
export!(NodeAttack);

/// Counting the entries of a listing, stopping at the first error.
trait CountOk {
    fn count_ok(self) -> std::io::Result<usize>;
}

impl<I: Iterator<Item = std::io::Result<()>>> CountOk for I {
    fn count_ok(self) -> std::io::Result<usize> {
        let mut n = 0;
        for entry in self {
            entry?;
            n += 1;
        }
        Ok(n)
    }
}

/// One filesystem call on `file` whose cost is the kernel's, in proportion to the file's size
/// on disk (a file with many extents takes seconds to free).
fn disk_work(config: &Config, op: &str, file: &str) -> Result<(), String> {
    use std::fs::OpenOptions;
    let path = config.guest_path(file);
    let writable = || OpenOptions::new().write(true).open(&path);
    let outcome = match op {
        "set-size" => writable().and_then(|f| f.set_len(0)),
        "open-truncate" => OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .map(drop),
        "unlink" => std::fs::remove_file(&path),
        "close-unlinked" => writable().and_then(|f| {
            std::fs::remove_file(&path)?;
            drop(black_box(f));
            Ok(())
        }),
        "sync" => writable().and_then(|f| f.sync_all()),
        other => return Err(format!("unknown op {other:?}")),
    };
    outcome.map_err(|e| e.to_string())
}

/// Host resources held through the WASI filesystem API itself (std hides the handles).
#[cfg(target_os = "wasi")]
mod hoard {
    use super::Config;
    use wasip2::filesystem::types::{Descriptor, DescriptorFlags, OpenFlags, PathFlags};

    fn preopen(config: &Config) -> Result<Descriptor, String> {
        let dir = config.guest_dir.trim_end_matches('/');
        wasip2::filesystem::preopens::get_directories()
            .into_iter()
            .find(|(_, preopened)| preopened.trim_end_matches('/') == dir)
            .map(|(descriptor, _)| descriptor)
            .ok_or_else(|| format!("{dir} is not a preopened directory"))
    }

    /// Streams whose descriptors were dropped, kept until something says no.
    pub fn streams(config: &Config, file: &str) -> Result<(), String> {
        let root = preopen(config)?;
        let mut held = Vec::new();
        loop {
            let opened = root
                .open_at(
                    PathFlags::empty(),
                    file,
                    OpenFlags::CREATE,
                    DescriptorFlags::READ | DescriptorFlags::WRITE,
                )
                .map_err(|code| format!("{} streams held, then open: {code}", held.len()))?;
            let stream = opened
                .read_via_stream(0)
                .map_err(|code| format!("{} streams held, then stream: {code}", held.len()))?;
            drop(opened);
            held.push(stream);
            if held.len() >= 1_000_000 {
                return Err("a million streams and counting".into());
            }
        }
    }

    /// One descriptor of `file`, then `count` read streams of it, each with a 64 KiB read
    /// started in the background (the host keeps the buffer while it waits).
    pub fn reads(config: &Config, file: &str, count: usize) -> Result<(), String> {
        let opened = open_file(config, file)?;
        let mut held = Vec::new();
        while held.len() < count {
            let stream = opened
                .read_via_stream(0)
                .map_err(|code| format!("{} streams held, then stream: {code}", held.len()))?;
            let _ = stream.read(64 << 10);
            held.push(stream);
        }
        Ok(())
    }

    /// One read stream of `file`, then `count` pollables of it.
    pub fn pollables(config: &Config, file: &str, count: usize) -> Result<(), String> {
        let opened = open_file(config, file)?;
        let stream = opened
            .read_via_stream(0)
            .map_err(|code| format!("stream: {code}"))?;
        let held: Vec<_> = (0..count).map(|_| stream.subscribe()).collect();
        drop(held);
        Ok(())
    }

    /// The granted directories, asked for `count` times, every handle kept.
    pub fn preopens(count: usize) -> Result<(), String> {
        let held: Vec<_> = (0..count)
            .map(|_| wasip2::filesystem::preopens::get_directories())
            .collect();
        drop(held);
        Ok(())
    }

    /// One call another process' lock on `file` (or on the directory `dir`) can hold up.
    pub fn locked(config: &Config, op: &str, file: &str, dir: &str) -> Result<(), String> {
        use wasip2::filesystem::types::NewTimestamp;
        let root = preopen(config)?;
        let fail = |code: wasip2::filesystem::types::ErrorCode| code.to_string();
        match op {
            "write" => open_file(config, file)?
                .write(b"guest", 0)
                .map(drop)
                .map_err(fail),
            "set-times" => open_file(config, file)?
                .set_times(NewTimestamp::Now, NewTimestamp::Now)
                .map_err(fail),
            "link" => root
                .link_at(PathFlags::empty(), file, &root, &format!("{file}.link"))
                .map_err(fail),
            "rename" => root
                .rename_at(file, &root, &format!("{file}.renamed"))
                .map_err(fail),
            "mkdir" => root
                .create_directory_at(&format!("{dir}/made"))
                .map_err(fail),
            "list" => {
                let listed = root
                    .open_at(
                        PathFlags::empty(),
                        dir,
                        OpenFlags::DIRECTORY,
                        DescriptorFlags::READ,
                    )
                    .map_err(fail)?;
                let entries = listed.read_directory().map_err(fail)?;
                while entries.read_directory_entry().map_err(fail)?.is_some() {}
                Ok(())
            }
            other => Err(format!("unknown op {other:?}")),
        }
    }

    fn open_file(config: &Config, file: &str) -> Result<Descriptor, String> {
        preopen(config)?
            .open_at(
                PathFlags::empty(),
                file,
                OpenFlags::CREATE,
                DescriptorFlags::READ | DescriptorFlags::WRITE,
            )
            .map_err(|code| format!("open {file}: {code}"))
    }

    /// Listings of `dir` opened and kept unread.
    pub fn listings(config: &Config, dir: &str, count: usize) -> Result<(), String> {
        let root = preopen(config)?;
        let target = if dir.is_empty() {
            None
        } else {
            Some(
                root.open_at(
                    PathFlags::empty(),
                    dir,
                    OpenFlags::DIRECTORY,
                    DescriptorFlags::READ,
                )
                .map_err(|code| format!("open {dir}: {code}"))?,
            )
        };
        let listed = target.as_ref().unwrap_or(&root);
        let mut held = Vec::new();
        while held.len() < count {
            let listing = listed
                .read_directory()
                .map_err(|code| format!("{} listings held, then: {code}", held.len()))?;
            held.push(listing);
        }
        Ok(())
    }
}

/// Native builds only run unit tests.
#[cfg(not(target_os = "wasi"))]
mod hoard {
    use super::Config;

    pub fn streams(_config: &Config, _file: &str) -> Result<(), String> {
        Err("only inside WebAssembly".into())
    }

    pub fn listings(_config: &Config, _dir: &str, _count: usize) -> Result<(), String> {
        Err("only inside WebAssembly".into())
    }

    pub fn reads(_config: &Config, _file: &str, _count: usize) -> Result<(), String> {
        Err("only inside WebAssembly".into())
    }

    pub fn pollables(_config: &Config, _file: &str, _count: usize) -> Result<(), String> {
        Err("only inside WebAssembly".into())
    }

    pub fn preopens(_count: usize) -> Result<(), String> {
        Err("only inside WebAssembly".into())
    }

    pub fn locked(_config: &Config, _op: &str, _file: &str, _dir: &str) -> Result<(), String> {
        Err("only inside WebAssembly".into())
    }
}

/// A hostPath volume at `path`, with what the guest did recorded in an annotation.
fn host_path(path: &str, did: Vec<String>) -> Result<VolumeSpec, ProvisionError> {
    let spec = VolumeSpec::new();
    spec.host_path(path, HostPathType::DirectoryOrCreate)
        .map_err(|error| ProvisionError::Final(format!("host-path refused: {error:?}")))?;
    let _ = spec.annotation("attack.example/did", &did.join("; ").replace(['\n'], " "));
    Ok(spec)
}

/// The well-behaved path: a directory in the granted dir, described as a hostPath volume.
fn normal_volume(config: &Config, pv: &str) -> Result<VolumeSpec, ProvisionError> {
    let guest_path = config.guest_path(pv);
    std::fs::create_dir_all(&guest_path)
        .map_err(|error| ProvisionError::Transient(format!("creating {guest_path}: {error}")))?;
    host_path(&config.node_path(pv), Vec::new())
}

fn rename(config: &Config, from: &str, to: &str) -> Result<(), String> {
    std::fs::rename(config.guest_path(from), config.guest_path(to)).map_err(|e| e.to_string())
}

/// Creates the symlink `<guest-dir>/<name>` -> `target` through the preopen's WASI descriptor
/// (`std::os::wasi::fs::symlink_path` is unstable on wasm32-wasip2).
#[cfg(target_os = "wasi")]
fn symlink(config: &Config, target: &str, name: &str) -> Result<(), String> {
    let dir = config.guest_dir.trim_end_matches('/');
    let (directory, _) = wasip2::filesystem::preopens::get_directories()
        .into_iter()
        .find(|(_, preopened)| preopened.trim_end_matches('/') == dir)
        .ok_or_else(|| format!("{dir} is not a preopened directory"))?;
    directory
        .symlink_at(target, name)
        .map_err(|code| code.to_string())
}

/// Native builds only run unit tests, which never plant links.
#[cfg(not(target_os = "wasi"))]
fn symlink(_config: &Config, _target: &str, _name: &str) -> Result<(), String> {
    Err("symlinks are only attempted inside WebAssembly".to_owned())
}
