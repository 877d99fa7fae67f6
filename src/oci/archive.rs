//! The air gap: `save` packs plugins (each `NAME.wasm` with its `NAME.toml`) into one tarball
//! with an index of their sha256s; `load` checks the whole tarball against that index before it
//! installs anything, then installs each plugin as `pull` does.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::digest::Digest;
use super::install::{self, Grant, InstallError};

/// The index's entry name, first in the tarball.
pub const INDEX: &str = "index.json";
const FORMAT: u32 = 1;

/// Why a save or a load failed.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{dir} has no NAME.wasm to save")]
    Empty { dir: PathBuf },
    #[error("{path}: entry {name:?} refused: {reason}")]
    Entry {
        path: PathBuf,
        name: String,
        reason: String,
    },
    #[error("{path}: the index is not this tarball format's JSON")]
    Index {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {name} is listed in the index but not in the tarball")]
    Missing { path: PathBuf, name: String },
    #[error("{path}: {name} digest mismatch: the index says {expected}, the bytes are {actual}")]
    Mismatch {
        path: PathBuf,
        name: String,
        expected: String,
        actual: Digest,
    },
    #[error(transparent)]
    Install(#[from] InstallError),
}

/// The tarball's `index.json`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Index {
    format: u32,
    modules: Vec<IndexEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct IndexEntry {
    name: String,
    /// Of `NAME.wasm`, 64 hex digits (as a grant's `[module] sha256`).
    sha256: String,
    /// Of `NAME.toml`, when the plugin has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    grant_sha256: Option<String>,
    /// Of its cosign signature evidence (`.NAME.sig.json` in a plugins directory, `NAME.sig.json`
    /// in the tarball), when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signature_sha256: Option<String>,
}

/// The tarball's name of a plugin's signature evidence (tar entries are never hidden files).
fn evidence_entry(name: &str) -> String {
    format!("{name}.sig.json")
}

/// One plugin saved or loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plugin {
    pub name: String,
    pub digest: Digest,
    pub grant: bool,
}

/// A module `save --pull` fetched: its name, bytes and signature evidence (JSON), if signed.
pub type PulledModule = (String, Vec<u8>, Option<Vec<u8>>);

/// Packs the plugins `names` of `dir` and the `pulled` modules (with `dir`'s grant of that name,
/// if any, and their own signature evidence) into the tarball `out`, written atomically. With neither names
/// nor pulled modules, every plugin of `dir`. A grant's `[module] sha256` pin is checked here as
/// `load` will.
pub fn save(
    dir: &Path,
    names: &[String],
    pulled: &[PulledModule],
    out: &Path,
) -> Result<Vec<Plugin>, ArchiveError> {
    let names = if names.is_empty() && pulled.is_empty() {
        plugin_names(dir)?
    } else {
        names.to_vec()
    };
    if names.is_empty() && pulled.is_empty() {
        return Err(ArchiveError::Empty {
            dir: dir.to_owned(),
        });
    }
    let read =
        |path: PathBuf| std::fs::read(&path).map_err(|source| ArchiveError::Read { path, source });
    let mut modules: Vec<PulledModule> = Vec::new();
    for name in names {
        install::check_name(&name)?;
        let module = read(dir.join(format!("{name}.wasm")))?;
        let evidence_path = dir.join(super::cosign::evidence_file(&name));
        let evidence = if evidence_path.exists() {
            Some(read(evidence_path)?)
        } else {
            None
        };
        modules.push((name, module, evidence));
    }
    modules.extend(pulled.iter().cloned());
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    let mut index = Index {
        format: FORMAT,
        modules: Vec::new(),
    };
    let mut plugins: Vec<Plugin> = Vec::new();
    for (name, module, evidence) in modules {
        install::check_name(&name)?;
        if plugins.iter().any(|p| p.name == name) {
            return Err(ArchiveError::Entry {
                path: out.to_owned(),
                name,
                reason: "named twice".into(),
            });
        }
        let grant_path = dir.join(format!("{name}.toml"));
        let grant = if grant_path.exists() {
            Some(Grant::read(&grant_path)?)
        } else {
            None
        };
        let digest = Digest::of(&module);
        if let Some(grant) = &grant {
            grant.check(&digest)?;
        }
        let grant = grant.map(|g| g.bytes);
        index.modules.push(IndexEntry {
            name: name.clone(),
            sha256: digest.hex().to_string(),
            grant_sha256: grant.as_ref().map(|g| Digest::of(g).hex().to_string()),
            signature_sha256: evidence.as_ref().map(|e| Digest::of(e).hex().to_string()),
        });
        plugins.push(Plugin {
            name: name.clone(),
            digest,
            grant: grant.is_some(),
        });
        files.push((format!("{name}.wasm"), module));
        if let Some(grant) = grant {
            files.push((format!("{name}.toml"), grant));
        }
        if let Some(evidence) = evidence {
            files.push((evidence_entry(&name), evidence));
        }
    }
    let index = serde_json::to_vec_pretty(&index).expect("the index serializes");
    let mut builder = tar::Builder::new(Vec::new());
    let write_err = |source| ArchiveError::Read {
        path: out.to_owned(),
        source,
    };
    for (name, bytes) in std::iter::once((INDEX.to_string(), index)).chain(files) {
        let mut header = tar::Header::new_ustar();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        builder
            .append_data(&mut header, &name, bytes.as_slice())
            .map_err(write_err)?;
    }
    let tarball = builder.into_inner().map_err(write_err)?;
    let out_dir = match out.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let out_name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| ArchiveError::Read {
            path: out.to_owned(),
            source: std::io::Error::other("not a file name"),
        })?;
    install::write_atomic(out_dir, out_name, &tarball)?;
    Ok(plugins)
}

