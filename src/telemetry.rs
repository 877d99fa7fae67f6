//! Logging setup: human-readable by default, JSON for collectors; `RUST_LOG` filters.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber (stderr).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
