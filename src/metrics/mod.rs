//! Prometheus metrics in one registry: the Go library's series, work queues, leadership, guests.
//!
//! The provision/delete series keep the exact names and labels of
//! `sig-storage-lib-external-provisioner` (`controller/metrics/metrics.go`), so dashboards built
//! for it keep working. The work-queue and leader series follow `k8s.io/component-base`'s names.
//! A [`Metrics`] handle is cheap to clone and is passed down (controller context, wasm engine);
//! nothing here is global, so tests can read a private registry.

mod series;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use series::{
    CallDurationLabels, CallLabels, ClaimLabels, ErrorLabels, FaultLabels, LeaderLabels,
    PluginEventLabels, PluginWarningLabels, QueueLabels, Series, VolumeLabels,
};

/// Which work queue a series is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queue {
    /// The provision path, keyed by claim.
    Claims,
    /// The delete path, keyed by PV name.
    Volumes,
}

impl Queue {
    fn as_str(self) -> &'static str {
        match self {
            Queue::Claims => "claims",
            Queue::Volumes => "volumes",
        }
    }
}

/// The series and what the handle keeps beside them.
struct Inner {
    series: Series,
    /// Keys with a retry scheduled, per queue: the part of the queue we can observe.
    waiting: Mutex<[HashSet<String>; 2]>,
    plugin_counts_seen: Mutex<[u64; 4]>,
    ready: AtomicBool,
}

