//! Image references: `registry/repository:tag`, `registry/repository@sha256:<hex>` and
//! `registry/repository:tag@sha256:<hex>`, as docker and the distribution spec write them.

use super::digest::{Digest, DigestError};

/// Docker Hub as references name it, and the host its API answers on.
const DOCKER_HUB: &str = "docker.io";
const DOCKER_HUB_API: &str = "registry-1.docker.io";

/// Why a reference was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    #[error("{reference:?}: empty repository name")]
    EmptyRepository { reference: String },
    #[error(
        "{reference:?}: repository {repository:?} may hold only lower-case letters, digits, '.', '_', '-' and '/' between components"
    )]
    Repository {
        reference: String,
        repository: String,
    },
    #[error(
        "{reference:?}: tag {tag:?} is not a tag (1-128 of A-Z a-z 0-9 _ . -, not starting with . or -)"
    )]
    Tag { reference: String, tag: String },
    #[error("{reference:?}: registry {registry:?} is not a host or host:port")]
    Registry { reference: String, registry: String },
    #[error("{reference:?}: bad digest")]
    Digest {
        reference: String,
        #[source]
        source: DigestError,
    },
}

/// A parsed reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host` or `host:port`, as written (`docker.io` when none was).
    pub registry: String,
    /// `a/b/c` (Docker Hub's one-component names get `library/`).
    pub repository: String,
    /// The tag; `latest` when neither tag nor digest was given.
    pub tag: Option<String>,
    /// The manifest's digest; when given, it is what is fetched and the tag is only a label.
    pub digest: Option<Digest>,
}

impl Reference {
    pub fn parse(text: &str) -> Result<Reference, ReferenceError> {
        let (rest, digest) = match text.split_once('@') {
            Some((rest, digest)) => {
                let digest = Digest::parse(digest).map_err(|source| ReferenceError::Digest {
                    reference: text.to_string(),
                    source,
                })?;
                (rest, Some(digest))
            }
            None => (text, None),
        };
        // The first component is a registry only if it looks like a host: docker's rule.
        let (registry, path) = match rest.split_once('/') {
            Some((first, path))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                (first, path)
            }
            _ => (DOCKER_HUB, rest),
        };
        let (repository, tag) = match path.rsplit_once(':') {
            Some((repository, tag)) if !tag.contains('/') => (repository, Some(tag)),
            _ => (path, None),
        };
        if !valid_registry(registry) {
            return Err(ReferenceError::Registry {
                reference: text.to_string(),
                registry: registry.to_string(),
            });
        }
        if repository.is_empty() {
            return Err(ReferenceError::EmptyRepository {
                reference: text.to_string(),
            });
        }
        if !repository.split('/').all(valid_component) {
            return Err(ReferenceError::Repository {
                reference: text.to_string(),
                repository: repository.to_string(),
            });
        }
        if let Some(tag) = tag
            && !valid_tag(tag)
        {
            return Err(ReferenceError::Tag {
                reference: text.to_string(),
                tag: tag.to_string(),
            });
        }
        let repository = if registry == DOCKER_HUB && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository.to_string()
        };
        let tag = match (tag, &digest) {
            (Some(tag), _) => Some(tag.to_string()),
            (None, None) => Some("latest".to_string()),
            (None, Some(_)) => None,
        };
        Ok(Reference {
            registry: registry.to_string(),
            repository,
            tag,
            digest,
        })
    }

    /// The host the API answers on (Docker Hub's differs from its name).
    pub fn api_host(&self) -> &str {
        if self.registry == DOCKER_HUB {
            DOCKER_HUB_API
        } else {
            &self.registry
        }
    }

    /// What goes after `/manifests/`: the digest when there is one, else the tag.
    pub fn manifest_ref(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(digest), _) => digest.to_string(),
            (None, Some(tag)) => tag.clone(),
            (None, None) => "latest".to_string(),
        }
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

fn valid_registry(text: &str) -> bool {
    let (host, port) = match text.rsplit_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (text, None),
    };
    !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        && port
            .is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()))
}

/// `[a-z0-9]+` joined by `.`, `_`, `__` or runs of `-`: the distribution spec's path component,
/// checked loosely (alphanumerics at both ends, separators of those kinds between).
fn valid_component(text: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let bytes = text.as_bytes();
    !bytes.is_empty()
        && alnum(bytes[0])
        && alnum(bytes[bytes.len() - 1])
        && bytes
            .iter()
            .all(|&b| alnum(b) || b == b'.' || b == b'_' || b == b'-')
        && !text.contains("..")
}

fn valid_tag(text: &str) -> bool {
    let ok = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-';
    (1..=128).contains(&text.len()) && text.bytes().all(ok) && !text.starts_with(['.', '-'])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex() -> String {
        "0123456789abcdef".repeat(4)
    }

    #[test]
    fn tags_digests_and_both() {
        let r = Reference::parse("127.0.0.1:5000/guests/hostpath:v1").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "guests/hostpath");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        assert_eq!(r.manifest_ref(), "v1");

        let r = Reference::parse(&format!("ghcr.io/a/b@sha256:{}", hex())).unwrap();
        assert_eq!(r.tag, None);
        assert_eq!(r.manifest_ref(), format!("sha256:{}", hex()));

        let r = Reference::parse(&format!("localhost/a:v2@sha256:{}", hex())).unwrap();
        assert_eq!(r.tag.as_deref(), Some("v2"));
        assert_eq!(r.manifest_ref(), format!("sha256:{}", hex()));
        assert_eq!(r.to_string(), format!("localhost/a:v2@sha256:{}", hex()));
    }

    #[test]
    fn no_tag_means_latest_and_docker_hub_gets_library() {
        let r = Reference::parse("example.com:443/x").unwrap();
        assert_eq!(r.tag.as_deref(), Some("latest"));
        let r = Reference::parse("hostpath").unwrap();
        assert_eq!(r.registry, "docker.io");
        assert_eq!(r.repository, "library/hostpath");
        assert_eq!(r.api_host(), "registry-1.docker.io");
    }

    #[test]
    fn malformed_references_are_refused() {
        for bad in [
            "example.com/",
            "example.com/UPPER:v1",
            "example.com/a:-tag",
            "example.com/a@sha256:short",
            "example.com/a/../b:v1",
            "exa mple.com/a:v1",
            "example.com:port/a:v1",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad} was accepted");
        }
    }
}
