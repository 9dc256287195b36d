//! The wire format: one [`Frame`] per message, read and written by [`FrameCodec`].
//!
//! A frame is a fixed 24-byte preamble, then `header_len` bytes of JSON (the message), then
//! `payload_len` raw bytes (bulk tensors). Preamble integers are big-endian (network order).
//! See the crate docs for the layout.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::codec::{Decoder, Encoder};

use crate::messages::{Message, MessageKind};

/// The first three bytes of every frame.
pub const MAGIC: [u8; 3] = *b"RLT";
/// The protocol version this build reads and writes.
pub const VERSION: u8 = 1;
/// Length of the fixed preamble before the header.
pub const PREAMBLE_LEN: usize = 24;
/// Default [`FrameCodec::max_header_bytes`]: 16 MiB.
pub const DEFAULT_MAX_HEADER_BYTES: u32 = 16 << 20;
/// Default [`FrameCodec::max_payload_bytes`]: 64 GiB.
pub const DEFAULT_MAX_PAYLOAD_BYTES: u64 = 64 << 30;
/// The room the decoder keeps for the rest of a frame before it grows its buffer.
const MIN_ROOM: usize = 1 << 20;

/// The most the decoder reserves ahead of bytes that have actually arrived, so a preamble
/// alone cannot make it allocate a large frame; bigger frames grow the buffer as they arrive.
const MAX_RESERVE_AHEAD: usize = 8 << 20;

/// One message on the wire: its kind, its JSON header and its raw payload (often empty).
#[derive(Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: MessageKind,
    pub header: Bytes,
    pub payload: Bytes,
}

impl Frame {
    /// A frame of `kind` whose header is `message` as JSON.
    pub fn encode_message<M: Serialize + ?Sized>(
        kind: MessageKind,
        message: &M,
        payload: Bytes,
    ) -> Result<Self, FrameError> {
        let header = serde_json::to_vec(message)
            .map_err(|source| FrameError::EncodeHeader { kind, source })?;
        Ok(Self {
            kind,
            header: Bytes::from(header),
            payload,
        })
    }

    /// A frame carrying `message`, of its own kind.
    pub fn from_message<M: Message>(message: &M, payload: Bytes) -> Result<Self, FrameError> {
        Self::encode_message(M::KIND, message, payload)
    }

    /// Parses the header as a `T`, whatever the frame's kind.
    pub fn decode_header<T: DeserializeOwned>(&self) -> Result<T, FrameError> {
        serde_json::from_slice(&self.header).map_err(|source| FrameError::InvalidHeader {
            kind: self.kind,
            source,
        })
    }

    /// Parses the header as an `M`, after checking that the frame is of `M`'s kind.
    pub fn decode_message<M: Message>(&self) -> Result<M, FrameError> {
        if self.kind != M::KIND {
            return Err(FrameError::KindMismatch {
                expected: M::KIND,
                found: self.kind,
            });
        }
        self.decode_header()
    }
}

impl std::fmt::Debug for Frame {
    /// Shows the header as text (cut to 1 KiB) and only the payload's length.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = &self.header[..self.header.len().min(1024)];
        f.debug_struct("Frame")
            .field("kind", &self.kind)
            .field("header", &String::from_utf8_lossy(shown))
            .field("header_len", &self.header.len())
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

/// Reads and writes [`Frame`]s on a byte stream, e.g. with `tokio_util::codec::Framed`.
///
/// Decoding validates the whole preamble, including both lengths against the limits, before
/// reserving any memory for a frame, and then reserves at most 8 MiB ahead of the bytes that
/// have actually arrived. After an error the stream is out of step and should be closed.
#[derive(Debug, Clone)]
pub struct FrameCodec {
    max_header_bytes: u32,
    max_payload_bytes: u64,
}

impl Default for FrameCodec {
    fn default() -> Self {
        Self {
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }
}

impl FrameCodec {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the largest header accepted or sent.
    pub fn with_max_header_bytes(mut self, max: u32) -> Self {
        self.max_header_bytes = max;
        self
    }

    /// Sets the largest payload accepted or sent.
    pub fn with_max_payload_bytes(mut self, max: u64) -> Self {
        self.max_payload_bytes = max;
        self
    }

    pub fn max_header_bytes(&self) -> u32 {
        self.max_header_bytes
    }

    pub fn max_payload_bytes(&self) -> u64 {
        self.max_payload_bytes
    }

