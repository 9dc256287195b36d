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
use crate::payload::{ArrivingPayload, BufferPool, POOLED_PAYLOAD_BYTES};

/// The first three bytes of every frame.
pub const MAGIC: [u8; 3] = *b"RLT";
/// The protocol version this build reads and writes.
pub const VERSION: u8 = 1;
/// Length of the fixed preamble before the header.
pub const PREAMBLE_LEN: usize = 24;
/// Preamble flag: the payload is followed by its XXH3-128 digest (16 bytes, big-endian),
/// computed by the sender as it wrote the payload; the decoder checks it
/// ([`FrameError::DigestMismatch`] otherwise). Every other flag is reserved.
pub const DIGEST_TRAILER: u16 = 1;
/// Length of the digest that follows a payload under [`DIGEST_TRAILER`].
pub const DIGEST_LEN: usize = 16;
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
#[derive(Clone)]
pub struct Frame {
    pub kind: MessageKind,
    pub header: Bytes,
    pub payload: Bytes,
    /// The payload's XXH3-128, where the decoder hashed it as it arrived (large payloads,
    /// and any payload the sender hashed); see [`Frame::payload_checksum`].
    pub payload_xxh3: Option<u128>,
    /// Whether the sender's own digest of the payload came with it ([`DIGEST_TRAILER`]) and
    /// matched `payload_xxh3`.
    pub sender_hashed: bool,
}

/// Frames are equal when they carry the same message: the digest is a cache.
impl PartialEq for Frame {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.header == other.header && self.payload == other.payload
    }
}

