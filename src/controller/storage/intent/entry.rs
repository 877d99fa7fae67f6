//! What one intent-log entry says, bounded in bytes: a claim whose guest is called (and, once it
//! returned, what it built), or a Released PV deleted ahead of its storage (and, once our own
//! DELETE of it succeeded, what deleting that storage needs). Pure: no I/O.

use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::ObjectMeta;
use serde::{Deserialize, Serialize};

/// One entry of the log, keyed by the claim's or the PV's UID.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Intent {
    /// A claim's guest is about to be called, or was.
    Claim(ClaimIntent),
    /// A Released PV is about to be deleted ahead of its storage, or was.
    Volume(VolumeIntent),
}

/// A claim whose guest is called. Only names: no labels, annotations or spec, so its size does
/// not depend on what a user writes into the claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClaimIntent {
    /// The provisioner (which guest).
    pub provisioner: String,
    /// The PV name (from the claim UID).
    pub pv: String,
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// Recorded ahead of its turn (it rode on another claim's write): its guest has not been
    /// called. Its turn rewrites the entry without this mark, and that write succeeds before the
    /// guest is called, so a stored entry that carries it stands for no storage at all. Entries
    /// of earlier versions lack it: they are taken as called.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ahead: bool,
    /// What the guest built, recorded once it returned: the only storage recovery ever deletes
    /// for a claim that is gone (a guest is never asked again to find out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub built: Option<Storage>,
    /// Failed cleanups so far.
    #[serde(default, skip_serializing_if = "Retries::is_clean")]
    pub retries: Retries,
}

/// A Released PV deleted ahead of its storage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeIntent {
    /// The provisioner (which guest).
    pub provisioner: String,
    /// The PV name.
    pub pv: String,
    /// The resourceVersion the decision was made on: the DELETE's precondition.
    pub version: String,
    /// Set once our own DELETE of that PV (that UID, that version: Released, policy Delete)
    /// succeeded, with what deleting its storage needs. Without it the entry never deletes
    /// anything: it was recorded ahead, or the process stopped before it knew.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleted: Option<Storage>,
    /// Failed storage deletes so far.
    #[serde(default, skip_serializing_if = "Retries::is_clean")]
    pub retries: Retries,
}

/// Storage as a guest's delete request reads it: the PV (identity, guest-set labels and
/// annotations, spec; no status) and its class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Storage {
    /// The PV as built or as deleted.
    pub volume: PersistentVolume,
    /// Its class, when it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<StorageClass>,
}

/// The handle of a storage delete that keeps failing: how often, why, and whether it stopped.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Retries {
    /// Failed attempts.
    #[serde(default)]
    pub attempts: u32,
    /// The last error (truncated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// No more attempts (`--failed-delete-threshold` reached): an operator decides
    /// (`wasm-provisioner forget-storage`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub given_up: bool,
}

impl Retries {
    fn is_clean(&self) -> bool {
        *self == Retries::default()
    }

    /// Counts one more failure; gives up at `threshold` (0: never).
    pub fn failed(&mut self, error: &str, threshold: u32) {
        self.attempts = self.attempts.saturating_add(1);
        self.error = Some(truncate(error, MAX_ERROR_BYTES));
        self.given_up = threshold > 0 && self.attempts >= threshold;
    }
}

/// Bytes of an error message kept in an entry.
const MAX_ERROR_BYTES: usize = 512;

/// Bytes one entry may take. A claim or an ahead volume entry is a few hundred bytes; one that
/// carries storage holds a PV spec and a class, which users cannot inflate beyond what the
/// guest and the class author wrote.
pub const MAX_ENTRY_BYTES: usize = 16 * 1024;

/// Bytes all entries of one log may take (a ConfigMap holds at most 1 MiB).
pub const MAX_LOG_BYTES: usize = 768 * 1024;

impl Intent {
    /// A claim about to be handed to its guest.
    pub fn claim(provisioner: &str, pv: &str, namespace: &str, name: &str) -> Intent {
        Intent::Claim(ClaimIntent {
            provisioner: provisioner.to_string(),
            pv: pv.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            ahead: false,
            built: None,
            retries: Retries::default(),
        })
    }

    /// A Released PV about to be deleted ahead of its storage (no storage: it cannot delete).
    pub fn volume(provisioner: &str, pv: &PersistentVolume) -> Intent {
        Intent::Volume(VolumeIntent {
            provisioner: provisioner.to_string(),
            pv: pv.metadata.name.clone().unwrap_or_default(),
            version: pv.metadata.resource_version.clone().unwrap_or_default(),
            deleted: None,
            retries: Retries::default(),
        })
    }

    /// Whether this is a claim entry recorded ahead of its turn: its guest was never called.
    pub fn is_ahead(&self) -> bool {
        matches!(self, Intent::Claim(claim) if claim.ahead)
    }

    /// The same entry marked as recorded ahead of its turn (claims; a volume entry is as it is).
    pub fn marked_ahead(mut self, ahead: bool) -> Intent {
        if let Intent::Claim(claim) = &mut self {
            claim.ahead = ahead;
        }
        self
    }