/// The metrics handle: clone it freely; all clones share one registry.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// A fresh registry with every series registered.
    pub fn new() -> Metrics {
        Metrics {
            inner: Arc::new(Inner {
                series: Series::register(),
                waiting: Mutex::new([HashSet::new(), HashSet::new()]),
                plugin_counts_seen: Mutex::new([0; 4]),
                ready: AtomicBool::new(false),
            }),
        }
    }

    /// The exposition text (OpenMetrics text format).
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.inner.series.registry);
        text
    }

    /// A claim was provisioned: the PV exists.
    pub fn provision_succeeded(&self, class: &str, source: &str, took: Duration) {
        let labels = ClaimLabels {
            class: class.into(),
            source: source.into(),
        };
        self.inner
            .series
            .provision_total
            .get_or_create(&labels)
            .inc();
        self.inner
            .series
            .provision_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// A provision attempt failed with an error of kind `kind`.
    pub fn provision_failed(&self, class: &str, source: &str, kind: &str) {
        let labels = ClaimLabels {
            class: class.into(),
            source: source.into(),
        };
        self.inner
            .series
            .provision_failed_total
            .get_or_create(&labels)
            .inc();
        self.reconcile_error(Queue::Claims, kind);
    }

    /// A volume's storage and PV were deleted.
    pub fn delete_succeeded(&self, class: &str, took: Duration) {
        let labels = VolumeLabels {
            class: class.into(),
        };
        self.inner.series.delete_total.get_or_create(&labels).inc();
        self.inner
            .series
            .delete_duration
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// A delete attempt failed with an error of kind `kind`.
    pub fn delete_failed(&self, class: &str, kind: &str) {
        let labels = VolumeLabels {
            class: class.into(),
        };
        self.inner
            .series
            .delete_failed_total
            .get_or_create(&labels)
            .inc();
        self.reconcile_error(Queue::Volumes, kind);
    }

    /// A claim's volume was grown.
    pub fn expand_succeeded(&self, class: &str) {
        let labels = VolumeLabels {
            class: class.into(),
        };
        self.inner.series.expand_total.get_or_create(&labels).inc();
    }

    /// An attempt to grow a claim's volume failed with an error of kind `kind`.
    pub fn expand_failed(&self, class: &str, kind: &str) {
        let labels = VolumeLabels {
            class: class.into(),
        };
        self.inner
            .series
            .expand_failed_total
            .get_or_create(&labels)
            .inc();
        self.reconcile_error(Queue::Claims, kind);
    }

    fn reconcile_error(&self, queue: Queue, kind: &str) {
        self.inner
            .series
            .reconcile_errors
            .get_or_create(&ErrorLabels {
                controller: queue.as_str().into(),
                kind: kind.into(),
            })
            .inc();
    }

    /// A reconcile of `key` starts; the returned guard records its duration when dropped.
    pub fn reconcile_started(&self, queue: Queue, key: &str) -> ReconcileGuard {
        let labels = QueueLabels::of(queue);
        self.inner.series.queue_adds.get_or_create(&labels).inc();
        self.inner.series.in_flight.get_or_create(&labels).inc();
        let mut waiting = self.inner.waiting.lock().expect("metrics lock");
        if waiting[queue as usize].remove(key) {
            self.inner.series.queue_depth.get_or_create(&labels).dec();
        }
        ReconcileGuard {
            metrics: self.clone(),
            labels,
            started: std::time::Instant::now(),
        }
    }

    /// A retry of `key` was scheduled after a failure.
    pub fn retry_scheduled(&self, queue: Queue, key: &str) {
        let labels = QueueLabels::of(queue);
        self.inner.series.queue_retries.get_or_create(&labels).inc();
        self.parked(queue, key);
    }

    /// `key` waits in a queue of ours (parked for a turn, or for a retry): counted in
    /// the depth until its next reconcile starts.
    pub fn parked(&self, queue: Queue, key: &str) {
        let mut waiting = self.inner.waiting.lock().expect("metrics lock");
        if waiting[queue as usize].insert(key.to_string()) {
            self.inner
                .series
                .queue_depth
                .get_or_create(&QueueLabels::of(queue))
                .inc();
        }
    }

    /// Drops waiting keys (a retry, or parked) of objects that no longer exist: their next
    /// reconcile never comes.
    pub fn retain_waiting(&self, queue: Queue, alive: impl Fn(&str) -> bool) {
        let labels = QueueLabels::of(queue);
        let mut waiting = self.inner.waiting.lock().expect("metrics lock");
        let before = waiting[queue as usize].len();
        waiting[queue as usize].retain(|key| alive(key));
        let gone = before - waiting[queue as usize].len();
        if gone > 0 {
            self.inner
                .series
                .queue_depth
                .get_or_create(&labels)
                .dec_by(i64::try_from(gone).unwrap_or(i64::MAX));
        }
    }

    /// Keys waiting in `queue`: a retry scheduled, or parked for a turn (`workqueue_depth`).
    pub fn waiting(&self, queue: Queue) -> usize {
        self.inner.waiting.lock().expect("metrics lock")[queue as usize].len()
    }

    /// Retries scheduled in `queue` so far (`workqueue_retries_total`).
    pub fn retries(&self, queue: Queue) -> u64 {
        let labels = QueueLabels::of(queue);
        self.inner.series.queue_retries.get_or_create(&labels).get()
    }

    /// Whether this replica leads (`lease` = the lease name). For the leader-election module.
    pub fn leader(&self, lease: &str, leading: bool) {
        self.inner
            .series
            .leader
            .get_or_create(&LeaderLabels { name: lease.into() })
            .set(i64::from(leading));
    }

    /// The plugins loader's running totals (loads, reloads, rejections, unloads); counters
    /// advance by what changed since the last call.
    pub fn plugin_counts(&self, totals: [u64; 4]) {
        let mut seen = self
            .inner
            .plugin_counts_seen
            .lock()
            .expect("plugin counts lock");
        for (i, event) in ["load", "reload", "rejection", "unload"]
            .into_iter()
            .enumerate()
        {
            let delta = totals[i].saturating_sub(seen[i]);
            if delta > 0 {
                self.inner
                    .series
                    .plugin_events
                    .get_or_create(&PluginEventLabels { event })
                    .inc_by(delta);
            }
            seen[i] = seen[i].max(totals[i]);
        }
    }

    /// A guest was loaded (or reloaded) despite `warning` about its grant.
    pub fn plugin_warning(&self, guest: &str, warning: &'static str) {
        self.inner
            .series
            .plugin_warnings
            .get_or_create(&PluginWarningLabels {
                guest: guest.to_string(),
                warning,
            })
            .inc();
    }

    /// How many guests serve now (set on load and reload).
    pub fn guests_loaded(&self, count: usize) {
        self.inner
            .series
            .guests_loaded
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// How many modules wait for their compile (set on load and reload).
    pub fn guests_compiling(&self, count: usize) {
        self.inner
            .series
            .guests_compiling
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// One guest call finished. `outcome` is `ok`, a typed error or a fault kind; `fault` is
    /// set when the call trapped.
    pub fn guest_call(
        &self,
        guest: &str,
        operation: &str,
        outcome: &str,
        fault: bool,
        took: Duration,
    ) {
        self.inner
            .series
            .guest_calls
            .get_or_create(&CallLabels {
                guest: guest.into(),
                operation: operation.into(),
                outcome: outcome.into(),
            })
            .inc();
        self.inner
            .series
            .guest_call_duration
            .get_or_create(&CallDurationLabels {
                guest: guest.into(),
                operation: operation.into(),
            })
            .observe(took.as_secs_f64());
        if fault {
            self.inner
                .series
                .guest_faults
                .get_or_create(&FaultLabels {
                    guest: guest.into(),
                    kind: outcome.into(),
                })
                .inc();
        }
    }

    /// Marks the process ready (caches synced, guests loaded) or not.
    pub fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::SeqCst);
    }

    /// Whether `/readyz` answers 200.
    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst)
    }
}

