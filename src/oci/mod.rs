//! Guests to and from OCI registries, and across an air gap (issue 37).
//!
//! ```text
//!  push FILE.wasm REF ──▶ artifact (config + application/wasm layer + manifest) ──▶ registry
//!  pull REF ──▶ manifest (digest checked) ──▶ layer (size cap, digest, grant pin) ──▶ install
//!  save DIR ──▶ tarball (index of sha256s) ──▶ load: every entry checked ──▶ install
//!  install: hidden temp file in the plugins directory, fsync, rename (grant first, module second)
//! ```
//!
//! [`reference`] parses image references, [`auth`] reads credentials and challenges,
//! [`transport`] is the bounded HTTP client, [`registry`] the distribution API on top of it,
//! [`artifact`] the wasm OCI format, [`install`] the atomic writes, [`archive`] the tarball,
//! [`commands`] the command line's glue.

pub mod archive;
pub mod artifact;
pub mod auth;
pub mod commands;
pub mod cosign;
pub mod digest;
pub mod fetch;
pub mod install;
pub mod reference;
pub mod registry;
pub mod transport;

pub use commands::OciError;
pub use digest::Digest;
pub use reference::Reference;
