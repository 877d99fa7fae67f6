//! The plugins directory: every `NAME.wasm` with its grant file `NAME.toml`, loaded or explained.
//!
//! One bad file never stops the others: each problem is reported with the file and the reason,
//! and the remaining guests serve their provisioner names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::grants::Grants;
use super::runtime::{Guest, WasmEngine};

/// A file in the plugins directory that was not loaded, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginProblem {
    /// The file at fault.
    pub file: PathBuf,
    /// One clear sentence.
    pub reason: String,
}

impl std::fmt::Display for PluginProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.file.display(), self.reason)
    }
}

/// Why the directory itself could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read plugins directory {dir}: {source}")]
pub struct PluginDirError {
    dir: PathBuf,
    #[source]
    source: std::io::Error,
}

/// The loaded guests, by the provisioner name each serves.
#[derive(Default, Clone)]
pub struct Plugins {
    guests: BTreeMap<String, Arc<Guest>>,
    /// Files that were skipped, with reasons.
    pub problems: Vec<PluginProblem>,
}

impl Plugins {
    /// The guest serving a StorageClass `provisioner` value.
    pub fn for_provisioner(&self, provisioner: &str) -> Option<&Arc<Guest>> {
        self.guests.get(provisioner)
    }

    /// Whether a provisioner name is served.
    pub fn serves(&self, provisioner: &str) -> bool {
        self.guests.contains_key(provisioner)
    }

    /// Every served provisioner name with its guest.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Arc<Guest>)> {
        self.guests.iter()
    }

    /// How many guests are loaded.
    pub fn len(&self) -> usize {
        self.guests.len()
    }

    /// Whether no guest is loaded.
    pub fn is_empty(&self) -> bool {
        self.guests.is_empty()
    }
}

/// Loads every guest in `dir`. Compiles, so call it off the async hot path.
pub fn load_dir(engine: &WasmEngine, dir: &Path) -> Result<Plugins, PluginDirError> {
    let read_err = |source| PluginDirError {
        dir: dir.to_owned(),
        source,
    };
    let mut wasm_files = Vec::new();
    let mut grant_files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let path = entry.map_err(read_err)?.path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("wasm") => wasm_files.push(path),
            Some("toml") => grant_files.push(path),
            Some("cwasm") => {
                // Precompiled artifacts are native code; never load them from here.
            }
            _ => {}
        }
    }
    wasm_files.sort();
    let mut plugins = Plugins::default();
    let mut loaded: Vec<(String, PathBuf, Arc<Guest>)> = Vec::new();
    for wasm in &wasm_files {
        let grant_path = wasm.with_extension("toml");
        let name = wasm
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("guest")
            .to_string();
        if !grant_path.exists() {
            plugins.problems.push(PluginProblem {
                file: wasm.clone(),
                reason: format!(
                    "no grant file {}; a guest without grants is not loaded",
                    grant_path.display()
                ),
            });
            continue;
        }
        let grants = match Grants::from_file(&grant_path) {
            Ok(g) => g,
            Err(e) => {
                plugins.problems.push(PluginProblem {
                    file: grant_path.clone(),
                    reason: e.to_string(),
                });
                continue;
            }
        };
        match engine.load(&name, wasm, grants) {
            Ok(guest) => loaded.push((name, wasm.clone(), Arc::new(guest))),
            Err(e) => plugins.problems.push(PluginProblem {
                file: wasm.clone(),
                reason: e.to_string(),
            }),
        }
    }
    for grant in &grant_files {
        if !grant.with_extension("wasm").exists() {
            plugins.problems.push(PluginProblem {
                file: grant.clone(),
                reason: "grant file without a module next to it".into(),
            });
        }
    }
    let mut by_provisioner: BTreeMap<String, Vec<(PathBuf, Arc<Guest>)>> = BTreeMap::new();
    for (_, path, guest) in loaded {
        by_provisioner
            .entry(guest.grants().provisioner.clone())
            .or_default()
            .push((path, guest));
    }
    for (provisioner, mut claimants) in by_provisioner {
        if claimants.len() == 1 {
            let (_, guest) = claimants.pop().expect("one claimant");
            plugins.guests.insert(provisioner, guest);
        } else {
            let names: Vec<String> = claimants
                .iter()
                .map(|(p, _)| p.display().to_string())
                .collect();
            for (path, _) in &claimants {
                plugins.problems.push(PluginProblem {
                    file: path.clone(),
                    reason: format!(
                        "provisioner {provisioner:?} is claimed by more than one guest ({}); none of them serves it",
                        names.join(", ")
                    ),
                });
            }
        }
    }
    for problem in &plugins.problems {
        tracing::error!(file = %problem.file.display(), "plugin not loaded: {}", problem.reason);
    }
    for (provisioner, guest) in &plugins.guests {
        tracing::info!(
            guest = guest.name(),
            provisioner,
            sha256 = guest.sha256(),
            "plugin loaded"
        );
    }
    Ok(plugins)
}
