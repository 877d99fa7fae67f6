//! HTTP to registries: HTTPS with the system's roots (plus `--ca-file`), plain HTTP only for the
//! registries named by `--plain-http`, a deadline over each request and its retries, a timeout on
//! each read, bounded retries with exponential backoff for 5xx and broken connections, and
//! bodies read with a size cap and hashed as they stream in.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt as _, Full};
use hyper::header::{CONTENT_LENGTH, HeaderMap, HeaderName};
use hyper::{Method, StatusCode, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;
use tokio::time::Instant;

use super::digest::{Digest, Hasher};

/// Error bodies (a registry's JSON explaining a 4xx) are read up to this much, the rest dropped.
const ERROR_BODY_MAX: u64 = 64 * 1024;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cannot read the CA file {path}")]
    CaFile {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("the CA file {path} holds no certificate")]
    CaFileEmpty { path: PathBuf },
    #[error("the CA file {path} has a certificate rustls refuses")]
    CaCertificate {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("cannot set up TLS")]
    Tls(#[source] rustls::Error),
    #[error("{url:?} is not a URL")]
    Url { url: String },
    #[error(
        "{url}: plain HTTP to {authority} is not allowed (pass --plain-http {authority} to allow it for that registry)"
    )]
    PlainHttp { url: String, authority: String },
    #[error("{url}: no complete answer within {after:?} (the request deadline, retries included)")]
    Timeout { url: String, after: Duration },
    #[error("{url}: the registry sent nothing for {after:?}")]
    Stalled { url: String, after: Duration },
    #[error("{method} {url} failed after {attempts} attempt(s){hint}")]
    Connect {
        method: Method,
        url: String,
        attempts: u32,
        /// What to try, when TLS failed.
        hint: &'static str,
        #[source]
        source: Box<hyper_util::client::legacy::Error>,
    },
    #[error("{url}: the connection broke while reading the answer")]
    Body {
        url: String,
        #[source]
        source: hyper::Error,
    },
    #[error("{url}: the answer is larger than the {limit} bytes allowed")]
    TooLarge { url: String, limit: u64 },
    #[error("{method} {url}: {status} after {attempts} attempt(s): {message}")]
    Server {
        method: Method,
        url: String,
        status: StatusCode,
        attempts: u32,
        message: String,
    },
}

impl TransportError {
    /// Worth another attempt: the connection or the read broke, not the request's content.
    fn is_transient(&self) -> bool {
        match self {
            // A certificate the roots do not accept, or TLS spoken to a plain HTTP port, will
            // fail the same way again.
            TransportError::Connect { source, .. } => !is_tls_failure(source),
            TransportError::Body { .. } | TransportError::Stalled { .. } => true,
            _ => false,
        }
    }
}

/// How requests are bounded and where plain HTTP is allowed.
#[derive(Debug, Clone)]
pub struct TransportOptions {
    /// Registries (`host:port`) spoken to over plain HTTP.
    pub plain_http: Vec<String>,
    /// A PEM file of CA certificates trusted besides the system's.
    pub ca_file: Option<PathBuf>,
    /// One request, its retries and its whole body.
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// The longest wait for the answer's head or its next bytes.
    pub read_timeout: Duration,
    /// Attempts after the first, for 5xx and broken connections.
    pub retries: u32,
    /// The first wait before a retry; each next one doubles.
    pub backoff: Duration,
}

impl Default for TransportOptions {
    fn default() -> Self {
        TransportOptions {
            plain_http: Vec::new(),
            ca_file: None,
            request_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(30),
            retries: 4,
            backoff: Duration::from_millis(200),
        }
    }
}

/// One request: its body is small (a manifest, a component of a few MiB), so it is held whole.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: Method,
    pub url: String,
    pub headers: Vec<(HeaderName, String)>,
    pub body: Bytes,
    /// The most body bytes a successful answer may have.
    pub limit: u64,
}

impl Request {
    pub fn new(method: Method, url: impl Into<String>, limit: u64) -> Request {
        Request {
            method,
            url: url.into(),
            headers: Vec::new(),
            body: Bytes::new(),
            limit,
        }
    }

    pub fn header(mut self, name: HeaderName, value: impl Into<String>) -> Request {
        self.headers.push((name, value.into()));
        self
    }

    pub fn body(mut self, body: Bytes) -> Request {
        self.body = body;
        self
    }
}

/// An answer, read whole; `digest` was computed as it streamed in.
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub digest: Digest,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// The HTTP client every registry call goes through.
pub struct Transport {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    options: TransportOptions,
}

