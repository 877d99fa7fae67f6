//! Finding the etcd, kube-apiserver and kube-controller-manager executables.

use std::path::{Path, PathBuf};

use anyhow::bail;

/// Environment variable naming the directory that holds the three binaries.
pub const BIN_DIR_ENV: &str = "WP_K8S_BIN_DIR";

/// The cache directory `.ci/control-plane-binaries` builds into, which it also reads from.
const SCRIPT_CACHE_ENV: &str = "WP_K8S_CACHE";

/// The control plane version the harness is written for (flags differ between versions).
pub const KUBERNETES_VERSION: &str = "1.20.2";

/// Paths of the control plane executables.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub etcd: PathBuf,
    pub kube_apiserver: PathBuf,
    pub kube_controller_manager: PathBuf,
}

/// Where `.ci/control-plane-binaries` puts the binaries unless told otherwise:
/// `$WP_K8S_CACHE`, else `$HOME/.cache/wasm-provisioner/k8s-1.20.2`.
pub fn default_bin_dir() -> PathBuf {
    if let Some(cache) = std::env::var_os(SCRIPT_CACHE_ENV) {
        return PathBuf::from(cache);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache/wasm-provisioner")
        .join(format!("k8s-{KUBERNETES_VERSION}"))
}

impl Binaries {
    /// Looks in `$WP_K8S_BIN_DIR`, else [`default_bin_dir`]; fails with instructions if any
    /// binary is missing.
    pub fn locate() -> anyhow::Result<Binaries> {
        let dir = std::env::var_os(BIN_DIR_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(default_bin_dir);
        Binaries::in_dir(&dir)
    }

    /// The three binaries in `dir`, each checked to be an executable file.
    pub fn in_dir(dir: &Path) -> anyhow::Result<Binaries> {
        let binaries = Binaries {
            etcd: dir.join("etcd"),
            kube_apiserver: dir.join("kube-apiserver"),
            kube_controller_manager: dir.join("kube-controller-manager"),
        };
        let missing: Vec<String> = [
            &binaries.etcd,
            &binaries.kube_apiserver,
            &binaries.kube_controller_manager,
        ]
        .into_iter()
        .filter(|path| !is_executable(path))
        .map(|path| path.display().to_string())
        .collect();
        if !missing.is_empty() {
            bail!(
                "control plane binaries missing or not executable: {}. Run `bash .ci/control-plane-binaries` \
                 (installs etcd and builds kube-apiserver + kube-controller-manager v{KUBERNETES_VERSION} into {}, \
                 about 10 minutes), or set {BIN_DIR_ENV} to a directory holding etcd, kube-apiserver and \
                 kube-controller-manager",
                missing.join(", "),
                default_bin_dir().display(),
            );
        }
        Ok(binaries)
    }
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    // metadata() follows symlinks: the cached etcd is a link to /usr/bin/etcd.
    path.metadata()
        .is_ok_and(|metadata| metadata.is_file() && metadata.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_binaries_error_says_how_to_get_them() {
        let empty = tempfile::tempdir().unwrap();
        let error = Binaries::in_dir(empty.path()).unwrap_err().to_string();
        assert!(error.contains(".ci/control-plane-binaries"), "{error}");
        assert!(error.contains("kube-apiserver"), "{error}");
    }
}
