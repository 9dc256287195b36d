//! The proxy on loopback, in front of an echo server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rollout_testkit::proxy::{ProxyConfig, serve};
use rollout_testkit::schedule::{ByteFaults, Scope};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LIMIT: Duration = Duration::from_secs(10);

/// An echo server; returns its address.
async fn echo() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let (mut read, mut write) = stream.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    address
}

/// A proxy in front of an echo server; returns the proxy's address.
async fn proxy(mut config: ProxyConfig) -> SocketAddr {
    config.upstream = echo().await.to_string();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, config));
    address
}

/// Sends `data`, closes the sending side, and reads until the end of the stream.
async fn round_trip(address: SocketAddr, data: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut stream = TcpStream::connect(address).await?;
    stream.write_all(data).await?;
    stream.shutdown().await?;
    let mut back = Vec::new();
    tokio::time::timeout(LIMIT, stream.read_to_end(&mut back))
        .await
        .expect("the proxy hung")?;
    Ok(back)
}

fn data(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

#[tokio::test]
async fn forwards_everything_unchanged() {
    let address = proxy(ProxyConfig::default()).await;
    let sent = data(200_000);
    assert_eq!(round_trip(address, &sent).await.unwrap(), sent);
}

#[tokio::test]
async fn delay_is_added_each_way() {
    let address = proxy(ProxyConfig {
        delay: Duration::from_millis(100),
        ..ProxyConfig::default()
    })
    .await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    let started = Instant::now();
    stream.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    stream.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"ping");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(200),
        "round trip took {took:?}"
    );
    assert!(took < Duration::from_secs(2), "round trip took {took:?}");
}

#[tokio::test]
async fn bandwidth_is_limited() {
    let address = proxy(ProxyConfig {
        bytes_per_sec: Some(10_000),
        ..ProxyConfig::default()
    })
    .await;
    let sent = data(5_000);
    let started = Instant::now();
    assert_eq!(round_trip(address, &sent).await.unwrap(), sent);
    // 5000 bytes at 10 kB/s each way, pipelined: at least about half a second.
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(400), "took {took:?}");
}

#[tokio::test]
async fn reset_after_bytes_cuts_the_connection_with_a_reset() {
    let address = proxy(ProxyConfig {
        faults: ByteFaults {
            reset_after: Some(1000),
            scope: Scope::Down,
            ..ByteFaults::default()
        },
        ..ProxyConfig::default()
    })
    .await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(&data(5000)).await.unwrap();
    let mut back = Vec::new();
    let mut buffer = [0u8; 4096];
    let error = loop {
        match tokio::time::timeout(LIMIT, stream.read(&mut buffer))
            .await
            .expect("the proxy hung")
        {
            Ok(0) => panic!("an orderly end after {} bytes, not a reset", back.len()),
            Ok(n) => back.extend_from_slice(&buffer[..n]),
            Err(err) => break err,
        }
    };
    assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset);
    assert_eq!(back, data(1000));
}

#[tokio::test]
async fn only_the_first_faulty_connections_are_reset() {
    let address = proxy(ProxyConfig {
        faults: ByteFaults {
            reset_after: Some(1000),
            ..ByteFaults::default()
        },
        faulty_connections: Some(1),
        ..ProxyConfig::default()
    })
    .await;
    let sent = data(5000);
    assert!(
        round_trip(address, &sent).await.is_err(),
        "the first is reset"
    );
    assert_eq!(round_trip(address, &sent).await.unwrap(), sent);
}

#[tokio::test]
async fn corrupt_flips_exactly_one_byte() {
    let address = proxy(ProxyConfig {
        faults: ByteFaults {
            corrupt_after: Some(777),
            scope: Scope::Up,
            ..ByteFaults::default()
        },
        ..ProxyConfig::default()
    })
    .await;
    let sent = data(3000);
    let back = round_trip(address, &sent).await.unwrap();
    assert_eq!(back.len(), sent.len());
    let differ: Vec<usize> = (0..sent.len()).filter(|&i| sent[i] != back[i]).collect();
    assert_eq!(differ, vec![777]);
    assert_eq!(back[777], !sent[777]);
}

#[tokio::test]
async fn stall_pauses_once() {
    let address = proxy(ProxyConfig {
        faults: ByteFaults {
            stall_after: Some(10),
            stall: Duration::from_millis(400),
            scope: Scope::Up,
            ..ByteFaults::default()
        },
        ..ProxyConfig::default()
    })
    .await;
    let mut stream = TcpStream::connect(address).await.unwrap();
    let mut back = [0u8; 10];
    stream.write_all(&[1; 10]).await.unwrap();
    let started = Instant::now();
    stream.read_exact(&mut back).await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(300));
    stream.write_all(&[2; 10]).await.unwrap();
    let started = Instant::now();
    stream.read_exact(&mut back).await.unwrap();
    assert_eq!(back, [2; 10]);
    assert!(started.elapsed() >= Duration::from_millis(400));
    stream.write_all(&[3; 10]).await.unwrap();
    let started = Instant::now();
    stream.read_exact(&mut back).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "stalled twice"
    );
}

#[tokio::test]
async fn the_first_connections_are_dropped() {
    let address = proxy(ProxyConfig {
        drop_first: 2,
        ..ProxyConfig::default()
    })
    .await;
    for _ in 0..2 {
        match round_trip(address, b"hello").await {
            Ok(back) => assert!(back.is_empty(), "a dropped connection echoed {back:?}"),
            Err(err) => assert!(
                matches!(
                    err.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ),
                "{err}"
            ),
        }
    }
    assert_eq!(round_trip(address, b"hello").await.unwrap(), b"hello");
}

#[tokio::test]
async fn an_unreachable_upstream_resets_the_client() {
    let unused = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = unused.local_addr().unwrap().to_string();
    drop(unused);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(serve(
        listener,
        ProxyConfig {
            upstream,
            ..ProxyConfig::default()
        },
    ));
    let back = round_trip(address, b"x").await;
    assert!(matches!(back.as_deref(), Ok(b"") | Err(_)), "{back:?}");
}
