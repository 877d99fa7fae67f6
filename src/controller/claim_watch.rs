//! The watch behind the claim cache, and what that cache keeps of each claim: a claim that may
//! need work from us whole; a settled claim (bound, no finalizer of ours) not at all; and a
//! foreign claim (unbound, of a provisioner no loaded guest knows) not at all either, its
//! provisioner's name noted, so that a plugins reload that serves the name re-lists the claims
//! and brings them back whole.
//!
//! Neither needs more: no path reads a claim that is not in the cache except by asking the API
//! server (intent recovery, before it deletes anything). A foreign claim becomes ours only when
//! its storage-provisioner annotation (GA or beta) names a served provisioner: either the
//! annotation changes (set later, or rewritten by kube-controller-manager for a class created
//! or changed), which is an update whose watch event carries the whole claim, kept whole now; or
//! a reload serves the name it has, which re-lists. A reload that serves nothing noted costs no
//! request; one that does costs one LIST of the claims (kube-runtime's watcher then replaces the
//! cache at once, and every unsettled claim it lists is reconciled).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::Api;
use kube::runtime::reflector::store::Writer;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;

use super::cache::claim_settled;
use super::decide::{self, FINALIZER_CLAIM, has_finalizer};
use super::slim::slim;
use crate::wasm::{Availability, Plugins};

/// What the claim cache does with a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Cached whole: it may need work from us.
    Whole,
    /// Left out: bound, and no finalizer of ours.
    Settled,
    /// Left out: unbound, of a provisioner no loaded guest knows; its name is noted.
    Foreign,
}

/// Distinct foreign provisioner names noted at most; past it, every reload re-lists.
const FOREIGN_NAMES: usize = 64;

/// The provisioner names of the foreign claims left out since the last re-list.
#[derive(Debug, Default)]
struct Noted {
    names: BTreeSet<String>,
    overflowed: bool,
}

/// Decides what the claim cache keeps, against the plugins as they are now, and remembers which
/// provisioners it left claims out for.
pub struct ClaimKeeping {
    whole: bool,
    plugins: watch::Receiver<Arc<Plugins>>,
    noted: Mutex<Noted>,
}

impl ClaimKeeping {
    /// Keeping for the plugins sent on `plugins`; `whole` keeps every claim whole
    /// (`--cache-whole-objects`).
    pub fn new(whole: bool, plugins: watch::Receiver<Arc<Plugins>>) -> ClaimKeeping {
        ClaimKeeping {
            whole,
            plugins,
            noted: Mutex::default(),
        }
    }

    /// What the cache does with `pvc`; a foreign claim's provisioner is noted.
    pub fn keep(&self, pvc: &PersistentVolumeClaim) -> Kept {
        if self.whole {
            return Kept::Whole;
        }
        if claim_settled(pvc) {
            return Kept::Settled;
        }
        // Under the lock, so that a reload's check (also under it) either sees this name or
        // happened before it and left the plugins this decision reads.
        let mut noted = self.noted.lock().expect("lock");
        let Some(provisioner) = foreign_provisioner(pvc, &self.plugins.borrow()) else {
            return Kept::Whole;
        };
        if !noted.names.contains(provisioner) {
            if noted.names.len() < FOREIGN_NAMES {
                noted.names.insert(provisioner.to_string());
            } else {
                noted.overflowed = true;
            }
        }
        Kept::Foreign
    }

    /// Whether the plugins as they are now know a provisioner whose claims were left out: then
    /// the claims must be listed again. Forgets the names (the re-list notes them anew).
    pub fn served_again(&self) -> bool {
        let mut noted = self.noted.lock().expect("lock");
        let plugins = self.plugins.borrow();
        let again = noted.overflowed
            || noted
                .names
                .iter()
                .any(|name| !matches!(plugins.availability(name), Availability::Unknown));
        if again {
            *noted = Noted::default();
        }
        again
    }

    /// How many provisioner names are noted (for tests and logs).
    pub fn noted(&self) -> usize {
        self.noted.lock().expect("lock").names.len()
    }

    /// The watcher event as the cache should apply it: a claim left out is dropped from a list,
    /// and an update that leaves a claim out removes it (it may have been cached before).
    fn event(
        &self,
        event: watcher::Event<PersistentVolumeClaim>,
    ) -> Option<watcher::Event<PersistentVolumeClaim>> {
        match event {
            watcher::Event::InitApply(claim) if self.keep(&claim) != Kept::Whole => None,
            // Not an applied object, so no reconcile either.
            watcher::Event::Apply(claim) if self.keep(&claim) != Kept::Whole => {
                Some(watcher::Event::Delete(claim))
            }
            other => Some(other),
        }
    }
}

/// The provisioner of a claim no loaded guest knows (neither served nor unavailable), when the
/// claim is unbound and holds no finalizer of ours: nothing of ours can act on it. A claim with
/// no provisioner annotation yet is not foreign: the annotation is still to come.
pub fn foreign_provisioner<'a>(
    pvc: &'a PersistentVolumeClaim,
    plugins: &Plugins,
) -> Option<&'a str> {
    let bound = pvc
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .is_some_and(|v| !v.is_empty());
    if bound || has_finalizer(&pvc.metadata.finalizers, FINALIZER_CLAIM) {
        return None;
    }
    let provisioner = decide::claim_provisioner(pvc)?;
    matches!(plugins.availability(provisioner), Availability::Unknown).then_some(provisioner)
}

