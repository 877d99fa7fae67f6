//! The distribution API a pull and a push need: manifests and blobs by digest, checked against
//! their digests and size caps, monolithic blob uploads, and the 401 → credentials → retry-once
//! dance (Basic, or a Bearer token from the challenge's realm).

use std::collections::HashMap;

use bytes::Bytes;
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, StatusCode};

use super::artifact::{self, ArtifactError, Descriptor, Manifest};
use super::auth::{self, Challenge, Credentials, DockerConfig, TokenResponse};
use super::digest::Digest;
use super::reference::Reference;
use super::transport::{self, Request, Response, Transport, TransportError};

/// Redirects followed for one blob (registries send blobs from object storage this way).
const MAX_REDIRECTS: usize = 5;

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("{registry}: 401 Unauthorized: {message}{hint}")]
    Unauthorized {
        registry: String,
        message: String,
        hint: String,
    },
    #[error("{url}: {status}: {message}")]
    Status {
        url: String,
        status: StatusCode,
        message: String,
    },
    #[error("{what} not found: {url}: {message}")]
    NotFound {
        what: String,
        url: String,
        message: String,
    },
    #[error("{what}: digest mismatch: expected {expected}, the registry sent {actual}")]
    DigestMismatch {
        what: String,
        expected: Digest,
        actual: Digest,
    },
    #[error("{what}: the registry sent {actual} bytes, the manifest declares {declared}")]
    SizeMismatch {
        what: String,
        declared: u64,
        actual: u64,
    },
    #[error(
        "{what} declares {size} bytes, over the {limit}-byte cap (raise --max-module-mib if this is expected); nothing was downloaded"
    )]
    TooLarge { what: String, size: u64, limit: u64 },
    #[error("{url}: the answer has no usable Location header")]
    NoLocation { url: String },
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
}

/// Size caps, in bytes.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Manifests and configs.
    pub manifest: u64,
    /// The wasm layer.
    pub module: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            manifest: 1024 * 1024,
            module: 64 * 1024 * 1024,
        }
    }
}

/// A pulled manifest.
#[derive(Debug)]
pub struct PulledManifest {
    pub digest: Digest,
    pub manifest: Manifest,
    /// The bytes as served (what the digest, and a signature of it, are over).
    pub raw: Bytes,
}

/// A client of registries, keeping the auth headers it earned per repository and access.
pub struct Registry {
    transport: Transport,
    credentials: DockerConfig,
    limits: Limits,
    auth: HashMap<String, String>,
}

impl Registry {
    pub fn new(transport: Transport, credentials: DockerConfig, limits: Limits) -> Registry {
        Registry {
            transport,
            credentials,
            limits,
            auth: HashMap::new(),
        }
    }

    fn base(&self, reference: &Reference) -> String {
        format!(
            "{}://{}/v2/{}",
            self.transport.scheme_for(reference.api_host()),
            reference.api_host(),
            reference.repository
        )
    }

    /// The manifest `reference` names, checked against its digest: the one in the reference,
    /// else the one the registry announces.
    pub async fn manifest(
        &mut self,
        reference: &Reference,
    ) -> Result<PulledManifest, RegistryError> {
        let url = format!(
            "{}/manifests/{}",
            self.base(reference),
            reference.manifest_ref()
        );
        let accept = [
            artifact::MANIFEST_MEDIA_TYPE,
            artifact::INDEX_MEDIA_TYPE,
            artifact::DOCKER_MANIFEST_MEDIA_TYPE,
            artifact::DOCKER_LIST_MEDIA_TYPE,
        ]
        .join(", ");
        let request = Request::new(Method::GET, &url, self.limits.manifest).header(ACCEPT, accept);
        let response = self.request(reference, "pull", request).await?;
        let what = format!("manifest {reference}");
        let response = expect(response, &url, &[StatusCode::OK], &what)?;
        let announced = response
            .header("docker-content-digest")
            .and_then(|d| Digest::parse(d).ok());
        if let Some(expected) = reference.digest.clone().or(announced)
            && expected != response.digest
        {
            return Err(RegistryError::DigestMismatch {
                what,
                expected,
                actual: response.digest,
            });
        }
        let manifest = artifact::parse_manifest(&response.body, response.header("content-type"))?;
        Ok(PulledManifest {
            digest: response.digest,
            manifest,
            raw: response.body,
        })
    }

