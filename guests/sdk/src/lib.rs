//! wasm-provisioner-sdk: write a wasm-provisioner guest as a plain Rust trait.
//!
//! ```text
//! author:  impl Provisioner for MyGuest { provision(&request, &dyn Host) -> VolumeSpec, delete(..) }
//!          export_provisioner!(MyGuest);                      // no bindgen code in the guest
//! native:  cargo test   ─▶ MyGuest::provision(&testing::request(..), &FakeHost) ─▶ assert on VolumeSpec
//! wasm:    host call ─▶ Adapter<MyGuest> ─▶ MyGuest::provision(&request, &WasmHost)
//!                     ─▶ VolumeSpec replayed into the host's grant-checked volume-builder ─▶ host
//! ```
//!
//! Helpers: [`needs!`] (what the guest needs from its grant file, declared once: the
//! `wasm-provisioner:needs` section and the constants its config is read with), [`Parameters`]
//! (typed class parameters, unknown ones refused), [`pattern`] (path patterns), [`DirVolume`]
//! (a directory per claim: pattern, records on the PV, delete or archive), [`quantity`]
//! (`RoundUpSize`-like rounding), [`parse_config`] (the grant file's `[config]` as a serde
//! struct), and [`testing`] (a fake host and records for native unit tests).
//! See `guests/GUIDE.md` for the way from `cargo new` to a running provisioner.

#[doc(hidden)]
pub mod bindings;
mod config;
pub mod dir_volume;
pub mod dirs;
mod host;
pub mod needs;
mod params;
pub mod pattern;
pub mod quantity;
mod spec;
pub mod testing;
mod types;

pub use config::{ConfigError, join, parse_config, require_absolute};
pub use dir_volume::DirVolume;
pub use host::Host;
#[cfg(target_arch = "wasm32")]
pub use host::WasmHost;
pub use params::{ParameterError, Parameters, parse_bool, parse_id, parse_mode};
pub use spec::{Ownership, VolumeSpec};
pub use types::*;

/// A provisioner guest. Implement `provision` and `delete`; the hooks have the host's defaults
/// and are only exported when listed in [`export_provisioner!`].
pub trait Provisioner {
    /// Creates the storage for a claim and describes its PersistentVolume. Must be idempotent
    /// for `request.pv_name`: a second call finds the storage the first one created.
    fn provision(request: &ProvisionRequest, host: &dyn Host)
    -> Result<VolumeSpec, ProvisionError>;

    /// Deletes the storage behind a volume this guest provisioned; storage already gone is
    /// success. Read what you need from `request.volume` (its annotations), not from the
    /// StorageClass, which may be gone.
    fn delete(request: &DeleteRequest, host: &dyn Host) -> Result<(), ProvisionError>;

    /// Hook `qualifier`: whether to provision this claim at all (false = leave it alone).
    /// `config` is the grant file's `[config]` as JSON, as in the requests.
    fn should_provision(_claim: &Claim, _class: &StorageClass, _config: &str) -> bool {
        true
    }

    /// Hook `deletion-guard`: whether to delete this released volume (false = keep it).
    fn should_delete(_volume: &Volume, _config: &str) -> bool {
        true
    }

    /// Hook `capabilities`: what the guest serves beyond a plain claim (`Capabilities::BLOCK`
    /// for `volumeMode: Block`, `Capabilities::SELECTOR` for claims with `spec.selector`). The
    /// host refuses a claim needing what is not declared, with an event, before calling
    /// `provision`. Export it with `hooks: [capabilities]`; it supersedes `block_support`.
    fn capabilities() -> Capabilities {
        Capabilities::empty()
    }

    /// Hook `cloning`: creates the storage for a claim that copies `source` (a Bound claim of
    /// the same class and provisioner, whose `volume` is what `delete` would get) and describes
    /// it, like `provision` (idempotent for `request.pv_name`). The host holds the source while
    /// this runs. Export it with `hooks: [cloning]`; a guest that does not is never asked, and
    /// the host refuses clones of its class: they are never provisioned empty.
    fn provision_clone(
        _request: &ProvisionRequest,
        _source: &CloneSource,
        _host: &dyn Host,
    ) -> Result<VolumeSpec, ProvisionError> {
        Err(crate::final_error(
            "this guest does not clone volumes (it exports no cloning hook)",
        ))
    }

    /// Hook `expansion`: grows the storage behind `request.volume` to hold at least
    /// `request.requested_bytes` and returns the capacity it has now (at least that). The host
    /// raises the limit of a volume it enforces a size on itself, from this answer, and writes
    /// the new capacity to the PV and the claim; a guest has nothing to grow for a plain
    /// directory and returns the request. Idempotent: called again after a failure. Export it
    /// with `hooks: [expansion]`; a guest that does not is never asked, and the host says its
    /// classes cannot expand.
    fn expand(request: &ExpandRequest, _host: &dyn Host) -> Result<u64, ProvisionError> {
        let _ = request;
        Err(crate::final_error(
            "this guest does not grow volumes (it exports no expansion hook)",
        ))
    }

    /// Hook `block-support` (the contract before `capabilities`): whether `volumeMode: Block`
    /// claims can be provisioned. Not asked when `capabilities` is exported.
    fn supports_block() -> bool {
        false
    }
}

/// What a guest serves beyond a plain claim ([`Provisioner::capabilities`]); combine with `|`.
pub use bindings::hooks::capabilities::exports::wasm_provisioner::provisioner::capabilities::CapabilitySet as Capabilities;

