//! wasm-provisioner: a Kubernetes external provisioner whose storage logic runs as WebAssembly.
//!
//! ```text
//!  watch (PVC, PV, StorageClass) ──▶ reflector caches ──▶ work queues (claims by UID, volumes by name)
//!                                                             │
//!                                         decide (pure: should provision / should delete)
//!                                                             │
//!                            guest call (fresh wasm instance, grants, deadline, memory cap)
//!                                                             │
//!                          validate returned spec against grants ──▶ API server (PV, events)
//! ```

pub mod config;
pub mod controller;
pub mod fixtures;
pub mod http;
pub mod malloc;
pub mod metrics;
pub mod oci;
pub mod offline;
pub mod run;
pub mod scaffold;
pub mod sizes;
pub mod telemetry;
pub mod uninstall;
pub mod wasm;
