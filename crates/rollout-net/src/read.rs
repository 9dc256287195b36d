//! Reading [`Frame`]s from a byte stream. Unlike `tokio_util`'s `FramedRead`, a large
//! payload (see [`crate::payload`]) is read from the stream straight into its own buffer,
//! not through the read buffer and copied out, and bytes already buffered (read ahead with
//! a greeting) are decoded before the stream is waited on.

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::codec::Decoder;

use crate::frame::{Frame, FrameCodec, FrameError};

/// The most read into a large payload at once: small enough that its bytes are still in
/// cache when they are hashed, large enough for few system calls.
const PAYLOAD_READ_BYTES: usize = 1 << 20;

/// The room kept in the read buffer for headers and small frames.
const READ_BUFFER_ROOM: usize = 8 << 10;

/// Frames from `io`, decoded by `codec`.
pub(crate) struct FrameReader<R> {
    io: R,
    codec: FrameCodec,
    buffer: BytesMut,
    ended: bool,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Reads from `io`, after the bytes `read_ahead` already holds. `codec` may be partway
    /// through a large payload begun in earlier bytes.
    pub(crate) fn new(io: R, codec: FrameCodec, read_ahead: BytesMut) -> Self {
        Self {
            io,
            codec,
            buffer: read_ahead,
            ended: false,
        }
    }

    /// The next frame; `None` once the stream has ended cleanly. After an error the stream
    /// is out of step: stop reading. Cancel-safe: a call dropped before it completes loses
    /// no bytes.
    pub(crate) async fn next(&mut self) -> Option<Result<Frame, FrameError>> {
        loop {
            if self.ended {
                return self.codec.decode_eof(&mut self.buffer).transpose();
            }
            match self.codec.decode(&mut self.buffer) {
                Ok(Some(frame)) => return Some(Ok(frame)),
                Ok(None) => {}
                Err(err) => return Some(Err(err)),
            }
            let read = match self.codec.arriving_payload() {
                // The decoder leaves the buffer empty while a payload is arriving.
                Some(payload) => payload.read_from(&mut self.io, PAYLOAD_READ_BYTES).await,
                None => {
                    self.buffer.reserve(READ_BUFFER_ROOM);
                    self.io.read_buf(&mut self.buffer).await
                }
            };
            match read {
                Ok(0) => self.ended = true,
                Ok(_) => {}
                Err(err) => return Some(Err(err.into())),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::messages::{Heartbeat, MessageKind};
    use bytes::Bytes;
    use tokio::io::AsyncWriteExt;
    use tokio_util::codec::Encoder;

    fn encoded(frames: &[Frame]) -> Vec<u8> {
        let mut codec = FrameCodec::new();
        let mut bytes = BytesMut::new();
        for frame in frames {
            codec.encode(frame.clone(), &mut bytes).unwrap();
        }
        bytes.to_vec()
    }

    fn frames() -> Vec<Frame> {
        let large: Vec<u8> = (0..3_000_000u32).map(|i| (i * 13 % 251) as u8).collect();
        let bucket = |payload: Bytes| {
            Frame::encode_message(MessageKind::WeightsBucket, &"bucket", payload).unwrap()
        };
        vec![
            Frame::from_message(&Heartbeat { seq: 1 }, Bytes::new()).unwrap(),
            bucket(Bytes::from(large)),
            bucket(Bytes::from_static(b"small")),
        ]
    }

    /// Whatever sizes the stream delivers the bytes in, the same frames come out, large
    /// payloads hashed, and the stream's clean end after them.
    #[tokio::test]
    async fn frames_arrive_whole_however_the_stream_cuts_them() {
        let sent = frames();
        let bytes = encoded(&sent);
        for chunk in [1, 7, 4096, 1 << 20, bytes.len()] {
            let (mut write, read) = tokio::io::duplex(64 << 10);
            let bytes = bytes.clone();
            let writer = tokio::spawn(async move {
                for piece in bytes.chunks(chunk) {
                    write.write_all(piece).await.unwrap();
                }
            });
            let mut reader = FrameReader::new(read, FrameCodec::new(), BytesMut::new());
            for expected in &sent {
                let frame = reader.next().await.unwrap().unwrap();
                assert_eq!(&frame, expected, "cut into {chunk}-byte pieces");
                if frame.payload.len() > 1 << 20 {
                    let digest = twox_hash::XxHash3_128::oneshot(&frame.payload);
                    assert_eq!(frame.payload_xxh3, Some(digest));
                    assert!(
                        reader.buffer.capacity() < 64 << 10,
                        "the payload went through the read buffer"
                    );
                }
            }
            writer.await.unwrap();
            assert!(reader.next().await.is_none(), "the stream ended cleanly");
        }
    }

    /// A stream that ends inside a frame is an error, not a silent end.
    #[tokio::test]
    async fn a_stream_cut_inside_a_large_payload_is_truncated() {
        let bytes = encoded(&frames());
        let cut = bytes.len() - 1000;
        let mut reader = FrameReader::new(&bytes[..cut], FrameCodec::new(), BytesMut::new());
        assert!(reader.next().await.unwrap().is_ok());
        match reader.next().await {
            Some(Err(FrameError::Truncated { buffered })) => assert!(buffered > 2_000_000),
            other => panic!("expected a truncated frame, got {other:?}"),
        }
    }

    /// Frames already in the read-ahead are decoded without waiting for the stream.
    #[tokio::test]
    async fn frames_read_ahead_are_served_before_the_stream_is_read() {
        let bytes = encoded(&frames());
        let (_write, read) = tokio::io::duplex(1024);
        let mut reader = FrameReader::new(read, FrameCodec::new(), BytesMut::from(&bytes[..]));
        for _ in 0..3 {
            let next = tokio::time::timeout(std::time::Duration::from_secs(5), reader.next());
            assert!(next.await.unwrap().unwrap().is_ok());
        }
    }
}
