//! The WebAssembly host: contract bindings, grants, the per-call sandbox and the plugins directory.

pub mod bindings;
pub mod cache;
pub mod call;
pub mod capabilities;
pub mod compile_queue;
pub mod compiler;
pub mod contract;
pub mod dirstream;
pub mod engine;
pub mod errors;
pub mod executor;
pub mod fs_view;
pub mod grants;
pub mod guest;
pub mod handles;
pub mod host;
pub mod localfs;
pub mod nodefs;
pub mod nodepath;
pub mod output;
pub mod ownership;
pub mod plugins;
pub mod pool;
pub mod rawname;
pub mod reload;
pub mod rename;
pub mod sandbox_fs;
pub mod served;
pub mod spec;

pub use bindings::types::{ProvisionError, SpecError};
pub use engine::{EngineOptions, Pooling, WasmEngine};
pub use errors::{CallError, FaultKind, LoadError};
pub use grants::Grants;
pub use guest::Guest;
pub use plugins::{Availability, Plugins};
pub use reload::load_dir;
