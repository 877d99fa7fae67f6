//! The wasm runtime at one path: the engine ([`super::engine`]), loaded guests and their one
//! call path ([`super::guest`]) and the errors at the boundary ([`super::errors`]).

pub use super::engine::{
    EPOCH_TICK, EngineOptions, POOL_INSTANCES, Pooling, WasmEngine, hook_names,
};
pub use super::errors::{CallError, FaultKind, LoadError};
pub use super::guest::Guest;
