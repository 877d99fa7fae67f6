//! The StorageClass parameters hostpath understands, parsed and checked in one place.

use crate::wasm_provisioner::provisioner::types::Pair;

/// `pathPattern`: the directory of a volume, relative to the granted directory.
pub const PATH_PATTERN: &str = "pathPattern";
/// `archiveOnDelete`: rename the directory instead of removing it when the volume is deleted.
pub const ARCHIVE_ON_DELETE: &str = "archiveOnDelete";

/// The parsed class parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClassParameters {
    /// `pathPattern`, when set; the directory is the PV name otherwise.
    pub path_pattern: Option<String>,
    /// `archiveOnDelete` (default false).
    pub archive_on_delete: bool,
}

impl ClassParameters {
    /// Parses the class parameters; unknown ones are an error, so that typos do not pass silently.
    pub fn parse(parameters: &[Pair]) -> Result<Self, String> {
        let mut parsed = Self::default();
        let mut unknown = Vec::new();
        for Pair { key, value } in parameters {
            match key.as_str() {
                PATH_PATTERN => parsed.path_pattern = Some(value.clone()),
                ARCHIVE_ON_DELETE => {
                    parsed.archive_on_delete = parse_bool(value).ok_or_else(|| {
                        format!("parameter {ARCHIVE_ON_DELETE}: expected a boolean, got {value}")
                    })?;
                }
                _ => unknown.push(key.as_str()),
            }
        }
        if !unknown.is_empty() {
            unknown.sort_unstable();
            return Err(format!(
                "unknown StorageClass parameters: {} (known: {PATH_PATTERN}, {ARCHIVE_ON_DELETE})",
                unknown.join(", ")
            ));
        }
        Ok(parsed)
    }
}

/// Booleans as Go's `strconv.ParseBool` reads them, which is what StorageClass authors expect.
fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "true" | "True" | "TRUE" | "t" | "T" | "1" => Some(true),
        "false" | "False" | "FALSE" | "f" | "F" | "0" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parameters(pairs: &[(&str, &str)]) -> Vec<Pair> {
        pairs
            .iter()
            .map(|(key, value)| Pair {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect()
    }

    #[test]
    fn defaults_without_parameters() {
        assert_eq!(
            ClassParameters::parse(&[]).unwrap(),
            ClassParameters::default()
        );
    }

    #[test]
    fn reads_both_parameters() {
        let parsed = ClassParameters::parse(&parameters(&[
            ("pathPattern", "${pvc.namespace}"),
            ("archiveOnDelete", "true"),
        ]))
        .unwrap();
        assert_eq!(parsed.path_pattern.as_deref(), Some("${pvc.namespace}"));
        assert!(parsed.archive_on_delete);
        assert!(
            !ClassParameters::parse(&parameters(&[("archiveOnDelete", "False")]))
                .unwrap()
                .archive_on_delete
        );
    }

    #[test]
    fn non_boolean_archive_on_delete_is_refused() {
        let error = ClassParameters::parse(&parameters(&[("archiveOnDelete", "yes")])).unwrap_err();
        assert_eq!(
            error,
            "parameter archiveOnDelete: expected a boolean, got yes"
        );
    }

    #[test]
    fn unknown_parameters_are_named() {
        let error = ClassParameters::parse(&parameters(&[
            ("zeta", "1"),
            ("pathPatern", "x"),
            ("archiveOnDelete", "0"),
        ]))
        .unwrap_err();
        assert!(
            error.starts_with("unknown StorageClass parameters: pathPatern, zeta"),
            "{error}"
        );
    }
}