    /// Checks a frame's lengths against this codec's limits and what its kind needs.
    fn check_lengths(
        &self,
        kind: MessageKind,
        header: u64,
        payload: u64,
    ) -> Result<(), FrameError> {
        let max = u64::from(self.max_header_bytes.min(kind.max_header_bytes()));
        if header > max {
            return Err(FrameError::HeaderTooLarge {
                kind,
                len: header,
                max,
            });
        }
        let max = if kind.carries_payload() {
            self.max_payload_bytes
        } else {
            0
        };
        if payload > max {
            return Err(FrameError::PayloadTooLarge {
                kind,
                len: payload,
                max,
            });
        }
        Ok(())
    }
}

/// The fixed-size start of a frame.
struct Preamble {
    kind: MessageKind,
    header_len: u32,
    payload_len: u64,
}

impl Preamble {
    fn parse(bytes: &[u8; PREAMBLE_LEN]) -> Result<Self, FrameError> {
        let mut buf = &bytes[..];
        let mut magic = [0; 3];
        buf.copy_to_slice(&mut magic);
        if magic != MAGIC {
            return Err(FrameError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = buf.get_u8();
        if version != VERSION {
            return Err(FrameError::UnsupportedVersion { found: version });
        }
        let kind = buf.get_u16();
        let kind = MessageKind::from_u16(kind).ok_or(FrameError::UnknownKind(kind))?;
        let flags = buf.get_u16();
        if flags != 0 {
            return Err(FrameError::ReservedFlags(flags));
        }
        let header_len = buf.get_u32();
        let reserved = buf.get_u32();
        if reserved != 0 {
            return Err(FrameError::ReservedField(reserved));
        }
        let payload_len = buf.get_u64();
        Ok(Self {
            kind,
            header_len,
            payload_len,
        })
    }

    fn write(&self, dst: &mut BytesMut) {
        dst.put_slice(&MAGIC);
        dst.put_u8(VERSION);
        dst.put_u16(self.kind.as_u16());
        dst.put_u16(0); // flags
        dst.put_u32(self.header_len);
        dst.put_u32(0); // reserved
        dst.put_u64(self.payload_len);
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let Some(preamble) = src.first_chunk::<PREAMBLE_LEN>() else {
            // Reject a peer that speaks another protocol without waiting for 24 bytes.
            let seen = &src[..src.len().min(MAGIC.len())];
            if !MAGIC.starts_with(seen) {
                return Err(FrameError::BadMagic {
                    found: seen.to_vec(),
                });
            }
            return Ok(None);
        };
        let Preamble {
            kind,
            header_len,
            payload_len,
        } = Preamble::parse(preamble)?;
        self.check_lengths(kind, u64::from(header_len), payload_len)?;

        // Both lengths are within the limits; they must still fit this machine's memory.
        let too_large = || FrameError::PayloadTooLarge {
            kind,
            len: payload_len,
            max: u64::try_from(usize::MAX).unwrap_or(u64::MAX),
        };
        let header_len = usize::try_from(header_len).map_err(|_| too_large())?;
        let payload_len_usize = usize::try_from(payload_len).map_err(|_| too_large())?;
        let frame_len = PREAMBLE_LEN
            .checked_add(header_len)
            .and_then(|n| n.checked_add(payload_len_usize))
            .ok_or_else(too_large)?;

        if src.len() < frame_len {
            // Once the room left runs low, room for more of the frame: as much again as has
            // arrived (at least MAX_RESERVE_AHEAD), so a large frame is copied a logarithmic
            // number of times while a preamble alone still cannot make the decoder allocate
            // much. A fresh buffer: `BytesMut::reserve` could keep the bytes of frames
            // already handed out in front of it.
            let missing = frame_len - src.len();
            let room = src.capacity() - src.len();
            if room < missing.min(MIN_ROOM) {
                let ahead = src.len().max(MAX_RESERVE_AHEAD);
                let wanted = frame_len.min(src.len().saturating_add(ahead));
                let mut grown = BytesMut::with_capacity(wanted);
                grown.extend_from_slice(src);
                *src = grown;
            }
            return Ok(None);
        }
        let mut frame = src.split_to(frame_len).freeze();
        frame.advance(PREAMBLE_LEN);
        let header = frame.split_to(header_len);
        Ok(Some(Frame {
            kind,
            header,
            payload: frame,
        }))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None if src.is_empty() => Ok(None),
            None => Err(FrameError::Truncated {
                buffered: src.len(),
            }),
        }
    }
}

impl FrameCodec {
    /// Writes a frame's preamble and header (not its payload) to `dst`, after checking both
    /// lengths: for writers that send a large payload straight from its buffer.
    pub fn encode_head(&self, frame: &Frame, dst: &mut BytesMut) -> Result<(), FrameError> {
        let header_len = frame.header.len() as u64;
        let payload_len = frame.payload.len() as u64;
        self.check_lengths(frame.kind, header_len, payload_len)?;
        let header_len = u32::try_from(header_len).map_err(|_| FrameError::HeaderTooLarge {
            kind: frame.kind,
            len: header_len,
            max: u64::from(u32::MAX),
        })?;
        dst.reserve(PREAMBLE_LEN.saturating_add(frame.header.len()));
        Preamble {
            kind: frame.kind,
            header_len,
            payload_len,
        }
        .write(dst);
        dst.extend_from_slice(&frame.header);
        Ok(())
    }
}

impl Encoder<Frame> for FrameCodec {
    type Error = FrameError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), FrameError> {
        self.encode_head(&frame, dst)?;
        dst.extend_from_slice(&frame.payload);
        Ok(())
    }
}

/// Why bytes could not be read or written as a frame. The messages read well after
/// "peer 10.0.0.2:7000 sent a bad frame: ".
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic bytes \"{}\", expected \"RLT\" (not a Rollout peer?)", found.escape_ascii())]
    BadMagic { found: Vec<u8> },
    #[error("unsupported protocol version {found}, this build speaks version {VERSION}")]
    UnsupportedVersion { found: u8 },
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    #[error("reserved flags {0:#06x} are set, expected 0")]
    ReservedFlags(u16),
    #[error("reserved preamble field is {0:#010x}, expected 0")]
    ReservedField(u32),
    #[error("{kind} header of {len} bytes exceeds the limit of {max} bytes")]
    HeaderTooLarge {
        kind: MessageKind,
        len: u64,
        max: u64,
    },
    #[error("{kind} payload of {len} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge {
        kind: MessageKind,
        len: u64,
        max: u64,
    },
    #[error("invalid {kind} header: {source}")]
    InvalidHeader {
        kind: MessageKind,
        source: serde_json::Error,
    },
    #[error("expected a {expected} frame, got {found}")]
    KindMismatch {
        expected: MessageKind,
        found: MessageKind,
    },
    #[error("cannot serialize a {kind} header: {source}")]
    EncodeHeader {
        kind: MessageKind,
        source: serde_json::Error,
    },
    #[error("connection closed in the middle of a frame ({buffered} bytes buffered)")]
    Truncated { buffered: usize },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::messages::{Heartbeat, Hello};

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
        assert_eq!(MessageKind::from_u16(25), None);
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
            Frame::encode_message(MessageKind::WeightsBucket, &Heartbeat { seq: 1 }, payload)
                .unwrap();
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
    fn a_large_frame_is_copied_a_logarithmic_number_of_times() {
        let payload = 64usize << 20;
        let mut buf = preamble(1, 20, 0, 2, payload as u64);
        buf.extend_from_slice(b"{}");
        let mut codec = FrameCodec::new();
        let chunk = vec![0u8; 1 << 20];
        let (mut grown, mut capacity) = (0, buf.capacity());
        for _ in 0..payload / chunk.len() {
            assert_eq!(codec.decode(&mut buf).unwrap(), None);
            if buf.capacity() != capacity {
                grown += 1;
                capacity = buf.capacity();
            }
            // Never far more than has arrived.
            assert!(buf.capacity() <= 2 * buf.len().max(MAX_RESERVE_AHEAD) + PREAMBLE_LEN + 2);
            buf.extend_from_slice(&chunk);
        }
        let frame = codec.decode(&mut buf).unwrap().expect("the whole frame");
        assert_eq!(frame.payload.len(), payload);
        assert!(grown <= 4, "the buffer grew {grown} times");
    }

    #[test]
    fn encoder_enforces_limits() {
        let payload = Bytes::from_static(&[0; 8]);
        let frame =
            Frame::encode_message(MessageKind::WeightsBucket, &Heartbeat { seq: 0 }, payload)
                .unwrap();
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
    fn header_errors() {
        let frame = Frame {
            kind: MessageKind::Hello,
            header: Bytes::from_static(b"{not json"),
            payload: Bytes::new(),
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
}
