//! What a component implements: which contract version, which optional hooks, which imports.
//!
//! Read from the component's type before linking, so a guest built against another contract
//! version gets a message naming both versions instead of wasmtime's link error.

use std::collections::BTreeSet;

use wasmtime::Engine;
use wasmtime::component::Component;

use super::bindings::{PACKAGE, PACKAGE_VERSION};

/// Optional exports a guest may implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hook {
    /// `qualifier.should-provision`.
    Qualifier,
    /// `deletion-guard.should-delete`.
    DeletionGuard,
    /// `block-support.supports-block`.
    BlockSupport,
    /// `capabilities.supported`.
    Capabilities,
    /// `cloning.provision-clone` (since 0.1.1).
    Cloning,
    /// `expansion.expand` (since 0.1.3).
    Expansion,
}

impl Hook {
    /// The WIT interface name.
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::Qualifier => "qualifier",
            Hook::DeletionGuard => "deletion-guard",
            Hook::BlockSupport => "block-support",
            Hook::Capabilities => "capabilities",
            Hook::Cloning => "cloning",
            Hook::Expansion => "expansion",
        }
    }

    fn from_interface(name: &str) -> Option<Hook> {
        match name {
            "qualifier" => Some(Hook::Qualifier),
            "deletion-guard" => Some(Hook::DeletionGuard),
            "block-support" => Some(Hook::BlockSupport),
            "capabilities" => Some(Hook::Capabilities),
            "cloning" => Some(Hook::Cloning),
            "expansion" => Some(Hook::Expansion),
            _ => None,
        }
    }
}

/// Why a component's contract is not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    /// It exports nothing from our package.
    #[error(
        "it does not export `{PACKAGE}/lifecycle`; is it a provisioner guest? (build it against wit/ of this repository, package {PACKAGE}@{PACKAGE_VERSION})"
    )]
    NotAProvisioner,
    /// It targets another version of the contract.
    #[error(
        "it targets {PACKAGE}@{found}, but this host serves {PACKAGE}@{served} (compatible: 0.1.x); rebuild the guest against wit/ of wasm-provisioner {host_version}"
    )]
    Version {
        /// The version the guest was built for.
        found: String,
        /// The version the host serves.
        served: &'static str,
        /// This host's release.
        host_version: &'static str,
    },
}

/// The contract facts of one component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContractInfo {
    /// The contract version its `lifecycle` export names, if any.
    pub version: Option<String>,
    /// Optional hooks it exports.
    pub hooks: BTreeSet<Hook>,
    /// Every import name (WASI and ours), for `inspect`.
    pub imports: Vec<String>,
    /// Every export name, for `inspect`.
    pub exports: Vec<String>,
}

/// Splits `ns:pkg/iface@1.2.3` into (`ns:pkg`, `iface`, `1.2.3`).
fn split_name(name: &str) -> Option<(&str, &str, &str)> {
    let (path, version) = name.split_once('@')?;
    let (package, interface) = path.split_once('/')?;
    Some((package, interface, version))
}

/// Whether two versions are compatible the way wasmtime's linker matches them:
/// same major for 1.x and later, same minor for 0.y (y ≥ 1), exact for 0.0.z and prereleases.
pub fn compatible(a: &str, b: &str) -> bool {
    let parse = |v: &str| -> Option<(u64, u64, u64, bool)> {
        let (core, pre) = match v.split_once('-') {
            Some((c, _)) => (c, true),
            None => (v, false),
        };
        let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
        Some((parts.next()??, parts.next()??, parts.next()??, pre))
    };
    let (Some(x), Some(y)) = (parse(a), parse(b)) else {
        return false;
    };
    if x.3 || y.3 {
        return a == b;
    }
    match (x.0, x.1) {
        (0, 0) => a == b,
        (0, minor) => y.0 == 0 && y.1 == minor,
        (major, _) => y.0 == major,
    }
}

impl ContractInfo {
    /// Reads the contract facts from a compiled component.
    pub fn of(engine: &Engine, component: &Component) -> ContractInfo {
        let ty = component.component_type();
        let imports: Vec<String> = ty.imports(engine).map(|(n, _)| n.to_string()).collect();
        let exports: Vec<String> = ty.exports(engine).map(|(n, _)| n.to_string()).collect();
        let mut version = None;
        let mut hooks = BTreeSet::new();
        for name in &exports {
            let Some((package, interface, v)) = split_name(name) else {
                continue;
            };
            if package != PACKAGE {
                continue;
            }
            if interface == "lifecycle" {
                version = Some(v.to_string());
            } else if let Some(hook) = Hook::from_interface(interface) {
                hooks.insert(hook);
            }
        }
        ContractInfo {
            version,
            hooks,
            imports,
            exports,
        }
    }

    /// Whether this host can run it.
    pub fn check(&self) -> Result<(), ContractError> {
        let found = self
            .version
            .as_deref()
            .ok_or(ContractError::NotAProvisioner)?;
        if compatible(found, PACKAGE_VERSION) {
            Ok(())
        } else {
            Err(ContractError::Version {
                found: found.to_string(),
                served: PACKAGE_VERSION,
                host_version: env!("CARGO_PKG_VERSION"),
            })
        }
    }
}

/// The hooks a guest implements, for display.
pub fn hook_names(hooks: &BTreeSet<Hook>) -> Vec<&'static str> {
    hooks.iter().map(|h| h.as_str()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_compatibility_follows_wasmtime_rules() {
        assert!(compatible("0.1.0", "0.1.0"));
        assert!(compatible("0.1.3", "0.1.0"));
        assert!(!compatible("0.2.0", "0.1.0"));
        assert!(!compatible("0.0.1", "0.0.2"));
        assert!(compatible("1.2.0", "1.0.0"));
        assert!(!compatible("2.0.0", "1.0.0"));
        assert!(!compatible("0.1.0-rc1", "0.1.0"));
        assert!(!compatible("garbage", "0.1.0"));
    }

    #[test]
    fn names_split_into_package_interface_version() {
        assert_eq!(
            split_name("wasm-provisioner:provisioner/lifecycle@0.1.0"),
            Some(("wasm-provisioner:provisioner", "lifecycle", "0.1.0"))
        );
        assert_eq!(split_name("wasi:cli/stdout"), None);
    }

    #[test]
    fn missing_lifecycle_and_wrong_version_are_explained() {
        let mut info = ContractInfo {
            version: None,
            hooks: BTreeSet::new(),
            imports: vec![],
            exports: vec![],
        };
        assert_eq!(info.check(), Err(ContractError::NotAProvisioner));
        info.version = Some("0.2.0".into());
        let msg = info.check().unwrap_err().to_string();
        assert!(msg.contains("@0.2.0") && msg.contains("@0.1.3"), "{msg}");
    }
}
