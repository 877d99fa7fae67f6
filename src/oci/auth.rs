//! Registry credentials and challenges: the Docker `config.json` (a kubelet
//! `kubernetes.io/dockerconfigjson` Secret's `.dockerconfigjson`, mounted as a file) and the
//! `WWW-Authenticate` header a registry answers 401 with (`Basic` or the `Bearer` token flow).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Deserialize;

/// Why credentials could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot read the registry config {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path} is not a Docker config.json ({{\"auths\": {{\"host:port\": {{\"auth\": ...}}}}}})"
    )]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{path}: the entry for {host:?} has neither an `auth` (base64 of user:password) nor `username` and `password`"
    )]
    NoSecret { path: PathBuf, host: String },
    #[error("{path}: the `auth` of {host:?} is not base64 of user:password")]
    BadAuth { path: PathBuf, host: String },
}

/// A user name and password (or token used as one, as registries take them).
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    // The password stays out of logs and error messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({:?}, <redacted>)", self.username)
    }
}

impl Credentials {
    /// The `Authorization` header value for Basic auth.
    pub fn basic_header(&self) -> String {
        let pair = format!("{}:{}", self.username, self.password);
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        )
    }
}

#[derive(Deserialize)]
struct ConfigFile {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    auth: Option<String>,
    username: Option<String>,
    password: Option<String>,
}

/// The credentials of a Docker config file, by registry host.
#[derive(Debug, Default, Clone)]
pub struct DockerConfig {
    by_host: BTreeMap<String, Credentials>,
}

impl DockerConfig {
    pub fn load(path: &Path) -> Result<DockerConfig, AuthError> {
        let bytes = std::fs::read(path).map_err(|source| AuthError::Read {
            path: path.to_owned(),
            source,
        })?;
        DockerConfig::parse(path, &bytes)
    }

    /// `path` only names the file in errors.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<DockerConfig, AuthError> {
        let file: ConfigFile =
            serde_json::from_slice(bytes).map_err(|source| AuthError::Parse {
                path: path.to_owned(),
                source,
            })?;
        let mut by_host = BTreeMap::new();
        for (key, entry) in file.auths {
            let credentials = entry_credentials(path, &key, entry)?;
            by_host.insert(normalize_host(&key), credentials);
        }
        Ok(DockerConfig { by_host })
    }

    /// The credentials for `registry` (`host` or `host:port`, as a reference names it).
    pub fn credentials_for(&self, registry: &str) -> Option<&Credentials> {
        let host = normalize_host(registry);
        self.by_host.get(&host)
    }
}

fn entry_credentials(path: &Path, key: &str, entry: AuthEntry) -> Result<Credentials, AuthError> {
    if let Some(auth) = entry.auth.filter(|a| !a.is_empty()) {
        let bad = || AuthError::BadAuth {
            path: path.to_owned(),
            host: key.to_string(),
        };
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|_| bad())?;
        let text = String::from_utf8(decoded).map_err(|_| bad())?;
        let (username, password) = text.split_once(':').ok_or_else(bad)?;
        return Ok(Credentials {
            username: username.to_string(),
            password: password.to_string(),
        });
    }
    match (entry.username, entry.password) {
        (Some(username), Some(password)) => Ok(Credentials { username, password }),
        _ => Err(AuthError::NoSecret {
            path: path.to_owned(),
            host: key.to_string(),
        }),
    }
}

/// Keys are written `host:port`, `https://host/v1/` or (Docker Hub) `index.docker.io`: compare
/// the host and port only, and every name of Docker Hub as one.
fn normalize_host(key: &str) -> String {
    let key = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = key.split('/').next().unwrap_or(key).to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "docker.io" => "docker.io".to_string(),
        _ => host,
    }
}

/// What a 401 asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    /// Send the user and password on every request.
    Basic,
    /// Get a token from `realm` (with the user and password, if any) and send it.
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
}

/// Parses a `WWW-Authenticate` value; `None` for schemes this client does not speak.
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let header = header.trim();
    let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
    match scheme.to_ascii_lowercase().as_str() {
        "basic" => Some(Challenge::Basic),
        "bearer" => {
            let mut params = parse_params(rest);
            Some(Challenge::Bearer {
                realm: params.remove("realm")?,
                service: params.remove("service"),
                scope: params.remove("scope"),
            })
        }
        _ => None,
    }
}

/// `key="value", key=value`: values may be quoted and quoted values may hold commas (a scope
/// such as `repository:a:pull,push` does).
fn parse_params(text: &str) -> BTreeMap<String, String> {
    let mut params = BTreeMap::new();
    let mut rest = text.trim_start();
    while let Some((key, after)) = rest.split_once('=') {
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let (value, remaining) = if let Some(quoted) = after.strip_prefix('"') {
            let mut value = String::new();
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((index, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, escaped)) = chars.next() {
                            value.push(escaped);
                        }
                    }
                    '"' => {
                        end = index + 1;
                        break;
                    }
                    c => value.push(c),
                }
            }
            (value, &quoted[end..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim().to_string(), &after[end..])
        };
        params.insert(key, value);
        rest = remaining.trim_start().trim_start_matches(',').trim_start();
    }
    params
}

/// A token endpoint's answer: `token`, or the OAuth2 spelling `access_token`.
#[derive(Debug, Deserialize)]
pub struct TokenResponse {
    token: Option<String>,
    access_token: Option<String>,
}

impl TokenResponse {
    pub fn into_token(self) -> Option<String> {
        self.token
            .filter(|t| !t.is_empty())
            .or(self.access_token.filter(|t| !t.is_empty()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auth_and_username_password_entries() {
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cr:et");
        let json = format!(
            r#"{{"auths": {{"127.0.0.1:5000": {{"auth": "{auth}"}},
                "https://index.docker.io/v1/": {{"username": "bob", "password": "pw"}}}}}}"#
        );
        let config = DockerConfig::parse(Path::new("c.json"), json.as_bytes()).unwrap();
        let alice = config.credentials_for("127.0.0.1:5000").unwrap();
        assert_eq!(alice.username, "alice");
        assert_eq!(alice.password, "s3cr:et");
        assert_eq!(config.credentials_for("docker.io").unwrap().username, "bob");
        assert!(config.credentials_for("127.0.0.1:5001").is_none());
        assert!(!format!("{alice:?}").contains("s3cr"));
    }

    #[test]
    fn entries_without_a_secret_are_refused() {
        let json = br#"{"auths": {"r.example": {"username": "only"}}}"#;
        assert!(matches!(
            DockerConfig::parse(Path::new("c.json"), json),
            Err(AuthError::NoSecret { .. })
        ));
        let json = br#"{"auths": {"r.example": {"auth": "bm9jb2xvbg=="}}}"#;
        assert!(matches!(
            DockerConfig::parse(Path::new("c.json"), json),
            Err(AuthError::BadAuth { .. })
        ));
    }

    #[test]
    fn bearer_challenges_keep_commas_inside_quotes() {
        let challenge = parse_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        );
        assert_eq!(
            challenge,
            Some(Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("registry.example".into()),
                scope: Some("repository:a/b:pull,push".into()),
            })
        );
        assert_eq!(
            parse_challenge(r#"Basic realm="Registry Realm""#),
            Some(Challenge::Basic)
        );
        assert_eq!(parse_challenge("Negotiate abc"), None);
        assert_eq!(parse_challenge("Bearer service=x"), None);
    }
}
