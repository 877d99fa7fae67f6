//! `scaffold`: starter files written from what already exists, so nobody writes them twice: a
//! grant file from the needs a module declares, a guest crate from `guests/template`.
//!
//! A starter grant grants what the module asks, on the paths the operator names, and nothing
//! else; it is text for the operator to review, never read by the host as authority.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};

use crate::wasm::grants::{DirAccess, SourceKind};
use crate::wasm::needs::{self, Needs};

/// Where the starter grant puts a guest directory the operator did not map: under this
/// folder, named after the provisioner's last segment.
const DEFAULT_HOST_ROOT: &str = "/var/lib/wasm-provisioner";

/// `scaffold grant FILE.wasm`: the starter grant file text for the module in `file`.
/// `host_dirs` maps guest paths to host paths (`/volumes=/srv/volumes`).
pub fn grant_for_file(
    file: &Path,
    host_dirs: &[String],
    provisioner: Option<&str>,
) -> anyhow::Result<String> {
    let bytes = crate::wasm::engine::read_module(file)?;
    let declared = needs::read(&bytes)
        .with_context(|| format!("{}", file.display()))?
        .with_context(|| {
            format!(
                "{} declares no needs (no {} section: guests built with the SDK's `needs!` carry one); write its grant from docs/contract.md",
                file.display(),
                needs::SECTION
            )
        })?;
    let mut map = BTreeMap::new();
    for pair in host_dirs {
        let Some((guest, host)) = pair.split_once('=') else {
            bail!("--host-dir {pair:?}: expected GUEST=HOST, such as /volumes=/srv/volumes");
        };
        if !declared.dirs.iter().any(|d| d.guest == guest) {
            bail!("--host-dir {pair:?}: the module opens no directory {guest:?}");
        }
        map.insert(guest.to_string(), PathBuf::from(host));
    }
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("guest");
    Ok(grant(&declared, stem, &map, provisioner))
}

