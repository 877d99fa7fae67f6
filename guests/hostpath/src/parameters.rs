//! The StorageClass parameters hostpath understands, parsed and checked in one place.

use wasm_provisioner_sdk::{ParameterError, Parameters, StorageClass};

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
    pub fn parse(class: &StorageClass) -> Result<Self, ParameterError> {
        let mut params = Parameters::of(class);
        let parsed = Self {
            path_pattern: params.string(PATH_PATTERN).map(str::to_owned),
            archive_on_delete: params.bool(ARCHIVE_ON_DELETE)?.unwrap_or(false),
        };
        params.finish()?;
        Ok(parsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasm_provisioner_sdk::testing::class;

    fn parse(pairs: &[(&str, &str)]) -> Result<ClassParameters, String> {
        ClassParameters::parse(&class("hostpath", pairs)).map_err(|error| error.to_string())
    }

    #[test]
    fn defaults_without_parameters() {
        assert_eq!(parse(&[]).unwrap(), ClassParameters::default());
    }

    #[test]
    fn reads_both_parameters() {
        let parsed = parse(&[
            ("pathPattern", "${pvc.namespace}"),
            ("archiveOnDelete", "true"),
        ])
        .unwrap();
        assert_eq!(parsed.path_pattern.as_deref(), Some("${pvc.namespace}"));
        assert!(parsed.archive_on_delete);
        assert!(
            !parse(&[("archiveOnDelete", "False")])
                .unwrap()
                .archive_on_delete
        );
    }

    #[test]
    fn non_boolean_archive_on_delete_is_refused() {
        assert_eq!(
            parse(&[("archiveOnDelete", "yes")]).unwrap_err(),
            "parameter archiveOnDelete: expected a boolean, got yes"
        );
    }

    #[test]
    fn unknown_parameters_are_named() {
        let error =
            parse(&[("zeta", "1"), ("pathPatern", "x"), ("archiveOnDelete", "0")]).unwrap_err();
        assert!(
            error.starts_with("unknown StorageClass parameters: pathPatern, zeta"),
            "{error}"
        );
    }
}
