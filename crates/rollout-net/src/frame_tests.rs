#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::messages::{Heartbeat, Hello};
use crate::payload::BufferPool;

fn hello() -> Hello {
    Hello {
        role: "generator".into(),
        name: "gen-0".into(),
        version: "0.1.0".into(),
        credits: 1,
        info: serde_json::Value::Null,
    }
}

fn encode(frame: Frame) -> BytesMut {
    let mut buf = BytesMut::new();
    FrameCodec::new().encode(frame, &mut buf).unwrap();
    buf
}

/// A preamble with the given fields, followed by nothing.
fn preamble(version: u8, kind: u16, flags: u16, header_len: u32, payload_len: u64) -> BytesMut {
    let mut buf = BytesMut::new();
    buf.put_slice(&MAGIC);
    buf.put_u8(version);
    buf.put_u16(kind);
    buf.put_u16(flags);
    buf.put_u32(header_len);
    buf.put_u32(0);
    buf.put_u64(payload_len);
    buf
}

fn decode_err(mut buf: BytesMut) -> FrameError {
    FrameCodec::new().decode(&mut buf).unwrap_err()
}

#[test]
fn layout_is_as_documented() {
    let frame = Frame::encode_message(MessageKind::WeightsBucket, &Heartbeat { seq: 7 }, {
        Bytes::from_static(b"xyz")
    })
    .unwrap();
    let buf = encode(frame);
    let header = br#"{"seq":7}"#;
    let mut expected = vec![b'R', b'L', b'T', 1, 0, 20, 0, 0];
    expected.extend_from_slice(&(header.len() as u32).to_be_bytes());
    expected.extend_from_slice(&[0; 4]);
    expected.extend_from_slice(&3u64.to_be_bytes());
    expected.extend_from_slice(header);
    expected.extend_from_slice(b"xyz");
    assert_eq!(&buf[..], &expected[..]);
}

#[test]
fn kinds_round_trip_through_numbers() {
    for kind in MessageKind::ALL {
        assert_eq!(MessageKind::from_u16(kind.as_u16()), Some(kind));
    }
    assert_eq!(MessageKind::from_u16(0), None);
    assert_eq!(MessageKind::from_u16(27), None);
}

#[test]
fn one_byte_chunks_decode_the_same() {
    let payload = Bytes::from_static(&[1, 2, 3, 4, 5]);
    let frame = Frame::encode_message(MessageKind::WeightsBucket, &hello(), payload).unwrap();
    let wire = encode(frame.clone());
    let mut codec = FrameCodec::new();
    let mut buf = BytesMut::new();
    for (i, byte) in wire.iter().enumerate() {
        buf.put_u8(*byte);
        let decoded = codec.decode(&mut buf).unwrap();
        if i + 1 < wire.len() {
            assert_eq!(decoded, None, "frame decoded early, at byte {i}");
        } else {
            assert_eq!(decoded.as_ref(), Some(&frame));
        }
    }
    assert!(buf.is_empty());
    assert_eq!(frame.decode_header::<Hello>().unwrap(), hello());
}

#[test]
fn back_to_back_frames() {
    let first = Frame::from_message(&hello(), Bytes::new()).unwrap();
    let payload = Bytes::from_static(b"payload");
    let second =
        Frame::encode_message(MessageKind::WeightsBucket, &Heartbeat { seq: 1 }, payload).unwrap();
    let mut buf = encode(first.clone());
    buf.extend_from_slice(&encode(second.clone()));
    let mut codec = FrameCodec::new();
    assert_eq!(codec.decode(&mut buf).unwrap(), Some(first));
    assert_eq!(codec.decode(&mut buf).unwrap(), Some(second));
    assert_eq!(codec.decode(&mut buf).unwrap(), None);
    assert_eq!(codec.decode_eof(&mut buf).unwrap(), None);
}