/// Every `NAME.wasm` in `dir` the host would load (hidden files skipped), sorted.
fn plugin_names(dir: &Path) -> Result<Vec<String>, ArchiveError> {
    let read_err = |source| ArchiveError::Read {
        path: dir.to_owned(),
        source,
    };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let file_name = entry.map_err(read_err)?.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        if let Some(name) = file_name.strip_suffix(".wasm")
            && !file_name.starts_with('.')
        {
            names.push(name.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// Checks the tarball `path` whole (entry names and kinds, sizes under `max_bytes`, every
/// digest against the index, every grant's pin), then installs its plugins into `dir`.
pub fn load(path: &Path, dir: &Path, max_bytes: u64) -> Result<Vec<Plugin>, ArchiveError> {
    let file = std::fs::File::open(path).map_err(|source| ArchiveError::Read {
        path: path.to_owned(),
        source,
    })?;
    let files = read_entries(path, file, max_bytes)?;
    let mut files = files;
    let index = files.remove(INDEX).ok_or_else(|| ArchiveError::Missing {
        path: path.to_owned(),
        name: INDEX.into(),
    })?;
    let index: Index = serde_json::from_slice(&index).map_err(|source| ArchiveError::Index {
        path: path.to_owned(),
        source,
    })?;
    let entry_err = |name: &str, reason: &str| ArchiveError::Entry {
        path: path.to_owned(),
        name: name.to_string(),
        reason: reason.to_string(),
    };
    if index.format != FORMAT {
        return Err(entry_err(INDEX, "unknown format version"));
    }
    let mut checked = Vec::new();
    for entry in &index.modules {
        install::check_name(&entry.name)?;
        let module_name = format!("{}.wasm", entry.name);
        let module = files
            .remove(&module_name)
            .ok_or_else(|| ArchiveError::Missing {
                path: path.to_owned(),
                name: module_name.clone(),
            })?;
        let digest = Digest::of(&module);
        if digest.hex() != entry.sha256 {
            return Err(ArchiveError::Mismatch {
                path: path.to_owned(),
                name: module_name,
                expected: entry.sha256.clone(),
                actual: digest,
            });
        }
        let grant_name = format!("{}.toml", entry.name);
        let grant = match (&entry.grant_sha256, files.remove(&grant_name)) {
            (None, None) => None,
            (Some(expected), Some(bytes)) => {
                let actual = Digest::of(&bytes);
                if actual.hex() != expected {
                    return Err(ArchiveError::Mismatch {
                        path: path.to_owned(),
                        name: grant_name,
                        expected: expected.clone(),
                        actual,
                    });
                }
                // Resolved where the host will read it: a cosign key beside the grant is the
                // destination's (the operator's trust), never one from the tarball.
                let grant = Grant::parse(&dir.join(&grant_name), bytes)?;
                grant.check(&digest)?;
                Some(grant.bytes)
            }
            (Some(_), None) => {
                return Err(ArchiveError::Missing {
                    path: path.to_owned(),
                    name: grant_name,
                });
            }
            (None, Some(_)) => return Err(entry_err(&grant_name, "not in the index")),
        };
        let evidence_name = evidence_entry(&entry.name);
        let evidence = match (&entry.signature_sha256, files.remove(&evidence_name)) {
            (None, None) => None,
            (Some(expected), Some(bytes)) if Digest::of(&bytes).hex() == expected => Some(bytes),
            (Some(expected), Some(bytes)) => {
                return Err(ArchiveError::Mismatch {
                    path: path.to_owned(),
                    name: evidence_name,
                    expected: expected.clone(),
                    actual: Digest::of(&bytes),
                });
            }
            (Some(_), None) => {
                return Err(ArchiveError::Missing {
                    path: path.to_owned(),
                    name: evidence_name,
                });
            }
            (None, Some(_)) => return Err(entry_err(&evidence_name, "not in the index")),
        };
        checked.push((entry.name.clone(), digest, module, grant, evidence));
    }
    if let Some(extra) = files.keys().next() {
        return Err(entry_err(extra, "not in the index"));
    }
    // Everything is checked: only now is anything written.
    let mut plugins = Vec::new();
    for (name, digest, module, grant, evidence) in checked {
        // The evidence before the module: a signed guest's module is never there without it.
        if let Some(evidence) = evidence {
            install::write_atomic(dir, &super::cosign::evidence_file(&name), &evidence)?;
        }
        install::install(dir, &name, &module, grant.as_deref())?;
        plugins.push(Plugin {
            name,
            digest,
            grant: grant.is_some(),
        });
    }
    Ok(plugins)
}

/// Every entry's bytes by name; refuses anything but plain files with plain names.
fn read_entries(
    path: &Path,
    reader: impl std::io::Read,
    max_bytes: u64,
) -> Result<BTreeMap<String, Vec<u8>>, ArchiveError> {
    let read_err = |source| ArchiveError::Read {
        path: path.to_owned(),
        source,
    };
    let refuse = |name: &str, reason: &str| ArchiveError::Entry {
        path: path.to_owned(),
        name: name.to_string(),
        reason: reason.to_string(),
    };
    let mut archive = tar::Archive::new(reader);
    let mut files = BTreeMap::new();
    for entry in archive.entries().map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        let raw_name = entry.path_bytes();
        let name = String::from_utf8_lossy(&raw_name).into_owned();
        if name.contains('/') || name.contains('\\') {
            return Err(refuse(&name, "entries are plain file names, without '/'"));
        }
        if name.is_empty() || name == "." || name == ".." || name.starts_with('.') {
            return Err(refuse(&name, "not a plugin's file name"));
        }
        if entry.header().entry_type() != tar::EntryType::Regular {
            return Err(refuse(
                &name,
                "only regular files are loaded (no links, directories or devices)",
            ));
        }
        let size = entry.header().size().map_err(read_err)?;
        if size > max_bytes {
            return Err(refuse(
                &name,
                &format!("{size} bytes, over the {max_bytes}-byte cap (--max-module-mib)"),
            ));
        }
        let mut bytes = Vec::new();
        entry
            .take(max_bytes + 1)
            .read_to_end(&mut bytes)
            .map_err(read_err)?;
        if files.insert(name.clone(), bytes).is_some() {
            return Err(refuse(&name, "appears twice"));
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tarball of raw entries: (name, kind, bytes).
    fn tarball(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, kind, bytes) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(*kind);
            header.set_size(bytes.len() as u64);
            header.set_mode(0o644);
            // set_path refuses `..`; the raw name field does not.
            let field = &mut header.as_old_mut().name;
            field[..name.len()].copy_from_slice(name.as_bytes());
            header.set_cksum();
            builder.append(&header, *bytes).unwrap();
        }
        builder.into_inner().unwrap()
    }

    fn refused(bytes: &[u8]) -> String {
        read_entries(Path::new("t.tar"), bytes, 1024)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn paths_links_and_oversized_entries_are_refused() {
        let regular = tar::EntryType::Regular;
        assert!(refused(&tarball(&[("a/b.wasm", regular, b"x")])).contains("without '/'"));
        assert!(refused(&tarball(&[("/abs.wasm", regular, b"x")])).contains("without '/'"));
        assert!(refused(&tarball(&[("..", regular, b"x")])).contains("not a plugin"));
        assert!(refused(&tarball(&[("l.wasm", tar::EntryType::Symlink, b"")])).contains("regular"));
        assert!(refused(&tarball(&[("big.wasm", regular, &[0; 2000])])).contains("cap"));
        assert!(
            refused(&tarball(&[
                ("a.wasm", regular, b"x"),
                ("a.wasm", regular, b"y")
            ]))
            .contains("twice")
        );
    }

    #[test]
    fn save_then_load_round_trips_and_an_unlisted_file_is_refused() {
        let from = tempfile::tempdir().unwrap();
        std::fs::write(from.path().join("g.wasm"), b"module").unwrap();
        std::fs::write(from.path().join("g.toml"), b"[dirs]\n").unwrap();
        std::fs::write(from.path().join(".hidden.wasm"), b"skip").unwrap();
        let out = from.path().join("plugins.tar");
        let saved = save(from.path(), &[], &[], &out).unwrap();
        assert_eq!(saved.len(), 1);
        let to = tempfile::tempdir().unwrap();
        let loaded = load(&out, to.path(), 1 << 20).unwrap();
        assert_eq!(saved, loaded);
        assert_eq!(std::fs::read(to.path().join("g.wasm")).unwrap(), b"module");

        let mut bytes = std::fs::read(&out).unwrap();
        let extra = tarball(&[("x.wasm", tar::EntryType::Regular, b"x")]);
        // Drop the end-of-archive blocks and append one more entry.
        bytes.truncate(bytes.len() - 1024);
        bytes.extend_from_slice(&extra);
        std::fs::write(&out, bytes).unwrap();
        let empty = tempfile::tempdir().unwrap();
        let error = load(&out, empty.path(), 1 << 20).unwrap_err().to_string();
        assert!(error.contains("not in the index"), "{error}");
        assert_eq!(std::fs::read_dir(empty.path()).unwrap().count(), 0);
    }
}