    /// The module blob `descriptor` names: its declared size is checked against the module cap
    /// before a byte is fetched, the body is cut off past that size, and its digest is checked.
    pub async fn blob(
        &mut self,
        reference: &Reference,
        descriptor: &Descriptor,
    ) -> Result<Bytes, RegistryError> {
        let limit = self.limits.module;
        let digest = descriptor.digest()?;
        let what = format!("blob {digest}");
        if descriptor.size > limit {
            return Err(RegistryError::TooLarge {
                what: format!("the layer {digest}"),
                size: descriptor.size,
                limit,
            });
        }
        let mut url = format!("{}/blobs/{digest}", self.base(reference));
        let mut response = self
            .request(
                reference,
                "pull",
                Request::new(Method::GET, &url, descriptor.size),
            )
            .await?;
        // Object storage behind a redirect gets no registry credentials.
        for _ in 0..MAX_REDIRECTS {
            if !response.status.is_redirection() {
                break;
            }
            url = response
                .header("location")
                .and_then(|location| transport::resolve_location(&url, location))
                .ok_or_else(|| RegistryError::NoLocation { url: url.clone() })?;
            response = self
                .transport
                .send(&Request::new(Method::GET, &url, descriptor.size))
                .await?;
        }
        let response = expect(response, &url, &[StatusCode::OK], &what)?;
        if response.body.len() as u64 != descriptor.size {
            return Err(RegistryError::SizeMismatch {
                what,
                declared: descriptor.size,
                actual: response.body.len() as u64,
            });
        }
        if response.digest != digest {
            return Err(RegistryError::DigestMismatch {
                what,
                expected: digest,
                actual: response.digest,
            });
        }
        Ok(response.body)
    }

    /// Uploads a blob in one request unless the repository has it already.
    pub async fn push_blob(
        &mut self,
        reference: &Reference,
        bytes: Bytes,
        digest: &Digest,
    ) -> Result<(), RegistryError> {
        let base = self.base(reference);
        let head = Request::new(Method::HEAD, format!("{base}/blobs/{digest}"), 0);
        if self.request(reference, "pull,push", head).await?.status == StatusCode::OK {
            return Ok(());
        }
        let start_url = format!("{base}/blobs/uploads/");
        let start = Request::new(Method::POST, &start_url, 0);
        let started = self.request(reference, "pull,push", start).await?;
        let started = expect(started, &start_url, &[StatusCode::ACCEPTED], "upload")?;
        let location = started
            .header("location")
            .and_then(|location| transport::resolve_location(&start_url, location))
            .ok_or_else(|| RegistryError::NoLocation {
                url: start_url.clone(),
            })?;
        let separator = if location.contains('?') { '&' } else { '?' };
        let put_url = format!(
            "{location}{separator}digest={}",
            percent_encode(digest.as_str())
        );
        let put = Request::new(Method::PUT, &put_url, 0)
            .header(CONTENT_TYPE, "application/octet-stream")
            .body(bytes);
        let put = self.request(reference, "pull,push", put).await?;
        expect(put, &put_url, &[StatusCode::CREATED], "upload")?;
        Ok(())
    }

    /// Puts a manifest under `tag`; returns its digest.
    pub async fn push_manifest(
        &mut self,
        reference: &Reference,
        tag: &str,
        manifest: Bytes,
        media_type: &str,
    ) -> Result<Digest, RegistryError> {
        let digest = Digest::of(&manifest);
        let url = format!("{}/manifests/{tag}", self.base(reference));
        let put = Request::new(Method::PUT, &url, 0)
            .header(CONTENT_TYPE, media_type)
            .body(manifest);
        let response = self.request(reference, "pull,push", put).await?;
        let response = expect(response, &url, &[StatusCode::CREATED], "manifest upload")?;
        if let Some(announced) = response
            .header("docker-content-digest")
            .and_then(|d| Digest::parse(d).ok())
            && announced != digest
        {
            return Err(RegistryError::DigestMismatch {
                what: "the pushed manifest".into(),
                expected: digest,
                actual: announced,
            });
        }
        Ok(digest)
    }

    /// Sends with the auth header earned before for this repository and access; on a 401,
    /// answers its challenge and sends once more.
    async fn request(
        &mut self,
        reference: &Reference,
        actions: &str,
        request: Request,
    ) -> Result<Response, RegistryError> {
        let key = format!(
            "{}/{}:{actions}",
            reference.api_host(),
            reference.repository
        );
        let first = match self.auth.get(&key) {
            Some(header) => request.clone().header(AUTHORIZATION, header.clone()),
            None => request.clone(),
        };
        let response = self.transport.send(&first).await?;
        if response.status != StatusCode::UNAUTHORIZED {
            return Ok(response);
        }
        let credentials = self
            .credentials
            .credentials_for(&reference.registry)
            .cloned();
        let challenge = response
            .header("www-authenticate")
            .and_then(auth::parse_challenge);
        let Some(challenge) = challenge else {
            return Err(self.unauthorized(reference, &response, credentials.is_some()));
        };
        let header = self
            .answer(
                reference,
                actions,
                challenge,
                credentials.as_ref(),
                &response,
            )
            .await?;
        self.auth.insert(key, header.clone());
        let response = self
            .transport
            .send(&request.header(AUTHORIZATION, header))
            .await?;
        if response.status == StatusCode::UNAUTHORIZED {
            return Err(self.unauthorized(reference, &response, credentials.is_some()));
        }
        Ok(response)
    }

