//! StorageClass parameters, parsed one by one with typed errors, and unknown ones refused.
//!
//! ```
//! # use wasm_provisioner_sdk::{Parameters, testing};
//! let class = testing::class("fast", &[("archiveOnDelete", "true")]);
//! let mut params = Parameters::of(&class);
//! let archive = params.bool("archiveOnDelete")?.unwrap_or(false);
//! let pattern = params.string("pathPattern");
//! params.finish()?; // refuses parameters nobody asked for (typos)
//! assert!(archive && pattern.is_none());
//! # Ok::<(), wasm_provisioner_sdk::ParameterError>(())
//! ```

use std::fmt;

use crate::types::{Pair, StorageClass};

/// Why a parameter was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParameterError {
    /// The value does not parse: `parameter X: expected a boolean, got Y`.
    Invalid {
        /// Parameter name.
        name: String,
        /// What was expected, e.g. "a boolean", "one of delete, retain".
        expected: String,
        /// The value given.
        got: String,
    },
    /// Parameters the guest does not know, sorted, and the ones it does.
    Unknown {
        /// The unknown names.
        names: Vec<String>,
        /// The names the guest asked for.
        known: Vec<String>,
    },
}

impl fmt::Display for ParameterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParameterError::Invalid {
                name,
                expected,
                got,
            } => write!(f, "parameter {name}: expected {expected}, got {got}"),
            ParameterError::Unknown { names, known } => write!(
                f,
                "unknown StorageClass parameters: {} (known: {})",
                names.join(", "),
                known.join(", ")
            ),
        }
    }
}

impl std::error::Error for ParameterError {}

impl From<ParameterError> for crate::types::ProvisionError {
    fn from(error: ParameterError) -> Self {
        crate::types::final_error(error)
    }
}

/// A class's parameters being read; remembers which names were asked for.
pub struct Parameters<'a> {
    pairs: &'a [Pair],
    known: Vec<String>,
}

impl<'a> Parameters<'a> {
    /// The parameters of `class`.
    pub fn of(class: &'a StorageClass) -> Self {
        Self::from_pairs(&class.parameters)
    }

    /// Parameters from pairs.
    pub fn from_pairs(pairs: &'a [Pair]) -> Self {
        Self {
            pairs,
            known: Vec::new(),
        }
    }

    /// A string parameter.
    pub fn string(&mut self, name: &str) -> Option<&'a str> {
        self.known.push(name.to_owned());
        crate::types::lookup(self.pairs, name)
    }

    /// A boolean parameter, read as Go's `strconv.ParseBool` does (`true`, `1`, `T`, `False`, ...).
    pub fn bool(&mut self, name: &str) -> Result<Option<bool>, ParameterError> {
        self.string(name)
            .map(|value| parse_bool(value).ok_or_else(|| invalid(name, "a boolean", value)))
            .transpose()
    }

    /// A parameter that must be one of `choices` (exact match).
    pub fn one_of(
        &mut self,
        name: &str,
        choices: &[&'static str],
    ) -> Result<Option<&'static str>, ParameterError> {
        self.string(name)
            .map(|value| {
                choices
                    .iter()
                    .find(|choice| **choice == value)
                    .copied()
                    .ok_or_else(|| invalid(name, &format!("one of {}", choices.join(", ")), value))
            })
            .transpose()
    }

    /// A size parameter as a Kubernetes quantity (`10Gi`, `500M`), in bytes.
    pub fn quantity(&mut self, name: &str) -> Result<Option<u64>, ParameterError> {
        self.string(name)
            .map(|value| {
                crate::quantity::parse_quantity(value)
                    .map_err(|_| invalid(name, "a quantity such as 10Gi", value))
            })
            .transpose()
    }

    /// A user or group id (decimal, as `chown` takes it numerically).
    pub fn id(&mut self, name: &str) -> Result<Option<u32>, ParameterError> {
        self.string(name)
            .map(|value| parse_id(name, value))
            .transpose()
    }

    /// Permission bits in octal (`"0770"`, `"770"`), as `chmod` takes them.
    pub fn mode(&mut self, name: &str) -> Result<Option<u32>, ParameterError> {
        self.string(name)
            .map(|value| parse_mode(name, value))
            .transpose()
    }

    /// Refuses parameters that were never asked for, so typos do not pass silently.
    pub fn finish(self) -> Result<(), ParameterError> {
        let mut names: Vec<String> = self
            .pairs
            .iter()
            .filter(|pair| !self.known.contains(&pair.key))
            .map(|pair| pair.key.clone())
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        names.sort_unstable();
        let mut known = self.known;
        known.dedup();
        Err(ParameterError::Unknown { names, known })
    }
}

