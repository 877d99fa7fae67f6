//! `wasm-provisioner run`: load the guests, connect to the API server, run the controller.

use std::sync::Arc;

use anyhow::Context as _;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::config::RunArgs;
use crate::controller;
use crate::http;
use crate::metrics::Metrics;
use crate::wasm::{WasmEngine, load_dir};

/// Runs until SIGTERM or SIGINT, then stops taking work and exits once in-flight work is done.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    if let Some(address) = args.metrics_address {
        // Up before the guests load, so liveness answers while readiness still says no.
        let server = http::Server::bind(address, &args.metrics_path, metrics.clone()).await?;
        tracing::info!(address = ?server.local_addr(), path = %args.metrics_path, "serving metrics, /healthz and /readyz");
        tokio::spawn(server.run());
    }
    let engine = WasmEngine::new()?.with_metrics(metrics.clone());
    let dir = args.plugins.clone();
    let plugins = tokio::task::spawn_blocking(move || load_dir(&engine, &dir)).await??;
    if plugins.is_empty() {
        tracing::warn!(dir = %args.plugins.display(), "no guest loaded; nothing will be provisioned");
    }
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    let client = kube::Client::try_from(config)?;
    controller::run_with_metrics(
        client,
        Arc::new(plugins),
        args.settings(),
        metrics,
        shutdown_signal(),
    )
    .await
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received; finishing in-flight work"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; finishing in-flight work"),
    }
}
