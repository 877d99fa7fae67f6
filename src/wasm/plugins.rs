//! The plugins directory: every `NAME.wasm` with its grant file `NAME.toml`, loaded or explained.
//!
//! One bad file never stops the others: each problem is reported with the file and the reason,
//! and the remaining guests serve their provisioner names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::guest::Guest;

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

/// Whether a provisioner name has a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Availability<'a> {
    /// A loaded guest serves it.
    Served,
    /// A guest served it earlier in this process and is gone (unloaded or refused): its claims
    /// wait for it to return. The text says why.
    Unavailable(&'a str),
    /// No guest here ever served it: not ours.
    Unknown,
}

/// The loaded guests, by the provisioner name each serves.
#[derive(Default, Clone)]
pub struct Plugins {
    guests: BTreeMap<String, Arc<Guest>>,
    /// Files that were skipped, with reasons.
    pub problems: Vec<PluginProblem>,
    unavailable: BTreeMap<String, String>,
    compiling: usize,
    /// Guests kept only to delete (their module stopped matching its pin and the grant lets the
    /// last good one delete), by provisioner name. Never serves claims.
    deleting: BTreeMap<String, Arc<Guest>>,
}

impl Plugins {
    /// A set of guests, the problems found while loading them, and provisioner names that were
    /// served earlier but are not now (with why).
    pub fn new(
        guests: BTreeMap<String, Arc<Guest>>,
        problems: Vec<PluginProblem>,
        unavailable: BTreeMap<String, String>,
    ) -> Plugins {
        Plugins {
            guests,
            problems,
            unavailable,
            compiling: 0,
            deleting: BTreeMap::new(),
        }
    }

    /// The same set, with guests that may only delete.
    pub fn with_deleting(mut self, deleting: BTreeMap<String, Arc<Guest>>) -> Plugins {
        self.deleting = deleting;
        self
    }

    /// The guest that deletes the volumes and recorded storage of `provisioner`: the serving
    /// one, or a last good module kept only to delete.
    pub fn for_deleting(&self, provisioner: &str) -> Option<&Arc<Guest>> {
        self.guests
            .get(provisioner)
            .or_else(|| self.deleting.get(provisioner))
    }

    /// The same set, noting `modules` still compiling in the background.
    pub fn with_compiling(mut self, modules: usize) -> Plugins {
        self.compiling = modules;
        self
    }

    /// Modules of the plugins directory still waiting for their compile (not yet served nor
    /// refused): 0 once every module present was tried.
    pub fn compiling(&self) -> usize {
        self.compiling
    }

    /// The guest serving a StorageClass `provisioner` value.
    pub fn for_provisioner(&self, provisioner: &str) -> Option<&Arc<Guest>> {
        self.guests.get(provisioner)
    }

    /// Whether a provisioner name is served.
    pub fn serves(&self, provisioner: &str) -> bool {
        self.guests.contains_key(provisioner)
    }

    /// Whether a guest deletes `provisioner`'s volumes: the serving one, or a last good module
    /// kept only to delete.
    pub fn deletes(&self, provisioner: &str) -> bool {
        self.for_deleting(provisioner).is_some()
    }

    /// Served, gone for now, or never ours.
    pub fn availability(&self, provisioner: &str) -> Availability<'_> {
        if self.guests.contains_key(provisioner) {
            Availability::Served
        } else if let Some(why) = self.unavailable.get(provisioner) {
            Availability::Unavailable(why)
        } else {
            Availability::Unknown
        }
    }

    /// Why no guest serves `provisioner`, for events: what unloaded or refused it, if known.
    pub fn why_not_served(&self, provisioner: &str) -> String {
        match self.availability(provisioner) {
            Availability::Unavailable(why) => why.to_string(),
            Availability::Served | Availability::Unknown => "it is not loaded".to_string(),
        }
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

/// The candidate files of a plugins directory.
pub(crate) struct Listing {
    /// `*.wasm`, sorted.
    pub wasm_files: Vec<PathBuf>,
    /// Grant files without a module, and precompiled artifacts: reported, never loaded.
    pub problems: Vec<PluginProblem>,
}

/// Lists a plugins directory. Entries are followed through symlinks (ConfigMap volumes are
/// symlinks into `..data`); hidden entries such as `..data` itself are not candidates.
pub(crate) fn list_dir(dir: &Path) -> Result<Listing, PluginDirError> {
    let read_err = |source| PluginDirError {
        dir: dir.to_owned(),
        source,
    };
    let mut wasm_files = Vec::new();
    let mut problems = Vec::new();
    let mut grant_files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let path = entry.map_err(read_err)?.path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_none_or(|n| n.starts_with('.'));
        if hidden {
            continue;
        }
        match path.extension().and_then(|e| e.to_str()) {
            Some("wasm") => wasm_files.push(path),
            Some("toml") => grant_files.push(path),
            Some("cwasm") => problems.push(PluginProblem {
                file: path,
                reason: "precompiled wasmtime artifacts are never loaded from the plugins directory (loading one runs unverified native code); ship the .wasm component".into(),
            }),
            _ => {}
        }
    }
    wasm_files.sort();
    grant_files.sort();
    for grant in grant_files {
        if !grant.with_extension("wasm").exists() {
            let source = crate::oci::install::Grant::read(&grant)
                .ok()
                .and_then(|g| g.module.source);
            let reason = match source {
                Some(source) => format!(
                    "grant file without a module next to it yet: the provisioner fetches it from {source}"
                ),
                None => "grant file without a module next to it".into(),
            };
            problems.push(PluginProblem {
                file: grant,
                reason,
            });
        }
    }
    Ok(Listing {
        wasm_files,
        problems,
    })
}
