//! `wasm-provisioner run`: load the guests, connect to the API server, run the controller, and
//! keep the guests in step with the plugins directory.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::config::RunArgs;
use crate::controller;
use crate::http;
use crate::metrics::Metrics;
use crate::wasm::WasmEngine;
use crate::wasm::nodefs::NodeFilesystems;
use crate::wasm::reload::{self, Loader};

/// Runs until SIGTERM or SIGINT, then stops taking work and exits once in-flight work is done.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    // Refused before anything starts: a bad value is named at once, not after guests compiled.
    let settings = args.settings()?;
    match crate::wasm::sandbox_fs::raise_nofile_limit() {
        Ok((before, after)) if before != after => {
            tracing::info!(
                ?before,
                ?after,
                "open-file limit (RLIMIT_NOFILE) raised to its hard limit"
            )
        }
        Ok((limit, _)) => {
            tracing::info!(
                ?limit,
                "open-file limit (RLIMIT_NOFILE) already at its hard limit"
            )
        }
        Err(error) => tracing::warn!(%error, "cannot raise the open-file limit (RLIMIT_NOFILE)"),
    }
    let metrics = Metrics::new();
    if let Some(address) = args.metrics.metrics_address {
        // Up before the guests load, so liveness answers while readiness still says no.
        let server =
            http::Server::bind(address, &args.metrics.metrics_path, metrics.clone()).await?;
        tracing::info!(address = ?server.local_addr(), path = %args.metrics.metrics_path, "serving metrics, /healthz and /readyz");
        tokio::spawn(server.run());
    }
    let engine = WasmEngine::with_options(&args.engine_options())?
        .with_metrics(metrics.clone())
        .with_node_filesystems(NodeFilesystems::probe(&args.guests.kubelet_dir));
    if let Some(cache) = engine.module_cache() {
        cache.check_separate_from(&args.guests.plugins)?;
    }
    // The first scan compiles nothing: guests in the module cache serve at once, the rest are
    // compiled in the background (one at a time) and serve as each is ready.
    let mut loader = Loader::new(engine.clone(), args.guests.plugins.clone())
        .compiling_in_background()
        .context("cannot start the compiler thread")?;
    let (loader, scan) = tokio::task::spawn_blocking(move || {
        let scan = loader.scan();
        (loader, scan)
    })
    .await?;
    let plugins = scan?.plugins;
    tracing::info!(
        guests = plugins.len(),
        compiling = plugins.compiling(),
        serving_ms = started.elapsed().as_millis() as u64,
        "plugins serving"
    );
    let mut tried = PluginsTried::new(started, engine.clone());
    tried.note(&plugins);
    if plugins.is_empty() && plugins.compiling() == 0 {
        tracing::warn!(dir = %args.guests.plugins.display(), "no guest loaded yet; the directory is watched");
    }
    let stats = loader.stats();
    let plugin_totals = move || {
        let c = stats.counts();
        [c.loads, c.reloads, c.rejections, c.unloads]
    };
    metrics.plugin_counts(plugin_totals());
    let (plugins_tx, plugins_rx) = tokio::sync::watch::channel(Arc::new(plugins));
    let reload_metrics = metrics.clone();
    let _watcher = reload::watch(loader, args.watch_options(), move |plugins| {
        reload_metrics.plugin_counts(plugin_totals());
        tried.note(&plugins);
        let _ = plugins_tx.send(plugins);
    })
    .context("cannot start watching the plugins directory")?;
    start_fetcher(&args)?;
    let client = client(args.api.kubeconfig.as_deref()).await?;
    controller::run_watching(client, plugins_rx, settings, metrics, shutdown_signal()).await
}

/// Fetches the modules of grants naming a `[module] source`, supervised: a pass that panics is
/// logged and the fetcher starts again. A pass reads the grant files only, so it costs nothing
/// when no grant names a source.
fn start_fetcher(args: &RunArgs) -> anyhow::Result<()> {
    let dir = args.guests.plugins.clone();
    let every = args.guests.fetch_interval;
    let registry_args = args.registry.clone();
    // Checked at start: a bad --ca-file or --registry-config is named now, not at first fetch.
    crate::oci::commands::registry(&registry_args)?;
    tokio::spawn(async move {
        loop {
            let registry = match crate::oci::commands::registry(&registry_args) {
                Ok(registry) => registry,
                Err(error) => {
                    tracing::error!(%error, "cannot build the registry client; module fetches stop");
                    return;
                }
            };
            let fetcher = crate::oci::fetch::Fetcher::new(dir.clone(), registry);
            match tokio::spawn(fetcher.run(every)).await {
                Ok(()) => return,
                Err(error) => {
                    tracing::error!(%error, "the module fetcher stopped; starting it again");
                    tokio::time::sleep(every).await;
                }
            }
        }
    });
    Ok(())
}

/// Logs `plugins ready` once every module found at start was tried once (served or refused),
/// however long the slowest compile took: `ready_ms` is the time to that point, and the guests
/// served before it did not wait for it.
struct PluginsTried {
    started: Instant,
    engine: WasmEngine,
    logged: bool,
}

impl PluginsTried {
    fn new(started: Instant, engine: WasmEngine) -> PluginsTried {
        PluginsTried {
            started,
            engine,
            logged: false,
        }
    }

    fn note(&mut self, plugins: &crate::wasm::Plugins) {
        if self.logged || plugins.compiling() > 0 {
            return;
        }
        self.logged = true;
        let cache = self.engine.module_cache().map(|c| {
            use std::sync::atomic::Ordering::Relaxed;
            (
                c.stats.hits.load(Relaxed),
                c.stats.misses.load(Relaxed) + c.stats.stale.load(Relaxed),
                c.stats.refusal_hits.load(Relaxed),
            )
        });
        tracing::info!(
            guests = plugins.len(),
            problems = plugins.problems.len(),
            ready_ms = self.started.elapsed().as_millis() as u64,
            pooling = self.engine.pooling(),
            cache_hits = cache.map(|c| c.0),
            cache_misses = cache.map(|c| c.1),
            refused_before = cache.map(|c| c.2),
            "plugins ready"
        );
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received; finishing in-flight work"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; finishing in-flight work"),
    }
}

/// The API client: from `kubeconfig`, or in-cluster / ~/.kube/config.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}
