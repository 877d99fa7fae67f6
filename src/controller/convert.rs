//! Conversions between Kubernetes objects and the contract's plain records, both directions:
//! the controller's side of the boundary (`src/wasm/` knows only the contract).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::storage::v1::StorageClass as K8sStorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::decide::ANN_PROVISIONED_BY;
use crate::wasm::bindings::types::{
    AccessMode, BindingMode, Claim, CsiSource, DeleteRequest, HostPathSource, HostPathType,
    LocalSource, NfsSource, NodeSelectorOperator, NodeSelectorRequirement, NodeSelectorTerm, Pair,
    ReclaimPolicy, StorageClass, TopologyRequirement, TopologyTerm, Volume, VolumeMode,
    VolumeSource,
};
use crate::wasm::spec::BuiltVolume;

/// Why a Kubernetes object could not be expressed in the contract.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConvertError {
    /// A quantity that does not parse.
    #[error("quantity {0:?} is not a valid Kubernetes quantity")]
    Quantity(String),
    /// A PV whose source the contract cannot express.
    #[error("volume {0} has a source kind the contract does not support")]
    UnsupportedSource(String),
}

/// Parses a Kubernetes quantity into bytes, rounding fractions up.
pub fn quantity_bytes(q: &str) -> Result<u64, ConvertError> {
    let err = || ConvertError::Quantity(q.to_string());
    let s = q.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    let multiplier: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024f64,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "Ei" => 1024f64.powi(6),
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        e if e.starts_with(['e', 'E']) => {
            let exp: i32 = e[1..].parse().map_err(|_| err())?;
            10f64.powi(exp)
        }
        _ => return Err(err()),
    };
    // Exact integer path for the common case, so large binary quantities do not lose precision.
    if let Ok(n) = number.parse::<u64>()
        && multiplier >= 1.0
        && multiplier.fract() == 0.0
    {
        return n.checked_mul(multiplier as u64).ok_or_else(err);
    }
    let n: f64 = number.parse().map_err(|_| err())?;
    if n < 0.0 || !n.is_finite() {
        return Err(err());
    }
    let bytes = (n * multiplier).ceil();
    if bytes > u64::MAX as f64 {
        return Err(err());
    }
    Ok(bytes as u64)
}

/// Formats bytes as the shortest exact binary quantity (`1Gi`, `1536Mi`, `1000`).
pub fn bytes_quantity(bytes: u64) -> Quantity {
    const UNITS: [(&str, u64); 6] = [
        ("Ei", 1 << 60),
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ];
    for (suffix, unit) in UNITS {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return Quantity(format!("{}{suffix}", bytes / unit));
        }
    }
    Quantity(bytes.to_string())
}

fn pairs(map: &Option<BTreeMap<String, String>>) -> Vec<Pair> {
    map.iter()
        .flatten()
        .map(|(k, v)| Pair {
            key: k.clone(),
            value: v.clone(),
        })
        .collect()
}

/// `ReadWriteOnce` and friends, unknown modes dropped.
pub fn access_mode(mode: &str) -> Option<AccessMode> {
    match mode {
        "ReadWriteOnce" => Some(AccessMode::ReadWriteOnce),
        "ReadOnlyMany" => Some(AccessMode::ReadOnlyMany),
        "ReadWriteMany" => Some(AccessMode::ReadWriteMany),
        "ReadWriteOncePod" => Some(AccessMode::ReadWriteOncePod),
        _ => None,
    }
}

fn access_mode_name(mode: AccessMode) -> &'static str {
    match mode {
        AccessMode::ReadWriteOnce => "ReadWriteOnce",
        AccessMode::ReadOnlyMany => "ReadOnlyMany",
        AccessMode::ReadWriteMany => "ReadWriteMany",
        AccessMode::ReadWriteOncePod => "ReadWriteOncePod",
    }
}

/// The Kubernetes name of a reclaim policy.
pub fn reclaim_policy_name(policy: ReclaimPolicy) -> &'static str {
    match policy {
        ReclaimPolicy::Delete => "Delete",
        ReclaimPolicy::Retain => "Retain",
        ReclaimPolicy::Recycle => "Recycle",
    }
}

/// Parses a reclaim policy; Kubernetes defaults a missing one to `Delete`.
pub fn reclaim_policy(name: Option<&str>) -> ReclaimPolicy {
    match name {
        Some("Retain") => ReclaimPolicy::Retain,
        Some("Recycle") => ReclaimPolicy::Recycle,
        _ => ReclaimPolicy::Delete,
    }
}