#[test]
fn rejects_bad_magic_early() {
    let err = decode_err(BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]));
    assert!(matches!(err, FrameError::BadMagic { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "bad magic bytes \"GET\", expected \"RLT\" (not a Rollout peer?)"
    );
    // One wrong byte is enough; a right prefix waits for more.
    let err = decode_err(BytesMut::from(&b"\x16"[..]));
    assert!(matches!(err, FrameError::BadMagic { .. }), "{err}");
    let mut codec = FrameCodec::new();
    assert_eq!(codec.decode(&mut BytesMut::from(&b"RL"[..])).unwrap(), None);
}

#[test]
fn rejects_bad_preamble_fields() {
    let err = decode_err(preamble(2, 1, 0, 0, 0));
    assert!(
        matches!(err, FrameError::UnsupportedVersion { found: 2 }),
        "{err}"
    );
    let err = decode_err(preamble(1, 0, 0, 0, 0));
    assert!(matches!(err, FrameError::UnknownKind(0)), "{err}");
    let err = decode_err(preamble(1, 999, 0, 0, 0));
    assert!(matches!(err, FrameError::UnknownKind(999)), "{err}");
    let err = decode_err(preamble(1, 1, 0x8000, 0, 0));
    assert!(matches!(err, FrameError::ReservedFlags(0x8000)), "{err}");
    let mut buf = preamble(1, 1, 0, 0, 0);
    buf[12..16].copy_from_slice(&[0, 0, 0, 1]);
    let err = decode_err(buf);
    assert!(matches!(err, FrameError::ReservedField(1)), "{err}");
}

#[test]
fn rejects_oversize_lengths_without_allocating() {
    let mut buf = preamble(1, 1, 0, 0, u64::MAX);
    let capacity = buf.capacity();
    let err = FrameCodec::new().decode(&mut buf).unwrap_err();
    assert!(
        matches!(err, FrameError::PayloadTooLarge { len: u64::MAX, .. }),
        "{err}"
    );
    assert_eq!(buf.capacity(), capacity);

    let mut buf = preamble(1, 1, 0, u32::MAX, 0);
    let err = FrameCodec::new().decode(&mut buf).unwrap_err();
    assert!(matches!(err, FrameError::HeaderTooLarge { .. }), "{err}");
    assert_eq!(buf.capacity(), capacity);

    let codec = FrameCodec::new()
        .with_max_header_bytes(10)
        .with_max_payload_bytes(100);
    let err = codec
        .clone()
        .decode(&mut preamble(1, 1, 0, 11, 0))
        .unwrap_err();
    assert!(
        matches!(
            err,
            FrameError::HeaderTooLarge {
                len: 11,
                max: 10,
                ..
            }
        ),
        "{err}"
    );
    let err = codec
        .clone()
        .decode(&mut preamble(1, 20, 0, 10, 101))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "WeightsBucket payload of 101 bytes exceeds the limit of 100 bytes"
    );
    assert_eq!(
        codec
            .clone()
            .decode(&mut preamble(1, 20, 0, 10, 100))
            .unwrap(),
        None
    );
}

#[test]
fn large_valid_claim_reserves_only_a_bounded_amount() {
    // 60 GiB is within the default limit, but only the preamble has arrived.
    let mut buf = preamble(1, 10, 0, 2, 60 << 30);
    assert_eq!(FrameCodec::new().decode(&mut buf).unwrap(), None);
    assert!(buf.capacity() <= PREAMBLE_LEN + MAX_RESERVE_AHEAD);
    // A small frame is reserved in full.
    let mut buf = preamble(1, 10, 0, 2, 1000);
    assert_eq!(FrameCodec::new().decode(&mut buf).unwrap(), None);
    assert!(buf.capacity() >= PREAMBLE_LEN + 2 + 1000);
}

#[test]
fn each_kind_is_held_to_what_it_needs() {
    // A heartbeat claiming a 1 MiB header, a generation request with a payload.
    let err = decode_err(preamble(1, 2, 0, 1 << 20, 0));
    assert_eq!(
        err.to_string(),
        "Heartbeat header of 1048576 bytes exceeds the limit of 65536 bytes"
    );
    let err = decode_err(preamble(1, 4, 0, 10, 1));
    assert_eq!(
        err.to_string(),
        "GenerateRequest payload of 1 bytes exceeds the limit of 0 bytes"
    );
    // Bulk kinds keep the link's limits.
    let mut buf = preamble(1, 4, 0, 100 << 20, 0);
    assert_eq!(
        FrameCodec::new()
            .with_max_header_bytes(256 << 20)
            .decode(&mut buf)
            .unwrap(),
        None
    );
}

#[test]
fn a_large_payload_grows_its_buffer_a_logarithmic_number_of_times() {
    let payload = 64usize << 20;
    let mut buf = preamble(1, 20, 0, 2, payload as u64);
    buf.extend_from_slice(b"{}");
    let mut codec = FrameCodec::new();
    let chunk = vec![0u8; 1 << 20];
    let (mut grown, mut capacity) = (0, 0);
    for _ in 0..payload / chunk.len() {
        assert_eq!(codec.decode(&mut buf).unwrap(), None);
        let arriving = &codec
            .arriving
            .as_ref()
            .expect("a payload under way")
            .payload;
        if arriving.capacity() != capacity {
            grown += 1;
            capacity = arriving.capacity();
        }
        // Never far more than has arrived, and the read buffer is emptied as it goes.
        assert!(capacity <= 2 * arriving.received().max(8 << 20));
        assert!(buf.is_empty());
        buf.extend_from_slice(&chunk);
    }
    let frame = codec.decode(&mut buf).unwrap().expect("the whole frame");
    assert_eq!(frame.payload.len(), payload);
    assert_eq!(frame.header, Bytes::from_static(b"{}"));
    assert!(grown <= 4, "the buffer grew {grown} times");
}

