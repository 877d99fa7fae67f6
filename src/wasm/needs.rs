//! What a guest says it needs from its grant file: the `wasm-provisioner:needs` custom section
//! the SDK writes from the guest's own declaration.
//!
//! The section is advice, never authority: the host grants only what the operator's grant file
//! says. It serves three readers: `inspect` prints it, `scaffold grant` turns it into a starter
//! grant file, and a load warns when the grant lacks something the module says it needs (a
//! guest that will fail on its first claim is better reported at load).

use std::collections::BTreeSet;

use serde::Deserialize;

use super::grants::{DirAccess, Grants, SourceKind};

/// The custom section's name, in the core module the SDK builds (or in the component itself).
pub const SECTION: &str = "wasm-provisioner:needs";

/// The largest section read: a declaration is a few hundred bytes; more is not one.
const MAX_SECTION_BYTES: usize = 64 * 1024;
/// Components nest modules and components; a real guest has one or two levels.
const MAX_DEPTH: usize = 8;

/// A guest's declaration, as the SDK writes it (unknown fields are ignored: newer SDKs may say
/// more than this host reads).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Needs {
    /// The declaration's format version (1).
    pub needs: u32,
    /// The StorageClass `provisioner:` name the author suggests.
    #[serde(default)]
    pub provisioner: Option<String>,
    /// Directories the guest opens.
    #[serde(default)]
    pub dirs: Vec<NeededDir>,
    /// PV source kinds it builds.
    #[serde(default)]
    pub kinds: BTreeSet<SourceKind>,
    /// Keys of `[config]` it reads.
    #[serde(default)]
    pub config: Vec<NeededConfig>,
    /// Whether it gives volumes an owner (uid/gid/mode), which the grant must allow.
    #[serde(default)]
    pub owners: bool,
    /// Limits the author expects to be enough.
    #[serde(default)]
    pub limits: Option<NeededLimits>,
}

/// One directory a guest opens.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct NeededDir {
    /// The path the guest opens.
    pub guest: String,
    /// The access it needs.
    pub access: DirAccess,
    /// What for, in the author's words.
    #[serde(default)]
    pub why: Option<String>,
}

/// One `[config]` key a guest reads.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct NeededConfig {
    /// The key.
    pub key: String,
    /// A value that works, as text.
    #[serde(default)]
    pub example: Option<String>,
    /// Whether the guest refuses to work without it.
    #[serde(default)]
    pub required: bool,
    /// What for, in the author's words.
    #[serde(default)]
    pub why: Option<String>,
}

/// The limits a guest's author expects.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct NeededLimits {
    /// `limits.memory-mib`.
    #[serde(default)]
    pub memory_mib: Option<u64>,
    /// `limits.call-timeout-ms`.
    #[serde(default)]
    pub call_timeout_ms: Option<u64>,
}

/// Why a module's declaration could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NeedsError {
    /// The bytes are not a well-formed module or component (the compiler says more).
    #[error("not a WebAssembly module or component: {0}")]
    Malformed(&'static str),
    /// The section is there but not a declaration this host reads.
    #[error("its {SECTION} section is not a readable declaration: {0}")]
    Declaration(String),
}

/// The declaration in `bytes` (a component or a core module), if it carries one.
pub fn read(bytes: &[u8]) -> Result<Option<Needs>, NeedsError> {
    let Some(section) = find_section(bytes, SECTION, 0)? else {
        return Ok(None);
    };
    if section.len() > MAX_SECTION_BYTES {
        return Err(NeedsError::Declaration(format!(
            "{} bytes, more than {MAX_SECTION_BYTES}",
            section.len()
        )));
    }
    let needs: Needs =
        serde_json::from_slice(section).map_err(|e| NeedsError::Declaration(e.to_string()))?;
    if needs.needs != 1 {
        return Err(NeedsError::Declaration(format!(
            "format version {}, this host reads 1",
            needs.needs
        )));
    }
    Ok(Some(needs))
}

