//! Large frame payloads as they arrive: read straight from the socket into a recycled
//! allocation (bytes a read buffer already holds are copied out of it) and hashed while they
//! are still in cache. A weight bucket then costs neither a fresh allocation (whose pages the
//! kernel faults in and zeroes), nor a copy out of a read buffer, nor a second pass over
//! memory to verify it.

use std::sync::{Arc, Mutex, Weak};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use twox_hash::XxHash3_128;

/// Payloads of at least this many bytes are received through a [`BufferPool`].
pub const POOLED_PAYLOAD_BYTES: usize = 64 << 10;

/// Default [`BufferPool::new`] bound on the bytes kept for reuse: 16 GiB.
pub const DEFAULT_POOL_BYTES: usize = 16 << 30;

/// A payload buffer grows to at most this far, or as far again as has arrived, ahead of the
/// bytes that have arrived: a peer's claim alone never makes the receiver allocate much.
const MAX_GROWTH_AHEAD: usize = 8 << 20;

/// Receive buffers of payloads that are no longer used, kept for the next ones. A payload's
/// buffer comes back here when the last [`Bytes`] holding any of it is dropped, never
/// earlier, so a buffer still read by anyone (a relay, an aliased tensor) is never reused.
/// Clones share one pool: a process gives all its links the same one, so a version pulled
/// over a new connection lands in the allocations of the version before.
#[derive(Clone, Debug)]
pub struct BufferPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    free: Mutex<Vec<Vec<u8>>>,
    max_bytes: usize,
}

impl Default for BufferPool {
    fn default() -> Self {
        Self::new(DEFAULT_POOL_BYTES)
    }
}

impl BufferPool {
    /// A pool that keeps at most `max_bytes` of free buffers (more are freed).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                free: Mutex::new(Vec::new()),
                max_bytes,
            }),
        }
    }

    /// The bytes of the free buffers held for reuse.
    pub fn free_bytes(&self) -> usize {
        self.inner.free_bytes()
    }

    /// An empty buffer with room for `len` bytes and at most twice that, if one is free.
    fn take(&self, len: usize) -> Option<Vec<u8>> {
        let mut free = self.inner.free.lock().ok()?;
        let fits = |buf: &Vec<u8>| buf.capacity() >= len && buf.capacity() / 2 <= len;
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, buf)| fits(buf))
            .min_by_key(|(_, buf)| buf.capacity())
            .map(|(index, _)| index)?;
        let mut buf = free.swap_remove(best);
        buf.clear();
        Some(buf)
    }
}

impl PoolInner {
    fn free_bytes(&self) -> usize {
        self.free
            .lock()
            .map(|free| free.iter().map(Vec::capacity).sum())
            .unwrap_or(0)
    }

    fn give_back(&self, buf: Vec<u8>) {
        if buf.capacity() < POOLED_PAYLOAD_BYTES {
            return;
        }
        if let Ok(mut free) = self.free.lock() {
            let held: usize = free.iter().map(Vec::capacity).sum();
            if held.saturating_add(buf.capacity()) <= self.max_bytes {
                free.push(buf);
            }
        }
    }
}

/// A received payload's buffer, returned to its pool when dropped.
struct Recycled {
    buf: Vec<u8>,
    pool: Weak<PoolInner>,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give_back(std::mem::take(&mut self.buf));
        }
    }
}

/// The part of one payload received so far.
#[derive(Clone)]
pub(crate) struct ArrivingPayload {
    buf: Vec<u8>,
    len: usize,
    hasher: XxHash3_128,
    pool: BufferPool,
}

impl std::fmt::Debug for ArrivingPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArrivingPayload")
            .field("len", &self.len)
            .field("received", &self.buf.len())
            .finish()
    }
}

impl ArrivingPayload {
    /// Starts a payload of `len` bytes (already checked against the limits) in a free
    /// buffer of `pool`, or in one that grows as the bytes arrive.
    pub(crate) fn start(len: usize, pool: &BufferPool) -> Self {
        Self {
            buf: pool.take(len).unwrap_or_default(),
            len,
            hasher: XxHash3_128::new(),
            pool: pool.clone(),
        }
    }

    /// Moves as much of `src` as belongs to this payload into it.
    pub(crate) fn take_from(&mut self, src: &mut BytesMut) {
        let count = src.len().min(self.missing());
        if count == 0 {
            return;
        }
        let arrived = &src[..count];
        self.make_room(count);
        self.hasher.write(arrived);
        self.buf.extend_from_slice(arrived);
        src.advance(count);
    }