fn invalid(name: &str, expected: &str, got: &str) -> ParameterError {
    ParameterError::Invalid {
        name: name.to_owned(),
        expected: expected.to_owned(),
        got: got.to_owned(),
    }
}

/// A user or group id given as parameter `name`: decimal, 0 to 4294967294.
pub fn parse_id(name: &str, value: &str) -> Result<u32, ParameterError> {
    value
        .parse::<u32>()
        .ok()
        .filter(|id| *id != u32::MAX && !value.starts_with('+'))
        .ok_or_else(|| invalid(name, "a numeric id from 0 to 4294967294", value))
}

/// Permission bits given as parameter `name`: octal digits, at most `7777`.
pub fn parse_mode(name: &str, value: &str) -> Result<u32, ParameterError> {
    let digits = value.strip_prefix("0o").unwrap_or(value);
    u32::from_str_radix(digits, 8)
        .ok()
        .filter(|mode| *mode <= 0o7777 && !digits.is_empty() && !digits.starts_with('+'))
        .ok_or_else(|| invalid(name, "octal permission bits such as 0770", value))
}

/// Booleans as Go's `strconv.ParseBool` reads them, which is what StorageClass authors expect.
pub fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "true" | "True" | "TRUE" | "t" | "T" | "1" => Some(true),
        "false" | "False" | "FALSE" | "f" | "F" | "0" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::class;

    #[test]
    fn typed_values_and_errors() {
        let class = class(
            "c",
            &[
                ("a", "True"),
                ("mode", "retain"),
                ("size", "1Gi"),
                ("b", "yes"),
            ],
        );
        let mut params = Parameters::of(&class);
        assert_eq!(params.bool("a"), Ok(Some(true)));
        assert_eq!(params.bool("missing"), Ok(None));
        assert_eq!(
            params.one_of("mode", &["delete", "retain"]),
            Ok(Some("retain"))
        );
        assert_eq!(params.quantity("size"), Ok(Some(1 << 30)));
        assert_eq!(
            params.bool("b").unwrap_err().to_string(),
            "parameter b: expected a boolean, got yes"
        );
        params.finish().unwrap();

        let class2 = crate::testing::class("c", &[("mode", "keep")]);
        let error = Parameters::of(&class2)
            .one_of("mode", &["delete", "retain"])
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "parameter mode: expected one of delete, retain, got keep"
        );
    }

    #[test]
    fn unknown_parameters_are_named_sorted_with_the_known_ones() {
        let class = class(
            "c",
            &[("zeta", "1"), ("pathPatern", "x"), ("archiveOnDelete", "0")],
        );
        let mut params = Parameters::of(&class);
        params.string("pathPattern");
        params.bool("archiveOnDelete").unwrap();
        assert_eq!(
            params.finish().unwrap_err().to_string(),
            "unknown StorageClass parameters: pathPatern, zeta (known: pathPattern, archiveOnDelete)"
        );
    }

    #[test]
    fn ids_and_modes_parse_as_chown_and_chmod_take_them() {
        assert_eq!(parse_id("uid", "1000"), Ok(1000));
        assert_eq!(parse_id("uid", "0"), Ok(0));
        for bad in ["-1", "+5", "4294967295", "1e3", "", "root"] {
            assert!(parse_id("uid", bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_mode("mode", "0770"), Ok(0o770));
        assert_eq!(parse_mode("mode", "2775"), Ok(0o2775));
        assert_eq!(parse_mode("mode", "0o700"), Ok(0o700));
        for bad in ["", "8", "17777", "rwx", "+7", "0x1ff"] {
            assert!(parse_mode("mode", bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            parse_mode("permPattern", "999").unwrap_err().to_string(),
            "parameter permPattern: expected octal permission bits such as 0770, got 999"
        );
    }
}
