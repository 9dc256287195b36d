#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::VecDeque;
use std::net::Ipv4Addr;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

use super::*;
use crate::auth::{AUTH_MAGIC, AuthError, CLIENT_PROOF_LEN, authenticate_server};
use crate::frame::{Frame, FrameCodec};
use crate::link::NetError;
use crate::tls::{Encryption, Stream as LinkStream, TlsContext};

/// The longest any one wait in these tests may take.
const PATIENCE: Duration = Duration::from_secs(10);

fn hello(name: &str) -> Hello {
    Hello {
        role: "test".into(),
        name: name.into(),
        version: "test".into(),
        credits: 4,
        info: serde_json::Value::Null,
    }
}

fn key() -> ClusterKey {
    ClusterKey::from_secret(b"the gate tests' cluster secret").unwrap()
}

/// A gate on a fresh loopback port; the names of the peers it lets in arrive on the
/// receiver.
async fn gate(limits: LinkLimits) -> (Gate, SocketAddr, JoinHandle<()>, mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (joined, links) = mpsc::channel(16);
    let gate = Gate::new(key(), hello("gate"), limits, "");
    let serving = gate.clone().serve(listener, move |link| {
        let joined = joined.clone();
        async move {
            let _ = joined.send(link.peer.name.clone()).await;
        }
    });
    (gate, addr, serving, links)
}

/// Where the gate's handshake with `peer` has got, if it is under way.
fn stage(gate: &Gate, peer: SocketAddr) -> Option<Stage> {
    lock(&gate.in_flight).stage(peer)
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A connection from `source` (any of 127.0.0.0/8, all of which route to loopback).
async fn connect_from(source: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source.into(), 0))?;
    socket.connect(to).await
}

/// Idle connections opened to a gate as fast as it takes them (up to 8 a millisecond), the
/// n-th from `source(n)`, the newest `held` of them kept open; until dropped, or for three
/// times [`PATIENCE`] at most.
struct Flood(JoinHandle<()>);

