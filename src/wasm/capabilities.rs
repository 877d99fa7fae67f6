//! What a guest serves beyond a plain claim: the `capabilities` hook, read by flag name.
//!
//! ```text
//! load:  exports `capabilities@0.1.x`? ─▶ its `supported` func, checked: no params, one `flags`
//! call:  capabilities.supported() ─▶ flag names ─▶ Capabilities (unknown names ignored)
//!        else block-support.supports-block() ─▶ Capabilities { block }   (guests built before)
//!        else nothing declared
//! ```
//!
//! The hook is called dynamically, not through `bindgen!`'s typed exports, on purpose: a typed
//! export must match the host's `flags` exactly, so adding a flag (data sources next) would stop
//! every guest built before from linking, and a guest built after from loading on this host.
//! Read by name, a flag set may grow within 0.1.x in both directions.

use wasmtime::component::types::ComponentItem;
use wasmtime::component::{Component, ComponentExportIndex, Type};

use super::bindings::PACKAGE;
use super::contract::compatible;

/// One thing a claim may need that a plain guest does not serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capability {
    /// `volumeMode: Block`.
    Block,
    /// `spec.selector`.
    Selector,
    /// A copy of another claim (`spec.dataSource` naming a PersistentVolumeClaim). Declared by
    /// exporting the `cloning` hook, not by a flag: the hook is what the host calls.
    Clone,
    /// A restore of a VolumeSnapshot. No guest can declare it yet (the contract has no snapshot
    /// restore), so such claims are always refused, never provisioned empty.
    Snapshot,
}

impl Capability {
    /// Every capability the host knows, in the order a claim's needs are checked.
    pub const ALL: [Capability; 4] = [
        Capability::Block,
        Capability::Selector,
        Capability::Clone,
        Capability::Snapshot,
    ];

    /// Its flag name in the WIT `capability-set`; `None` for what no flag declares.
    pub fn flag(self) -> Option<&'static str> {
        match self {
            Capability::Block => Some("block"),
            Capability::Selector => Some("selector"),
            Capability::Clone | Capability::Snapshot => None,
        }
    }

    /// Why a claim needing this is refused, for the `ProvisioningFailed` event: the Go
    /// library's words first, then which guest declares what.
    pub fn refusal(self, provisioner: &str, guest: &str) -> String {
        match self {
            Capability::Block => format!(
                "{provisioner} does not support block volume provisioning: guest {guest} declares no `block` capability"
            ),
            Capability::Selector => format!(
                "claim Selector is not supported: {provisioner} does not handle claims with a selector (spec.selector): guest {guest} declares no `selector` capability"
            ),
            Capability::Clone => format!(
                "this class cannot copy from a PersistentVolumeClaim: guest {guest} of {provisioner} does not export the `cloning` hook; a clone is never provisioned as an empty volume"
            ),
            Capability::Snapshot => format!(
                "this class cannot copy from a VolumeSnapshot: {provisioner} (guest {guest}) cannot restore snapshots, the guest contract has no snapshot restore yet; a restore is never provisioned as an empty volume"
            ),
        }
    }

    fn from_flag(name: &str) -> Option<Capability> {
        Capability::ALL.into_iter().find(|c| c.flag() == Some(name))
    }
}

/// A set of [`Capability`]: what a guest declares, or what a claim needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    bits: u8,
}

impl Capabilities {
    /// Nothing: a plain claim, or a guest that declares nothing.
    pub const NONE: Capabilities = Capabilities { bits: 0 };

    /// This set and `capability`.
    #[must_use]
    pub fn with(self, capability: Capability) -> Capabilities {
        Capabilities {
            bits: self.bits | 1 << capability as u8,
        }
    }

    /// This set, and `capability` when `yes`.
    #[must_use]
    pub fn with_if(self, capability: Capability, yes: bool) -> Capabilities {
        if yes { self.with(capability) } else { self }
    }

    /// Whether `capability` is in the set.
    pub fn has(self, capability: Capability) -> bool {
        self.bits & 1 << capability as u8 != 0
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.bits == 0
    }

    /// The first capability of `self` (what a claim needs) that `declared` lacks.
    pub fn first_missing(self, declared: Capabilities) -> Option<Capability> {
        Capability::ALL
            .into_iter()
            .find(|&c| self.has(c) && !declared.has(c))
    }

    /// The set named by a guest's flags; names this host does not know are ignored (a guest
    /// built against a later 0.1.x may declare more than this host gates).
    pub fn from_flags<'a>(names: impl IntoIterator<Item = &'a str>) -> Capabilities {
        names
            .into_iter()
            .filter_map(Capability::from_flag)
            .fold(Capabilities::NONE, Capabilities::with)
    }
}

/// Why a `capabilities` export cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("its `capabilities` export must hold `supported: func() -> flags`: {0}")]
pub struct HookError(String);

/// Where a component's `capabilities.supported` is, when it exports one: found and type-checked
/// at load, so a malformed hook refuses the module instead of failing every claim.
pub fn find_hook(
    component: &Component,
    exports: &[String],
) -> Result<Option<ComponentExportIndex>, HookError> {
    let Some(interface) = exports.iter().find(|name| {
        name.split_once('@').is_some_and(|(path, version)| {
            path == format!("{PACKAGE}/capabilities")
                && compatible(version, super::bindings::PACKAGE_VERSION)
        })
    }) else {
        return Ok(None);
    };
    let instance = component
        .get_export_index(None, interface.as_str())
        .ok_or_else(|| HookError(format!("{interface} is not an instance")))?;
    let (item, index) = component
        .get_export(Some(&instance), "supported")
        .ok_or_else(|| HookError("no `supported` function".into()))?;
    let ComponentItem::ComponentFunc(func) = item else {
        return Err(HookError("`supported` is not a function".into()));
    };
    let results: Vec<Type> = func.results().collect();
    let returns_flags = matches!(results.as_slice(), [Type::Flags(_)]);
    if func.params().len() != 0 || !returns_flags {
        return Err(HookError(format!(
            "found one taking {} parameters and returning {results:?}",
            func.params().len()
        )));
    }
    Ok(Some(index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_read_by_name_and_unknown_ones_ignored() {
        let declared = Capabilities::from_flags(["selector", "data-source", "block"]);
        assert!(declared.has(Capability::Block) && declared.has(Capability::Selector));
        assert_eq!(Capabilities::from_flags([]), Capabilities::NONE);
        assert_eq!(
            Capabilities::from_flags(["clone", "snapshot", "later"]),
            Capabilities::NONE,
            "only the hooks declare copies; a later host's flag means nothing here"
        );
    }

    #[test]
    fn the_first_missing_capability_is_named() {
        let needs = Capabilities::NONE
            .with(Capability::Block)
            .with(Capability::Selector);
        assert_eq!(
            needs.first_missing(Capabilities::NONE),
            Some(Capability::Block)
        );
        assert_eq!(
            needs.first_missing(Capabilities::NONE.with(Capability::Block)),
            Some(Capability::Selector)
        );
        assert_eq!(needs.first_missing(needs), None);
        assert_eq!(Capabilities::NONE.first_missing(Capabilities::NONE), None);
        assert!(
            Capabilities::NONE
                .with_if(Capability::Selector, false)
                .is_empty()
        );
    }
}
