//! The operator's HTTP endpoint: Prometheus metrics, `/healthz` (alive) and `/readyz` (ready).
//!
//! Off unless `--metrics-address` is set, like external-provisioner's `--http-endpoint`. Plain
//! HTTP/1.1 on hyper's server connection (hyper is already in the tree through kube); GET and
//! HEAD only, no request bodies read.

use std::convert::Infallible;
use std::net::SocketAddr;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// The OpenMetrics text content type that prometheus-client writes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {address} for metrics and health: {source}")]
pub struct ServeError {
    address: SocketAddr,
    #[source]
    source: std::io::Error,
}

/// A bound listener; [`Server::run`] serves it until the process ends.
pub struct Server {
    listener: TcpListener,
    metrics: Metrics,
    metrics_path: String,
}

impl Server {
    /// Binds `address` (port 0 picks a free port; see [`Server::local_addr`]).
    pub async fn bind(
        address: SocketAddr,
        metrics_path: &str,
        metrics: Metrics,
    ) -> Result<Server, ServeError> {
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| ServeError { address, source })?;
        Ok(Server {
            listener,
            metrics,
            metrics_path: metrics_path.to_string(),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Accepts connections forever; a broken connection only ends that connection.
    pub async fn run(self) {
        loop {
            let (stream, _) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(%error, "accepting a metrics connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let metrics = self.metrics.clone();
            let path = self.metrics_path.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let response = respond(&request, &path, &metrics);
                    async move { Ok::<_, Infallible>(response) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "metrics connection ended");
                }
            });
        }
    }
}

/// Answers one request: pure, so it is tested without sockets.
fn respond(
    request: &Request<Incoming>,
    metrics_path: &str,
    metrics: &Metrics,
) -> Response<Full<Bytes>> {
    route(
        request.method(),
        request.uri().path(),
        metrics_path,
        metrics,
    )
}

fn route(
    method: &Method,
    path: &str,
    metrics_path: &str,
    metrics: &Metrics,
) -> Response<Full<Bytes>> {
    if method != Method::GET && method != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
    }
    if path == metrics_path {
        return Response::builder()
            .header(CONTENT_TYPE, OPENMETRICS)
            .body(Full::new(Bytes::from(metrics.encode())))
            .unwrap_or_else(|_| text(StatusCode::INTERNAL_SERVER_ERROR, "encoding\n"));
    }
    match path {
        "/healthz" | "/livez" => text(StatusCode::OK, "ok\n"),
        "/readyz" if metrics.is_ready() => text(StatusCode::OK, "ok\n"),
        "/readyz" => text(
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: guests loading or caches not synced\n",
        ),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_answer_with_the_right_status() {
        let m = Metrics::new();
        let status = |method: &Method, path: &str| route(method, path, "/metrics", &m).status();
        assert_eq!(status(&Method::GET, "/healthz"), StatusCode::OK);
        assert_eq!(
            status(&Method::GET, "/readyz"),
            StatusCode::SERVICE_UNAVAILABLE
        );
        m.set_ready(true);
        assert_eq!(status(&Method::GET, "/readyz"), StatusCode::OK);
        assert_eq!(status(&Method::GET, "/metrics"), StatusCode::OK);
        assert_eq!(status(&Method::HEAD, "/metrics"), StatusCode::OK);
        assert_eq!(status(&Method::GET, "/other"), StatusCode::NOT_FOUND);
        assert_eq!(
            status(&Method::POST, "/metrics"),
            StatusCode::METHOD_NOT_ALLOWED
        );
        let custom = route(&Method::GET, "/custom", "/custom", &m);
        assert_eq!(custom.headers()[CONTENT_TYPE], OPENMETRICS);
    }

    #[tokio::test]
    async fn serves_over_tcp() {
        let m = Metrics::new();
        m.guests_loaded(3);
        let server = Server::bind("127.0.0.1:0".parse().unwrap(), "/metrics", m)
            .await
            .unwrap();
        let address = server.local_addr().unwrap();
        tokio::spawn(server.run());
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
        assert!(
            reply.contains("wasm_provisioner_guests_loaded 3"),
            "{reply}"
        );
        assert!(reply.trim_end().ends_with("# EOF"), "{reply}");
    }
}