impl Transport {
    pub fn new(options: TransportOptions) -> Result<Transport, TransportError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        // Unreadable system certificates are skipped: a custom CA or plain HTTP may be all
        // this registry needs, and an HTTPS registry the roots lack fails with a clear TLS error.
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        if let Some(path) = &options.ca_file {
            add_ca_file(&mut roots, path)?;
        }
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(TransportError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(options.connect_timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new()).build(https);
        Ok(Transport { client, options })
    }

    /// `https://` unless `registry` is one of `--plain-http`.
    pub fn scheme_for(&self, registry: &str) -> &'static str {
        if self.is_plain(registry) {
            "http"
        } else {
            "https"
        }
    }

    fn is_plain(&self, authority: &str) -> bool {
        self.options
            .plain_http
            .iter()
            .any(|allowed| allowed.eq_ignore_ascii_case(authority))
    }

    /// Sends `request`, retrying 5xx answers and broken connections with backoff, all within the
    /// request deadline. 4xx answers come back as they are (the caller handles a 401).
    pub async fn send(&self, request: &Request) -> Result<Response, TransportError> {
        let uri = self.check_url(&request.url)?;
        let deadline = Instant::now() + self.options.request_timeout;
        let timeout = || TransportError::Timeout {
            url: request.url.clone(),
            after: self.options.request_timeout,
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            let result = tokio::time::timeout_at(deadline, self.attempt(request, &uri, deadline))
                .await
                .unwrap_or_else(|_| Err(timeout()));
            let retry = match &result {
                Ok(response) => response.status.is_server_error(),
                Err(error) => error.is_transient(),
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(delay) = retry_delay(&self.options, attempt, left).filter(|_| retry) {
                tracing::debug!(url = %request.url, attempt, ?delay, "registry request retried");
                tokio::time::sleep(delay).await;
                continue;
            }
            return match result {
                Ok(response) if response.status.is_server_error() => Err(TransportError::Server {
                    method: request.method.clone(),
                    url: request.url.clone(),
                    status: response.status,
                    attempts: attempt,
                    message: String::from_utf8_lossy(&response.body).trim().to_string(),
                }),
                Err(TransportError::Connect {
                    method,
                    url,
                    source,
                    ..
                }) => Err(TransportError::Connect {
                    method,
                    url,
                    attempts: attempt,
                    hint: if is_tls_failure(&source) {
                        " (TLS failed: a registry without TLS needs --plain-http HOST:PORT, one \
                         with a private CA --ca-file)"
                    } else {
                        ""
                    },
                    source,
                }),
                other => other,
            };
        }
    }

    async fn attempt(
        &self,
        request: &Request,
        uri: &Uri,
        deadline: Instant,
    ) -> Result<Response, TransportError> {
        let mut builder = hyper::Request::builder()
            .method(request.method.clone())
            .uri(uri.clone());
        for (name, value) in &request.headers {
            builder = builder.header(name, value);
        }
        let http_request = builder
            .header(CONTENT_LENGTH, request.body.len())
            .body(Full::new(request.body.clone()))
            .map_err(|_| TransportError::Url {
                url: request.url.clone(),
            })?;
        let read_timeout = self.options.read_timeout;
        let stalled = || TransportError::Stalled {
            url: request.url.clone(),
            after: read_timeout,
        };
        let answer = tokio::time::timeout(read_timeout, self.client.request(http_request))
            .await
            .map_err(|_| stalled())?
            .map_err(|source| TransportError::Connect {
                method: request.method.clone(),
                url: request.url.clone(),
                attempts: 1,
                hint: "",
                source: Box::new(source),
            })?;
        let (parts, mut body) = answer.into_parts();
        let success = parts.status.is_success();
        let limit = if success {
            request.limit
        } else {
            request.limit.min(ERROR_BODY_MAX)
        };
        let too_large = || TransportError::TooLarge {
            url: request.url.clone(),
            limit,
        };
        // A declared length over the cap is refused before a byte of the body is read. A HEAD
        // answer declares the length of a body it does not send.
        let declared = parts
            .headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if success && request.method != Method::HEAD && declared.is_some_and(|len| len > limit) {
            return Err(too_large());
        }
        let mut hasher = Hasher::default();
        let mut bytes = BytesMut::new();
        loop {
            let wait = read_timeout.min(deadline.saturating_duration_since(Instant::now()));
            let frame = tokio::time::timeout(wait, body.frame())
                .await
                .map_err(|_| stalled())?;
            let Some(frame) = frame else { break };
            let frame = frame.map_err(|source| TransportError::Body {
                url: request.url.clone(),
                source,
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if hasher.len() + data.len() as u64 > limit {
                if !success {
                    break;
                }
                // A registry sending more than it declared (or than allowed) is cut off here.
                return Err(too_large());
            }
            hasher.update(&data);
            bytes.extend_from_slice(&data);
        }
        Ok(Response {
            status: parts.status,
            headers: parts.headers,
            body: bytes.freeze(),
            digest: hasher.finish(),
        })
    }

    /// Only `https://`, or `http://` to a registry named by `--plain-http`.
    fn check_url(&self, url: &str) -> Result<Uri, TransportError> {
        let bad = || TransportError::Url {
            url: url.to_string(),
        };
        let uri: Uri = url.parse().map_err(|_| bad())?;
        let authority = uri.authority().ok_or_else(bad)?.as_str().to_string();
        match uri.scheme_str() {
            Some("https") => Ok(uri),
            Some("http") if self.is_plain(&authority) => Ok(uri),
            Some("http") => Err(TransportError::PlainHttp {
                url: url.to_string(),
                authority,
            }),
            _ => Err(bad()),
        }
    }
}

/// The wait after failed attempt `attempt` (from 1) before the next: `backoff`, doubling each
/// time; none once the retries are spent or when the wait would outlast the deadline (`left`).
fn retry_delay(options: &TransportOptions, attempt: u32, left: Duration) -> Option<Duration> {
    let delay = options
        .backoff
        .checked_mul(2u32.checked_pow(attempt.checked_sub(1)?)?)?;
    (attempt <= options.retries && delay < left).then_some(delay)
}

/// Whether rustls refused the connection somewhere down `error`'s chain.
fn is_tls_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<rustls::Error>() {
            return true;
        }
        // An io::Error hides the error it wraps from `source()` (hyper-rustls wraps tokio-rustls'
        // io::Error, which wraps the rustls::Error, in another one).
        next = match error.downcast_ref::<std::io::Error>() {
            Some(io) => io
                .get_ref()
                .map(|inner| inner as &(dyn std::error::Error + 'static)),
            None => error.source(),
        };
    }
    false
}

fn add_ca_file(roots: &mut rustls::RootCertStore, path: &Path) -> Result<(), TransportError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TransportError::CaFile {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TransportError::CaFileEmpty {
            path: path.to_owned(),
        });
    }
    for cert in certs {
        roots
            .add(cert)
            .map_err(|source| TransportError::CaCertificate {
                path: path.to_owned(),
                source,
            })?;
    }
    Ok(())
}

