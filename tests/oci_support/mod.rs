//! The registry side of tests/oci.rs: a real registry (Debian's `docker-registry`, distribution
//! 2.8) on loopback, and a proxy in front of it that delays, stalls, fails or lies on cue.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::header::HeaderMap;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

/// A `docker-registry serve` child, killed by its PID when dropped.
pub struct Registry {
    child: Child,
    pub addr: String,
    _root: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

impl Registry {
    /// A registry with no auth, or htpasswd auth for one user.
    pub fn start(user: Option<(&str, &str)>) -> Registry {
        Registry::start_with(user, None)
    }

    /// Over HTTPS with this certificate and key (PEM files).
    pub fn start_with(user: Option<(&str, &str)>, tls: Option<(&Path, &Path)>) -> Registry {
        let root = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n\
             storage:\n  filesystem:\n    rootdirectory: {}\n\
             http:\n  addr: {addr}\n  secret: test-secret\n",
            root.path().join("data").display()
        );
        if let Some((certificate, key)) = tls {
            config.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                certificate.display(),
                key.display()
            ));
        }
        if let Some((name, password)) = user {
            let htpasswd = root.path().join("htpasswd");
            // apache2-utils' htpasswd, bcrypt (-B): the only format the registry reads.
            let out = Command::new("htpasswd")
                .args(["-Bbn", name, password])
                .output()
                .expect("htpasswd (apache2-utils; bash .ci/setup installs it)");
            assert!(out.status.success(), "htpasswd failed");
            std::fs::write(&htpasswd, out.stdout).unwrap();
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: test\n    path: {}\n",
                htpasswd.display()
            ));
        }
        let config_path = root.path().join("config.yml");
        std::fs::write(&config_path, config).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config_path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("docker-registry (Debian's package; bash .ci/setup installs it)");
        let registry = Registry {
            child,
            addr,
            _root: root,
        };
        let start = Instant::now();
        while std::net::TcpStream::connect(&registry.addr).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the registry did not listen"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        registry
    }
}

/// A CA and a certificate for 127.0.0.1 it signed (openssl): (ca.pem, server.pem, server.key).
pub fn test_ca(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let run = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl");
        assert!(status.success(), "openssl {args:?}");
    };
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec![
        "req", "-x509", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
    ];
    ca.extend_from_slice(&ec);
    ca.extend_from_slice(&[
        "-subj",
        "/CN=wasm-provisioner test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign",
    ]);
    run(&ca);
    let mut csr = vec![
        "req",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ];
    csr.extend_from_slice(&ec);
    run(&csr);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}

