//! A read-write grant on the node's own filesystem (that of `/`, the kubelet's directory or the
//! container runtime's) loads loudly: a warning in the log naming the threat model's section,
//! and a metric. A grant on a filesystem of its own loads quietly.

use super::*;
use std::os::unix::fs::MetadataExt;
use tracing_subscriber::layer::SubscriberExt;
use wasm_provisioner::metrics::Metrics;
use wasm_provisioner::wasm::nodefs::NodeFilesystems;

/// A writer into a shared buffer, for a fmt layer.
#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buffer {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A directory on a filesystem other than `avoid`'s: in `/dev/shm` when that is one, else on a
/// tmpfs mounted for the test (root only). None when neither can be had.
struct OwnFilesystem {
    dir: tempfile::TempDir,
    mounted: bool,
}

impl OwnFilesystem {
    fn apart_from(avoid: &[u64]) -> Option<OwnFilesystem> {
        let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
        if let Ok(dir) = tempfile::tempdir_in("/dev/shm")
            && dev(dir.path()).is_some_and(|d| !avoid.contains(&d))
        {
            return Some(OwnFilesystem {
                dir,
                mounted: false,
            });
        }
        let dir = tempfile::tempdir().ok()?;
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "wp-own-disk"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        (mounted && dev(dir.path()).is_some_and(|d| !avoid.contains(&d)))
            .then_some(OwnFilesystem { dir, mounted })
    }
}

impl Drop for OwnFilesystem {
    fn drop(&mut self) {
        if self.mounted {
            let _ = std::process::Command::new("umount")
                .arg(self.dir.path())
                .status();
        }
    }
}

/// Runs in a child process of its own: it installs the process' global subscriber (a scoped
/// one misses lines when another test's thread reaches the same log call at the same time, as
/// every test loading a guest granted a directory in /tmp does).
#[test]
fn a_read_write_grant_on_the_nodes_filesystem_is_loud() {
    if !in_child(
        "node_disk::a_read_write_grant_on_the_nodes_filesystem_is_loud",
        "WP_NODE_DISK_CHILD",
    ) {
        return;
    }
    // The kubelet's directory (`--kubelet-dir`) and a guest's directory beside it, both on the
    // filesystem of this checkout: a node whose kubelet and guest share a disk.
    let node_disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (kubelet, on_node) = (
        node_disk.path().join("kubelet"),
        node_disk.path().join("guest"),
    );
    std::fs::create_dir_all(&kubelet).unwrap();
    std::fs::create_dir_all(&on_node).unwrap();
    let devs = [
        std::fs::metadata("/").unwrap().dev(),
        std::fs::metadata(&kubelet).unwrap().dev(),
    ];
    let Some(own) = OwnFilesystem::apart_from(&devs) else {
        println!("SKIPPED: no filesystem apart from / and the checkout's (/dev/shm, or mount)");
        return;
    };
    let on_node = on_node.canonicalize().unwrap();
    let own_dir = own.dir.path().canonicalize().unwrap();
    println!(
        "kubelet {} and guest {} on device {:#x}; own filesystem {} on {:#x}",
        kubelet.display(),
        on_node.display(),
        devs[1],
        own_dir.display(),
        std::fs::metadata(&own_dir).unwrap().dev()
    );
    let plugins = PluginsDir::new();
    plugins.add(
        "on-node",
        "hostpath",
        &dir_grant(
            "test.wasm-provisioner.dev/on-node",
            &on_node,
            "/volumes",
            "",
        ),
    );
    plugins.add(
        "own-disk",
        "hostpath",
        &dir_grant(
            "test.wasm-provisioner.dev/own-disk",
            &own_dir,
            "/volumes",
            "",
        ),
    );
    let metrics = Metrics::new();
    let engine = WasmEngine::new()
        .unwrap()
        .with_metrics(metrics.clone())
        .with_node_filesystems(NodeFilesystems::probe(&kubelet));
    let log = Buffer::default();
    let subscriber = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer({
                let log = log.clone();
                move || log.clone()
            }),
    );
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let loaded = load_dir(&engine, plugins.path()).unwrap();
    let log = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
    println!("log:\n{log}");
    // A warning, not a refusal: both guests serve.
    assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
    assert_eq!(loaded.len(), 2);
    let warnings: Vec<&str> = log.lines().filter(|l| l.contains(" WARN ")).collect();
    let on_node_text = format!("dirs: {} (read-write)", on_node.display());
    assert!(
        warnings.iter().any(|l| l.contains("on-node")
            && l.contains(&on_node_text)
            && l.contains(&format!("the kubelet's directory {}", kubelet.display()))
            && l.contains("docs/threat-model.md, \"Disk\"")),
        "the grant on the node's filesystem is warned about: {warnings:?}"
    );
    assert!(
        !warnings.iter().any(|l| l.contains("own-disk")),
        "the grant on a filesystem of its own is not: {warnings:?}"
    );
    let exposed = metrics.encode();
    let series: Vec<&str> = exposed
        .lines()
        .filter(|l| l.starts_with("wasm_provisioner_plugin_warnings_total{"))
        .collect();
    println!("metric: {series:?}");
    assert_eq!(
        series,
        ["wasm_provisioner_plugin_warnings_total{guest=\"on-node\",warning=\"node-filesystem\"} 1"]
    );
}
