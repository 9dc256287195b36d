#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::messages::Done;

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
    let mut server = start_server(Framed::from_parts(parts), "peer".into(), hello, &limits);
    let incoming = tokio::time::timeout(Duration::from_secs(1), server.requests.recv())
        .await
        .expect("the request read ahead waited for more bytes")
        .unwrap();
    assert_eq!(incoming.call, 7);
    drop(client);
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
    };
    let head = EnvelopeHead::read(&frame).unwrap();
    assert_eq!((head.call, head.more), (3, true));
}
