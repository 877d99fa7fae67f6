//! What the caches drop from every object they keep: managed fields and kubectl's last-applied
//! copy. A leaf: every watch slims, and nothing here reaches back into the watches.

/// Annotation `kubectl apply` keeps: a second copy of the whole object as the user wrote it.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops what the controller never reads from a cached object: managed fields (a JSON tree per
/// writer, often larger than the object itself) and kubectl's last-applied copy. Every write the
/// controller makes is a patch, so nothing it sends back is derived from the dropped parts.
pub fn slim<K: kube::Resource>(object: &mut K) {
    let meta = object.meta_mut();
    meta.managed_fields = None;
    if let Some(annotations) = meta.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta};

    #[test]
    fn slim_keeps_what_decisions_read() {
        let mut claim = PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some("data".into()),
                uid: Some("u1".into()),
                finalizers: Some(vec!["wasm-provisioner.dev/provisioning".into()]),
                annotations: Some(
                    [
                        (LAST_APPLIED.to_string(), "{\"big\":true}".to_string()),
                        (
                            "volume.beta.kubernetes.io/storage-provisioner".to_string(),
                            "example.com/hostpath".to_string(),
                        ),
                    ]
                    .into(),
                ),
                managed_fields: Some(vec![ManagedFieldsEntry {
                    manager: Some("kubectl".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            ..Default::default()
        };
        let before = claim.clone();
        slim(&mut claim);
        assert_eq!(claim.metadata.managed_fields, None);
        let annotations = claim
            .metadata
            .annotations
            .as_ref()
            .expect("annotations kept");
        assert_eq!(annotations.len(), 1);
        assert_eq!(
            annotations["volume.beta.kubernetes.io/storage-provisioner"],
            "example.com/hostpath"
        );
        assert_eq!(claim.metadata.name, before.metadata.name);
        assert_eq!(claim.metadata.uid, before.metadata.uid);
        assert_eq!(claim.metadata.finalizers, before.metadata.finalizers);
        assert_eq!(claim.spec, before.spec);
    }
}