impl Eq for Frame {}

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
            payload_xxh3: None,
            sender_hashed: false,
        })
    }

    /// The payload's [`crate::tensor::checksum`], without a pass over it where the decoder
    /// hashed it while it arrived.
    pub fn payload_checksum(&self) -> String {
        match self.payload_xxh3 {
            Some(digest) => format!("{digest:032x}"),
            None => crate::tensor::checksum(&self.payload),
        }
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
/// have actually arrived. A large payload (see [`crate::payload`]) is moved out of the read
/// buffer as it arrives, into a buffer of the codec's [`BufferPool`], and hashed on the way
/// (a link's reader reads the rest of it from the socket straight into that buffer).
/// After an error the stream is out of step and should be closed.
#[derive(Debug, Clone)]
pub struct FrameCodec {
    max_header_bytes: u32,
    max_payload_bytes: u64,
    pool: BufferPool,
    /// The frame whose large payload is arriving.
    arriving: Option<Arriving>,
}

impl Default for FrameCodec {
    fn default() -> Self {
        Self {
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            pool: BufferPool::default(),
            arriving: None,
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

    /// Receives large payloads into (and returns them to) `pool`.
    pub fn with_pool(mut self, pool: BufferPool) -> Self {
        self.pool = pool;
        self
    }

    /// The large payload arriving now, if one is: [`crate::read::FrameReader`] reads the
    /// rest of it straight from the stream.
    pub(crate) fn arriving_payload(&mut self) -> Option<&mut ArrivingPayload> {
        self.arriving
            .as_mut()
            .map(|arriving| &mut arriving.payload)
            .filter(|payload| payload.missing() > 0)
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
    /// [`DIGEST_TRAILER`]: the sender's digest follows the payload.
    trailer: bool,
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
        if flags & !DIGEST_TRAILER != 0 {
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
            trailer: flags & DIGEST_TRAILER != 0,
        })
    }

    fn write(&self, dst: &mut BytesMut) {
        dst.put_slice(&MAGIC);
        dst.put_u8(VERSION);
        dst.put_u16(self.kind.as_u16());
        dst.put_u16(if self.trailer { DIGEST_TRAILER } else { 0 });
        dst.put_u32(self.header_len);
        dst.put_u32(0); // reserved
        dst.put_u64(self.payload_len);
    }
}

impl FrameCodec {
    /// Takes what `src` holds of the arriving large payload (and of its digest); the frame
    /// once it is whole.
    fn continue_payload(
        &mut self,
        mut arriving: Arriving,
        src: &mut BytesMut,
    ) -> Result<Option<Frame>, FrameError> {
        arriving.payload.take_from(src);
        let trailer = if arriving.trailer { DIGEST_LEN } else { 0 };
        if arriving.payload.missing() > 0 || src.len() < trailer {
            self.arriving = Some(arriving);
            return Ok(None);
        }
        let Arriving {
            kind,
            header,
            payload,
            trailer,
        } = arriving;
        let (payload, digest) = payload.finish();
        if trailer {
            check_digest(kind, digest, src.split_to(DIGEST_LEN).as_ref())?;
        }
        Ok(Some(Frame {
            kind,
            header,
            payload,
            payload_xxh3: Some(digest),
            sender_hashed: trailer,
        }))
    }

    /// Once the header is in, a large payload is read into a pooled buffer instead of `src`.
    fn start_pooled_payload(
        &mut self,
        preamble: &Preamble,
        sizes: FrameSizes,
        src: &mut BytesMut,
    ) -> Result<Option<Frame>, FrameError> {
        let head_len = PREAMBLE_LEN + sizes.header;
        if src.len() < head_len {
            make_room(src, head_len);
            return Ok(None);
        }
        src.advance(PREAMBLE_LEN);
        // Copied, so the read buffer stays this codec's alone and is reused.
        let header = Bytes::copy_from_slice(&src[..sizes.header]);
        src.advance(sizes.header);
        self.arriving = Some(Arriving {
            kind: preamble.kind,
            header,
            payload: ArrivingPayload::start(sizes.payload, &self.pool),
            trailer: preamble.trailer,
        });
        self.decode(src)
    }
}

/// A frame whose large payload is arriving: its kind, header, the payload so far, and
/// whether its sender's digest follows it.
#[derive(Debug, Clone)]
struct Arriving {
    kind: MessageKind,
    header: Bytes,
    payload: ArrivingPayload,
    trailer: bool,
}

/// Checks the digest a sender wrote after a payload against the one computed on arrival.
fn check_digest(kind: MessageKind, found: u128, sent: &[u8]) -> Result<(), FrameError> {
    let sent = <[u8; DIGEST_LEN]>::try_from(sent).map_or(0, u128::from_be_bytes);
    if sent == found {
        Ok(())
    } else {
        Err(FrameError::DigestMismatch { kind, sent, found })
    }
}

/// A frame's lengths in this machine's `usize`, their sum known not to overflow.
struct FrameSizes {
    header: usize,
    payload: usize,
    frame: usize,
}

impl FrameSizes {
    /// Both lengths are within the limits already; they must still fit this machine's memory.
    fn of(preamble: &Preamble) -> Result<Self, FrameError> {
        let too_large = || FrameError::PayloadTooLarge {
            kind: preamble.kind,
            len: preamble.payload_len,
            max: u64::try_from(usize::MAX).unwrap_or(u64::MAX),
        };
        let header = usize::try_from(preamble.header_len).map_err(|_| too_large())?;
        let payload = usize::try_from(preamble.payload_len).map_err(|_| too_large())?;
        let trailer = if preamble.trailer { DIGEST_LEN } else { 0 };
        let frame = PREAMBLE_LEN
            .checked_add(header)
            .and_then(|head| head.checked_add(payload))
            .and_then(|frame| frame.checked_add(trailer))
            .ok_or_else(too_large)?;
        Ok(Self {
            header,
            payload,
            frame,
        })
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        if let Some(arriving) = self.arriving.take() {
            return self.continue_payload(arriving, src);
        }
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
        let preamble = Preamble::parse(preamble)?;
        self.check_lengths(
            preamble.kind,
            u64::from(preamble.header_len),
            preamble.payload_len,
        )?;
        let sizes = FrameSizes::of(&preamble)?;
        if sizes.payload >= POOLED_PAYLOAD_BYTES {
            return self.start_pooled_payload(&preamble, sizes, src);
        }
        if src.len() < sizes.frame {
            make_room(src, sizes.frame);
            return Ok(None);
        }
        let mut frame = src.split_to(sizes.frame).freeze();
        frame.advance(PREAMBLE_LEN);
        let header = frame.split_to(sizes.header);
        let payload = frame.split_to(sizes.payload);
        let mut digest = None;
        if preamble.trailer {
            let found = twox_hash::XxHash3_128::oneshot(&payload);
            check_digest(preamble.kind, found, &frame)?;
            digest = Some(found);
        }
        Ok(Some(Frame {
            kind: preamble.kind,
            header,
            payload,
            payload_xxh3: digest,
            sender_hashed: preamble.trailer,
        }))
    }

    fn decode_eof(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        match self.decode(src)? {
            Some(frame) => Ok(Some(frame)),
            None if src.is_empty() && self.arriving.is_none() => Ok(None),
            None => Err(FrameError::Truncated {
                buffered: src.len()
                    + self.arriving.as_ref().map_or(0, |arriving| {
                        arriving.header.len() + arriving.payload.received()
                    }),
            }),
        }
    }
}

/// Once the room left in `src` runs low, makes room for more of a `frame_len`-byte frame: as
/// much again as has arrived (at least MAX_RESERVE_AHEAD), so a large frame is copied a
/// logarithmic number of times while a preamble alone still cannot make the decoder allocate
/// much. A fresh buffer: `BytesMut::reserve` could keep the bytes of frames already handed out
/// in front of it.
fn make_room(src: &mut BytesMut, frame_len: usize) {
    let missing = frame_len - src.len();
    let room = src.capacity() - src.len();
    if room < missing.min(MIN_ROOM) {
        let ahead = src.len().max(MAX_RESERVE_AHEAD);
        let wanted = frame_len.min(src.len().saturating_add(ahead));
        let mut grown = BytesMut::with_capacity(wanted);
        grown.extend_from_slice(src);
        *src = grown;
    }
}

impl FrameCodec {
    /// Writes a frame's preamble and header (not its payload) to `dst`, after checking both
    /// lengths: for writers that send a large payload straight from its buffer.
    pub fn encode_head(&self, frame: &Frame, dst: &mut BytesMut) -> Result<(), FrameError> {
        let head = OutgoingHead {
            kind: frame.kind,
            header: &frame.header,
            payload_len: frame.payload.len() as u64,
            trailer: false,
        };
        self.encode_outgoing_head(&head, dst)
    }

    /// Writes the preamble and header of a frame whose payload (`head.payload_len` bytes,
    /// followed by its digest where `head.trailer`) the caller writes after them.
    pub(crate) fn encode_outgoing_head(
        &self,
        head: &OutgoingHead<'_>,
        dst: &mut BytesMut,
    ) -> Result<(), FrameError> {
        let header_len = head.header.len() as u64;
        self.check_lengths(head.kind, header_len, head.payload_len)?;
        let header_len = u32::try_from(header_len).map_err(|_| FrameError::HeaderTooLarge {
            kind: head.kind,
            len: header_len,
            max: u64::from(u32::MAX),
        })?;
        dst.reserve(PREAMBLE_LEN.saturating_add(head.header.len()));
        Preamble {
            kind: head.kind,
            header_len,
            payload_len: head.payload_len,
            trailer: head.trailer,
        }
        .write(dst);
        dst.extend_from_slice(head.header);
        Ok(())
    }
}

/// The start of a frame being written: its kind, header, payload length, and whether the
/// payload's digest follows it ([`DIGEST_TRAILER`]).
pub(crate) struct OutgoingHead<'a> {
    pub kind: MessageKind,
    pub header: &'a [u8],
    pub payload_len: u64,
    pub trailer: bool,
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
    #[error("{kind} payload arrived with digest {found:032x}, but its sender wrote {sent:032x}")]
    DigestMismatch {
        kind: MessageKind,
        sent: u128,
        found: u128,
    },
    #[error("connection closed in the middle of a frame ({buffered} bytes buffered)")]
    Truncated { buffered: usize },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
#[path = "frame_tests.rs"]
mod tests;