    /// Reads at most `most` bytes of this payload from `io` straight into its buffer (no
    /// read buffer in between) and hashes them while they are in cache; 0 at the end of the
    /// stream. Never reads past the payload's end. Cancel-safe: nothing is read unless it
    /// completes.
    pub(crate) async fn read_from<R: AsyncRead + Unpin>(
        &mut self,
        io: &mut R,
        most: usize,
    ) -> std::io::Result<usize> {
        let count = most.min(self.missing());
        if count == 0 {
            return Ok(0);
        }
        self.make_room(count);
        let before = self.buf.len();
        let read = io.read_buf(&mut (&mut self.buf).limit(count)).await?;
        self.hasher.write(&self.buf[before..]);
        Ok(read)
    }

    /// Makes room for `count` more bytes: as far again as has arrived, at least
    /// MAX_GROWTH_AHEAD, never past the payload's end.
    fn make_room(&mut self, count: usize) {
        let room = self.buf.capacity() - self.buf.len();
        if room < count {
            let ahead = self.buf.len().max(MAX_GROWTH_AHEAD);
            let wanted = self.missing().min(ahead.max(count));
            self.buf.reserve_exact(wanted);
        }
    }

    pub(crate) fn missing(&self) -> usize {
        self.len - self.buf.len()
    }

    pub(crate) fn received(&self) -> usize {
        self.buf.len()
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// The whole payload and its XXH3-128 digest; its buffer goes back to the pool once
    /// every handle on it is dropped.
    pub(crate) fn finish(self) -> (Bytes, u128) {
        let digest = self.hasher.finish_128();
        let owner = Recycled {
            buf: self.buf,
            pool: Arc::downgrade(&self.pool.inner),
        };
        (Bytes::from_owner(owner), digest)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn receive(pool: &BufferPool, data: &[u8], chunk: usize) -> (Bytes, u128) {
        let mut arriving = ArrivingPayload::start(data.len(), pool);
        let pieces: Vec<&[u8]> = data.chunks(chunk).collect();
        for (index, piece) in pieces.iter().enumerate() {
            let mut src = BytesMut::from(*piece);
            // What follows the payload on the wire stays for the next frame.
            let last = index + 1 == pieces.len();
            if last {
                src.extend_from_slice(b"next frame");
            }
            arriving.take_from(&mut src);
            let left: &[u8] = if last { b"next frame" } else { b"" };
            assert_eq!(&src[..], left);
        }
        assert_eq!(arriving.missing(), 0);
        arriving.finish()
    }

    #[test]
    fn digest_is_the_payloads_xxh3_however_it_arrives() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let pool = BufferPool::default();
        for chunk in [1 << 10, 4096, 65_537, data.len()] {
            let (payload, digest) = receive(&pool, &data, chunk);
            assert_eq!(&payload[..], &data[..]);
            assert_eq!(digest, XxHash3_128::oneshot(&data));
        }
    }

    #[test]
    fn a_buffer_is_reused_only_once_every_handle_is_gone() {
        let pool = BufferPool::default();
        let data = vec![3u8; 1 << 20];
        let (first, _) = receive(&pool, &data, 1 << 16);
        let slice = first.slice(10..20);
        let first_address = first.as_ptr();
        drop(first);
        assert_eq!(pool.free_bytes(), 0, "a slice still holds the buffer");
        let (second, _) = receive(&pool, &data, 1 << 16);
        let second_address = second.as_ptr();
        assert_ne!(second_address, first_address);
        drop(slice);
        drop(second);
        assert_eq!(pool.free_bytes(), 2 * data.len());
        let (third, _) = receive(&pool, &[4u8; 900_000], 1 << 16);
        assert!(third.iter().all(|&b| b == 4));
        assert!([first_address, second_address].contains(&third.as_ptr()));
        assert_eq!(pool.free_bytes(), data.len());
    }

    #[test]
    fn a_buffer_far_larger_than_needed_is_not_taken() {
        let pool = BufferPool::default();
        drop(receive(&pool, &[1u8; 1 << 20], 1 << 20));
        let before = pool.free_bytes();
        let (small, _) = receive(&pool, &[2u8; 100_000], 1 << 20);
        assert_eq!(pool.free_bytes(), before, "the 1 MiB buffer stayed free");
        drop(small);
    }

    #[test]
    fn the_pool_keeps_at_most_its_bound() {
        let pool = BufferPool::new(1 << 20);
        let a = receive(&pool, &[1u8; 1 << 20], 1 << 20).0;
        let b = receive(&pool, &[1u8; 1 << 20], 1 << 20).0;
        drop((a, b));
        assert!(pool.free_bytes() <= 1 << 20);
    }

    #[test]
    fn a_claim_grows_the_buffer_only_with_what_arrives() {
        let pool = BufferPool::default();
        let mut arriving = ArrivingPayload::start(60 << 30, &pool);
        let mut src = BytesMut::from(&[0u8; 1000][..]);
        arriving.take_from(&mut src);
        assert!(arriving.capacity() <= MAX_GROWTH_AHEAD);
        assert_eq!(arriving.received(), 1000);
    }
}
