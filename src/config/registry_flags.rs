//! The flags of `push`, `pull`, `save` and `load`: guests to and from OCI registries, and
//! tarballs of plugins for clusters without one (src/oci).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

/// How a registry is reached: shared by `push`, `pull` and `run` (grants naming a source).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Registries")]
pub struct RegistryArgs {
    /// A Docker config.json with credentials per registry (a `kubernetes.io/dockerconfigjson`
    /// Secret's `.dockerconfigjson`, mounted as a file).
    #[arg(long, env = "WP_REGISTRY_CONFIG", value_name = "FILE")]
    pub registry_config: Option<PathBuf>,
    /// PEM file of CA certificates trusted besides the system's.
    #[arg(long, value_name = "PEM")]
    pub ca_file: Option<PathBuf>,
    /// Speak plain HTTP to this registry (repeatable); every other one is HTTPS.
    #[arg(long, value_name = "HOST:PORT")]
    pub plain_http: Vec<String>,
    /// The largest module accepted, MiB: checked against the manifest before downloading and
    /// enforced while downloading.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub max_module_mib: u64,
    /// Deadline of each registry request, its retries and its whole body included.
    #[arg(long, default_value = "60s", value_parser = parse_deadline)]
    pub request_timeout: Duration,
}

/// A duration a request can finish in: not zero.
fn parse_deadline(text: &str) -> Result<Duration, String> {
    match super::parse_duration(text)? {
        Duration::ZERO => Err("a request deadline of 0 lets no request finish".into()),
        deadline => Ok(deadline),
    }
}

/// `wasm-provisioner push`.
#[derive(Debug, Args)]
pub struct PushArgs {
    /// The component to push.
    pub file: PathBuf,
    /// Where: REGISTRY/REPOSITORY:TAG.
    pub reference: String,
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// `wasm-provisioner pull`.
#[derive(Debug, Args)]
pub struct PullArgs {
    /// REGISTRY/REPOSITORY:TAG, REGISTRY/REPOSITORY@sha256:HEX or both.
    pub reference: String,
    /// Plugins directory to install into.
    #[arg(long)]
    pub plugins: PathBuf,
    /// Installed as NAME.wasm (and NAME.toml with --grant).
    #[arg(long)]
    pub name: String,
    /// Grant file installed as NAME.toml; a `[module] sha256` in it must match the module.
    #[arg(long, value_name = "FILE")]
    pub grant: Option<PathBuf>,
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// `wasm-provisioner save`.
#[derive(Debug, Args)]
pub struct SaveArgs {
    /// Plugins directory to read.
    #[arg(long)]
    pub plugins: PathBuf,
    /// The tarball to write.
    #[arg(long, value_name = "FILE.tar")]
    pub out: PathBuf,
    /// Plugins to save (NAME of NAME.wasm); all of the directory's when neither these nor
    /// --pull are given.
    pub names: Vec<String>,
    /// Also pull NAME=REFERENCE from a registry into the tarball (repeatable), beside the
    /// directory's NAME.toml if it has one (its `[module] sha256` pin checked).
    #[arg(long = "pull", value_name = "NAME=REFERENCE")]
    pub pulls: Vec<String>,
    /// How --pull reaches registries.
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// `wasm-provisioner load`.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// A tarball written by `save`.
    pub file: PathBuf,
    /// Plugins directory to install into.
    #[arg(long)]
    pub plugins: PathBuf,
    /// The largest file accepted from the tarball, MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub max_module_mib: u64,
}