/// The first custom section named `name`, at this level or in a nested module or component.
/// Walks the binary format's section headers only (id, LEB128 size); never more than `bytes`.
fn find_section<'a>(
    bytes: &'a [u8],
    name: &str,
    depth: usize,
) -> Result<Option<&'a [u8]>, NeedsError> {
    if depth > MAX_DEPTH {
        return Err(NeedsError::Malformed("nested too deep"));
    }
    if bytes.len() < 8 || &bytes[..4] != b"\0asm" {
        return Err(NeedsError::Malformed("no wasm preamble"));
    }
    // Core modules are version 1 layer 0; components have layer 1 in bytes 6..8.
    let component = bytes[6..8] == [1, 0];
    let mut rest = &bytes[8..];
    while !rest.is_empty() {
        let id = rest[0];
        let (size, used) = leb128_u32(&rest[1..])?;
        let start = 1 + used;
        let end = start
            .checked_add(size as usize)
            .filter(|end| *end <= rest.len())
            .ok_or(NeedsError::Malformed("a section runs past the end"))?;
        let content = &rest[start..end];
        match id {
            0 => {
                let (len, used) = leb128_u32(content)?;
                let text = content
                    .get(used..used + len as usize)
                    .ok_or(NeedsError::Malformed(
                        "a custom section's name runs past it",
                    ))?;
                if text == name.as_bytes() {
                    return Ok(Some(&content[used + len as usize..]));
                }
            }
            // A component's core module (1) and nested component (4) sections hold whole binaries.
            1 | 4 if component => {
                if let Some(found) = find_section(content, name, depth + 1)? {
                    return Ok(Some(found));
                }
            }
            _ => {}
        }
        rest = &rest[end..];
    }
    Ok(None)
}

/// An unsigned LEB128 number of at most 5 bytes, and how many bytes it took.
fn leb128_u32(bytes: &[u8]) -> Result<(u32, usize), NeedsError> {
    let mut value: u64 = 0;
    for (i, byte) in bytes.iter().take(5).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return u32::try_from(value)
                .map(|v| (v, i + 1))
                .map_err(|_| NeedsError::Malformed("a size overflows"));
        }
    }
    Err(NeedsError::Malformed("a size is cut off"))
}

/// What the grant lacks of what the module says it needs to serve any claim, one sentence each.
pub fn missing(needs: &Needs, grants: &Grants) -> Vec<String> {
    let mut out = Vec::new();
    let config: serde_json::Value =
        serde_json::from_str(&grants.config_json).unwrap_or(serde_json::Value::Null);
    for dir in &needs.dirs {
        // A directory a config key places (its example is the declared path, as the SDK
        // declares `guest-dir`) is wherever the grant's config puts it.
        let path = needs
            .config
            .iter()
            .filter(|key| key.example.as_deref() == Some(dir.guest.as_str()))
            .find_map(|key| config.get(&key.key)?.as_str())
            .unwrap_or(&dir.guest);
        let granted = grants.dirs.iter().find(|d| d.guest == path);
        match granted {
            None => out.push(format!(
                "the module opens {path} ({}) and the grant has no [[dirs]] with guest = {path:?}",
                access_name(dir.access),
            )),
            Some(d) if dir.access == DirAccess::ReadWrite && d.access == DirAccess::ReadOnly => out
                .push(format!(
                    "the module writes in {path} and the grant gives it read-only"
                )),
            Some(_) => {}
        }
    }
    for kind in &needs.kinds {
        if !grants.volumes.kinds.contains(kind) {
            out.push(format!(
                "the module builds {} volumes and volumes.kinds does not grant {:?}",
                kind.as_str(),
                kind.as_str()
            ));
        }
    }
    for key in needs.config.iter().filter(|c| c.required) {
        if config.get(&key.key).is_none() {
            out.push(format!(
                "the module needs config key {:?} and [config] does not set it",
                key.key
            ));
        }
    }
    // `owners` is not a need: without uids/gids only the classes that ask for an owner fail,
    // which is the operator's choice (inspect and scaffold grant show it).
    out
}

/// The label of the warnings a load gives about what the grant lacks.
pub const WARNING_LABEL: &str = "needs";

/// What a load says about module `bytes` under `grants`: what the grant lacks of the module's
/// declaration, or why the declaration cannot be read. Nothing for a module without one.
pub fn warnings(bytes: &[u8], grants: &Grants) -> Vec<String> {
    match read(bytes) {
        Ok(Some(needs)) => missing(&needs, grants)
            .into_iter()
            .map(|m| format!("{m} (loaded anyway: the grant file decides)"))
            .collect(),
        Ok(None) => Vec::new(),
        Err(error) => vec![format!(
            "the module's declaration of its needs is ignored: {error}"
        )],
    }
}

