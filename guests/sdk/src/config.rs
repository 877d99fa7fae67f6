//! The guest's configuration: the `[config]` table of its grant file, handed over as JSON.

use serde::de::DeserializeOwned;

/// The configuration did not parse; the message names the key and the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "guest config: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

impl From<ConfigError> for crate::types::ProvisionError {
    fn from(error: ConfigError) -> Self {
        crate::types::final_error(error)
    }
}

/// Parses the configuration JSON into `T` (use `#[serde(deny_unknown_fields)]` so typos fail).
pub fn parse_config<T: DeserializeOwned>(json: &str) -> Result<T, ConfigError> {
    serde_json::from_str(json).map_err(|error| ConfigError(error.to_string()))
}

/// Checks that a configured path is absolute; `key` names it in the error.
pub fn require_absolute(key: &str, path: &str) -> Result<(), ConfigError> {
    if path.starts_with('/') {
        Ok(())
    } else {
        Err(ConfigError(format!(
            "{key} must be an absolute path, got {path:?}"
        )))
    }
}

/// `base/relative`, with no doubled slash.
pub fn join(base: &str, relative: &str) -> String {
    format!("{}/{relative}", base.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields, rename_all = "kebab-case")]
    struct Sample {
        #[allow(dead_code)]
        guest_dir: String,
    }

    #[test]
    fn errors_name_the_key() {
        let error = parse_config::<Sample>("{}").unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("guest config: missing field `guest-dir`"),
            "{error}"
        );
        let error = parse_config::<Sample>(r#"{"guest-dir": "/v", "x": 1}"#).unwrap_err();
        assert!(error.to_string().contains("unknown field `x`"), "{error}");
        assert!(
            require_absolute("node-dir", "rel")
                .unwrap_err()
                .to_string()
                .contains("node-dir must be an absolute path")
        );
        assert_eq!(join("/a/", "b/c"), "/a/b/c");
    }
}