/// Every frame `wire` holds, fed to one codec `chunk` bytes at a time.
fn decode_in_chunks(wire: &[u8], chunk: usize) -> Vec<Frame> {
    let mut codec = FrameCodec::new();
    let mut buf = BytesMut::new();
    let mut decoded = Vec::new();
    for piece in wire.chunks(chunk) {
        buf.extend_from_slice(piece);
        while let Some(frame) = codec.decode(&mut buf).unwrap() {
            decoded.push(frame);
        }
    }
    decoded
}

fn bucket_frame(payload: Vec<u8>) -> Frame {
    Frame::encode_message(MessageKind::WeightsBucket, &"bucket", Bytes::from(payload)).unwrap()
}

#[test]
fn a_large_payload_is_hashed_as_it_arrives_in_any_chunks() {
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    let frame = bucket_frame(payload.clone());
    let small = Frame::from_message(&hello(), Bytes::new()).unwrap();
    let mut wire = encode(frame.clone());
    wire.extend_from_slice(&encode(small.clone()));
    for chunk in [1000, 65_536, wire.len()] {
        let decoded = decode_in_chunks(&wire, chunk);
        assert_eq!(
            decoded,
            vec![frame.clone(), small.clone()],
            "chunks of {chunk}"
        );
        let digest = twox_hash::XxHash3_128::oneshot(&payload);
        assert_eq!(decoded[0].payload_xxh3, Some(digest));
        assert_eq!(
            decoded[0].payload_checksum(),
            crate::tensor::checksum(&payload)
        );
        assert_eq!(decoded[1].payload_xxh3, None);
    }
}

#[test]
fn received_payloads_land_in_the_buffers_of_dropped_ones() {
    let pool = BufferPool::default();
    let mut codec = FrameCodec::new().with_pool(pool.clone());
    let mut receive = |fill: u8| {
        let mut buf = encode(bucket_frame(vec![fill; 1 << 20]));
        codec.decode(&mut buf).unwrap().expect("a whole frame")
    };
    let first = receive(1);
    let address = first.payload.as_ptr();
    drop(first);
    assert!(pool.free_bytes() >= 1 << 20);
    let second = receive(2);
    assert_eq!(second.payload.as_ptr(), address);
    assert!(second.payload.iter().all(|&b| b == 2));
    assert_eq!(
        second.payload_xxh3,
        Some(twox_hash::XxHash3_128::oneshot(&[2u8; 1 << 20]))
    );
}

#[test]
fn encoder_enforces_limits() {
    let payload = Bytes::from_static(&[0; 8]);
    let frame =
        Frame::encode_message(MessageKind::WeightsBucket, &Heartbeat { seq: 0 }, payload).unwrap();
    let mut buf = BytesMut::new();
    let err = FrameCodec::new()
        .with_max_payload_bytes(7)
        .encode(frame.clone(), &mut buf)
        .unwrap_err();
    assert!(
        matches!(err, FrameError::PayloadTooLarge { len: 8, max: 7, .. }),
        "{err}"
    );
    let err = FrameCodec::new()
        .with_max_header_bytes(2)
        .encode(frame, &mut buf)
        .unwrap_err();
    assert!(
        matches!(err, FrameError::HeaderTooLarge { max: 2, .. }),
        "{err}"
    );
    assert!(buf.is_empty(), "nothing is written for a rejected frame");
}

#[test]
fn truncated_stream_is_an_error_at_eof() {
    let wire = encode(Frame::from_message(&hello(), Bytes::new()).unwrap());
    let mut buf = BytesMut::from(&wire[..wire.len() - 1]);
    let err = FrameCodec::new().decode_eof(&mut buf).unwrap_err();
    assert!(
        matches!(err, FrameError::Truncated { buffered } if buffered == wire.len() - 1),
        "{err}"
    );
}

#[test]
fn a_stream_ending_inside_a_large_payload_is_an_error_at_eof() {
    let wire = encode(bucket_frame(vec![5u8; 100_000]));
    let mut buf = BytesMut::from(&wire[..wire.len() - 10]);
    let mut codec = FrameCodec::new();
    assert_eq!(codec.decode(&mut buf).unwrap(), None);
    let err = codec.decode_eof(&mut buf).unwrap_err();
    assert!(matches!(err, FrameError::Truncated { .. }), "{err}");
}

