//! What a guest needs from the operator's grant file, declared once in Rust with
//! [`needs!`](crate::needs!): the declaration becomes the `wasm-provisioner:needs` custom
//! section of the guest's module (JSON the host reads to write a starter grant and to compare
//! with the grant it is given), and the constants the guest's own code reads its directories
//! and config with.
//!
//! ```text
//! needs! { provisioner, dirs: [VOLUMES = {..}], kinds, config: [NODE_DIR = {..}], owners, limits }
//!   ├─▶ NEEDS.json: concat!-ed at compile time ─▶ #[used] static [u8; N] in the custom section
//!   ├─▶ VOLUMES: &str (the guest path)          ─▶ the guest creates volumes there
//!   └─▶ NODE_DIR: ConfigKey (key, default)      ─▶ NEEDS.config(json)?.get(NODE_DIR)?
//! ```

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::config::ConfigError;

/// The name of the custom section the declaration is written to.
pub const SECTION: &str = "wasm-provisioner:needs";

/// A guest's declared needs, as [`needs!`](crate::needs!) generates them (`NEEDS`).
#[derive(Debug, Clone, Copy)]
pub struct Needs {
    /// The declaration as JSON: exactly the bytes of the custom section.
    pub json: &'static str,
    /// The config keys the guest reads; any other key in `[config]` is refused.
    pub config: &'static [ConfigKey],
}

/// One key of the grant file's `[config]` table, as declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigKey {
    /// The key, as written in the grant file (`guest-dir`).
    pub key: &'static str,
    /// Whether the grant must set it (then it has no default).
    pub required: bool,
    /// The value used when the grant does not set it, as JSON (`8000`, `"/volumes"`).
    pub default: Option<&'static str>,
}

impl Needs {
    /// Parses the grant's `[config]` (the JSON every request carries), refusing keys that were
    /// not declared, so a typo in the grant file fails loudly instead of being ignored.
    pub fn config(&self, json: &str) -> Result<Config, ConfigError> {
        let values: Map<String, Value> =
            serde_json::from_str(json).map_err(|error| ConfigError(error.to_string()))?;
        if let Some(unknown) = values
            .keys()
            .find(|key| !self.config.iter().any(|declared| declared.key == *key))
        {
            let expected: Vec<String> = self
                .config
                .iter()
                .map(|declared| format!("`{}`", declared.key))
                .collect();
            return Err(ConfigError(format!(
                "unknown field `{unknown}`, expected one of {}",
                expected.join(", ")
            )));
        }
        Ok(Config { values })
    }

    /// The declared config keys, in declaration order.
    pub fn config_keys(&self) -> Vec<&'static str> {
        self.config.iter().map(|declared| declared.key).collect()
    }
}

/// The grant's `[config]`, checked against the declared keys; read each with [`Config::get`].
#[derive(Debug, Clone)]
pub struct Config {
    values: Map<String, Value>,
}

impl Config {
    /// The value of `key` as `T`: the grant's value, else the declared default, else `None`
    /// for an `Option`; a required key the grant lacks is "missing field `key`".
    pub fn get<T: DeserializeOwned>(&self, key: ConfigKey) -> Result<T, ConfigError> {
        let invalid = |error: serde_json::Error| ConfigError(format!("{}: {error}", key.key));
        if let Some(value) = self.values.get(key.key) {
            return serde_json::from_value(value.clone()).map_err(invalid);
        }
        if let Some(default) = key.default {
            return serde_json::from_str(default).map_err(invalid);
        }
        // An optional key without a default reads as null: `None` for an `Option`.
        serde_json::from_value(Value::Null)
            .map_err(|_| ConfigError(format!("missing field `{}`", key.key)))
    }
}

/// Copies `text` into an array of exactly its length, at compile time: the custom section's
/// contents (a `#[link_section]` static must be a byte array, not a reference).
pub const fn section_bytes<const N: usize>(text: &str) -> [u8; N] {
    let bytes = text.as_bytes();
    assert!(bytes.len() == N, "the section is as long as its text");
    let mut out = [0u8; N];
    let mut at = 0;
    while at < N {
        out[at] = bytes[at];
        at += 1;
    }
    out
}

