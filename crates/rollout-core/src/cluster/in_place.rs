//! A version served from a trainer's own tensors, not from a copy of them. Its buckets are
//! pieces viewing the tensors' bytes (and the zero gaps between them), sent back to back and
//! hashed as they are written, after the kernel has read them; the first send of each
//! bucket records its checksum, and the last one seals the version. So a sync reads each
//! parameter byte once on the trainer, from cache for the hash.
//!
//! The tensors must not change while any piece of them is held: before the trainer next
//! changes its weights (an optimizer step, a checkpoint load) it [`ServedInPlace::settle`]s
//! the version, which copies each bucket into a buffer of its own (so the version is still
//! served to pullers that come later) and waits until no send still holds a piece. A version
//! nobody pulls is sealed by [`ServedInPlace::seal_unless_pulled`] hashing it in place.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rollout_net::tensor::Dtype;

use super::buckets::{BucketLayout, GAP, allocation, copy_and_hash, hash, headers};
use super::weights::{Bucket, Payload, VersionBuffer, WeightsError, hex};

/// How long [`ServedInPlace::seal_unless_pulled`] gives pullers, at least, and per byte.
const UNPULLED_GRACE: Duration = Duration::from_secs(1);
const UNPULLED_BYTES_PER_SECOND: u64 = 200 << 20;

/// How often waits on pullers look again.
const POLL: Duration = Duration::from_millis(2);

/// A tensor's bytes, held by every piece viewing them, with the version's lease.
struct Leased {
    bytes: Bytes,
    _lease: Arc<()>,
}

impl AsRef<[u8]> for Leased {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// A version whose buckets view the tensors they were planned from (see the module docs).
pub struct ServedInPlace {
    buffer: Arc<VersionBuffer>,
    bytes: u64,
    /// Held by every piece: once only this one is left, nothing reads the tensors.
    lease: Arc<()>,
    /// An earlier version's bucket allocations, for [`ServedInPlace::settle`].
    allocations: Vec<Vec<u8>>,
}

impl ServedInPlace {
    /// Lays `tensors` (name, dtype, shape, bytes) out in buckets of about `bucket_bytes`, as
    /// [`super::buckets::PlannedVersion`] does, each bucket's pieces viewing them.
    pub fn plan(
        version: u64,
        bucket_bytes: u64,
        tensors: impl IntoIterator<Item = (String, Dtype, Vec<u64>, Bytes)>,
        allocations: Vec<Vec<u8>>,
    ) -> Result<Self, WeightsError> {
        let lease = Arc::new(());
        let mut layout = BucketLayout::new(bucket_bytes);
        // Each bucket's pieces, and where its bytes end so far.
        let mut pieces: Vec<(Vec<Bytes>, usize)> = Vec::new();
        for (name, dtype, shape, data) in tensors {
            let data = Bytes::from_owner(Leased {
                bytes: data,
                _lease: lease.clone(),
            });
            for placement in layout.add(&name, dtype, &shape, data.len())? {
                if pieces.len() <= placement.bucket {
                    pieces.resize_with(placement.bucket + 1, Default::default);
                }
                let (bucket, end) = &mut pieces[placement.bucket];
                if placement.offset > *end {
                    bucket.push(Bytes::from_static(&GAP[..placement.offset - *end]));
                }
                *end = placement.offset + placement.range.len();
                bucket.push(data.slice(placement.range));
            }
        }
        let (tables, lens) = layout.finish();
        pieces.resize_with(tables.len(), Default::default);
        let buffer = VersionBuffer::new(version, tables.len() as u32);
        let unhashed = vec![String::new(); tables.len()];
        for (header, (bucket, _)) in headers(version, tables, unhashed).into_iter().zip(pieces) {
            buffer.push(Bucket {
                header,
                payload: Payload::InPlace(bucket.into()),
            });
        }
        Ok(Self {
            buffer: Arc::new(buffer),
            bytes: lens.iter().map(|&len| len as u64).sum(),
            lease,
            allocations,
        })
    }

    /// The buffer pullers are served from; it seals once every bucket has been hashed.
    pub fn buffer(&self) -> &Arc<VersionBuffer> {
        &self.buffer
    }

    /// Payload bytes of all buckets.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Seals the version, on a thread of its own, by hashing in place the buckets no send
    /// has hashed within a grace that grows with the version's size (no puller came, or
    /// one left midway); a version that seals meanwhile, or is settled, is left alone.
    pub fn seal_unless_pulled(&self) {
        let grace = UNPULLED_GRACE
            + Duration::from_secs_f64(self.bytes as f64 / UNPULLED_BYTES_PER_SECOND as f64);
        let buffer = Arc::downgrade(&self.buffer);
        let spawned = std::thread::Builder::new()
            .name("weights-seal".into())
            .spawn(move || seal_after(&buffer, grace));
        if let Err(err) = spawned {
            tracing::warn!("cannot start the thread that seals an unpulled version: {err}");
        }
    }

    /// Before the tensors change: copies every bucket still viewing them into a buffer of
    /// its own (the version stays served; a bucket no send has hashed yet is hashed as it is
    /// copied), then waits, at most `limit`, until no send still holds a piece. False if
    /// one still does: bytes it sends from now on may be of the changed tensors, and fail
    /// the version's checksum where they arrive.
    pub fn settle(mut self, limit: Duration) -> bool {
        for index in 0..self.buffer.count {
            let Some(bucket) = self.buffer.bucket(index) else {
                continue;
            };
            let Payload::InPlace(pieces) = bucket.payload else {
                continue;
            };
            let len = pieces.iter().map(Bytes::len).sum();
            let mut copy = allocation(&mut self.allocations, len);
            copy.reserve(len);
            let digest = copy_and_hash(&mut copy, pieces.iter().map(|piece| &piece[..]));
            if let Some(sent) = self.buffer.record_checksum(index, digest)
                && sent != hex(digest)
            {
                tracing::error!(
                    "weight version {}: bucket {index} changed while it was served in place \
                     (the policy changed its weights outside `apply_update`); pullers of it \
                     will fail its checksum",
                    self.buffer.version
                );
            }
            self.buffer
                .replace_payload(index, Payload::Owned(Bytes::from(copy)));
        }
        let deadline = Instant::now() + limit;
        while Arc::strong_count(&self.lease) > 1 {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(POLL);
        }
        true
    }
}

/// Waits `grace` for `buffer` to seal, then hashes in place what no send has hashed.
fn seal_after(buffer: &Weak<VersionBuffer>, grace: Duration) {
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        match buffer.upgrade() {
            Some(buffer) if !buffer.is_hashed() => {}
            _ => return,
        }
        std::thread::sleep(POLL.max(grace / 100));
    }
    let Some(buffer) = buffer.upgrade() else {
        return;
    };
    for index in 0..buffer.count {
        let Some(bucket) = buffer.bucket(index) else {
            continue;
        };
        if let Payload::InPlace(pieces) = bucket.payload
            && bucket.header.checksum.is_empty()
        {
            buffer.record_checksum(index, hash(pieces.iter().map(|piece| &piece[..])));
        }
    }
}

#[cfg(test)]
#[path = "in_place_tests.rs"]
mod tests;