/// The watch behind the claim cache (see the module docs): slimmed claims, the settled and the
/// foreign left out, and a fresh LIST whenever a reload serves a provisioner of claims left out.
/// Yields the claims to reconcile.
pub fn claim_watch(
    api: Api<PersistentVolumeClaim>,
    writer: Writer<PersistentVolumeClaim>,
    keeping: Arc<ClaimKeeping>,
) -> impl Stream<Item = Result<PersistentVolumeClaim, watcher::Error>> + Send + 'static {
    let relists = relist_ticks(keeping.clone());
    restarting(
        move || {
            crate::controller::relist::watcher(api.clone(), watcher::Config::default())
                .default_backoff()
                .boxed()
        },
        relists,
    )
    .modify(slim)
    .try_filter_map(move |event| futures::future::ready(Ok(keeping.event(event))))
    .reflect(writer)
    .applied_objects()
}

/// One tick per plugins change that serves a provisioner whose claims were left out.
fn relist_ticks(keeping: Arc<ClaimKeeping>) -> impl Stream<Item = ()> + Send + 'static {
    let changes = keeping.plugins.clone();
    futures::stream::unfold((keeping, changes), |(keeping, mut changes)| async move {
        loop {
            changes.changed().await.ok()?;
            changes.borrow_and_update();
            if keeping.served_again() {
                tracing::info!("a reload serves claims the cache left out: listing claims again");
                return Some(((), (keeping, changes)));
            }
        }
    })
}

/// The stream `start()` makes, started again from scratch at every tick of `restarts`.
fn restarting<S, T>(
    start: impl Fn() -> S + Send + 'static,
    restarts: impl Stream<Item = ()> + Send + 'static,
) -> impl Stream<Item = T> + Send + 'static
where
    S: Stream<Item = T> + Send + Unpin + 'static,
    T: Send + 'static,
{
    let current = start();
    let restarts = restarts.fuse().boxed();
    futures::stream::unfold(
        (start, current, restarts),
        |(start, mut current, mut restarts)| async move {
            loop {
                tokio::select! {
                    biased;
                    Some(()) = restarts.next() => current = start(),
                    item = current.next() => return Some((item?, (start, current, restarts))),
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use serde_json::json;

    fn claim(
        provisioner: Option<&str>,
        volume: Option<&str>,
        finalizers: &[&str],
    ) -> PersistentVolumeClaim {
        let annotations = provisioner
            .map(|p| json!({"volume.kubernetes.io/storage-provisioner": p}))
            .unwrap_or(json!({}));
        serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "n", "uid": "u", "finalizers": finalizers,
                         "annotations": annotations},
            "spec": {"volumeName": volume, "storageClassName": "other"},
        }))
        .expect("claim")
    }

    #[test]
    fn foreign_means_unbound_of_an_unknown_provisioner_without_our_finalizer() {
        let plugins = Plugins::default();
        let cases = [
            (
                "unbound, unknown provisioner",
                claim(Some("x.io/p"), None, &[]),
                true,
            ),
            ("no annotation yet", claim(None, None, &[]), false),
            ("bound", claim(Some("x.io/p"), Some("pv"), &[]), false),
            (
                "our finalizer",
                claim(Some("x.io/p"), None, &[FINALIZER_CLAIM]),
                false,
            ),
            (
                "another finalizer",
                claim(Some("x.io/p"), None, &["kubernetes.io/pvc-protection"]),
                true,
            ),
        ];
        for (what, pvc, want) in cases {
            assert_eq!(
                foreign_provisioner(&pvc, &plugins).is_some(),
                want,
                "{what}"
            );
        }
    }

    #[test]
    fn a_reload_of_unrelated_plugins_never_relists_and_overflow_always_does() {
        let (tx, rx) = watch::channel(Arc::new(Plugins::default()));
        let keeping = ClaimKeeping::new(false, rx);
        assert_eq!(
            keeping.keep(&claim(Some("x.io/p"), None, &[])),
            Kept::Foreign
        );
        assert_eq!(keeping.keep(&claim(None, None, &[])), Kept::Whole);
        assert_eq!(
            keeping.keep(&claim(Some("x.io/p"), Some("pv"), &[])),
            Kept::Settled
        );
        assert_eq!(keeping.noted(), 1);
        tx.send(Arc::new(Plugins::default())).expect("send");
        assert!(!keeping.served_again(), "still unknown: no re-list");
        let gone = [("x.io/p".to_string(), "unloaded".to_string())].into();
        tx.send(Arc::new(Plugins::new(Default::default(), Vec::new(), gone)))
            .expect("send");
        assert!(
            keeping.served_again(),
            "known again (even if unavailable): re-list"
        );
        tx.send(Arc::new(Plugins::default())).expect("send");
        for n in 0..=FOREIGN_NAMES {
            keeping.keep(&claim(Some(&format!("x.io/p{n}")), None, &[]));
        }
        assert!(keeping.served_again(), "too many names to tell: re-list");
        assert_eq!(keeping.noted(), 0, "a re-list notes them anew");
        assert!(!keeping.served_again());

        let whole = ClaimKeeping::new(true, watch::channel(Arc::new(Plugins::default())).1);
        assert_eq!(whole.keep(&claim(Some("x.io/p"), None, &[])), Kept::Whole);
    }

    #[tokio::test]
    async fn restarting_starts_the_stream_again_at_each_tick() {
        let (tick, ticks) = futures::channel::mpsc::unbounded::<()>();
        let starts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = starts.clone();
        let mut stream = Box::pin(restarting(
            move || {
                let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                futures::stream::iter([n * 10, n * 10 + 1])
                    .chain(futures::stream::pending())
                    .boxed()
            },
            ticks,
        ));
        assert_eq!(stream.next().await, Some(0));
        assert_eq!(stream.next().await, Some(1));
        tick.unbounded_send(()).expect("tick");
        assert_eq!(stream.next().await, Some(10), "started again");
        assert_eq!(stream.next().await, Some(11));
        assert_eq!(starts.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
}