/// Fails the build when a declared text would break the JSON it is pasted into: `concat!`
/// cannot escape, so `"`, `\` and control characters are refused instead.
pub const fn plain(text: &str) {
    let bytes = text.as_bytes();
    let mut at = 0;
    while at < bytes.len() {
        let byte = bytes[at];
        assert!(
            byte != b'"' && byte != b'\\' && byte >= 0x20,
            "needs!: texts may not hold `\"`, `\\` or control characters"
        );
        at += 1;
    }
}

/// Fails the build unless `text` is one of `choices` (an access mode, a volume kind).
pub const fn one_of(text: &str, choices: &[&str]) {
    let mut at = 0;
    while at < choices.len() {
        if same(text, choices[at]) {
            return;
        }
        at += 1;
    }
    panic!("needs!: access is read-only or read-write; kinds are host-path, local, nfs, csi");
}

const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut at = 0;
    while at < a.len() {
        if a[at] != b[at] {
            return false;
        }
        at += 1;
    }
    true
}

/// The access modes a declared directory may have.
pub const ACCESS: &[&str] = &["read-only", "read-write"];
/// The volume kinds a guest may declare.
pub const KINDS: &[&str] = &["host-path", "local", "nfs", "csi"];

/// The field names of a struct `T` derives `Deserialize` for, in order (its `rename`s
/// applied): for a guest whose `[config]` is a serde struct, a test that its fields are the
/// declared keys keeps the struct and the declaration one list.
pub fn serde_fields<T: DeserializeOwned>() -> Vec<&'static str> {
    let mut fields = Vec::new();
    let _ = T::deserialize(FieldNames(&mut fields));
    fields
}

/// A deserializer that records the field names a struct asks for, then stops.
struct FieldNames<'a>(&'a mut Vec<&'static str>);

