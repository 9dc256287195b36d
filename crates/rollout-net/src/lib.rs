//! Rollout's transport layer: the messages roles exchange and the framing that carries them
//! between processes and machines.
//!
//! - [`messages`]: the message types, and [`MessageKind`], the number each travels under.
//! - [`frame`]: [`Frame`] and [`FrameCodec`], a `tokio_util` codec for any byte stream.
//! - [`payload`]: large payloads received into recycled buffers and hashed as they arrive.
//! - `read`: frames read from a stream, large payloads straight into their buffers.
//! - [`tensor`]: safetensors-shaped tables laying out bulk tensors in a frame's payload.
//! - [`auth`]: the challenge-response every TCP connection passes before a frame is read.
//! - [`link`]: authenticated TCP connections between roles.
//! - [`gate`]: accepting such connections from anyone who can reach a port, boundedly.
//! - `handshakes`: the handshakes under way at a gate, and which one a new connection closes.
//! - [`rpc`]: calls and answers over a link, with heartbeats and credits.
//! - [`heard`]: when a connection last delivered a frame.
//! - [`tls`]: optional encryption of links, bound to the authentication.
//!
//! # Frame layout
//!
//! Every frame starts with a fixed 24-byte preamble. Its integers are big-endian (network
//! order); tensor data in the payload is little-endian, as in safetensors.
//!
//! | bytes | field         | type     | meaning                                              |
//! |-------|---------------|----------|------------------------------------------------------|
//! | 0..3  | magic         | `[u8;3]` | `b"RLT"`                                             |
//! | 3     | version       | `u8`     | protocol version, [`frame::VERSION`] (1)             |
//! | 4..6  | kind          | `u16`    | [`MessageKind`]; unknown numbers are rejected        |
//! | 6..8  | flags         | `u16`    | bit 0: [`frame::DIGEST_TRAILER`]; others must be 0   |
//! | 8..12 | header_len    | `u32`    | length of the JSON header                            |
//! | 12..16| reserved      | `u32`    | must be 0 (keeps `payload_len` 8-byte aligned)       |
//! | 16..24| payload_len   | `u64`    | length of the raw payload                            |
//! | 24..  | header        | JSON     | the message, UTF-8 `serde_json`                      |
//! | ..    | payload       | bytes    | bulk data, e.g. tensors described by the header      |
//! | ..    | digest        | `u128`   | with bit 0 of flags only: the payload's XXH3-128     |
//!
//! The decoder checks the whole preamble, including both lengths against its limits
//! ([`FrameCodec::with_max_header_bytes`], [`FrameCodec::with_max_payload_bytes`]), before
//! it reserves memory for a frame.
//!
//! ```
//! use bytes::{Bytes, BytesMut};
//! use rollout_net::{Frame, FrameCodec, messages::Heartbeat};
//! use tokio_util::codec::{Decoder, Encoder};
//!
//! let mut codec = FrameCodec::new();
//! let mut wire = BytesMut::new();
//! let frame = Frame::from_message(&Heartbeat { seq: 1 }, Bytes::new())?;
//! codec.encode(frame, &mut wire)?;
//! let frame = codec.decode(&mut wire)?.expect("a whole frame");
//! assert_eq!(frame.decode_message::<Heartbeat>()?, Heartbeat { seq: 1 });
//! # Ok::<(), rollout_net::FrameError>(())
//! ```

pub mod auth;
pub mod frame;
pub mod gate;
mod handshakes;
pub mod heard;
pub mod link;
pub mod messages;
pub mod payload;
mod read;
pub mod rpc;
pub mod tensor;
pub mod tls;

pub use auth::{AuthError, ClusterKey};
pub use frame::{Frame, FrameCodec, FrameError};
pub use link::{Link, LinkLimits, NetError};
pub use messages::{Message, MessageKind};
pub use payload::BufferPool;
pub use rpc::{RpcClient, RpcServer};
pub use tensor::{Dtype, TensorBytes, TensorError, TensorMeta, TensorPayloadBuilder, TensorTable};
pub use tls::Encryption;