/// What the proxy does with one request.
#[derive(Debug, Clone)]
pub enum Action {
    Forward,
    /// Forward after a pause.
    Delay(Duration),
    /// Never answer.
    Stall,
    /// Answer with this status and an empty body.
    Status(u16),
    /// Answer 200 with this body and content type.
    Serve(&'static str, Vec<u8>),
    /// Forward, then flip one byte of the body (same length, other digest).
    Corrupt,
    /// Answer 401 with this `WWW-Authenticate`.
    Challenge(String),
}

type Rule = Arc<dyn Fn(&Method, &str, &HeaderMap) -> Action + Send + Sync>;

/// A loopback HTTP proxy in front of a registry, on its own thread and runtime.
pub struct Proxy {
    pub addr: String,
    seen: Arc<Mutex<VecDeque<String>>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Proxy {
    pub fn start(
        upstream: &str,
        rule: impl Fn(&Method, &str) -> Action + Send + Sync + 'static,
    ) -> Proxy {
        Proxy::with_headers(upstream, move |method, path, _| rule(method, path))
    }

    /// A proxy whose rule also sees the request's headers.
    pub fn with_headers(
        upstream: &str,
        rule: impl Fn(&Method, &str, &HeaderMap) -> Action + Send + Sync + 'static,
    ) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seen = Arc::new(Mutex::new(VecDeque::new()));
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let rule: Rule = Arc::new(rule);
        let upstream = upstream.to_string();
        let log = seen.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let client: Client<_, Full<Bytes>> =
                    Client::builder(TokioExecutor::new()).build_http();
                loop {
                    let (stream, _) = tokio::select! {
                        _ = &mut stopped => break,
                        accepted = listener.accept() => accepted.unwrap(),
                    };
                    let (client, rule, log, upstream) =
                        (client.clone(), rule.clone(), log.clone(), upstream.clone());
                    tokio::spawn(async move {
                        let service = hyper::service::service_fn(move |request| {
                            handle(
                                request,
                                client.clone(),
                                rule.clone(),
                                log.clone(),
                                upstream.clone(),
                            )
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
            });
        });
        Proxy {
            addr,
            seen,
            _stop: stop,
        }
    }

    /// `METHOD /path?query` of every request so far.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().iter().cloned().collect()
    }
}

async fn handle(
    request: Request<hyper::body::Incoming>,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    rule: Rule,
    log: Arc<Mutex<VecDeque<String>>>,
    upstream: String,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = request
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    log.lock()
        .unwrap()
        .push_back(format!("{} {path}", request.method()));
    let action = rule(request.method(), &path, request.headers());
    let reply = |status: u16, content_type: &str, body: Vec<u8>| {
        Ok(Response::builder()
            .status(status)
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .unwrap())
    };
    match action {
        Action::Stall => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            return reply(500, "text/plain", Vec::new());
        }
        Action::Status(status) => return reply(status, "text/plain", Vec::new()),
        Action::Challenge(challenge) => {
            return Ok(Response::builder()
                .status(401)
                .header("www-authenticate", challenge)
                .body(Full::new(Bytes::from_static(
                    br#"{"errors":[{"code":"UNAUTHORIZED","message":"token required"}]}"#,
                )))
                .unwrap());
        }
        Action::Serve(content_type, body) => return reply(200, content_type, body),
        Action::Delay(pause) => tokio::time::sleep(pause).await,
        Action::Forward | Action::Corrupt => {}
    }
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut forward = Request::builder()
        .method(parts.method)
        .uri(format!("http://{upstream}{path}"));
    // Host stays the proxy's: the registry writes its upload URLs from it.
    for (name, value) in &parts.headers {
        forward = forward.header(name, value);
    }
    let answer = match client.request(forward.body(Full::new(body)).unwrap()).await {
        Ok(answer) => answer,
        Err(_) => return reply(502, "text/plain", Vec::new()),
    };
    let (parts, body) = answer.into_parts();
    let mut body = body
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    if matches!(action, Action::Corrupt) && !body.is_empty() {
        let middle = body.len() / 2;
        body[middle] ^= 0xff;
    }
    let mut response = Response::builder().status(parts.status);
    for (name, value) in &parts.headers {
        response = response.header(name, value);
    }
    Ok(response
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| {
            let mut r = Response::new(Full::new(Bytes::new()));
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            r
        }))
}

/// Runs the provisioner's binary; (success, stdout, stderr).
pub fn provisioner(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_wasm-provisioner"))
        .args(args)
        .output()
        .expect("run wasm-provisioner");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The files of a directory, sorted (hidden ones too: a leftover temp file is a failure).
pub fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// The value after `prefix` on the line that starts with it.
pub fn line_value(text: &str, prefix: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} line in:\n{text}"))
        .trim()
        .to_string()
}

pub fn write(dir: &Path, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// GET over plain HTTP/1.0 (the answer ends when the connection does): the body of a 200.
pub fn http_get(addr: &str, path: &str, accept: &str) -> Vec<u8> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: {accept}\r\n\r\n"
    )
    .unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).unwrap();
    let split = answer
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP answer");
    let head = String::from_utf8_lossy(&answer[..split]).into_owned();
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "GET {path}: {head}"
    );
    answer[split + 4..].to_vec()
}
