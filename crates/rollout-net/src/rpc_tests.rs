#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;

use super::*;
use crate::link::LinkLimits;
use crate::messages::{Done, Hello, MessageKind};
use tokio_util::codec::Encoder;

/// The answering side of `parts`, with no heartbeat to get in the way.
fn quiet_server(parts: tokio_util::codec::FramedParts<LinkStream, FrameCodec>) -> RpcServer {
    let limits = LinkLimits {
        heartbeat: Duration::from_secs(3600),
        ..LinkLimits::default()
    };
    let hello = Hello {
        role: "test".into(),
        name: "test".into(),
        version: "test".into(),
        credits: 4,
        info: serde_json::Value::Null,
    };
    start_server(Framed::from_parts(parts), "peer".into(), hello, &limits)
}

/// A request that arrived together with the peer's greeting is served at once, not when
/// the peer's next heartbeat brings more bytes (the ~2 s weight-sync stalls).
#[tokio::test]
async fn a_request_read_ahead_with_the_greeting_is_served_without_more_bytes() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (accepted, _) = listener.accept().await.unwrap();
    let request = Frame::encode_message(
        MessageKind::Done,
        &Envelope {
            call: 7,
            more: false,
            body: Done {},
        },
        Bytes::new(),
    )
    .unwrap();
    let mut read_ahead = BytesMut::new();
    FrameCodec::new()
        .encode_head(&request, &mut read_ahead)
        .unwrap();
    // Half of a second frame too: it waits for the socket, the whole one does not.
    read_ahead.extend_from_slice(&read_ahead.clone()[..10]);
    let mut parts =
        tokio_util::codec::FramedParts::new(LinkStream::Plain(accepted), FrameCodec::new());
    parts.read_buf = read_ahead;
    let mut server = quiet_server(parts);
    let incoming = tokio::time::timeout(Duration::from_secs(1), server.requests.recv())
        .await
        .expect("the request read ahead waited for more bytes")
        .unwrap();
    assert_eq!(incoming.call, 7);
    drop(client);
}

/// A large payload whose start came with the greeting continues where it left off: the
/// codec that began it reads the rest.
#[tokio::test]
async fn a_large_payload_begun_in_the_read_ahead_arrives_whole() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (accepted, _) = listener.accept().await.unwrap();
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let frame = Frame::encode_message(
        MessageKind::WeightsBucket,
        &"bucket",
        Bytes::from(payload.clone()),
    )
    .unwrap();
    let mut wire = BytesMut::new();
    FrameCodec::new().encode(frame.clone(), &mut wire).unwrap();
    let (read_ahead, rest) = wire.split_at(100_000);
    let mut parts =
        tokio_util::codec::FramedParts::new(LinkStream::Plain(accepted), FrameCodec::new());
    parts.read_buf = BytesMut::from(read_ahead);
    let (_sink, mut stream) = split(Framed::from_parts(parts));
    tokio::io::AsyncWriteExt::write_all(&mut client, rest)
        .await
        .unwrap();
    let received = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("the rest of the frame was read")
        .unwrap()
        .unwrap();
    assert_eq!(received, frame);
    assert_eq!(
        received.payload_xxh3,
        Some(twox_hash::XxHash3_128::oneshot(&payload))
    );
}

#[test]
fn the_envelope_prefix_reads_like_the_full_parse() {
    for (call, more) in [(0, false), (7, true), (u64::MAX, false)] {
        let envelope = Envelope {
            call,
            more,
            body: Done {},
        };
        let frame = Frame::encode_message(MessageKind::Done, &envelope, Bytes::new()).unwrap();
        let head = EnvelopeHead::from_prefix(&frame.header).unwrap();
        assert_eq!((head.call, head.more), (call, more));
    }
    for odd in [
        &b"{\"more\":true,\"call\":3,\"body\":{}}"[..],
        b"{\"call\":3,\"body\":{}}",
        b"{\"call\":99999999999999999999999,\"more\":true,\"body\":{}}",
        b"{\"call\":3,\"more\":truex",
    ] {
        assert!(EnvelopeHead::from_prefix(odd).is_none());
    }
    // Layouts the prefix reader does not know still parse in full.
    let frame = Frame {
        kind: MessageKind::Done,
        header: Bytes::from_static(b"{\"more\":true,\"call\":3,\"body\":{}}"),
        payload: Bytes::new(),
        payload_xxh3: None,
        sender_hashed: false,
    };
    let head = EnvelopeHead::read(&frame).unwrap();
    assert_eq!((head.call, head.more), (3, true));
}

/// A hashed answer arrives as its pieces joined, with the sender's digest checked, and the
/// digest the sender reports once it is written is the payload's.
#[tokio::test]
async fn a_hashed_answer_arrives_joined_and_reports_its_digest() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (accepted, _) = listener.accept().await.unwrap();
    let parts = tokio_util::codec::FramedParts::new(LinkStream::Plain(accepted), FrameCodec::new());
    let server = quiet_server(parts);
    let large: Vec<u8> = (0..700_000u32).map(|i| (i % 239) as u8).collect();
    let pieces = vec![
        Bytes::from_static(b"tiny"),
        Bytes::from(large.clone()),
        Bytes::from_static(&[0; 3]),
        Bytes::from_static(b"end"),
    ];
    let joined: Vec<u8> = pieces.iter().flat_map(|p| p.iter().copied()).collect();
    let (written, reported) = tokio::sync::oneshot::channel();
    let bucket = crate::messages::WeightsBucket {
        version: 1,
        index: 0,
        count: 1,
        checksum: String::new(),
        tensors: crate::tensor::TensorTable::default(),
    };
    server
        .responder
        .reply_hashed(3, &bucket.clone(), pieces, false, move |digest| {
            let _ = written.send(digest);
        })
        .unwrap();
    let parts = tokio_util::codec::FramedParts::new(LinkStream::Plain(client), FrameCodec::new());
    let (_sink, mut stream) = split(Framed::from_parts(parts));
    let received = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("the answer arrived")
        .unwrap()
        .unwrap();
    let expected = twox_hash::XxHash3_128::oneshot(&joined);
    assert_eq!(&received.payload[..], &joined[..]);
    assert!(received.sender_hashed);
    assert_eq!(received.payload_xxh3, Some(expected));
    let envelope = decode_envelope::<crate::messages::WeightsBucket>(&received).unwrap();
    assert_eq!((envelope.call, envelope.body), (3, bucket));
    assert_eq!(reported.await.unwrap(), expected);
}