#[test]
fn header_errors() {
    let frame = Frame {
        kind: MessageKind::Hello,
        header: Bytes::from_static(b"{not json"),
        payload: Bytes::new(),
        payload_xxh3: None,
        sender_hashed: false,
    };
    let err = frame.decode_message::<Hello>().unwrap_err();
    assert!(matches!(err, FrameError::InvalidHeader { .. }), "{err}");
    assert!(
        err.to_string().starts_with("invalid Hello header: "),
        "{err}"
    );

    let frame = Frame {
        kind: MessageKind::Hello,
        header: Bytes::from_static(b"{\"role\":\"\xff\xfe\",\"name\":\"a\",\"version\":\"1\"}"),
        payload: Bytes::new(),
        payload_xxh3: None,
        sender_hashed: false,
    };
    let err = frame.decode_message::<Hello>().unwrap_err();
    assert!(
        matches!(err, FrameError::InvalidHeader { .. }),
        "not UTF-8: {err}"
    );

    // Well-formed JSON of another message: wrong kind, or wrong shape for the type.
    let frame = Frame::from_message(&Heartbeat { seq: 3 }, Bytes::new()).unwrap();
    let err = frame.decode_message::<Hello>().unwrap_err();
    assert_eq!(err.to_string(), "expected a Hello frame, got Heartbeat");
    let err = frame.decode_header::<Hello>().unwrap_err();
    assert!(matches!(err, FrameError::InvalidHeader { .. }), "{err}");
}

#[test]
fn encode_header_error_is_typed() {
    // JSON object keys must be strings.
    let map = std::collections::BTreeMap::from([((1, 2), 3)]);
    let err = Frame::encode_message(MessageKind::Hello, &map, Bytes::new()).unwrap_err();
    assert!(matches!(err, FrameError::EncodeHeader { .. }), "{err}");
}

/// A frame as a sender writes it under [`DIGEST_TRAILER`]: `digest` after the payload.
fn with_trailer(kind: MessageKind, header: &[u8], payload: &[u8], digest: u128) -> BytesMut {
    let mut buf = preamble(
        VERSION,
        kind.as_u16(),
        DIGEST_TRAILER,
        header.len() as u32,
        payload.len() as u64,
    );
    buf.extend_from_slice(header);
    buf.extend_from_slice(payload);
    buf.extend_from_slice(&digest.to_be_bytes());
    buf
}

/// The sender's digest after a payload, small or large, is checked however the bytes are
/// cut, and the frame says the sender hashed it; the next frame still decodes after it.
#[test]
fn a_senders_digest_after_the_payload_is_checked_in_any_chunks() {
    let small = Frame::from_message(&hello(), Bytes::new()).unwrap();
    for len in [0, 100, 200_000] {
        let payload: Vec<u8> = (0..len as u32).map(|i| (i % 241) as u8).collect();
        let digest = twox_hash::XxHash3_128::oneshot(&payload);
        let mut wire = with_trailer(MessageKind::WeightsBucket, b"\"bucket\"", &payload, digest);
        wire.extend_from_slice(&encode(small.clone()));
        for chunk in [1, 7, 1000, 65_536, wire.len()] {
            let decoded = decode_in_chunks(&wire, chunk);
            assert_eq!(decoded.len(), 2, "{len} bytes in chunks of {chunk}");
            assert_eq!(&decoded[0].payload[..], &payload[..]);
            assert_eq!(decoded[0].payload_xxh3, Some(digest));
            assert!(decoded[0].sender_hashed);
            assert_eq!(decoded[1], small);
            assert!(!decoded[1].sender_hashed);
        }
    }
}

#[test]
fn a_payload_that_does_not_match_its_senders_digest_is_rejected() {
    for len in [10, 200_000] {
        let payload = vec![5u8; len];
        let wrong = twox_hash::XxHash3_128::oneshot(&payload) ^ 1;
        let mut codec = FrameCodec::new();
        let mut buf = with_trailer(MessageKind::WeightsBucket, b"\"bucket\"", &payload, wrong);
        let err = codec
            .decode(&mut buf)
            .expect_err("a corrupt payload was accepted");
        assert!(matches!(err, FrameError::DigestMismatch { .. }), "{err}");
    }
}

/// The stream ending between a payload and its digest is a truncated frame.
#[test]
fn a_stream_cut_before_the_digest_is_truncated() {
    let payload = vec![9u8; 200_000];
    let digest = twox_hash::XxHash3_128::oneshot(&payload);
    let wire = with_trailer(MessageKind::WeightsBucket, b"\"bucket\"", &payload, digest);
    let mut buf = BytesMut::from(&wire[..wire.len() - 3]);
    let mut codec = FrameCodec::new();
    assert_eq!(codec.decode(&mut buf).unwrap(), None);
    assert!(matches!(
        codec.decode_eof(&mut buf),
        Err(FrameError::Truncated { .. })
    ));
}
