//! What the two demo binaries (`demo`, `demo-node`) share: the repository root, their step
//! headings, and the built provisioner and hostpath guest they run.

use std::path::{Path, PathBuf};

use anyhow::ensure;

/// The repository root (this crate lives in `tests/harness`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

/// Prints a step heading.
pub fn step(text: &str) {
    println!("\n==> {text}");
}

/// The provisioner binary (`$WP_PROVISIONER_BIN`, else `target/debug/wasm-provisioner`) and the
/// release hostpath guest, both checked to exist; `command` is what builds them.
pub fn demo_inputs(repo: &Path, command: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
    let binary = std::env::var_os("WP_PROVISIONER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join("target/debug/wasm-provisioner"));
    let guest = repo.join("guests/target/wasm32-wasip2/release/hostpath.wasm");
    for needed in [&binary, &guest] {
        ensure!(
            needed.exists(),
            "{} is missing: run `{command}` (it builds everything)",
            needed.display()
        );
    }
    Ok((binary, guest))
}
