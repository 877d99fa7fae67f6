//! The WebAssembly host: contract bindings, grants, the per-call sandbox and the plugins directory.

pub mod bindings;
pub mod contract;
pub mod convert;
pub mod grants;
pub mod host;
pub mod plugins;
pub mod runtime;
pub mod spec;

pub use bindings::types::{ProvisionError, SpecError};
pub use grants::Grants;
pub use plugins::{Plugins, load_dir};
pub use runtime::{CallError, FaultKind, Guest, LoadError, WasmEngine};

/// One line describing a refused volume-spec value.
pub fn describe_spec_error(error: &SpecError) -> String {
    match error {
        SpecError::NotGranted(m) => format!("not granted: {m}"),
        SpecError::Invalid(m) => format!("invalid: {m}"),
    }
}
