//! A loopback TCP proxy that delays every byte by a fixed time in each direction and does not
//! throttle: what a control plane a few milliseconds away looks like to a client (issue 36's
//! latency knob). TLS passes through untouched, so a kubeconfig that points at the proxy's
//! address instead of the API server's works as it is (the serving certificate names 127.0.0.1).
//!
//! ```text
//! client ─▶ proxy: read ─▶ (bytes, now + delay) ─▶ queue ─▶ write once the time has come ─▶ upstream
//!          (and the same back): ordered per direction, never more than `delay` late
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A running proxy; stops (and drops every connection) when dropped.
pub struct LatencyProxy {
    address: SocketAddr,
    accept: JoinHandle<()>,
}

impl LatencyProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`, each byte
    /// held back `one_way` in both directions.
    pub async fn start(upstream: SocketAddr, one_way: Duration) -> std::io::Result<LatencyProxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let address = listener.local_addr()?;
        let accept = tokio::spawn(async move {
            let mut connections = Vec::new();
            while let Ok((client, _)) = listener.accept().await {
                connections.retain(|c: &JoinHandle<()>| !c.is_finished());
                connections.push(tokio::spawn(relay(client, upstream, one_way)));
            }
        });
        Ok(LatencyProxy { address, accept })
    }

    /// Where clients connect.
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

/// A control plane seen from `one_way` away: a [`LatencyProxy`] in front of its API server, and
/// copies of its kubeconfigs that go through it (for a provisioner; the tests' own clients and
/// kube-controller-manager stay direct). Dropped, the proxy and the copies go.
pub struct Distant {
    proxy: LatencyProxy,
    url: String,
    dir: tempfile::TempDir,
}

impl Distant {
    /// The API server of `cp`, `one_way` away in each direction.
    pub async fn new(cp: &crate::ControlPlane, one_way: Duration) -> anyhow::Result<Distant> {
        let url = cp.apiserver_url()?;
        let upstream: SocketAddr = url
            .trim_start_matches("https://")
            .parse()
            .map_err(|e| anyhow::anyhow!("the API server's address in {url}: {e}"))?;
        Ok(Distant {
            proxy: LatencyProxy::start(upstream, one_way).await?,
            url,
            dir: tempfile::tempdir()?,
        })
    }

    /// A copy of the kubeconfig at `from` that reaches the API server through the proxy.
    pub fn kubeconfig(&self, from: &std::path::Path) -> anyhow::Result<std::path::PathBuf> {
        let text = std::fs::read_to_string(from)?
            .replace(&self.url, &format!("https://{}", self.proxy.address()));
        let name = from.file_name().unwrap_or_else(|| "kubeconfig".as_ref());
        let to = self.dir.path().join(name);
        std::fs::write(&to, text)?;
        Ok(to)
    }
}

impl Drop for LatencyProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// One connection: two directions, each a reader that stamps what it reads and a writer that
/// writes it when its time has come.
async fn relay(client: TcpStream, upstream: SocketAddr, one_way: Duration) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = direction(client_read, server_write, one_way);
    let down = direction(server_read, client_write, one_way);
    let _ = tokio::join!(up, down);
}

async fn direction(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, one_way: Duration) {
    let (queue, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buffer = vec![0u8; 64 << 10];
        loop {
            match from.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if queue
                        .send((Instant::now() + one_way, buffer[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