/// Exports a [`Provisioner`] as the guest's component exports (only in WebAssembly builds, so
/// native `cargo test` links). List the optional hooks to export after `hooks:`.
///
/// ```ignore
/// wasm_provisioner_sdk::export_provisioner!(MyGuest);
/// wasm_provisioner_sdk::export_provisioner!(MyGuest, hooks: [qualifier, deletion_guard, capabilities]);
/// ```
#[macro_export]
macro_rules! export_provisioner {
    ($guest:ty) => {
        $crate::export_provisioner!($guest, hooks: []);
    };
    ($guest:ty, hooks: [$($hook:ident),* $(,)?]) => {
        #[cfg(target_arch = "wasm32")]
        const _: () = {
            type WasmProvisionerSdkAdapter = $crate::__private::Adapter<$guest>;
            $crate::bindings::export_lifecycle!(WasmProvisionerSdkAdapter with_types_in $crate::bindings);
            $( $crate::__export_hook!($hook, WasmProvisionerSdkAdapter); )*
        };
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __export_hook {
    (qualifier, $adapter:ident) => {
        $crate::bindings::hooks::qualifier::export_qualifier!($adapter with_types_in $crate::bindings::hooks::qualifier);
    };
    (deletion_guard, $adapter:ident) => {
        $crate::bindings::hooks::deletion_guard::export_deletion_guard!($adapter with_types_in $crate::bindings::hooks::deletion_guard);
    };
    (capabilities, $adapter:ident) => {
        $crate::bindings::hooks::capabilities::export_capabilities!($adapter with_types_in $crate::bindings::hooks::capabilities);
    };
    (block_support, $adapter:ident) => {
        $crate::bindings::hooks::block_support::export_block_support!($adapter with_types_in $crate::bindings::hooks::block_support);
    };
    (cloning, $adapter:ident) => {
        $crate::bindings::hooks::cloning::export_cloning!($adapter with_types_in $crate::bindings::hooks::cloning);
    };
    (expansion, $adapter:ident) => {
        $crate::bindings::hooks::expansion::export_expansion!($adapter with_types_in $crate::bindings::hooks::expansion);
    };
    ($other:ident, $adapter:ident) => {
        compile_error!(concat!(
            "unknown hook `", stringify!($other),
            "`: the hooks are qualifier, deletion_guard, capabilities, block_support, cloning and expansion"
        ));
    };
}

#[doc(hidden)]
pub mod __private {
    /// Connects a [`crate::Provisioner`] to the generated export traits.
    pub struct Adapter<T>(std::marker::PhantomData<T>);

    #[cfg(target_arch = "wasm32")]
    mod exports {
        use super::Adapter;
        use crate::bindings::exports::wasm_provisioner::provisioner::lifecycle;
        use crate::bindings::hooks;
        use crate::bindings::wasm_provisioner::provisioner::volume_builder;
        use crate::{
            Claim, DeleteRequest, ProvisionError, ProvisionRequest, Provisioner, StorageClass,
            Volume, WasmHost,
        };

        fn host_config() -> String {
            crate::bindings::wasm_provisioner::provisioner::host::config()
        }

        impl<T: Provisioner> lifecycle::Guest for Adapter<T> {
            fn provision(
                request: ProvisionRequest,
            ) -> Result<volume_builder::VolumeSpec, ProvisionError> {
                let spec = T::provision(&request, &WasmHost)?;
                Ok(spec.build()?)
            }

            fn delete(request: DeleteRequest) -> Result<(), ProvisionError> {
                T::delete(&request, &WasmHost)
            }
        }

        impl<T: Provisioner>
            hooks::qualifier::exports::wasm_provisioner::provisioner::qualifier::Guest
            for Adapter<T>
        {
            fn should_provision(claim: Claim, class: StorageClass) -> bool {
                T::should_provision(&claim, &class, &host_config())
            }
        }

        impl<T: Provisioner>
            hooks::deletion_guard::exports::wasm_provisioner::provisioner::deletion_guard::Guest
            for Adapter<T>
        {
            fn should_delete(volume: Volume) -> bool {
                T::should_delete(&volume, &host_config())
            }
        }

        impl<T: Provisioner>
            hooks::capabilities::exports::wasm_provisioner::provisioner::capabilities::Guest
            for Adapter<T>
        {
            fn supported() -> crate::Capabilities {
                T::capabilities()
            }
        }

        impl<T: Provisioner> hooks::cloning::exports::wasm_provisioner::provisioner::cloning::Guest
            for Adapter<T>
        {
            fn provision_clone(
                request: ProvisionRequest,
                source: crate::CloneSource,
            ) -> Result<volume_builder::VolumeSpec, ProvisionError> {
                let spec = T::provision_clone(&request, &source, &WasmHost)?;
                Ok(spec.build()?)
            }
        }

        impl<T: Provisioner>
            hooks::expansion::exports::wasm_provisioner::provisioner::expansion::Guest
            for Adapter<T>
        {
            fn expand(request: crate::ExpandRequest) -> Result<u64, ProvisionError> {
                T::expand(&request, &WasmHost)
            }
        }

        impl<T: Provisioner>
            hooks::block_support::exports::wasm_provisioner::provisioner::block_support::Guest
            for Adapter<T>
        {
            fn supports_block() -> bool {
                T::supports_block()
            }
        }
    }
}