    /// The PV this intent is about.
    pub fn pv(&self) -> &str {
        match self {
            Intent::Claim(claim) => &claim.pv,
            Intent::Volume(volume) => &volume.pv,
        }
    }

    /// The provisioner whose guest holds the storage.
    pub fn provisioner(&self) -> &str {
        match self {
            Intent::Claim(claim) => &claim.provisioner,
            Intent::Volume(volume) => &volume.provisioner,
        }
    }

    /// The storage recovery may delete, if this entry names any.
    pub fn storage(&self) -> Option<&Storage> {
        match self {
            Intent::Claim(claim) => claim.built.as_ref(),
            Intent::Volume(volume) => volume.deleted.as_ref(),
        }
    }

    /// Its failure count.
    pub fn retries(&self) -> &Retries {
        match self {
            Intent::Claim(claim) => &claim.retries,
            Intent::Volume(volume) => &volume.retries,
        }
    }

    /// Its failure count, to change.
    pub fn retries_mut(&mut self) -> &mut Retries {
        match self {
            Intent::Claim(claim) => &mut claim.retries,
            Intent::Volume(volume) => &mut volume.retries,
        }
    }

    /// The entry as stored.
    pub fn to_text(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

impl Storage {
    /// What a delete of `pv`'s storage reads: its identity, labels and annotations (the guest set
    /// them, or an admin; bounded by [`MAX_ENTRY_BYTES`] when recorded), spec; no status.
    pub fn of(pv: &PersistentVolume, class: Option<&StorageClass>) -> Storage {
        Storage {
            volume: PersistentVolume {
                metadata: ObjectMeta {
                    name: pv.metadata.name.clone(),
                    uid: pv.metadata.uid.clone(),
                    labels: pv.metadata.labels.clone(),
                    annotations: pv.metadata.annotations.clone(),
                    ..ObjectMeta::default()
                },
                spec: pv.spec.clone(),
                status: None,
            },
            class: class.map(slim_class),
        }
    }
}

fn slim_class(class: &StorageClass) -> StorageClass {
    serde_json::from_str(&crate::controller::decide::class_record(class)).unwrap_or_default()
}

/// `text` cut to at most `max` bytes on a character boundary.
pub fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pv(annotation_bytes: usize) -> PersistentVolume {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "pvc-u", "uid": "pu", "resourceVersion": "7",
                         "finalizers": ["kubernetes.io/pv-protection"],
                         "annotations": {"big": "x".repeat(annotation_bytes)}},
            "spec": {"hostPath": {"path": "/x"}, "persistentVolumeReclaimPolicy": "Delete"},
            "status": {"phase": "Released"}
        }))
        .unwrap()
    }

    #[test]
    fn a_claim_entry_holds_names_only_whatever_the_claim_carries() {
        let text = Intent::claim("p", "pvc-u", &"n".repeat(63), &"c".repeat(253)).to_text();
        assert!(text.len() < 512, "{} bytes", text.len());
    }

    #[test]
    fn a_claim_entry_says_it_was_recorded_ahead_and_older_entries_count_as_called() {
        let ahead = Intent::claim("p", "pvc-u", "n", "c").marked_ahead(true);
        assert!(ahead.to_text().contains("\"ahead\":true"));
        let back: Intent = serde_json::from_str(&ahead.to_text()).unwrap();
        assert!(back.is_ahead());
        let called = back.marked_ahead(false);
        assert!(!called.to_text().contains("ahead"), "{}", called.to_text());
        let older: Intent = serde_json::from_str(
            r#"{"kind":"claim","provisioner":"p","pv":"pvc-u","namespace":"n","name":"c"}"#,
        )
        .unwrap();
        assert!(!older.is_ahead());
    }

    #[test]
    fn an_ahead_volume_entry_names_the_version_and_cannot_delete() {
        let intent = Intent::volume("p", &pv(200 * 1024));
        assert!(intent.to_text().len() < 256);
        assert!(intent.storage().is_none());
        let Intent::Volume(volume) = &intent else {
            panic!()
        };
        assert_eq!(volume.version, "7");
        let back: Intent = serde_json::from_str(&intent.to_text()).unwrap();
        assert_eq!(back, intent);
    }

    #[test]
    fn storage_keeps_what_a_delete_reads_and_no_status_or_finalizers() {
        let storage = Storage::of(&pv(10), None);
        assert_eq!(storage.volume.metadata.uid.as_deref(), Some("pu"));
        assert_eq!(storage.volume.metadata.finalizers, None);
        assert_eq!(storage.volume.metadata.resource_version, None);
        assert!(storage.volume.status.is_none());
    }

    #[test]
    fn retries_give_up_at_the_threshold_and_never_at_zero() {
        let mut retries = Retries::default();
        for _ in 0..3 {
            retries.failed("boom", 3);
        }
        assert!(retries.given_up);
        let mut never = Retries::default();
        for _ in 0..100 {
            never.failed(&"e".repeat(4096), 0);
        }
        assert!(!never.given_up);
        assert!(never.error.unwrap().len() <= MAX_ERROR_BYTES + 3);
    }
}
