//! The labels and annotations a guest may put on a PV: Kubernetes' syntax for keys and values,
//! the keys the host owns, and the size budget; and how a guest's value is quoted in a refusal.

use std::collections::BTreeMap;

use super::bindings::types::SpecError;

fn invalid(msg: impl Into<String>) -> SpecError {
    SpecError::Invalid(msg.into())
}

fn not_granted(msg: impl Into<String>) -> SpecError {
    SpecError::NotGranted(msg.into())
}

/// Kubernetes' limit on the total size of an object's annotations.
pub const MAX_ANNOTATIONS_BYTES: usize = 256 * 1024;
/// Labels plus annotations a guest may set on one PV.
pub const MAX_METADATA_ENTRIES: usize = 128;
/// Key prefixes the host owns; a guest may not set them on a PV. Guests may use their own
/// subdomains such as `hostpath.wasm-provisioner.dev/`.
const RESERVED_PREFIXES: &[&str] = &["wasm-provisioner.dev/", "kubernetes.io/", "k8s.io/"];
/// Domains reserved with all their subdomains (`pv.kubernetes.io/`, `volume.beta.kubernetes.io/`, ...).
const RESERVED_DOMAINS: &[&str] = &["kubernetes.io/", "k8s.io/"];

pub(super) fn check_metadata_key(key: &str) -> Result<(), SpecError> {
    check_qualified_name(key)?;
    let reserved = RESERVED_PREFIXES
        .iter()
        .find(|p| key.starts_with(*p))
        .or_else(|| {
            RESERVED_DOMAINS.iter().find(|d| {
                key.split_once('/')
                    .is_some_and(|(prefix, _)| format!("{prefix}/").ends_with(&format!(".{d}")))
            })
        });
    if let Some(prefix) = reserved {
        return Err(not_granted(format!(
            "key {} is in {prefix:?}, which the host owns",
            shown(key)
        )));
    }
    Ok(())
}

pub(super) fn check_metadata_budget(
    labels: &BTreeMap<String, String>,
    annotations: &BTreeMap<String, String>,
) -> Result<(), SpecError> {
    check_entries(labels.len() + annotations.len())?;
    check_annotations_size(annotations_size(annotations))
}

pub(super) fn check_entries(entries: usize) -> Result<(), SpecError> {
    if entries > MAX_METADATA_ENTRIES {
        return Err(invalid(format!(
            "at most {MAX_METADATA_ENTRIES} labels and annotations"
        )));
    }
    Ok(())
}

pub(super) fn annotations_size(annotations: &BTreeMap<String, String>) -> usize {
    annotations.iter().map(|(k, v)| k.len() + v.len()).sum()
}

pub(super) fn check_annotations_size(size: usize) -> Result<(), SpecError> {
    if size > MAX_ANNOTATIONS_BYTES {
        return Err(invalid(format!(
            "annotations total {size} bytes, more than Kubernetes' {MAX_ANNOTATIONS_BYTES}"
        )));
    }
    Ok(())
}

/// Characters of a guest-supplied value quoted in a refusal: messages are built from a
/// bounded prefix, never from the whole value (which may be megabytes of control bytes).
pub const SHOWN_CHARS: usize = 64;

/// `value` quoted for a message: at most [`SHOWN_CHARS`] characters, Debug-escaped, with the
/// full length when it was cut.
pub fn shown(value: &str) -> String {
    match value.char_indices().nth(SHOWN_CHARS) {
        None => format!("{value:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &value[..cut], value.len()),
    }
}

/// A Kubernetes qualified name: `[prefix/]name`, prefix a DNS subdomain, name ≤ 63 characters.
pub(super) fn check_qualified_name(key: &str) -> Result<(), SpecError> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            })
    });
    if name_ok && prefix_ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "{} is not a valid Kubernetes key",
            shown(key)
        )))
    }
}

pub(super) fn check_label_value(value: &str) -> Result<(), SpecError> {
    let ok = value.is_empty()
        || (value.len() <= 63
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            && value.starts_with(|c: char| c.is_ascii_alphanumeric())
            && value.ends_with(|c: char| c.is_ascii_alphanumeric()));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "{} is not a valid label value",
            shown(value)
        )))
    }
}