/// The grant-file spelling of an access.
pub fn access_name(access: DirAccess) -> &'static str {
    match access {
        DirAccess::ReadOnly => "read-only",
        DirAccess::ReadWrite => "read-write",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const DECLARATION: &str = r#"{"needs": 1, "provisioner": "example.dev/hp",
        "dirs": [{"guest": "/volumes", "access": "read-write", "why": "volumes"}],
        "kinds": ["host-path"],
        "config": [{"key": "node-dir", "example": "/srv", "required": true}],
        "owners": true, "limits": {"memory-mib": 32}, "from-a-newer-sdk": [1]}"#;

    fn component_with(section: &str, name: &str) -> Vec<u8> {
        let escaped = section
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', " ");
        wat::parse_str(format!(
            r#"(component (core module (@custom "{name}" "{escaped}")))"#
        ))
        .unwrap()
    }

    #[test]
    fn the_declaration_is_found_in_the_core_module_of_a_component() {
        let needs = read(&component_with(DECLARATION, SECTION))
            .unwrap()
            .unwrap();
        assert_eq!(needs.provisioner.as_deref(), Some("example.dev/hp"));
        assert_eq!(needs.dirs[0].access, DirAccess::ReadWrite);
        assert!(needs.kinds.contains(&SourceKind::HostPath));
        assert!(needs.owners && needs.config[0].required);
        assert_eq!(needs.limits.unwrap().memory_mib, Some(32));
    }

    #[test]
    fn modules_without_it_or_with_a_bad_one_say_so_and_garbage_is_not_a_panic() {
        assert!(
            read(&component_with(DECLARATION, "other"))
                .unwrap()
                .is_none()
        );
        let bad = read(&component_with("{\"needs\": 2}", SECTION)).unwrap_err();
        assert!(bad.to_string().contains("format version 2"), "{bad}");
        assert!(read(&component_with("not json", SECTION)).is_err());
        let wasm = wat::parse_str("(component)").unwrap();
        for cut in 0..wasm.len() {
            let _ = read(&wasm[..cut]);
        }
        // A section that claims more bytes than there are.
        let mut lying = b"\0asm\x0d\x00\x01\x00".to_vec();
        lying.extend([1, 0xff, 0xff, 0xff, 0x0f]);
        assert!(read(&lying).is_err());
    }

    #[test]
    fn a_grant_that_lacks_what_the_module_needs_is_told_each_thing() {
        let needs = read(&component_with(DECLARATION, SECTION))
            .unwrap()
            .unwrap();
        let bare = Grants::parse(
            "provisioner = \"p\"\n[[dirs]]\nhost = \"/tmp\"\nguest = \"/volumes\"\naccess = \"read-only\"\n",
            Path::new("/"),
        )
        .unwrap();
        let said = missing(&needs, &bare);
        assert_eq!(said.len(), 3, "{said:#?}");
        let full = Grants::parse(
            "provisioner = \"p\"\n[[dirs]]\nhost = \"/tmp\"\nguest = \"/volumes\"\naccess = \"read-write\"\n\
             [volumes]\nkinds = [\"host-path\"]\nuids = [\"1000\"]\n[config]\nnode-dir = \"/srv\"\n",
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(missing(&needs, &full), Vec::<String>::new());
        // The directory placed elsewhere by the config key whose example is its path.
        let placed: Needs = serde_json::from_str(
            r#"{"needs": 1, "dirs": [{"guest": "/volumes", "access": "read-write"}],
                "config": [{"key": "guest-dir", "example": "/volumes"}]}"#,
        )
        .unwrap();
        let elsewhere = Grants::parse(
            "provisioner = \"p\"\n[[dirs]]\nhost = \"/tmp\"\nguest = \"/state\"\naccess = \"read-write\"\n\
             [config]\nguest-dir = \"/state\"\n",
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(missing(&placed, &elsewhere), Vec::<String>::new());
        let unplaced = Grants::parse(
            "provisioner = \"p\"\n[[dirs]]\nhost = \"/tmp\"\nguest = \"/state\"\naccess = \"read-write\"\n",
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(missing(&placed, &unplaced).len(), 1);
    }
}
