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