    async fn answer(
        &self,
        reference: &Reference,
        actions: &str,
        challenge: Challenge,
        credentials: Option<&Credentials>,
        refused: &Response,
    ) -> Result<String, RegistryError> {
        match challenge {
            Challenge::Basic => match credentials {
                Some(credentials) => Ok(credentials.basic_header()),
                None => Err(self.unauthorized(reference, refused, false)),
            },
            Challenge::Bearer {
                realm,
                service,
                scope,
            } => {
                let scope = scope
                    .unwrap_or_else(|| format!("repository:{}:{actions}", reference.repository));
                let mut query = vec![format!("scope={}", percent_encode(&scope))];
                if let Some(service) = service {
                    query.insert(0, format!("service={}", percent_encode(&service)));
                }
                let separator = if realm.contains('?') { '&' } else { '?' };
                let url = format!("{realm}{separator}{}", query.join("&"));
                let mut token_request = Request::new(Method::GET, &url, self.limits.manifest);
                if let Some(credentials) = credentials {
                    token_request = token_request.header(AUTHORIZATION, credentials.basic_header());
                }
                let response = self.transport.send(&token_request).await?;
                if response.status == StatusCode::UNAUTHORIZED
                    || response.status == StatusCode::FORBIDDEN
                {
                    return Err(self.unauthorized(reference, &response, credentials.is_some()));
                }
                let response = expect(response, &url, &[StatusCode::OK], "token")?;
                let token = serde_json::from_slice::<TokenResponse>(&response.body)
                    .ok()
                    .and_then(TokenResponse::into_token)
                    .ok_or_else(|| RegistryError::Status {
                        url: url.clone(),
                        status: response.status,
                        message: "the token service's answer holds no token".into(),
                    })?;
                Ok(format!("Bearer {token}"))
            }
        }
    }

    fn unauthorized(
        &self,
        reference: &Reference,
        response: &Response,
        had_credentials: bool,
    ) -> RegistryError {
        let hint = if had_credentials {
            " (the registry refused the credentials --registry-config has for it)".to_string()
        } else {
            format!(
                " (no credentials for {} in --registry-config)",
                reference.registry
            )
        };
        RegistryError::Unauthorized {
            registry: reference.registry.clone(),
            message: error_message(&response.body),
            hint,
        }
    }
}

/// `response` if its status is one of `ok`, else the error the registry explained.
fn expect(
    response: Response,
    url: &str,
    ok: &[StatusCode],
    what: &str,
) -> Result<Response, RegistryError> {
    if ok.contains(&response.status) {
        return Ok(response);
    }
    let message = error_message(&response.body);
    if response.status == StatusCode::NOT_FOUND {
        return Err(RegistryError::NotFound {
            what: what.to_string(),
            url: url.to_string(),
            message,
        });
    }
    Err(RegistryError::Status {
        url: url.to_string(),
        status: response.status,
        message,
    })
}

/// The distribution spec's `{"errors": [{"code", "message"}]}`, else the body as text.
fn error_message(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<ErrorEntry>,
    }
    #[derive(serde::Deserialize)]
    struct ErrorEntry {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<Errors>(body) {
        Ok(errors) if !errors.errors.is_empty() => errors
            .errors
            .iter()
            .map(|e| format!("{} {}", e.code, e.message).trim().to_string())
            .collect::<Vec<_>>()
            .join("; "),
        _ => {
            let text = String::from_utf8_lossy(body).trim().to_string();
            if text.is_empty() {
                "(no explanation)".into()
            } else {
                text.chars().take(300).collect()
            }
        }
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_errors_read_as_their_code_and_message() {
        let body = br#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required","detail":null}]}"#;
        assert_eq!(error_message(body), "UNAUTHORIZED authentication required");
        assert_eq!(error_message(b""), "(no explanation)");
        assert_eq!(error_message(b"oops\n"), "oops");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            percent_encode("repository:a/b:pull,push"),
            "repository%3Aa%2Fb%3Apull%2Cpush"
        );
    }
}
