//! The wasm runtime at one path: the engine ([`super::engine`]), loaded guests and their one
//! call path ([`super::guest`]) and the errors at the boundary ([`super::errors`]).

pub use super::contract::hook_names;
pub use super::engine::{EPOCH_TICK, EngineOptions, Pooling, WasmEngine};
pub use super::errors::{CallError, FaultKind, LoadError};
pub use super::guest::Guest;
pub use super::pool::POOL_INSTANCES;