impl<'de> serde::Deserializer<'de> for FieldNames<'_> {
    type Error = serde::de::value::Error;

    fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
        Err(serde::de::Error::custom("not a struct"))
    }

    fn deserialize_struct<V: serde::de::Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.extend_from_slice(fields);
        Err(serde::de::Error::custom("field names recorded"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// Declares what the guest needs from its grant file, once: writes it as JSON to the
/// `wasm-provisioner:needs` custom section and defines the constants the guest reads with.
///
/// ```
/// wasm_provisioner_sdk::needs! {
///     provisioner: "example.com/my-guest",
///     dirs: [VOLUMES = { guest: "/volumes", access: "read-write", why: "one directory per volume" }],
///     kinds: ["host-path"],
///     config: [
///         NODE_DIR = { key: "node-dir", required: true, example: "/var/lib/my-guest",
///                      why: "the granted directory as the node sees it" },
///         TIMEOUT_MS = { key: "timeout-ms", required: false, default: 8000,
///                        why: "how long a copy may take" },
///     ],
///     owners: false,
///     limits: { memory-mib: 64, call-timeout-ms: 10000 },
/// }
/// let config = NEEDS.config(r#"{"node-dir": "/data"}"#).unwrap();
/// assert_eq!(VOLUMES, "/volumes");
/// assert_eq!(config.get::<String>(NODE_DIR).unwrap(), "/data");
/// assert_eq!(config.get::<u64>(TIMEOUT_MS).unwrap(), 8000);
/// assert!(NEEDS.json.starts_with(r#"{"needs": 1, "provisioner": "example.com/my-guest""#));
/// ```
///
/// Defines `NEEDS` ([`needs::Needs`](crate::needs::Needs)), a `&str` constant per directory
/// (its guest path) and a [`ConfigKey`](crate::needs::ConfigKey) per config key. `default`
/// (a literal, used by [`Config::get`](crate::needs::Config::get)) stays in the guest;
/// `example` (a string) goes to the section for the starter grant. Texts may not hold `"` or
/// `\`; access and kinds are checked: both fail the build.
#[macro_export]
macro_rules! needs {
    (
        provisioner: $provisioner:literal,
        dirs: [$($dir:ident = {
            guest: $guest:literal, access: $access:literal, why: $dir_why:literal $(,)?
        }),* $(,)?],
        kinds: [$($kind:literal),* $(,)?],
        config: [$($key_name:ident = {
            key: $key:literal, required: $required:literal
            $(, default: $default:literal)? $(, example: $example:literal)?
            , why: $key_why:literal $(,)?
        }),* $(,)?],
        owners: $owners:literal,
        limits: { memory-mib: $memory:literal, call-timeout-ms: $timeout:literal $(,)? } $(,)?
    ) => {
        /// What this guest needs from its grant file (the `wasm-provisioner:needs` section).
        pub const NEEDS: $crate::needs::Needs = $crate::needs::Needs {
            json: $crate::__needs_json!(
                $provisioner, [$(($guest, $access, $dir_why)),*], [$($kind),*],
                [$(($key, $required, ($($example)?), $key_why)),*], $owners, $memory, $timeout
            ),
            config: &[$($key_name),*],
        };

        $(
            #[doc = concat!("The granted directory `", $guest, "`: ", $dir_why, ".")]
            pub const $dir: &str = $guest;
        )*

        $(
            #[doc = concat!("Config key `", $key, "`: ", $key_why, ".")]
            pub const $key_name: $crate::needs::ConfigKey = $crate::needs::ConfigKey {
                key: $key,
                required: $required,
                default: $crate::__needs_default!($($default)?),
            };
        )*

        const _: () = {
            $crate::needs::plain($provisioner);
            $( $crate::needs::plain($dir_why); $crate::needs::plain($guest);
               $crate::needs::one_of($access, $crate::needs::ACCESS); )*
            $( $crate::needs::one_of($kind, $crate::needs::KINDS); )*
            $( $crate::needs::plain($key); $crate::needs::plain($key_why);
               $( $crate::needs::plain($example); )?
               assert!(!($required && $crate::__needs_default!($($default)?).is_some()),
                   "needs!: a required config key has no default"); )*
        };

        // Only the WebAssembly module carries the section; natively (unit tests) the bytes are
        // plain data, and ELF or Mach-O would not take this section name.
        #[used]
        #[cfg_attr(target_family = "wasm", unsafe(link_section = "wasm-provisioner:needs"))]
        static WASM_PROVISIONER_NEEDS: [u8; NEEDS.json.len()] =
            $crate::needs::section_bytes(NEEDS.json);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __needs_default {
    () => {
        None::<&'static str>
    };
    ($default:literal) => {
        Some(stringify!($default))
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __needs_json {
    (
        $provisioner:literal, [$(($guest:literal, $access:literal, $dir_why:literal)),*],
        [$($kind:literal),*],
        [$(($key:literal, $required:literal, ($($example:literal)?), $key_why:literal)),*],
        $owners:literal, $memory:literal, $timeout:literal
    ) => {
        concat!(
            "{\"needs\": 1, \"provisioner\": \"", $provisioner, "\", \"dirs\": [",
            $crate::__needs_list!($(concat!(
                "{\"guest\": \"", $guest, "\", \"access\": \"", $access,
                "\", \"why\": \"", $dir_why, "\"}"
            )),*),
            "], \"kinds\": [", $crate::__needs_list!($(concat!("\"", $kind, "\"")),*),
            "], \"config\": [",
            $crate::__needs_list!($(concat!(
                "{\"key\": \"", $key, "\"", $(", \"example\": \"", $example, "\"",)?
                ", \"required\": ", $required, ", \"why\": \"", $key_why, "\"}"
            )),*),
            "], \"owners\": ", $owners,
            ", \"limits\": {\"memory-mib\": ", $memory, ", \"call-timeout-ms\": ", $timeout, "}}"
        )
    };
}

/// Joins string expressions with `, ` (JSON array elements) inside `concat!`.
#[doc(hidden)]
#[macro_export]
macro_rules! __needs_list {
    () => {
        ""
    };
    ($first:expr $(, $rest:expr)*) => {
        concat!($first $(, ", ", $rest)*)
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::needs! {
        provisioner: "wasm-provisioner.dev/hostpath",
        dirs: [
            VOLUMES = { guest: "/volumes", access: "read-write", why: "one directory per volume" },
            SEEDS = { guest: "/seeds", access: "read-only", why: "data new volumes start with" },
        ],
        kinds: ["host-path", "local"],
        config: [
            GUEST_DIR = { key: "guest-dir", required: false, default: "/volumes", example: "/volumes",
                          why: "where the volumes directory is preopened" },
            NODE_DIR = { key: "node-dir", required: true, example: "/var/lib/x",
                         why: "the same directory as the node sees it" },
            NODE_NAME = { key: "node-name", required: false, why: "pins volumes to this node" },
            TIMEOUT_MS = { key: "timeout-ms", required: false, default: 8000, why: "in ms" },
        ],
        owners: true,
        limits: { memory-mib: 64, call-timeout-ms: 10000 },
    }

    #[test]
    fn the_section_is_the_declaration_as_json() {
        let json: Value = serde_json::from_str(NEEDS.json).unwrap();
        let expected = serde_json::json!({
            "needs": 1,
            "provisioner": "wasm-provisioner.dev/hostpath",
            "dirs": [
                {"guest": "/volumes", "access": "read-write", "why": "one directory per volume"},
                {"guest": "/seeds", "access": "read-only", "why": "data new volumes start with"},
            ],
            "kinds": ["host-path", "local"],
            "config": [
                {"key": "guest-dir", "example": "/volumes", "required": false,
                 "why": "where the volumes directory is preopened"},
                {"key": "node-dir", "example": "/var/lib/x", "required": true,
                 "why": "the same directory as the node sees it"},
                {"key": "node-name", "required": false, "why": "pins volumes to this node"},
                {"key": "timeout-ms", "required": false, "why": "in ms"},
            ],
            "owners": true,
            "limits": {"memory-mib": 64, "call-timeout-ms": 10000},
        });
        assert_eq!(json, expected);
        assert_eq!(&WASM_PROVISIONER_NEEDS[..], NEEDS.json.as_bytes());
        assert_eq!((VOLUMES, SEEDS), ("/volumes", "/seeds"));
    }

    #[test]
    fn an_empty_declaration_is_valid_json() {
        mod empty {
            crate::needs! {
                provisioner: "example.com/x", dirs: [], kinds: [], config: [], owners: false,
                limits: { memory-mib: 16, call-timeout-ms: 1000 }
            }
            pub const JSON: &str = NEEDS.json;
        }
        let json: Value = serde_json::from_str(empty::JSON).unwrap();
        assert_eq!(json["dirs"], serde_json::json!([]));
        assert_eq!(json["config"], serde_json::json!([]));
    }

    #[test]
    fn config_reads_declared_keys_with_their_defaults() {
        let config = NEEDS.config(r#"{"node-dir": "/data"}"#).unwrap();
        assert_eq!(config.get::<String>(GUEST_DIR).unwrap(), "/volumes");
        assert_eq!(config.get::<String>(NODE_DIR).unwrap(), "/data");
        assert_eq!(config.get::<Option<String>>(NODE_NAME).unwrap(), None);
        assert_eq!(config.get::<u64>(TIMEOUT_MS).unwrap(), 8000);
        let config = NEEDS
            .config(r#"{"node-dir": "/d", "timeout-ms": 5, "node-name": "n1"}"#)
            .unwrap();
        assert_eq!(config.get::<u64>(TIMEOUT_MS).unwrap(), 5);
        assert_eq!(
            config.get::<Option<String>>(NODE_NAME).unwrap().as_deref(),
            Some("n1")
        );
    }

    #[test]
    fn config_errors_name_the_key() {
        let missing = NEEDS.config("{}").unwrap().get::<String>(NODE_DIR);
        assert_eq!(
            missing.unwrap_err().to_string(),
            "guest config: missing field `node-dir`"
        );
        let unknown = NEEDS.config(r#"{"nod-dir": "/d"}"#).unwrap_err();
        assert_eq!(
            unknown.to_string(),
            "guest config: unknown field `nod-dir`, expected one of `guest-dir`, `node-dir`, \
             `node-name`, `timeout-ms`"
        );
        let wrong = NEEDS.config(r#"{"timeout-ms": "soon"}"#).unwrap();
        let error = wrong.get::<u64>(TIMEOUT_MS).unwrap_err().to_string();
        assert!(
            error.starts_with("guest config: timeout-ms: invalid type"),
            "{error}"
        );
        assert!(NEEDS.config("[]").is_err());
    }

    #[test]
    fn serde_fields_lists_a_structs_keys() {
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "kebab-case")]
        #[allow(dead_code)]
        struct Sample {
            guest_dir: String,
            node_name: Option<String>,
        }
        assert_eq!(serde_fields::<Sample>(), ["guest-dir", "node-name"]);
    }
}