/// The starter grant text for `declared`, guest directories placed by `host_dirs` (others
/// under [`DEFAULT_HOST_ROOT`]).
pub fn grant(
    declared: &Needs,
    stem: &str,
    host_dirs: &BTreeMap<String, PathBuf>,
    provisioner: Option<&str>,
) -> String {
    let provisioner = provisioner
        .map(str::to_owned)
        .or_else(|| declared.provisioner.clone())
        .unwrap_or_else(|| format!("example.com/{stem}"));
    // The module's own name for itself places its directories, so its config examples (which
    // name those places) still match when the operator serves it under another name.
    let short = declared
        .provisioner
        .as_deref()
        .and_then(|p| p.rsplit('/').next())
        .unwrap_or(stem)
        .to_string();
    let default_root = format!("{DEFAULT_HOST_ROOT}/{short}");
    // Unmapped directories go under the default root (one directory: the root itself).
    let default_host = |guest: &str| -> String {
        if declared.dirs.len() == 1 {
            default_root.clone()
        } else {
            format!("{default_root}{guest}")
        }
    };
    let host_of = |guest: &str| -> String {
        host_dirs
            .get(guest)
            .map(|host| host.display().to_string())
            .unwrap_or_else(|| default_host(guest))
    };
    // A config example naming a directory's default host path follows where the operator put
    // it (`node-dir = "/var/lib/wasm-provisioner/hostpath"` becomes the `--host-dir` given).
    let placed = |example: &str| -> String {
        declared
            .dirs
            .iter()
            .find(|d| default_host(&d.guest) == example)
            .map(|d| host_of(&d.guest))
            .unwrap_or_else(|| example.to_string())
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Starter grant for {stem}.wasm, written by `wasm-provisioner scaffold grant` from what the\n\
         # module declares it needs. Review every line: the host grants what this file says, never\n\
         # what the module asks (docs/contract.md lists every key).\n"
    );
    let _ = writeln!(out, "# which StorageClass `provisioner:` this guest serves");
    let _ = writeln!(out, "provisioner = {}\n", quoted(&provisioner));
    let _ = writeln!(out, "[limits]");
    let limits = declared.limits.as_ref();
    let timeout = limits.and_then(|l| l.call_timeout_ms).unwrap_or(10_000);
    let memory = limits.and_then(|l| l.memory_mib).unwrap_or(64);
    let _ = writeln!(out, "call-timeout-ms = {timeout}\nmemory-mib = {memory}\n");
    for dir in &declared.dirs {
        if let Some(why) = &dir.why {
            let _ = writeln!(out, "# {}: {why}", dir.guest);
        }
        let _ = writeln!(
            out,
            "[[dirs]]\nhost = {}\nguest = {}\naccess = {}\n",
            quoted(&host_of(&dir.guest)),
            quoted(&dir.guest),
            quoted(needs::access_name(dir.access))
        );
    }
    let _ = writeln!(out, "[volumes]");
    let kinds: Vec<String> = declared.kinds.iter().map(|k| quoted(k.as_str())).collect();
    let _ = writeln!(out, "kinds = [{}]", kinds.join(", "));
    let paths = declared
        .kinds
        .iter()
        .any(|k| matches!(k, SourceKind::HostPath | SourceKind::Local));
    if paths {
        let prefixes: Vec<String> = declared
            .dirs
            .iter()
            .filter(|d| d.access == DirAccess::ReadWrite)
            .map(|d| quoted(&host_of(&d.guest)))
            .collect();
        let _ = writeln!(
            out,
            "# where its hostPath/local volumes may lie on the node\npath-prefixes = [{}]",
            prefixes.join(", ")
        );
    }
    if declared.kinds.contains(&SourceKind::Nfs) {
        let _ = writeln!(
            out,
            "# the NFS servers its volumes may name, and per server the export paths\nnfs-servers = []\nnfs-exports = {{}}"
        );
    }
    if declared.kinds.contains(&SourceKind::Csi) {
        let _ = writeln!(
            out,
            "# the CSI drivers its volumes may name, and per driver the volume handles\ncsi-drivers = []\ncsi-volume-handles = {{}}"
        );
    }
    if declared.owners {
        let _ = writeln!(
            out,
            "# owners a StorageClass may give its volumes: narrow these to your tenants' ids\nuids = [\"1000-59999\"]\ngids = [\"1000-59999\"]"
        );
    }
    let _ = writeln!(out, "\n[config]");
    for key in &declared.config {
        if let Some(why) = &key.why {
            let _ = writeln!(out, "# {why}");
        }
        let value = key
            .example
            .as_deref()
            .map(|example| config_value(example, &placed));
        match (value, key.required) {
            (Some(value), _) => {
                let _ = writeln!(out, "{} = {value}", bare_key(&key.key));
            }
            (None, true) => {
                let _ = writeln!(out, "# {} = ...    # required: set it", bare_key(&key.key));
            }
            (None, false) => {
                let _ = writeln!(out, "# {} = ...", bare_key(&key.key));
            }
        }
    }
    out
}

/// A config example as a TOML value: an array or inline table as written, any other text as a
/// (placed) string.
fn config_value(example: &str, placed: &dyn Fn(&str) -> String) -> String {
    let trimmed = example.trim_start();
    if (trimmed.starts_with('[') || trimmed.starts_with('{'))
        && toml::from_str::<toml::Table>(&format!("v = {example}")).is_ok()
    {
        return example.to_string();
    }
    quoted(&placed(example))
}

fn quoted(text: &str) -> String {
    toml::Value::String(text.to_string()).to_string()
}

fn bare_key(key: &str) -> String {
    if !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        key.to_string()
    } else {
        quoted(key)
    }
}

/// `guests/template`, built into the binary: (path in the new crate, text). The template's
/// `cargo-generate.toml` is cargo-generate's, not the guest's.
const TEMPLATE: &[(&str, &str)] = &[
    ("Cargo.toml", include_str!("../guests/template/Cargo.toml")),
    ("README.md", include_str!("../guests/template/README.md")),
    (".gitignore", include_str!("../guests/template/.gitignore")),
    ("src/lib.rs", include_str!("../guests/template/src/lib.rs")),
    (
        "tests/guest.rs",
        include_str!("../guests/template/tests/guest.rs"),
    ),
    (
        "{{project-name}}.toml",
        include_str!("../guests/template/{{project-name}}.toml"),
    ),
];

