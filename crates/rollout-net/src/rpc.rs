//! Calls and answers over an authenticated [`crate::link::Link`]: each request travels in
//! an [`Envelope`] naming its call, so a server may answer out of order and stream several
//! frames for one call (weight buckets); heartbeats both ways, a peer timeout, and credits
//! (requests the server accepts before the client waits).

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio_util::codec::Framed;
use twox_hash::XxHash3_128;

use crate::frame::{Frame, FrameCodec, FrameError, OutgoingHead};
use crate::link::Link;
use crate::messages::{Message, MessageKind};
use crate::read::FrameReader;
use crate::tls::Stream as LinkStream;
use client::start_client;
use server::start_server;

/// A request or response: the call it belongs to, whether more frames follow for it, and
/// the message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    pub call: u64,
    #[serde(default)]
    pub more: bool,
    pub body: T,
}

#[derive(Deserialize)]
struct EnvelopeHead {
    call: u64,
    #[serde(default)]
    more: bool,
}

impl EnvelopeHead {
    /// Reads `call` and `more` from the start of a header. [`Envelope`] serialises them
    /// first (`{"call":N,"more":B,...`), so the body is not parsed twice; any other layout
    /// falls back to a full JSON parse.
    fn read(frame: &Frame) -> Result<Self, FrameError> {
        Self::from_prefix(&frame.header).map_or_else(|| frame.decode_header(), Ok)
    }

    fn from_prefix(header: &[u8]) -> Option<Self> {
        let rest = header.strip_prefix(b"{\"call\":")?;
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let call = std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()?;
        let rest = rest[digits..].strip_prefix(b",\"more\":")?;
        let (more, rest) = match rest {
            [b't', b'r', b'u', b'e', rest @ ..] => (true, rest),
            [b'f', b'a', b'l', b's', b'e', rest @ ..] => (false, rest),
            _ => return None,
        };
        rest.starts_with(b",").then_some(Self { call, more })
    }
}

impl Link {
    /// The calling side of this connection.
    pub fn client(self) -> RpcClient {
        let (framed, peer, hello, limits) = self.into_parts();
        start_client(framed, peer, hello, &limits)
    }

    /// The answering side: requests arrive on `requests` (at most `credits` queued; then
    /// the socket is not read, so the peer's writes back up), answers go through `responder`.
    pub fn server(self) -> RpcServer {
        let (framed, peer, hello, limits) = self.into_parts();
        start_server(framed, peer, hello, &limits)
    }
}

/// The frames a link reads: those the greeting already read ahead, then the socket's.
type Stream = FrameReader<ReadHalf<LinkStream>>;

/// Writes frames with their payloads sent straight from their buffers (a weight bucket is
/// not copied into a write buffer first).
struct Sink {
    stream: WriteHalf<LinkStream>,
    codec: FrameCodec,
    head: BytesMut,
    /// Small pieces of a hashed payload, gathered into one write.
    gathered: BytesMut,
}

/// Pieces of a hashed payload shorter than this are gathered into one write.
const GATHER_BELOW: usize = 16 << 10;

/// A hashed payload is written, and hashed after the kernel has read it (so from cache),
/// this many bytes at a time.
const HASHED_WRITE_BYTES: usize = 256 << 10;

impl Sink {
    async fn send(&mut self, frame: Frame) -> Result<(), FrameError> {
        self.head.clear();
        self.codec.encode_head(&frame, &mut self.head)?;
        self.stream.write_all(&self.head).await?;
        if !frame.payload.is_empty() {
            self.stream.write_all(&frame.payload).await?;
        }
        self.flush().await
    }

    /// Writes `frame`, its payload `pieces` back to back, hashed as they are written and
    /// followed by their digest ([`crate::frame::DIGEST_TRAILER`]), which `frame.written`
    /// is then given.
    async fn send_hashed(&mut self, frame: HashedFrame) -> Result<(), FrameError> {
        self.head.clear();
        let head = OutgoingHead {
            kind: frame.kind,
            header: &frame.header,
            payload_len: frame.pieces.iter().map(|piece| piece.len() as u64).sum(),
            trailer: true,
        };
        self.codec.encode_outgoing_head(&head, &mut self.head)?;
        self.stream.write_all(&self.head).await?;
        let mut hasher = XxHash3_128::new();
        for piece in &frame.pieces {
            if piece.len() < GATHER_BELOW {
                hasher.write(piece);
                self.gathered.extend_from_slice(piece);
                continue;
            }
            self.write_gathered().await?;
            for stretch in piece.chunks(HASHED_WRITE_BYTES) {
                self.stream.write_all(stretch).await?;
                hasher.write(stretch);
            }
        }
        self.write_gathered().await?;
        let digest = hasher.finish_128();
        self.stream.write_all(&digest.to_be_bytes()).await?;
        self.flush().await?;
        (frame.written)(digest);
        Ok(())
    }

    async fn write_gathered(&mut self) -> Result<(), FrameError> {
        if !self.gathered.is_empty() {
            self.stream.write_all(&self.gathered).await?;
            self.gathered.clear();
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), FrameError> {
        // TLS holds records back until flushed: without this a frame could wait for the
        // next one (the next heartbeat, seconds later).
        self.stream.flush().await?;
        Ok(())
    }

    async fn close(&mut self) -> Result<(), FrameError> {
        self.stream.shutdown().await?;
        Ok(())
    }
}

/// A frame whose payload is sent from several buffers back to back (a weight bucket served
/// from a model's tensors in place), hashed as it is written; `written` gets the digest
/// once the whole frame is out.
pub(crate) struct HashedFrame {
    kind: MessageKind,
    header: Bytes,
    pieces: Vec<Bytes>,
    written: Box<dyn FnOnce(u128) + Send>,
}

/// Splits a link's framed stream into its reading and writing halves, keeping what the
/// greeting read ahead (the reader decodes those bytes before it waits on the socket).
fn split(framed: Framed<LinkStream, FrameCodec>) -> (Sink, Stream) {
    let parts = framed.into_parts();
    let (read, write) = tokio::io::split(parts.io);
    // The writer's codec has the same limits and no state; the reader keeps the one that
    // read the greeting: it may hold the start of a large payload from the read-ahead.
    let codec = FrameCodec::new()
        .with_max_header_bytes(parts.codec.max_header_bytes())
        .with_max_payload_bytes(parts.codec.max_payload_bytes());
    let sink = Sink {
        stream: write,
        codec,
        head: BytesMut::new(),
        gathered: BytesMut::new(),
    };
    (sink, FrameReader::new(read, parts.codec, parts.read_buf))
}

/// Parses a frame carrying an `Envelope<M>`, after checking its kind.
pub fn decode_envelope<M: Message>(frame: &Frame) -> Result<Envelope<M>, FrameError> {
    if frame.kind != M::KIND {
        return Err(FrameError::KindMismatch {
            expected: M::KIND,
            found: frame.kind,
        });
    }
    frame.decode_header()
}

mod client;
mod server;

pub use client::{Call, RpcClient};
pub use server::{Incoming, Responder, RpcServer};

#[cfg(test)]
#[path = "rpc_tests.rs"]
mod tests;
