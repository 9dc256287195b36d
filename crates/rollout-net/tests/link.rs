//! Authenticated links over loopback TCP: who gets in, what a bad peer costs, heartbeats,
//! credits and streamed answers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use rollout_net::auth::CLIENT_PROOF_LEN;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{Done, Heartbeat, Hello, PullWeights, Shutdown, WeightsBucket};
use rollout_net::rpc::RpcServer;
use rollout_net::tensor::TensorTable;
use rollout_net::{ClusterKey, NetError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const LIMIT: Duration = Duration::from_secs(20);

/// A weight bucket's header: the kind of message that carries a payload.
fn bucket(index: u32) -> WeightsBucket {
    WeightsBucket {
        version: 1,
        index,
        count: 3,
        checksum: String::new(),
        tensors: TensorTable::default(),
    }
}

fn key(secret: &str) -> ClusterKey {
    ClusterKey::from_secret(secret.as_bytes()).unwrap()
}

fn hello(role: &str, credits: u32) -> Hello {
    Hello {
        role: role.into(),
        name: format!("{role}-test"),
        version: "test".into(),
        credits,
        info: serde_json::Value::Null,
    }
}

fn limits() -> LinkLimits {
    LinkLimits {
        heartbeat: Duration::from_millis(50),
        peer_timeout: Duration::from_secs(5),
        handshake_timeout: Duration::from_secs(2),
        max_payload_bytes: 1 << 20,
        ..LinkLimits::default()
    }
}

/// A listener that accepts links until dropped, handing each accepted server side out.
async fn listener(
    secret: &str,
    credits: u32,
) -> (String, mpsc::Receiver<Result<RpcServer, NetError>>) {
    let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap().to_string();
    let (tx, rx) = mpsc::channel(16);
    let key = key(secret);
    tokio::spawn(async move {
        loop {
            let (stream, _) = socket.accept().await.unwrap();
            let server = Link::accept(stream, &key, &hello("worker", credits), &limits())
                .await
                .map(Link::server);
            if tx.send(server).await.is_err() {
                break;
            }
        }
    });
    (addr, rx)
}

async fn next<T>(rx: &mut mpsc::Receiver<T>) -> T {
    tokio::time::timeout(LIMIT, rx.recv())
        .await
        .expect("in time")
        .expect("a value")
}

#[tokio::test]
async fn raw_bytes_without_the_secret_are_dropped_unparsed_and_the_listener_lives_on() {
    let (addr, mut accepted) = listener("the cluster secret, 32 bytes long", 4).await;
    // A frame-shaped message (valid magic and all) sent without authenticating first.
    let mut raw = TcpStream::connect(&addr).await.unwrap();
    let mut challenge = [0u8; 40];
    raw.read_exact(&mut challenge).await.unwrap();
    assert_eq!(&challenge[..8], b"RLTAUTH1");
    let frame = rollout_net::Frame::from_message(&Heartbeat { seq: 1 }, Bytes::new()).unwrap();
    let mut wire = bytes::BytesMut::new();
    tokio_util::codec::Encoder::encode(&mut rollout_net::FrameCodec::new(), frame, &mut wire)
        .unwrap();
    wire.resize(CLIENT_PROOF_LEN, 0);
    raw.write_all(&wire).await.unwrap();
    let refused = next(&mut accepted).await.unwrap_err();
    assert!(matches!(refused, NetError::Auth { .. }), "{refused}");
    assert!(
        refused.to_string().contains("not a Rollout peer"),
        "{refused}"
    );
    let mut rest = Vec::new();
    let read = tokio::time::timeout(LIMIT, raw.read_to_end(&mut rest))
        .await
        .unwrap();
    assert!(
        read.is_err() || rest.is_empty(),
        "the server answered an unauthenticated peer"
    );

    // A peer with the wrong secret is refused too; one with the right secret still gets in.
    let wrong = Link::connect(
        &addr,
        &key("another secret, also 32 bytes!!"),
        &hello("trainer", 1),
        &limits(),
    )
    .await;
    assert!(matches!(wrong, Err(NetError::Auth { .. })), "{wrong:?}");
    assert!(matches!(
        next(&mut accepted).await,
        Err(NetError::Auth { .. })
    ));
    let good = Link::connect(
        &addr,
        &key("the cluster secret, 32 bytes long"),
        &hello("trainer", 1),
        &limits(),
    )
    .await
    .unwrap();
    assert_eq!(good.peer.role, "worker");
    let server = next(&mut accepted).await.unwrap();
    assert_eq!(server.hello.role, "trainer");
}

#[tokio::test]
async fn requests_and_streamed_answers_arrive_by_call() {
    let secret = "the cluster secret, 32 bytes long";
    let (addr, mut accepted) = listener(secret, 4).await;
    let client = Link::connect(&addr, &key(secret), &hello("controller", 4), &limits())
        .await
        .unwrap()
        .client();
    let mut server = next(&mut accepted).await.unwrap();
    let first = client
        .call(&PullWeights { version: 7 }, Bytes::new())
        .unwrap();
    let second = client
        .call(
            &Shutdown {
                reason: "bye".into(),
            },
            Bytes::new(),
        )
        .unwrap();
    let a = next(&mut server.requests).await;
    let b = next(&mut server.requests).await;
    assert_eq!(a.decode::<PullWeights>().unwrap().version, 7);
    // Answered out of order: the second call first, the first as a stream of three.
    server
        .responder
        .reply(b.call, &Done {}, Bytes::new(), false)
        .unwrap();
    for i in 0..3u8 {
        server
            .responder
            .reply(
                a.call,
                &bucket(u32::from(i)),
                Bytes::from(vec![i; 4]),
                i < 2,
            )
            .unwrap();
    }
    let (_, payload) = second.answer::<Done>().await.unwrap();
    assert!(payload.is_empty());
    let mut first = first;
    let mut payloads = Vec::new();
    while let Some(frame) = first.next_frame().await.unwrap() {
        let (_, _, payload) = first.decode::<WeightsBucket>(frame).unwrap();
        payloads.push(payload[0]);
    }
    assert_eq!(payloads, [0, 1, 2]);

    // An error answer reaches the caller as the peer's failure.
    let failing = client.call(&Done {}, Bytes::new()).unwrap();
    let c = next(&mut server.requests).await;
    server
        .responder
        .fail(c.call, "plugin `x` failed in `score`")
        .unwrap();
    let err = failing.answer::<Done>().await.unwrap_err();
    assert!(
        matches!(err, NetError::Remote { ref message, .. } if message.contains("plugin `x`")),
        "{err}"
    );
}

#[tokio::test]
async fn credits_hold_back_requests_until_answers_free_them() {
    let secret = "the cluster secret, 32 bytes long";
    let (addr, mut accepted) = listener(secret, 1).await;
    let client = Link::connect(&addr, &key(secret), &hello("controller", 4), &limits())
        .await
        .unwrap()
        .client();
    let mut server = next(&mut accepted).await.unwrap();
    let first = client.call(&Done {}, Bytes::new()).unwrap();
    let second = client.call(&Done {}, Bytes::new()).unwrap();
    let a = next(&mut server.requests).await;
    // With one credit the second request is not sent before the first is answered.
    let early = tokio::time::timeout(Duration::from_millis(300), server.requests.recv()).await;
    assert!(
        early.is_err(),
        "a request beyond the peer's credits was sent"
    );
    server
        .responder
        .reply(a.call, &Done {}, Bytes::new(), false)
        .unwrap();
    first.answer::<Done>().await.unwrap();
    let b = next(&mut server.requests).await;
    server
        .responder
        .reply(b.call, &Done {}, Bytes::new(), false)
        .unwrap();
    second.answer::<Done>().await.unwrap();
}

#[tokio::test]
async fn an_oversized_frame_closes_only_its_connection() {
    let secret = "the cluster secret, 32 bytes long";
    let (addr, mut accepted) = listener(secret, 4).await;
    let generous = LinkLimits {
        max_payload_bytes: 64 << 20,
        ..limits()
    };
    let client = Link::connect(&addr, &key(secret), &hello("controller", 4), &generous)
        .await
        .unwrap()
        .client();
    let mut server = next(&mut accepted).await.unwrap();
    // Over the listener's 1 MiB payload limit: refused by the receiving decoder, which never reserves
    // what the preamble claims.
    let call = client
        .call(&bucket(0), Bytes::from(vec![0u8; 2 << 20]))
        .unwrap();
    assert!(
        tokio::time::timeout(LIMIT, server.requests.recv())
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        server.closed_reason().contains("exceeds the limit"),
        "{}",
        server.closed_reason()
    );
    let err = call.answer::<Done>().await.unwrap_err();
    assert!(matches!(err, NetError::PeerLost { .. }), "{err}");

    // Another connection to the same listener is unaffected.
    let other = Link::connect(&addr, &key(secret), &hello("controller", 4), &limits())
        .await
        .unwrap()
        .client();
    let mut other_server = next(&mut accepted).await.unwrap();
    let pending = other.call(&Done {}, Bytes::new()).unwrap();
    let request = next(&mut other_server.requests).await;
    other_server
        .responder
        .reply(request.call, &Done {}, Bytes::new(), false)
        .unwrap();
    pending.answer::<Done>().await.unwrap();
}

#[tokio::test]
async fn a_silent_peer_is_lost_after_the_timeout() {
    let secret = "the cluster secret, 32 bytes long";
    let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap().to_string();
    let server_key = key(secret);
    // Authenticates and greets, then never sends another byte (no heartbeats).
    tokio::spawn(async move {
        let (mut stream, _) = socket.accept().await.unwrap();
        rollout_net::auth::authenticate_client(&mut stream, &server_key, b"", LIMIT)
            .await
            .unwrap();
        let mut framed = tokio_util::codec::Framed::new(stream, rollout_net::FrameCodec::new());
        let frame = rollout_net::Frame::from_message(&hello("worker", 4), Bytes::new()).unwrap();
        futures_util::SinkExt::send(&mut framed, frame)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(framed);
    });
    let quick = LinkLimits {
        peer_timeout: Duration::from_millis(400),
        ..limits()
    };
    let client = Link::connect(&addr, &key(secret), &hello("controller", 4), &quick)
        .await
        .unwrap()
        .client();
    let call = client.call(&Done {}, Bytes::new()).unwrap();
    let started = std::time::Instant::now();
    let err = tokio::time::timeout(LIMIT, call.answer::<Done>())
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, NetError::PeerSilent { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            client.call(&Done {}, Bytes::new()),
            Err(NetError::PeerSilent { .. })
        ),
        "a lost link takes no more calls"
    );
}

