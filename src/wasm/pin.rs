//! A grant file's `[module]` table: the digest an operator pins a guest's bytes to, and what a
//! module that no longer matches may still do.
//!
//! The pin is the SHA-256 of the `.wasm` file, the same digest `inspect` prints and an OCI
//! registry gives the module's `application/wasm` layer, so a module reviewed once is the module
//! that runs. Checked before the module is compiled (compiling is the costliest thing untrusted
//! bytes can make the host do) and again where every load ends, so no load path can skip it.

use serde::Deserialize;

/// The `[module]` table as written.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub(crate) struct ModuleTable {
    #[serde(default)]
    sha256: Option<String>,
    #[serde(default)]
    on_mismatch: Option<OnMismatch>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    cosign_key: Option<std::path::PathBuf>,
}

/// What the guest that served before may still do once its file stops matching the pin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnMismatch {
    /// Nothing: its claims and its released volumes wait until a module that matches returns.
    /// The default: the operator has not reviewed what replaced it, and storage that waits is
    /// not lost.
    #[default]
    Wait,
    /// The module loaded before (which matched the pin then) keeps deleting released volumes
    /// and recorded orphans; new claims wait. Only until this process restarts: the last good
    /// module lives in memory, never on disk.
    DeleteWithLastGood,
}

impl OnMismatch {
    /// The name used in grant files and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            OnMismatch::Wait => "wait",
            OnMismatch::DeleteWithLastGood => "delete-with-last-good",
        }
    }
}

/// A validated `[module]` table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModulePin {
    /// The pinned SHA-256 of the module's bytes, lowercase hex; `None` loads any bytes.
    pub sha256: Option<String>,
    /// What the last good module may do after a mismatch.
    pub on_mismatch: OnMismatch,
    /// The OCI reference the running host fetches the module from when it is missing or does
    /// not match (src/oci/fetch.rs); checked as a reference by the fetcher.
    pub source: Option<String>,
    /// The PEM public key (cosign.pub) whose signature the module's artifact must carry,
    /// verified at every load from the evidence `pull` keeps beside it.
    pub cosign_key: Option<String>,
}

/// A module whose bytes are not the ones its grant pins.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "module sha256 {actual} is not the {pinned} its grant file pins ([module] sha256); refused: \
     replace the module with the reviewed one, or pin the new digest after reviewing it"
)]
pub struct PinMismatch {
    /// What the grant pins.
    pub pinned: String,
    /// What the file holds.
    pub actual: String,
}

impl ModulePin {
    /// Validates the table: a pin is 64 hex digits (an optional `sha256:` prefix, as registries
    /// write digests, is accepted).
    pub(crate) fn from_table(
        table: Option<ModuleTable>,
        base: &std::path::Path,
    ) -> Result<ModulePin, String> {
        let table = table.unwrap_or_default();
        let sha256 = match table.sha256 {
            None => None,
            Some(text) => Some(parse_digest(&text)?),
        };
        let vouched = sha256.is_some() || table.cosign_key.is_some();
        let on_mismatch = match (table.on_mismatch, vouched) {
            (Some(_), false) => {
                return Err(
                    "module.on-mismatch needs module.sha256 or module.cosign-key (nothing to mismatch)"
                        .into(),
                );
            }
            (choice, _) => choice.unwrap_or_default(),
        };
        let cosign_key = match table.cosign_key {
            None => None,
            Some(path) => {
                let path = base.join(path);
                let text = std::fs::read_to_string(&path).map_err(|e| {
                    format!("module.cosign-key: cannot read {}: {e}", path.display())
                })?;
                Some(text)
            }
        };
        Ok(ModulePin {
            sha256,
            on_mismatch,
            source: table.source,
            cosign_key,
        })
    }

    /// Whether a module with SHA-256 `actual` (lowercase hex) may load under this pin.
    pub fn check(&self, actual: &str) -> Result<(), PinMismatch> {
        match &self.sha256 {
            Some(pinned) if pinned != actual => Err(PinMismatch {
                pinned: pinned.clone(),
                actual: actual.to_owned(),
            }),
            _ => Ok(()),
        }
    }
}

/// `sha256:<hex>` or `<hex>`, 64 hex digits, to lowercase hex.
fn parse_digest(text: &str) -> Result<String, String> {
    let hex = text.strip_prefix("sha256:").unwrap_or(text);
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "module.sha256 must be 64 hex digits (what `wasm-provisioner inspect` prints), got {text:?}"
        ));
    }
    Ok(hex.to_ascii_lowercase())
}

/// The `[module]` lines that pin a module with SHA-256 `sha256`, as `inspect` prints them.
pub fn pin_lines(sha256: &str) -> String {
    format!("[module]\nsha256 = \"{sha256}\"\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const A: &str = "ab0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcd";

    fn table(sha256: Option<&str>, on_mismatch: Option<OnMismatch>) -> Option<ModuleTable> {
        Some(ModuleTable {
            sha256: sha256.map(str::to_owned),
            on_mismatch,
            ..ModuleTable::default()
        })
    }

    #[test]
    fn digests_are_read_as_lowercase_hex_with_or_without_the_registry_prefix() {
        let cases = [
            (A.to_string(), Ok(A.to_string())),
            (format!("sha256:{A}"), Ok(A.to_string())),
            (A.to_ascii_uppercase(), Ok(A.to_string())),
            (A[..63].to_string(), Err(())),
            (format!("{}g", &A[..63]), Err(())),
            (format!("sha512:{A}"), Err(())),
            (String::new(), Err(())),
        ];
        for (text, want) in cases {
            let got = ModulePin::from_table(table(Some(&text), None), Path::new("/"))
                .map(|p| p.sha256.unwrap());
            assert_eq!(got.map_err(|_| ()), want, "{text:?}");
        }
    }

    #[test]
    fn an_unpinned_grant_loads_any_bytes_and_a_pinned_one_only_its_own() {
        let open = ModulePin::from_table(None, Path::new("/")).unwrap();
        assert_eq!(open.check(A), Ok(()));
        let pinned = ModulePin::from_table(table(Some(A), None), Path::new("/")).unwrap();
        assert_eq!(pinned.on_mismatch, OnMismatch::Wait);
        assert_eq!(pinned.check(A), Ok(()));
        let other = "cd".repeat(32);
        let error = pinned.check(&other).unwrap_err();
        assert!(error.to_string().contains(&other) && error.to_string().contains(A));
    }

    #[test]
    fn a_mismatch_policy_without_a_pin_is_refused() {
        assert!(
            ModulePin::from_table(
                table(None, Some(OnMismatch::DeleteWithLastGood)),
                Path::new("/")
            )
            .is_err()
        );
        let pin = ModulePin::from_table(
            table(Some(A), Some(OnMismatch::DeleteWithLastGood)),
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(pin.on_mismatch, OnMismatch::DeleteWithLastGood);
    }

    #[test]
    fn the_printed_lines_parse_back_to_the_same_pin() {
        let text = format!("provisioner = \"p\"\n{}", pin_lines(A));
        #[derive(Deserialize)]
        struct File {
            module: Option<ModuleTable>,
        }
        let file: File = toml::from_str(&text).unwrap();
        assert_eq!(
            ModulePin::from_table(file.module, Path::new("/"))
                .unwrap()
                .sha256
                .as_deref(),
            Some(A)
        );
    }
}