/// `scaffold guest NAME --sdk PATH`: a new guest crate in `dir` (default `./NAME`) that builds,
/// passes its tests and loads with its grant file.
pub fn guest(name: &str, sdk: &Path, dir: Option<&Path>) -> anyhow::Result<String> {
    let valid = name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !valid {
        bail!("guest name {name:?}: lowercase letters, digits and '-', starting with a letter");
    }
    let sdk = std::fs::canonicalize(sdk)
        .with_context(|| format!("--sdk {}: not found", sdk.display()))?;
    if !sdk.join("Cargo.toml").is_file() {
        bail!(
            "--sdk {}: no Cargo.toml (give the guests/sdk folder of a wasm-provisioner checkout)",
            sdk.display()
        );
    }
    let dir = dir
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(name));
    if dir.exists() {
        bail!("{} exists; choose another --dir", dir.display());
    }
    let sdk_text = sdk
        .to_str()
        .context("the SDK's path is not UTF-8")?
        .replace('\\', "\\\\");
    let render = |text: &str| {
        text.replace("{{project-name}}", name)
            .replace("{{crate_name}}", &name.replace('-', "_"))
            .replace("{{sdk-path}}", &sdk_text)
    };
    let mut written = Vec::new();
    for (path, text) in TEMPLATE {
        let target = dir.join(render(path));
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&target, render(text))
            .with_context(|| format!("cannot write {}", target.display()))?;
        written.push(format!("  {}\n", target.display()));
    }
    Ok(format!(
        "created guest {name} in {}:\n{}next: cd {} && cargo test && cargo build --release --target wasm32-wasip2\n",
        dir.display(),
        written.concat(),
        dir.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wasm::Grants;

    fn declared(json: &str) -> Needs {
        serde_json::from_str(json).unwrap()
    }

    /// Whatever a module declares, its starter grant parses and lacks nothing it declared.
    #[test]
    fn a_starter_grant_gives_every_declared_need_and_parses() {
        let cases = [
            r#"{"needs": 1, "provisioner": "x.dev/hostpath",
                "dirs": [{"guest": "/volumes", "access": "read-write", "why": "one per volume"}],
                "kinds": ["host-path"],
                "config": [{"key": "guest-dir", "example": "/volumes"},
                           {"key": "node-dir", "example": "/var/lib/wasm-provisioner/hostpath", "required": true}],
                "owners": true, "limits": {"memory-mib": 32, "call-timeout-ms": 5000}}"#,
            r#"{"needs": 1, "dirs": [{"guest": "/a", "access": "read-only"}, {"guest": "/b", "access": "read-write"}],
                "kinds": ["nfs", "csi", "local"],
                "config": [{"key": "map", "example": "[{ node = \"n\", paths = [\"/p\"] }]", "required": true},
                           {"key": "odd key", "required": true}, {"key": "quiet"}]}"#,
            r#"{"needs": 1}"#,
        ];
        for json in cases {
            let needs = declared(json);
            let text = grant(&needs, "g", &BTreeMap::new(), None);
            let grants =
                Grants::parse(&text, Path::new("/")).unwrap_or_else(|e| panic!("{e}\n{text}"));
            let lacking: Vec<String> = needs::missing(&needs, &grants)
                .into_iter()
                .filter(|m| !m.contains("odd key"))
                .collect();
            assert!(lacking.is_empty(), "{lacking:?}\n{text}");
        }
    }

    #[test]
    fn mapped_directories_move_the_config_that_names_them() {
        let needs = declared(
            r#"{"needs": 1, "provisioner": "x.dev/hostpath",
                "dirs": [{"guest": "/volumes", "access": "read-write"}], "kinds": ["host-path"],
                "config": [{"key": "node-dir", "example": "/var/lib/wasm-provisioner/hostpath"}]}"#,
        );
        let unmapped = grant(&needs, "g", &BTreeMap::new(), None);
        assert!(
            unmapped.contains("host = \"/var/lib/wasm-provisioner/hostpath\""),
            "{unmapped}"
        );
        let map = BTreeMap::from([("/volumes".to_string(), PathBuf::from("/srv/v"))]);
        let text = grant(&needs, "g", &map, Some("me.dev/p"));
        let grants = Grants::parse(&text, Path::new("/")).unwrap();
        assert_eq!(grants.provisioner, "me.dev/p");
        assert_eq!(grants.dirs[0].host, PathBuf::from("/srv/v"));
        assert_eq!(grants.volumes.path_prefixes, vec![PathBuf::from("/srv/v")]);
        assert!(
            grants.config_json.contains("\"node-dir\":\"/srv/v\""),
            "{}",
            grants.config_json
        );
    }
}