/// The claim's requested storage in bytes (0 when absent or unparsable).
pub fn claim_request_bytes(pvc: &core::PersistentVolumeClaim) -> Result<u64, ConvertError> {
    let requests = pvc
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref());
    match requests.and_then(|r| r.get("storage")) {
        Some(q) => quantity_bytes(&q.0),
        None => Ok(0),
    }
}

/// The contract view of a claim.
pub fn claim(pvc: &core::PersistentVolumeClaim) -> Result<Claim, ConvertError> {
    let spec = pvc.spec.clone().unwrap_or_default();
    let limit = spec
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("storage"))
        .map(|q| quantity_bytes(&q.0))
        .transpose()?;
    Ok(Claim {
        namespace: pvc.metadata.namespace.clone().unwrap_or_default(),
        name: pvc.metadata.name.clone().unwrap_or_default(),
        uid: pvc.metadata.uid.clone().unwrap_or_default(),
        labels: pairs(&pvc.metadata.labels),
        annotations: pairs(&pvc.metadata.annotations),
        requested_bytes: claim_request_bytes(pvc)?,
        limit_bytes: limit,
        access_modes: spec
            .access_modes
            .iter()
            .flatten()
            .filter_map(|m| access_mode(m))
            .collect(),
        volume_mode: if spec.volume_mode.as_deref() == Some("Block") {
            VolumeMode::Block
        } else {
            VolumeMode::Filesystem
        },
        has_selector: spec.selector.is_some(),
        has_data_source: spec.data_source.is_some() || spec.data_source_ref.is_some(),
    })
}

