//! The latency proxy delays each direction by its one-way time, keeps the bytes and their order,
//! and serves several connections at once.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use wp_harness::LatencyProxy;

/// An echo server on loopback.
async fn echo() -> std::net::SocketAddr {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = socket.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    address
}

#[tokio::test]
async fn a_round_trip_takes_at_least_both_delays_and_keeps_every_byte() {
    let one_way = Duration::from_millis(40);
    let proxy = LatencyProxy::start(echo().await, one_way).await.unwrap();
    let mut tasks = Vec::new();
    for seed in 0..3u8 {
        let address = proxy.address();
        tasks.push(tokio::spawn(async move {
            let mut socket = TcpStream::connect(address).await.unwrap();
            let started = Instant::now();
            socket.write_all(b"ping").await.unwrap();
            let mut pong = [0u8; 4];
            socket.read_exact(&mut pong).await.unwrap();
            let round_trip = started.elapsed();
            assert_eq!(&pong, b"ping");
            // A floor, not a speed target: the proxy must hold each direction back.
            assert!(round_trip >= 2 * one_way, "round trip {round_trip:?}");

            let sent: Vec<u8> = (0..1_000_000u32).map(|i| (i as u8) ^ seed).collect();
            let (mut read, mut write) = socket.into_split();
            let writer = {
                let sent = sent.clone();
                tokio::spawn(async move {
                    write.write_all(&sent).await.unwrap();
                    write.shutdown().await.unwrap();
                })
            };
            let mut back = Vec::new();
            read.read_to_end(&mut back).await.unwrap();
            writer.await.unwrap();
            assert!(back == sent, "the bytes came back changed or reordered");
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}
