//! What a claim's data source asks for: nothing, a copy of another claim, a snapshot restore,
//! or an external populator's work. Pure: read from the claim as written.
//!
//! `spec.dataSourceRef` wins over `spec.dataSource` where the API server has both (it mirrors
//! the one into the other for the kinds both can name). A kind that is neither a
//! PersistentVolumeClaim nor a VolumeSnapshot belongs to a volume populator, which provisions
//! the claim itself; external-provisioner leaves such claims alone, and so do we.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;

/// The API group of VolumeSnapshot.
pub const SNAPSHOT_GROUP: &str = "snapshot.storage.k8s.io";

/// What a claim's data source asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataSource<'a> {
    /// No data source: an empty volume.
    None,
    /// A copy of the claim `name` (in `namespace`, when the reference names one).
    Claim {
        /// The source claim's name.
        name: &'a str,
        /// `dataSourceRef.namespace`, when set (cross-namespace references).
        namespace: Option<&'a str>,
    },
    /// A restore of the VolumeSnapshot `name`.
    Snapshot {
        /// The snapshot's name.
        name: &'a str,
    },
    /// Another kind: an external populator's claim.
    Populator {
        /// The kind named.
        kind: &'a str,
        /// Its API group ("" for the core group).
        api_group: &'a str,
    },
}

/// The data source of `pvc`.
pub fn of(pvc: &PersistentVolumeClaim) -> DataSource<'_> {
    let Some(spec) = pvc.spec.as_ref() else {
        return DataSource::None;
    };
    let (api_group, kind, name, namespace) = match (&spec.data_source_ref, &spec.data_source) {
        (Some(r), _) => (
            r.api_group.as_deref(),
            r.kind.as_str(),
            r.name.as_str(),
            r.namespace.as_deref(),
        ),
        (None, Some(r)) => (
            r.api_group.as_deref(),
            r.kind.as_str(),
            r.name.as_str(),
            None,
        ),
        (None, None) => return DataSource::None,
    };
    let api_group = api_group.unwrap_or_default();
    match (api_group, kind) {
        ("", "PersistentVolumeClaim") => DataSource::Claim { name, namespace },
        (SNAPSHOT_GROUP, "VolumeSnapshot") => DataSource::Snapshot { name },
        _ => DataSource::Populator { kind, api_group },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(spec: serde_json::Value) -> PersistentVolumeClaim {
        serde_json::from_value(json!({"metadata": {"name": "c"}, "spec": spec})).unwrap()
    }

    #[test]
    fn kinds_are_told_apart_and_the_ref_wins() {
        let pvc = |group: Option<&str>, kind: &str| {
            claim(json!({"dataSource": {"apiGroup": group, "kind": kind, "name": "src"}}))
        };
        assert_eq!(of(&claim(json!({}))), DataSource::None);
        assert_eq!(
            of(&pvc(None, "PersistentVolumeClaim")),
            DataSource::Claim {
                name: "src",
                namespace: None
            }
        );
        assert_eq!(
            of(&pvc(Some(""), "PersistentVolumeClaim")),
            DataSource::Claim {
                name: "src",
                namespace: None
            }
        );
        assert_eq!(
            of(&pvc(Some(SNAPSHOT_GROUP), "VolumeSnapshot")),
            DataSource::Snapshot { name: "src" }
        );
        for (group, kind) in [
            (Some("populators.example.com"), "Hello"),
            (Some("other.example.com"), "PersistentVolumeClaim"),
            (None, "VolumeSnapshot"),
            (Some(SNAPSHOT_GROUP), "VolumeSnapshotContent"),
        ] {
            assert_eq!(
                of(&pvc(group, kind)),
                DataSource::Populator {
                    kind,
                    api_group: group.unwrap_or_default()
                },
                "{group:?} {kind}"
            );
        }
        let both = claim(json!({
            "dataSource": {"kind": "PersistentVolumeClaim", "name": "old"},
            "dataSourceRef": {"apiGroup": "populators.example.com", "kind": "Hello", "name": "h"},
        }));
        assert_eq!(
            of(&both),
            DataSource::Populator {
                kind: "Hello",
                api_group: "populators.example.com"
            }
        );
        let elsewhere = claim(json!({
            "dataSourceRef": {"kind": "PersistentVolumeClaim", "name": "src", "namespace": "other"},
        }));
        assert_eq!(
            of(&elsewhere),
            DataSource::Claim {
                name: "src",
                namespace: Some("other")
            }
        );
    }
}