impl Flood {
    fn start(
        to: SocketAddr,
        held: usize,
        source: impl Fn(u32) -> Ipv4Addr + Send + 'static,
    ) -> Self {
        Self(tokio::spawn(async move {
            let started = Instant::now();
            let mut open = VecDeque::with_capacity(held + 1);
            let mut opened = 0u32;
            while started.elapsed() < 3 * PATIENCE {
                for _ in 0..8 {
                    if let Ok(stream) = connect_from(source(opened), to).await {
                        open.push_back(stream);
                        if open.len() > held {
                            open.pop_front();
                        }
                    }
                    opened = opened.wrapping_add(1);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }))
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The connecting side of a handshake from the challenge on (after TLS, if any): proves the
/// secret and greets as `name`; returns the name the gate greeted with.
async fn authenticate_and_greet(
    mut stream: LinkStream,
    binding: &[u8],
    name: &str,
) -> Result<String, String> {
    authenticate_server(&mut stream, &key(), binding, PATIENCE)
        .await
        .map_err(|err| err.to_string())?;
    let mut framed = Framed::new(stream, FrameCodec::new());
    let greeting = Frame::from_message(&hello(name), Bytes::new()).unwrap();
    framed.send(greeting).await.map_err(|err| err.to_string())?;
    let reply = tokio::time::timeout(PATIENCE, framed.next())
        .await
        .map_err(|_| "no greeting".to_owned())?
        .ok_or("closed before greeting")?
        .map_err(|err| err.to_string())?;
    let theirs: Hello = reply.decode_message().map_err(|err| err.to_string())?;
    Ok(theirs.name)
}

/// Waits until `peer`'s handshake reaches `reached`, then until the flood has ended twice
/// the gate's slots' worth of handshakes since (under a gate that closed the oldest, the
/// peer's among them), and checks that the peer's is still under way at `reached`.
async fn outlast_the_flood(gate: &Gate, peer: SocketAddr, reached: Stage) {
    wait_until("the peer's handshake to get under way", || {
        stage(gate, peer) == Some(reached)
    })
    .await;
    let before = gate.refusals();
    wait_until("the flood to end twice the gate's slots", || {
        gate.refusals() >= before + 2 * MAX_HANDSHAKES as u64
    })
    .await;
    assert_eq!(stage(gate, peer), Some(reached));
    assert!(gate.in_flight() <= MAX_HANDSHAKES);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_flooding_holds_its_share_and_keeps_no_one_out() {
    let (gate, addr, serving, mut links) = gate(LinkLimits::default()).await;
    let flooder = Ipv4Addr::new(127, 0, 0, 2);
    let flood = Flood::start(addr, 4 * MAX_HANDSHAKES_PER_SOURCE, move |_| flooder);
    wait_until("the flood to take its share", || {
        gate.in_flight_from(flooder.into()) == MAX_HANDSHAKES_PER_SOURCE
    })
    .await;
    let before = gate.refusals();
    let (to, key, limits) = (addr.to_string(), key(), LinkLimits::default());
    for round in 0..5 {
        let name = format!("peer-{round}");
        let started = Instant::now();
        let link = Link::connect(&to, &key, &hello(&name), &limits).await;
        assert!(link.is_ok(), "{link:?}");
        let joined = tokio::time::timeout(PATIENCE, links.recv()).await.unwrap();
        assert_eq!(joined, Some(name));
        assert!(
            started.elapsed() < BUSY_HANDSHAKE_TIMEOUT,
            "{:?}",
            started.elapsed()
        );
        assert!(gate.in_flight_from(flooder.into()) <= MAX_HANDSHAKES_PER_SOURCE);
        assert!(gate.in_flight() <= MAX_HANDSHAKES_PER_SOURCE + 1);
    }
    wait_until("the flood past its share to be closed", || {
        gate.refusals() >= before + 2 * MAX_HANDSHAKES as u64
    })
    .await;
    assert!(gate.in_flight_from(flooder.into()) <= MAX_HANDSHAKES_PER_SOURCE);
    drop(flood);
    serving.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_peer_outlasts_a_flood_from_a_few_addresses() {
    let (gate, addr, serving, mut links) = gate(LinkLimits::default()).await;
    // 16 addresses, more idle connections than the gate holds: every slot taken, and every
    // new connection closing one.
    let flood = Flood::start(addr, MAX_HANDSHAKES + 32, |n| {
        Ipv4Addr::new(127, 0, 1, 1 + (n % 16) as u8)
    });
    wait_until("the flood to fill the gate", || {
        gate.in_flight() == MAX_HANDSHAKES
    })
    .await;
    // A peer slow to answer the challenge (a long round trip): it has made no more progress
    // than the flood, but its address holds fewer handshakes than any of the flood's.
    let stream = connect_from(Ipv4Addr::LOCALHOST, addr).await.unwrap();
    let peer = stream.local_addr().unwrap();
    outlast_the_flood(&gate, peer, Stage::Accepted).await;
    let greeted = authenticate_and_greet(LinkStream::Plain(stream), b"", "slow").await;
    assert_eq!(greeted.as_deref(), Ok("gate"));
    let joined = tokio::time::timeout(PATIENCE, links.recv()).await.unwrap();
    assert_eq!(joined.as_deref(), Some("slow"));
    drop(flood);
    serving.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_past_tls_outlasts_a_flood_from_fresh_addresses() {
    let tls = TlsContext::new().unwrap();
    let limits = LinkLimits {
        encryption: Encryption::Always(tls.clone()),
        ..LinkLimits::default()
    };
    let (gate, addr, serving, mut links) = gate(limits).await;
    // Every connection from an address of its own: no address holds more handshakes than
    // the peer's, so only the peer's progress sets it apart.
    let first = u32::from(Ipv4Addr::new(127, 2, 0, 0));
    let flood = Flood::start(addr, MAX_HANDSHAKES + 32, move |n| {
        Ipv4Addr::from(first + n % 65_536)
    });
    wait_until("the flood to fill the gate", || {
        gate.in_flight() == MAX_HANDSHAKES
    })
    .await;
    let stream = connect_from(Ipv4Addr::LOCALHOST, addr).await.unwrap();
    let peer = stream.local_addr().unwrap();
    let (stream, binding) = tls.connect(stream).await.unwrap();
    // Done with TLS, slow to answer the challenge.
    outlast_the_flood(&gate, peer, Stage::Encrypted).await;
    let greeted = authenticate_and_greet(stream, &binding, "slow").await;
    assert_eq!(greeted.as_deref(), Ok("gate"));
    let joined = tokio::time::timeout(PATIENCE, links.recv()).await.unwrap();
    assert_eq!(joined.as_deref(), Some("slow"));
    drop(flood);
    serving.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_closed_for_a_newer_one_is_told_to_try_again() {
    let (gate, addr, serving, _links) = gate(LinkLimits::default()).await;
    let source = Ipv4Addr::new(127, 0, 0, 3);
    let mut first = connect_from(source, addr).await.unwrap();
    let first_addr = first.local_addr().unwrap();
    wait_until("the first handshake", || stage(&gate, first_addr).is_some()).await;
    let mut newer = Vec::new();
    for _ in 0..MAX_HANDSHAKES_PER_SOURCE {
        newer.push(connect_from(source, addr).await.unwrap());
    }
    wait_until("the newer ones to take the source's slots", || {
        stage(&gate, first_addr).is_none()
            && gate.in_flight_from(source.into()) == MAX_HANDSHAKES_PER_SOURCE
    })
    .await;
    assert_eq!(gate.refusals(), 1);
    // The first connection got its challenge and then was closed: the connecting side can
    // tell that from a refused secret, and tries again.
    let result = authenticate_server(&mut first, &key(), b"", PATIENCE).await;
    assert!(matches!(result, Err(AuthError::NoAnswer(_))), "{result:?}");
    serving.abort();
}

#[tokio::test]
async fn a_listener_closing_after_its_challenge_is_a_connect_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let listening = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut challenge = AUTH_MAGIC.to_vec();
        challenge.extend_from_slice(&[7; 32]);
        stream.write_all(&challenge).await.unwrap();
        let mut proof = [0; CLIENT_PROOF_LEN];
        stream.read_exact(&mut proof).await.unwrap();
    });
    let link = Link::connect(&addr, &key(), &hello("peer"), &LinkLimits::default()).await;
    // What `connect_with_retry` in the roles retries, unlike a refused secret.
    assert!(matches!(link, Err(NetError::Connect { .. })), "{link:?}");
    listening.await.unwrap();
}

#[test]
fn refusals_past_the_first_few_are_counted_then_summed_up() {
    let mut refusals = Refusals::default();
    let start = Instant::now();
    for _ in 0..LOGGED_PER_WINDOW + 7 {
        assert_eq!(refusals.count(start), None);
    }
    assert_eq!(refusals.quiet, 7);
    assert_eq!(refusals.count(start + LOG_WINDOW), Some(7));
    assert_eq!((refusals.logged, refusals.quiet), (1, 0));
    assert_eq!(refusals.count(start + LOG_WINDOW * 3), None);
    assert_eq!(refusals.total, u64::from(LOGGED_PER_WINDOW) + 9);
}
