//! The StorageClass parameters hostpath understands, parsed and checked in one place.

use wasm_provisioner_sdk::dir_volume::{ARCHIVE_ON_DELETE, PATH_PATTERN};
use wasm_provisioner_sdk::{Ownership, ParameterError, Parameters, StorageClass};

/// `uid`, `gid`, `mode`: owner, group and octal mode of the volume's directory, applied by the
/// host within the grant's `uids`/`gids`. Unset: the directory stays as the host creates it.
pub const UID: &str = "uid";
/// See [`UID`].
pub const GID: &str = "gid";
/// See [`UID`].
pub const MODE: &str = "mode";

/// The parsed class parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClassParameters {
    /// `pathPattern`, when set; the directory is the PV name otherwise.
    pub path_pattern: Option<String>,
    /// `archiveOnDelete` (default false).
    pub archive_on_delete: bool,
    /// `uid`, `gid`, `mode` (default: none asked).
    pub ownership: Ownership,
}

impl ClassParameters {
    /// Parses the class parameters; unknown ones are an error, so that typos do not pass silently.
    pub fn parse(class: &StorageClass) -> Result<Self, ParameterError> {
        let mut params = Parameters::of(class);
        let parsed = Self {
            path_pattern: params.string(PATH_PATTERN).map(str::to_owned),
            archive_on_delete: params.bool(ARCHIVE_ON_DELETE)?.unwrap_or(false),
            ownership: Ownership {
                uid: params.id(UID)?,
                gid: params.id(GID)?,
                mode: params.mode(MODE)?,
            },
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
    fn owner_group_and_mode() {
        let parsed = parse(&[("uid", "1000"), ("gid", "2000"), ("mode", "0750")]).unwrap();
        assert_eq!(
            parsed.ownership,
            Ownership {
                uid: Some(1000),
                gid: Some(2000),
                mode: Some(0o750)
            }
        );
        assert_eq!(
            parse(&[("uid", "bob")]).unwrap_err(),
            "parameter uid: expected a numeric id from 0 to 4294967294, got bob"
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
