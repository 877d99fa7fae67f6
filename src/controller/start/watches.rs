//! The watches behind the controllers' caches: every object slimmed, settled objects kept as
//! their identity or dropped (see [`super::super::cache`]), the served-path index fed from PVs;
//! the node watch of node mode; and the tick streams that re-run every object.

use std::time::Duration;

use futures::StreamExt;
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

use crate::controller::cache::{Cached, CachedVolume};
use crate::controller::node;
use crate::controller::slim::slim;

/// Node mode: checks this node exists (a mistyped `--node-name` would otherwise serve nothing,
/// silently), then caches node metadata; the stream ticks when a node is deleted. The watch task
/// is returned for the caller to supervise.
pub(super) async fn watch_nodes(
    client: &Client,
    settings: &node::NodeSettings,
) -> anyhow::Result<(
    node::NodeState,
    impl futures::Stream<Item = ()> + Send + 'static,
    tokio::task::JoinHandle<()>,
)> {
    use k8s_openapi::api::core::v1::Node;
    let api: Api<Node> = Api::all(client.clone());
    match api.get_metadata_opt(&settings.name).await {
        Ok(Some(_)) => {}
        Ok(None) => anyhow::bail!(
            "node {:?} does not exist: --node-name (or NODE_NAME) must name this instance's node",
            settings.name
        ),
        Err(error) => {
            return Err(anyhow::Error::new(error).context(format!(
                "cannot read node {:?} (RBAC: get nodes)",
                settings.name
            )));
        }
    }
    let (nodes, writer) = reflector::store();
    let (deleted_tx, deleted_rx) = futures::channel::mpsc::unbounded::<()>();
    // Metadata only: node status (conditions, images, addresses) is most of a Node's bytes and
    // churn, and node mode needs names and the hostname label.
    let meta: Api<kube::core::PartialObjectMeta<Node>> = Api::all(client.clone());
    let node_watch = crate::controller::relist::watcher(meta, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .for_each(move |event| {
            match event {
                Ok(watcher::Event::Delete(_) | watcher::Event::InitDone) => {
                    let _ = deleted_tx.unbounded_send(());
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "watching nodes failed (RBAC: list, watch nodes)");
                }
            }
            futures::future::ready(())
        });
    let watch = tokio::spawn(node_watch);
    tokio::time::timeout(Duration::from_secs(60), nodes.wait_until_ready())
        .await
        .map_err(|_| {
            anyhow::anyhow!("Node cache did not sync within 60 s (RBAC: list, watch nodes)")
        })??;
    tracing::info!(node = %settings.name, "node deployment: serving this node's claims and volumes");
    Ok((
        node::NodeState::new(settings.clone(), nodes),
        deleted_rx,
        watch,
    ))
}

/// One tick per plugins reload.
pub(super) fn reload_ticks(
    reloaded: tokio::sync::watch::Receiver<u64>,
) -> impl futures::Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(reloaded, |mut reloaded| async move {
        reloaded.changed().await.ok()?;
        Some(((), reloaded))
    })
}

pub(super) fn resync_ticks(period: Duration) -> impl futures::Stream<Item = ()> + Send + 'static {
    let start = tokio::time::Instant::now() + period;
    futures::stream::unfold(
        tokio::time::interval_at(start, period),
        |mut interval| async move {
            interval.tick().await;
            Some(((), interval))
        },
    )
}

/// The watch behind a controller's cache: every object slimmed, and settled down to its identity
/// when `settled` says it needs no work (see [`cache`]).
pub(super) fn cached_watch<K>(
    api: Api<Cached<K>>,
    writer: reflector::store::Writer<Cached<K>>,
    settled: impl Fn(&K) -> bool + Send + 'static,
    storage: impl Fn(&K) -> Option<u64> + Send + 'static,
    observe: impl Fn(&watcher::Event<Cached<K>>) + Send + 'static,
) -> impl futures::Stream<Item = Result<Cached<K>, watcher::Error>> + Send + 'static
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    use futures::TryStreamExt;
    crate::controller::relist::watcher(api, watcher::Config::default())
        .default_backoff()
        .inspect_ok(move |event| observe(event))
        .modify(move |cached| {
            cached.settle(&settled, &storage);
            slim(cached);
        })
        .reflect(writer)
        .applied_objects()
}

/// Every PV's node path, whole as the watch delivers it, into the index of served paths that
/// keeps guests from nesting volumes or moving a served directory (`crate::wasm::served`).
pub(super) fn served_paths(event: &watcher::Event<CachedVolume>) {
    let served = crate::wasm::served::served();
    match event {
        watcher::Event::Apply(pv) | watcher::Event::InitApply(pv) => {
            if let Some(pv) = pv.whole() {
                served.note(pv);
            }
        }
        watcher::Event::Delete(pv) => served.release(&kube::ResourceExt::name_any(pv)),
        watcher::Event::Init | watcher::Event::InitDone => {}
    }
}