/// The contract view of a StorageClass.
pub fn storage_class(sc: &K8sStorageClass) -> StorageClass {
    StorageClass {
        name: sc.metadata.name.clone().unwrap_or_default(),
        provisioner: sc.provisioner.clone(),
        parameters: pairs(&sc.parameters),
        reclaim_policy: reclaim_policy(sc.reclaim_policy.as_deref()),
        mount_options: sc.mount_options.clone().unwrap_or_default(),
        binding_mode: if sc.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer") {
            BindingMode::WaitForFirstConsumer
        } else {
            BindingMode::Immediate
        },
        allowed_topologies: sc
            .allowed_topologies
            .iter()
            .flatten()
            .map(|t| TopologyTerm {
                requirements: t
                    .match_label_expressions
                    .iter()
                    .flatten()
                    .map(|r| TopologyRequirement {
                        key: r.key.clone(),
                        values: r.values.clone(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

fn operator(op: &str) -> NodeSelectorOperator {
    match op {
        "NotIn" => NodeSelectorOperator::NotIn,
        "Exists" => NodeSelectorOperator::Exists,
        "DoesNotExist" => NodeSelectorOperator::DoesNotExist,
        _ => NodeSelectorOperator::In,
    }
}

fn operator_name(op: NodeSelectorOperator) -> &'static str {
    match op {
        NodeSelectorOperator::In => "In",
        NodeSelectorOperator::NotIn => "NotIn",
        NodeSelectorOperator::Exists => "Exists",
        NodeSelectorOperator::DoesNotExist => "DoesNotExist",
    }
}

/// A guest's delete request for `pv` of `class` (None: the class is gone), with its config.
pub fn delete_request(
    pv: &core::PersistentVolume,
    class: Option<&K8sStorageClass>,
    config: String,
) -> Result<DeleteRequest, ConvertError> {
    Ok(DeleteRequest {
        volume: volume(pv)?,
        storage_class: class.map(storage_class),
        config,
    })
}

/// The contract view of a PersistentVolume.
pub fn volume(pv: &core::PersistentVolume) -> Result<Volume, ConvertError> {
    let name = pv.metadata.name.clone().unwrap_or_default();
    let spec = pv.spec.clone().unwrap_or_default();
    let source = if let Some(h) = &spec.host_path {
        VolumeSource::HostPath(HostPathSource {
            path: h.path.clone(),
            kind: match h.type_.as_deref() {
                Some("DirectoryOrCreate") => HostPathType::DirectoryOrCreate,
                Some("Directory") => HostPathType::Directory,
                _ => HostPathType::Unset,
            },
        })
    } else if let Some(l) = &spec.local {
        VolumeSource::Local(LocalSource {
            path: l.path.clone(),
            fs_type: l.fs_type.clone(),
        })
    } else if let Some(n) = &spec.nfs {
        VolumeSource::Nfs(NfsSource {
            server: n.server.clone(),
            path: n.path.clone(),
            read_only: n.read_only.unwrap_or(false),
        })
    } else if let Some(c) = &spec.csi {
        VolumeSource::Csi(CsiSource {
            driver: c.driver.clone(),
            volume_handle: c.volume_handle.clone(),
            fs_type: c.fs_type.clone(),
            read_only: c.read_only.unwrap_or(false),
            attributes: pairs(&c.volume_attributes),
        })
    } else {
        return Err(ConvertError::UnsupportedSource(name));
    };
    let capacity = spec
        .capacity
        .as_ref()
        .and_then(|c| c.get("storage"))
        .map(|q| quantity_bytes(&q.0))
        .transpose()?
        .unwrap_or(0);
    let node_affinity = spec
        .node_affinity
        .as_ref()
        .and_then(|a| a.required.as_ref())
        .map(|r| {
            r.node_selector_terms
                .iter()
                .map(|t| NodeSelectorTerm {
                    requirements: t
                        .match_expressions
                        .iter()
                        .flatten()
                        .map(|e| NodeSelectorRequirement {
                            key: e.key.clone(),
                            operator: operator(&e.operator),
                            values: e.values.clone().unwrap_or_default(),
                        })
                        .collect(),
                })
                .collect()
        })
        .unwrap_or_default();
    let claim = spec.claim_ref.as_ref();
    Ok(Volume {
        name,
        capacity_bytes: capacity,
        source,
        reclaim_policy: reclaim_policy(spec.persistent_volume_reclaim_policy.as_deref()),
        storage_class_name: spec.storage_class_name.clone().unwrap_or_default(),
        labels: pairs(&pv.metadata.labels),
        annotations: pairs(&pv.metadata.annotations),
        node_affinity,
        claim_namespace: claim.and_then(|c| c.namespace.clone()),
        claim_name: claim.and_then(|c| c.name.clone()),
    })
}

/// What the host sets on every PV it creates, whatever the guest built.
pub struct PvIdentity<'a> {
    /// `pvc-<claim uid>`.
    pub name: &'a str,
    /// The claim it is for.
    pub claim: &'a core::PersistentVolumeClaim,
    /// The class it came from.
    pub class: &'a K8sStorageClass,
    /// The class name as the claim names it.
    pub class_name: &'a str,
    /// Whether a PV with the `Delete` policy is created held by our finalizer
    /// (`--add-pv-finalizer`): in the create itself, so holding it costs no request.
    pub held: bool,
}

/// Builds the PersistentVolume object: the guest's spec, unset fields filled from claim and
/// class, and the host-owned fields (name, claimRef, provisioned-by, storageClassName).
pub fn persistent_volume(id: &PvIdentity<'_>, built: &BuiltVolume) -> core::PersistentVolume {
    let claim_spec = id.claim.spec.clone().unwrap_or_default();
    let capacity = built
        .capacity
        .map(bytes_quantity)
        .or_else(|| {
            claim_spec
                .resources
                .as_ref()
                .and_then(|r| r.requests.as_ref())
                .and_then(|r| r.get("storage").cloned())
        })
        .unwrap_or_else(|| Quantity("0".into()));
    let access_modes = match &built.access_modes {
        Some(modes) => modes
            .iter()
            .map(|m| access_mode_name(*m).to_string())
            .collect(),
        None => claim_spec.access_modes.clone().unwrap_or_default(),
    };
    let volume_mode = match built.volume_mode {
        Some(VolumeMode::Block) => Some("Block".to_string()),
        Some(VolumeMode::Filesystem) => Some("Filesystem".to_string()),
        None => claim_spec.volume_mode.clone(),
    };
    let reclaim = built
        .reclaim_policy
        .map(|p| reclaim_policy_name(p).to_string())
        .unwrap_or_else(|| {
            id.class
                .reclaim_policy
                .clone()
                .unwrap_or_else(|| "Delete".to_string())
        });
    let mount_options = built
        .mount_options
        .clone()
        .or_else(|| id.class.mount_options.clone());
    let mut annotations = built.annotations.clone();
    annotations.insert(ANN_PROVISIONED_BY.to_string(), id.class.provisioner.clone());
    let mut spec = core::PersistentVolumeSpec {
        capacity: Some(BTreeMap::from([("storage".to_string(), capacity)])),
        access_modes: Some(access_modes),
        volume_mode,
        persistent_volume_reclaim_policy: Some(reclaim),
        mount_options: mount_options.filter(|o| !o.is_empty()),
        storage_class_name: Some(id.class_name.to_string()),
        claim_ref: Some(core::ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("PersistentVolumeClaim".into()),
            namespace: id.claim.metadata.namespace.clone(),
            name: id.claim.metadata.name.clone(),
            uid: id.claim.metadata.uid.clone(),
            resource_version: id.claim.metadata.resource_version.clone(),
            ..Default::default()
        }),
        ..Default::default()
    };
    match &built.source {
        VolumeSource::HostPath(h) => {
            spec.host_path = Some(core::HostPathVolumeSource {
                path: h.path.clone(),
                type_: match h.kind {
                    HostPathType::Unset => None,
                    HostPathType::DirectoryOrCreate => Some("DirectoryOrCreate".into()),
                    HostPathType::Directory => Some("Directory".into()),
                },
            })
        }
        VolumeSource::Local(l) => {
            spec.local = Some(core::LocalVolumeSource {
                path: l.path.clone(),
                fs_type: l.fs_type.clone(),
            })
        }
        VolumeSource::Nfs(n) => {
            spec.nfs = Some(core::NFSVolumeSource {
                server: n.server.clone(),
                path: n.path.clone(),
                read_only: n.read_only.then_some(true),
            })
        }
        VolumeSource::Csi(c) => {
            spec.csi = Some(core::CSIPersistentVolumeSource {
                driver: c.driver.clone(),
                volume_handle: c.volume_handle.clone(),
                fs_type: c.fs_type.clone(),
                read_only: c.read_only.then_some(true),
                volume_attributes: (!c.attributes.is_empty()).then(|| {
                    c.attributes
                        .iter()
                        .map(|p| (p.key.clone(), p.value.clone()))
                        .collect()
                }),
                ..Default::default()
            })
        }
    }
    if !built.node_affinity.is_empty() {
        spec.node_affinity = Some(core::VolumeNodeAffinity {
            required: Some(core::NodeSelector {
                node_selector_terms: built
                    .node_affinity
                    .iter()
                    .map(|t| core::NodeSelectorTerm {
                        match_expressions: Some(
                            t.requirements
                                .iter()
                                .map(|r| core::NodeSelectorRequirement {
                                    key: r.key.clone(),
                                    operator: operator_name(r.operator).to_string(),
                                    values: (!r.values.is_empty()).then(|| r.values.clone()),
                                })
                                .collect(),
                        ),
                        match_fields: None,
                    })
                    .collect(),
            }),
        });
    }
    let held = id.held && spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete");
    core::PersistentVolume {
        metadata: ObjectMeta {
            name: Some(id.name.to_string()),
            labels: (!built.labels.is_empty()).then(|| built.labels.clone()),
            annotations: Some(annotations),
            finalizers: held.then(|| vec![crate::controller::decide::FINALIZER_PV.to_string()]),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_and_round_up() {
        assert_eq!(quantity_bytes("1Gi"), Ok(1 << 30));
        assert_eq!(quantity_bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(quantity_bytes("500M"), Ok(500_000_000));
        assert_eq!(quantity_bytes("1e3"), Ok(1000));
        assert_eq!(quantity_bytes("100"), Ok(100));
        assert_eq!(quantity_bytes("1500m"), Ok(2));
        assert_eq!(quantity_bytes("8Ei"), Ok(8u64 << 60));
        assert!(quantity_bytes("16Ei").is_err());
        assert!(quantity_bytes("1Xi").is_err());
        assert!(quantity_bytes("-1Gi").is_err());
        assert!(quantity_bytes("").is_err());
    }

    #[test]
    fn bytes_format_as_shortest_exact_quantity() {
        assert_eq!(bytes_quantity(1 << 30).0, "1Gi");
        assert_eq!(bytes_quantity(1536 << 20).0, "1536Mi");
        assert_eq!(bytes_quantity(1000).0, "1000");
        for q in ["1Gi", "3Ti", "12345"] {
            assert_eq!(bytes_quantity(quantity_bytes(q).unwrap()).0, q);
        }
    }
}
