//! Putting a module (and its grant) into a plugins directory so the host never sees half of it:
//! each file is written to a hidden temporary file in the same directory (the host's scan skips
//! names starting with `.`), synced, and renamed over `NAME.wasm` / `NAME.toml`.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::digest::Digest;
use crate::wasm::pin::{ModulePin, ModuleTable};

/// Why an install was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(
        "{name:?} is not a plugin name (letters, digits, '_', '-' and '.', not starting with '.', at most 200)"
    )]
    Name { name: String },
    #[error("cannot read the grant file {path}")]
    ReadGrant {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the grant file {path} is not TOML with a [module] table of the right shape")]
    ParseGrant {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("{path}: {reason}")]
    PinShape { path: PathBuf, reason: String },
    #[error(
        "the grant {path} pins [module] sha256 = \"{pinned}\" but the module is {actual}; nothing was written"
    )]
    PinMismatch {
        path: PathBuf,
        pinned: String,
        actual: Digest,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A grant file's bytes and its `[module]` table, read as the host reads it when it loads.
#[derive(Debug, Clone)]
pub struct Grant {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
    /// The module digest it pins, if it pins one.
    pub pin: Option<Digest>,
    /// The rest of its `[module]` table (cosign key, source).
    pub module: ModulePin,
}

impl Grant {
    pub fn read(path: &Path) -> Result<Grant, InstallError> {
        let bytes = std::fs::read(path).map_err(|source| InstallError::ReadGrant {
            path: path.to_owned(),
            source,
        })?;
        Grant::parse(path, bytes)
    }

    /// Reads only `[module]` (with the host's own rules); the rest of the grant is the host's to
    /// judge when it loads.
    pub fn parse(path: &Path, bytes: Vec<u8>) -> Result<Grant, InstallError> {
        #[derive(Deserialize)]
        struct File {
            module: Option<ModuleTable>,
        }
        let text = String::from_utf8_lossy(&bytes);
        let file: File = toml::from_str(&text).map_err(|source| InstallError::ParseGrant {
            path: path.to_owned(),
            source,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let module =
            ModulePin::from_table(file.module, base).map_err(|reason| InstallError::PinShape {
                path: path.to_owned(),
                reason,
            })?;
        let pin = module
            .sha256
            .as_deref()
            .map(|hex| Digest::from_hex(hex).expect("ModulePin checks the shape"));
        Ok(Grant {
            path: path.to_owned(),
            bytes,
            pin,
            module,
        })
    }

    /// Refuses a module other than the one the grant pins.
    pub fn check(&self, module: &Digest) -> Result<(), InstallError> {
        match &self.pin {
            Some(pinned) if pinned != module => Err(InstallError::PinMismatch {
                path: self.path.clone(),
                pinned: pinned.hex().to_string(),
                actual: module.clone(),
            }),
            _ => Ok(()),
        }
    }
}

/// A name the host loads as `NAME.wasm`: no path separators, not hidden.
pub fn check_name(name: &str) -> Result<(), InstallError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(InstallError::Name {
            name: name.to_string(),
        })
    }
}

/// Installs `NAME.wasm` and, if given, `NAME.toml` into `dir`.
///
/// The grant goes in first. On a fresh install the host then sees a grant without a module
/// (reported and skipped) and, a moment later, the module with its grant: never the module
/// alone. On an upgrade there is a moment where the old module sits beside the new grant; a grant
/// that pins the new module's sha256 makes the host refuse that pair instead of running it, and
/// the module's rename ends the moment. The other order would run the new module under the old
/// grant, which pins (if it pins) the old module, or grants what the old one needed.
pub fn install(
    dir: &Path,
    name: &str,
    module: &[u8],
    grant: Option<&[u8]>,
) -> Result<(), InstallError> {
    check_name(name)?;
    if let Some(grant) = grant {
        write_atomic(dir, &format!("{name}.toml"), grant)?;
    }
    write_atomic(dir, &format!("{name}.wasm"), module)
}

/// Writes `bytes` to `dir/file_name` by a hidden temporary file, fsync and rename; the directory
/// is synced so the rename survives a crash.
pub fn write_atomic(dir: &Path, file_name: &str, bytes: &[u8]) -> Result<(), InstallError> {
    let target = dir.join(file_name);
    let temp = dir.join(format!(
        ".{file_name}.{}.{:08x}.tmp",
        std::process::id(),
        rand::random::<u32>()
    ));
    let write_err = |path: &Path| {
        let path = path.to_owned();
        move |source| InstallError::Write { path, source }
    };
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })()
    .map_err(write_err(&temp))
    .and_then(|()| std::fs::rename(&temp, &target).map_err(write_err(&target)));
    if result.is_err() {
        // Nothing half-written stays behind; the hidden name kept the host away meanwhile.
        let _ = std::fs::remove_file(&temp);
    }
    result?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(write_err(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_pin_is_read_from_the_module_table_only() {
        let hex = "ab".repeat(32);
        let text = format!("[volumes]\nx = 1\n[module]\nsha256 = \"{hex}\"\nsource = \"r/x:1\"\n");
        let grant = Grant::parse(Path::new("g.toml"), text.into_bytes()).unwrap();
        assert_eq!(grant.pin, Some(Digest::from_hex(&hex).unwrap()));
        assert!(grant.check(&Digest::from_hex(&hex).unwrap()).is_ok());
        assert!(matches!(
            grant.check(&Digest::of(b"other")),
            Err(InstallError::PinMismatch { .. })
        ));
        let unpinned = Grant::parse(Path::new("g.toml"), b"[dirs]\n".to_vec()).unwrap();
        assert_eq!(unpinned.pin, None);
        assert!(matches!(
            Grant::parse(
                Path::new("g.toml"),
                b"[module]\nsha256 = \"ABC\"\n".to_vec()
            ),
            Err(InstallError::PinShape { .. })
        ));
    }

    #[test]
    fn names_are_plain_file_names() {
        for ok in ["hostpath", "local_path", "nfs-subdir.v2"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".hidden", "a/b", "..", "a b", "x\0"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn install_leaves_only_the_two_files() {
        let dir = tempfile::tempdir().unwrap();
        install(dir.path(), "g", b"module", Some(b"[dirs]\n")).unwrap();
        install(dir.path(), "g", b"module2", None).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["g.toml", "g.wasm"]);
        assert_eq!(
            std::fs::read(dir.path().join("g.wasm")).unwrap(),
            b"module2"
        );
    }
}