/// Records a reconcile's duration and in-flight count when it ends (also on cancellation).
pub struct ReconcileGuard {
    metrics: Metrics,
    labels: QueueLabels,
    started: std::time::Instant,
}

impl ReconcileGuard {
    /// Time since the reconcile started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for ReconcileGuard {
    fn drop(&mut self) {
        let inner = &self.metrics.inner;
        inner.series.in_flight.get_or_create(&self.labels).dec();
        inner
            .series
            .queue_work_duration
            .get_or_create(&self.labels)
            .observe(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(prefix))
    }

    #[test]
    fn library_series_keep_their_go_names_and_labels() {
        let m = Metrics::new();
        m.provision_succeeded("fast", "", Duration::from_millis(30));
        m.provision_failed("fast", "PersistentVolumeClaim", "final");
        m.delete_succeeded("fast", Duration::from_millis(20));
        m.delete_failed("slow", "api");
        let text = m.encode();
        assert_eq!(
            line(&text, "controller_persistentvolumeclaim_provision_total{"),
            Some(r#"controller_persistentvolumeclaim_provision_total{class="fast",source=""} 1"#)
        );
        assert!(text.contains(r#"controller_persistentvolumeclaim_provision_failed_total{class="fast",source="PersistentVolumeClaim"} 1"#), "{text}");
        assert!(text.contains(r#"controller_persistentvolumeclaim_provision_duration_seconds_bucket{le="0.05",class="fast",source=""} 1"#), "{text}");
        assert!(text.contains(r#"controller_persistentvolume_delete_total{class="fast"} 1"#));
        assert!(
            text.contains(r#"controller_persistentvolume_delete_failed_total{class="slow"} 1"#)
        );
        assert!(text.contains(
            r#"controller_persistentvolume_delete_duration_seconds_count{class="fast"} 1"#
        ));
        assert!(text.contains(
            r#"wasm_provisioner_reconcile_errors_total{controller="claims",kind="final"} 1"#
        ));
        assert!(text.contains(
            r#"wasm_provisioner_reconcile_errors_total{controller="volumes",kind="api"} 1"#
        ));
    }

    #[test]
    fn depth_counts_each_waiting_key_once_until_it_runs() {
        let m = Metrics::new();
        m.retry_scheduled(Queue::Claims, "a");
        m.retry_scheduled(Queue::Claims, "a");
        m.retry_scheduled(Queue::Claims, "b");
        assert!(m.encode().contains(r#"workqueue_depth{name="claims"} 2"#));
        assert!(
            m.encode()
                .contains(r#"workqueue_retries_total{name="claims"} 3"#)
        );
        {
            let _guard = m.reconcile_started(Queue::Claims, "a");
            let text = m.encode();
            assert!(
                text.contains(r#"workqueue_depth{name="claims"} 1"#),
                "{text}"
            );
            assert!(text.contains(r#"wasm_provisioner_reconciles_in_flight{name="claims"} 1"#));
        }
        let text = m.encode();
        assert!(text.contains(r#"wasm_provisioner_reconciles_in_flight{name="claims"} 0"#));
        assert!(text.contains(r#"workqueue_adds_total{name="claims"} 1"#));
        assert!(text.contains(r#"workqueue_work_duration_seconds_count{name="claims"} 1"#));
    }

    #[test]
    fn guest_calls_faults_leader_and_readiness() {
        let m = Metrics::new();
        m.guest_call(
            "hostpath",
            "provision",
            "ok",
            false,
            Duration::from_millis(2),
        );
        m.guest_call(
            "hostpath",
            "provision",
            "deadline",
            true,
            Duration::from_secs(1),
        );
        m.leader("wasm-provisioner", true);
        m.guests_loaded(2);
        let text = m.encode();
        assert!(text.contains(r#"wasm_provisioner_guest_calls_total{guest="hostpath",operation="provision",outcome="ok"} 1"#));
        assert!(text.contains(
            r#"wasm_provisioner_guest_faults_total{guest="hostpath",kind="deadline"} 1"#
        ));
        assert!(text.contains(r#"wasm_provisioner_guest_call_duration_seconds_count{guest="hostpath",operation="provision"} 2"#));
        assert!(text.contains(r#"leader_election_master_status{name="wasm-provisioner"} 1"#));
        assert!(text.contains("wasm_provisioner_guests_loaded 2"));
        assert!(!m.is_ready());
        m.set_ready(true);
        assert!(m.is_ready());
    }
}