/// Resolves a `Location` header against the URL that answered with it.
pub fn resolve_location(base: &str, location: &str) -> Option<String> {
    if location.starts_with("https://") || location.starts_with("http://") {
        return Some(location.to_string());
    }
    let uri: Uri = base.parse().ok()?;
    let origin = format!("{}://{}", uri.scheme_str()?, uri.authority()?);
    if location.starts_with('/') {
        Some(format!("{origin}{location}"))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_only_for_the_named_registries() {
        let transport = Transport::new(TransportOptions {
            plain_http: vec!["127.0.0.1:5000".into()],
            ..TransportOptions::default()
        })
        .unwrap();
        assert!(transport.check_url("http://127.0.0.1:5000/v2/").is_ok());
        assert!(matches!(
            transport.check_url("http://127.0.0.1:5001/v2/"),
            Err(TransportError::PlainHttp { .. })
        ));
        assert!(transport.check_url("https://r.example/v2/").is_ok());
        assert!(transport.check_url("ftp://r.example/v2/").is_err());
        assert_eq!(transport.scheme_for("127.0.0.1:5000"), "http");
        assert_eq!(transport.scheme_for("r.example"), "https");
    }

    #[test]
    fn retries_back_off_exponentially_within_the_count_and_the_deadline() {
        let options = TransportOptions::default();
        let minute = Duration::from_secs(60);
        let delays: Vec<_> = (1..=6).map(|a| retry_delay(&options, a, minute)).collect();
        let ms = |m| Some(Duration::from_millis(m));
        assert_eq!(delays, [ms(200), ms(400), ms(800), ms(1600), None, None]);
        // A wait that would end past the deadline is not started.
        assert_eq!(retry_delay(&options, 3, Duration::from_millis(800)), None);
        assert_eq!(
            retry_delay(&options, 3, Duration::from_millis(801)),
            ms(800)
        );
    }

    #[test]
    fn locations_resolve_against_the_answering_url() {
        let base = "http://127.0.0.1:5000/v2/a/blobs/uploads/";
        assert_eq!(
            resolve_location(base, "/v2/a/blobs/uploads/123?state=x").as_deref(),
            Some("http://127.0.0.1:5000/v2/a/blobs/uploads/123?state=x")
        );
        assert_eq!(
            resolve_location(base, "https://cdn.example/blob").as_deref(),
            Some("https://cdn.example/blob")
        );
        assert_eq!(resolve_location(base, "relative"), None);
    }
}