#[tokio::test]
async fn mismatched_builds_do_not_talk() {
    let secret = "the cluster secret, 32 bytes long";
    let (addr, mut accepted) = listener(secret, 4).await;
    let mut old = hello("trainer", 1);
    old.version = "0.0.1".into();
    let refused = Link::connect(&addr, &key(secret), &old, &limits())
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("same build"), "{refused}");
    assert!(next(&mut accepted).await.is_err());
}

#[tokio::test]
async fn tls_links_carry_requests_and_refuse_plain_peers() {
    let secret = "the cluster secret, 32 bytes long";
    // Heartbeats far apart: a frame must not wait for the next one to be flushed.
    let tls = LinkLimits {
        encryption: rollout_net::Encryption::Always(rollout_net::tls::TlsContext::new().unwrap()),
        heartbeat: Duration::from_secs(30),
        peer_timeout: Duration::from_secs(60),
        max_payload_bytes: 64 << 20,
        ..limits()
    };
    let socket = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap().to_string();
    let (tx, mut accepted) = mpsc::channel(4);
    let server_limits = tls.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = socket.accept().await.unwrap();
            let server = Link::accept(stream, &key(secret), &hello("worker", 4), &server_limits)
                .await
                .map(Link::server);
            if tx.send(server).await.is_err() {
                break;
            }
        }
    });
    let client_tls = LinkLimits {
        encryption: rollout_net::Encryption::Always(rollout_net::tls::TlsContext::new().unwrap()),
        ..tls.clone()
    };
    let client = Link::connect(&addr, &key(secret), &hello("controller", 4), &client_tls)
        .await
        .unwrap()
        .client();
    let mut server: RpcServer = next(&mut accepted).await.unwrap();
    for index in 0..5 {
        let started = std::time::Instant::now();
        let call = client
            .call(&bucket(index), Bytes::from(vec![9u8; 8 << 20]))
            .unwrap();
        let request = next(&mut server.requests).await;
        assert_eq!(request.frame.payload.len(), 8 << 20);
        server
            .responder
            .reply(request.call, &Done {}, Bytes::new(), false)
            .unwrap();
        call.answer::<Done>().await.unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "a round trip took {took:?}");
    }

    // A peer without TLS, and a TLS peer with the wrong secret, are both refused.
    let plain = Link::connect(&addr, &key(secret), &hello("controller", 4), &limits()).await;
    assert!(plain.is_err());
    assert!(next(&mut accepted).await.is_err());
    let wrong = Link::connect(
        &addr,
        &key("a wrong secret, 32 bytes long too"),
        &hello("c", 4),
        &client_tls,
    )
    .await;
    assert!(matches!(wrong, Err(NetError::Auth { .. })), "{wrong:?}");
    assert!(next(&mut accepted).await.is_err());
}

#[tokio::test]
async fn closing_a_client_ends_the_connection_for_every_clone_and_the_peer() {
    let secret = "the cluster secret, 32 bytes long";
    let (addr, mut accepted) = listener(secret, 4).await;
    let link = Link::connect(&addr, &key(secret), &hello("controller", 4), &limits())
        .await
        .unwrap();
    let client = link.client();
    let kept = client.clone();
    let mut server = next(&mut accepted).await.unwrap();
    client.close("the controller stopped");
    // The peer reads the end of the stream although a clone of the client lives on.
    let ended = tokio::time::timeout(LIMIT, server.requests.recv())
        .await
        .expect("the peer sees the connection end");
    assert!(ended.is_none());
    let lost = tokio::time::timeout(LIMIT, kept.lost()).await.unwrap();
    assert!(
        lost.to_string().contains("the controller stopped"),
        "{lost}"
    );
    let shutdown = Shutdown {
        reason: "too late".into(),
    };
    let refused = kept
        .request::<Shutdown, Done>(&shutdown, Bytes::new())
        .await;
    assert!(refused.is_err());
}
