//! Cutting a policy's tensors into weight buckets. `BucketLayout` decides where each
//! tensor's bytes go; [`VersionBuilder`] copies tensors into their buckets as a policy hands
//! them over one at a time; [`PlannedVersion`] lays out tensors that are all at hand before
//! it copies any byte, so a trainer can announce a version (and workers start pulling it)
//! while its buckets are still being filled and checksummed, and a rank that only reports a
//! checksum copies nothing.
//!
//! Both lay tensors out alike: each starts at a multiple of [`TENSOR_ALIGN`] (gaps are
//! zero), a bucket holds about `bucket_bytes`, and a tensor larger than a bucket is split into
//! bucket-sized pieces, one per bucket, that the receiver joins again.

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use rollout_net::messages::WeightsBucket;
use rollout_net::tensor::{
    Dtype, TENSOR_ALIGN, TensorBytes, TensorError, TensorMeta, TensorTable, checksum,
};

use super::weights::{Bucket, Payload, VersionBuffer, VersionHasher, WeightsError, hex};

/// A version a trainer exported: its size, its checksum (`None` while the buffer is still
/// being filled: [`VersionBuffer::sealed`] has it then) and, when it serves the version, the
/// buffer its buckets are filled into (pullers wait for each).
#[derive(Debug)]
pub struct ExportedVersion {
    pub version: u64,
    pub checksum: Option<String>,
    pub bytes: u64,
    pub buffer: Option<Arc<VersionBuffer>>,
}

/// How a trainer serves the version it exports, with an earlier version's bucket
/// allocations to write into.
#[derive(Debug)]
pub enum Serving {
    /// Buckets copied from the tensors (a generator in the same process views them).
    Copied(Vec<Vec<u8>>),
    /// Buckets sent from the tensors in place while they hold still, copied only before
    /// they change (see [`super::in_place`]).
    InPlace(Vec<Vec<u8>>),
}

impl Serving {
    pub fn into_allocations(self) -> Vec<Vec<u8>> {
        match self {
            Serving::Copied(allocations) | Serving::InPlace(allocations) => allocations,
        }
    }
}

/// Where bytes `range` of a tensor go: bucket `bucket`, from byte `offset` of its payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Placement {
    pub(super) bucket: usize,
    pub(super) offset: usize,
    pub(super) range: Range<usize>,
}

/// The tables of a version's buckets, built as tensors are added.
pub(super) struct BucketLayout {
    bucket_bytes: usize,
    /// The tables so far; the last one is the open bucket's.
    tables: Vec<TensorTable>,
    /// Payload bytes of each bucket so far.
    lens: Vec<usize>,
    names: HashSet<String>,
}

impl BucketLayout {
    pub(super) fn new(bucket_bytes: u64) -> Self {
        Self {
            bucket_bytes: usize::try_from(bucket_bytes.max(1)).unwrap_or(usize::MAX),
            tables: vec![TensorTable::default()],
            lens: vec![0],
            names: HashSet::new(),
        }
    }

    fn open_is_empty(&self) -> bool {
        self.tables.last().is_none_or(|t| t.tensors.is_empty())
    }

    fn close(&mut self) {
        self.tables.push(TensorTable::default());
        self.lens.push(0);
    }

    /// Places a tensor of `len` bytes and returns where its bytes go, in order.
    pub(super) fn add(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[u64],
        len: usize,
    ) -> Result<Vec<Placement>, WeightsError> {
        let expected = dtype.byte_len(shape);
        if expected != Some(len as u64) {
            return Err(TensorError::LengthMismatch {
                name: name.to_owned(),
                dtype,
                shape: shape.to_vec(),
                len: len as u64,
                expected: expected.unwrap_or(u64::MAX),
            }
            .into());
        }
        if !self.names.insert(name.to_owned()) {
            return Err(TensorError::DuplicateName {
                name: name.to_owned(),
            }
            .into());
        }
        if len <= self.bucket_bytes {
            let open_len = self.lens.last().copied().unwrap_or(0);
            if !self.open_is_empty() && open_len + len > self.bucket_bytes {
                self.close();
            }
            return Ok(vec![self.append(name, dtype, shape, None, 0..len)]);
        }
        if !self.open_is_empty() {
            self.close();
        }
        let piece = (self.bucket_bytes / TENSOR_ALIGN * TENSOR_ALIGN).max(TENSOR_ALIGN);
        let mut placements = Vec::with_capacity(len.div_ceil(piece));
        for start in (0..len).step_by(piece) {
            let range = start..(start + piece).min(len);
            placements.push(self.append(name, dtype, shape, Some(start as u64), range));
            self.close();
        }
        Ok(placements)
    }

    fn append(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[u64],
        piece_start: Option<u64>,
        range: Range<usize>,
    ) -> Placement {
        let bucket = self.tables.len() - 1;
        let offset = self.lens[bucket].next_multiple_of(TENSOR_ALIGN);
        self.lens[bucket] = offset + range.len();
        self.tables[bucket].tensors.push(TensorMeta {
            name: name.to_owned(),
            dtype,
            shape: shape.to_vec(),
            offset: offset as u64,
            len: range.len() as u64,
            piece_start,
        });
        Placement {
            bucket,
            offset,
            range,
        }
    }

    /// The buckets' tables and payload lengths (one empty bucket for a model without
    /// tensors).
    pub(super) fn finish(&mut self) -> (Vec<TensorTable>, Vec<usize>) {
        if self.open_is_empty() && self.tables.len() > 1 {
            self.tables.pop();
            self.lens.pop();
        }
        (
            std::mem::take(&mut self.tables),
            std::mem::take(&mut self.lens),
        )
    }
}

/// Appends `bytes` to a bucket's payload at `offset` (zeroing the alignment gap before it).
fn write_at(payload: &mut Vec<u8>, offset: usize, bytes: &[u8]) {
    payload.resize(offset, 0);
    payload.extend_from_slice(bytes);
}

pub(super) fn allocation(allocations: &mut Vec<Vec<u8>>, bucket_bytes: usize) -> Vec<u8> {
    match allocations.pop() {
        Some(mut reused) => {
            reused.clear();
            reused
        }
        // Room for a full bucket and its alignment gaps; a huge configured size is not
        // reserved up front.
        None => Vec::with_capacity(bucket_bytes.saturating_add(TENSOR_ALIGN).min(1 << 30)),
    }
}

pub(super) fn headers(
    version: u64,
    tables: Vec<TensorTable>,
    checksums: Vec<String>,
) -> Vec<WeightsBucket> {
    let count = tables.len() as u32;
    tables
        .into_iter()
        .zip(checksums)
        .enumerate()
        .map(|(index, (tensors, checksum))| WeightsBucket {
            version,
            index: index as u32,
            count,
            checksum,
            tensors,
        })
        .collect()
}

/// Cuts tensors into buckets as a policy exports them one at a time: each tensor's bytes
/// are copied once, straight into its bucket (checksummed as the bucket closes, while it is
/// still in cache). Buckets are written into `allocations` left by an earlier version where
/// there are any, so a trainer does not fault in fresh pages every sync.
pub struct VersionBuilder {
    version: u64,
    layout: BucketLayout,
    open: Vec<u8>,
    closed: Vec<(Bytes, String)>,
    allocations: Vec<Vec<u8>>,
}

impl VersionBuilder {
    pub fn new(version: u64, bucket_bytes: u64, mut allocations: Vec<Vec<u8>>) -> Self {
        let layout = BucketLayout::new(bucket_bytes);
        let open = allocation(&mut allocations, layout.bucket_bytes);
        Self {
            version,
            layout,
            open,
            closed: Vec::new(),
            allocations,
        }
    }

    /// Appends one tensor (its little-endian, row-major bytes).
    pub fn push(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[u64],
        data: &[u8],
    ) -> Result<(), WeightsError> {
        for placement in self.layout.add(name, dtype, shape, data.len())? {
            while self.closed.len() < placement.bucket {
                self.close_bucket();
            }
            write_at(&mut self.open, placement.offset, &data[placement.range]);
        }
        Ok(())
    }

    fn close_bucket(&mut self) {
        let next = allocation(&mut self.allocations, self.layout.bucket_bytes);
        let payload = Bytes::from(std::mem::replace(&mut self.open, next));
        let checksum = checksum(&payload);
        self.closed.push((payload, checksum));
    }

    /// The version, in buckets numbered in order.
    pub fn finish(mut self) -> VersionBuffer {
        let (tables, _) = self.layout.finish();
        while self.closed.len() < tables.len() {
            self.close_bucket();
        }
        let (payloads, checksums): (Vec<Bytes>, Vec<String>) = self.closed.into_iter().unzip();
        let buffer = VersionBuffer::new(self.version, tables.len() as u32);
        for (header, payload) in headers(self.version, tables, checksums)
            .into_iter()
            .zip(payloads)
        {
            buffer.push(Bucket {
                header,
                payload: Payload::Owned(payload),
            });
        }
        buffer
    }
}

impl VersionBuffer {
    /// Cuts `tensors` into buckets of about `bucket_bytes` (see [`VersionBuilder`]).
    pub fn from_tensors(
        version: u64,
        tensors: &[TensorBytes],
        bucket_bytes: u64,
    ) -> Result<Self, WeightsError> {
        let mut builder = VersionBuilder::new(version, bucket_bytes, Vec::new());
        for tensor in tensors {
            builder.push(&tensor.name, tensor.dtype, &tensor.shape, &tensor.data)?;
        }
        Ok(builder.finish())
    }
}

/// A version laid out from tensors that are all at hand (read in place, not copied). A rank
/// that only reports the version [`PlannedVersion::checksum`]s it without copying a byte;
/// one that serves it announces the version at once and [`PlannedVersion::fill`]s its
/// buckets while pullers already wait for them, each checksummed as it is copied.
pub struct PlannedVersion<'a> {
    version: u64,
    tables: Vec<TensorTable>,
    lens: Vec<usize>,
    /// Each bucket's contents: where each run of source bytes goes.
    contents: Vec<Vec<(usize, &'a [u8])>>,
}

impl<'a> PlannedVersion<'a> {
    /// Lays `tensors` (name, dtype, shape, bytes) out in buckets of about `bucket_bytes`.
    pub fn plan<'t>(
        version: u64,
        bucket_bytes: u64,
        tensors: impl IntoIterator<Item = (&'t str, Dtype, &'t [u64], &'a [u8])>,
    ) -> Result<Self, WeightsError> {
        let mut layout = BucketLayout::new(bucket_bytes);
        let mut contents: Vec<Vec<(usize, &'a [u8])>> = Vec::new();
        for (name, dtype, shape, data) in tensors {
            for placement in layout.add(name, dtype, shape, data.len())? {
                if contents.len() <= placement.bucket {
                    contents.resize_with(placement.bucket + 1, Vec::new);
                }
                contents[placement.bucket].push((placement.offset, &data[placement.range]));
            }
        }
        let (tables, lens) = layout.finish();
        contents.resize_with(tables.len(), Vec::new);
        Ok(Self {
            version,
            tables,
            lens,
            contents,
        })
    }

    /// The version checksum ([`VersionBuffer::checksum`] once filled), reading every byte
    /// once, in place.
    pub fn checksum(&self) -> String {
        let checksums = checksum_buckets(&self.contents);
        let mut hasher = VersionHasher::default();
        for header in headers(self.version, self.tables.clone(), checksums) {
            hasher.add(&header);
        }
        hasher.finish()
    }

    /// Payload bytes of all buckets.
    pub fn bytes(&self) -> u64 {
        self.lens.iter().map(|&len| len as u64).sum()
    }

    /// An empty buffer for this version, for [`PlannedVersion::fill`].
    pub fn buffer(&self) -> VersionBuffer {
        VersionBuffer::new(self.version, self.tables.len() as u32)
    }

    /// Copies each bucket into `buffer` (written into `allocations` where there are any),
    /// in order, checksumming its bytes while they are still in cache, and publishes it to
    /// pullers as soon as it is whole. The buffer is sealed once the last bucket is in.
    pub fn fill(self, buffer: &Arc<VersionBuffer>, mut allocations: Vec<Vec<u8>>) {
        let count = self.tables.len() as u32;
        let buckets = self.tables.into_iter().zip(self.contents).zip(self.lens);
        for (index, ((tensors, runs), len)) in buckets.enumerate() {
            let mut payload = allocation(&mut allocations, len);
            payload.reserve(len);
            let checksum = hex(copy_and_hash(&mut payload, pieces(&runs)));
            buffer.push(Bucket {
                header: WeightsBucket {
                    version: self.version,
                    index: index as u32,
                    count,
                    checksum,
                    tensors,
                },
                payload: Payload::Owned(Bytes::from(payload)),
            });
        }
    }
}

/// The zeros of the alignment gaps between tensors.
pub(super) static GAP: [u8; TENSOR_ALIGN] = [0; TENSOR_ALIGN];

/// The pieces of the payload `runs` lay out: each run after the zeros of its alignment gap
/// (shorter than [`TENSOR_ALIGN`], as [`BucketLayout`] places runs).
fn pieces<'a>(runs: &'a [(usize, &'a [u8])]) -> impl Iterator<Item = &'a [u8]> {
    let mut end = 0;
    runs.iter().flat_map(move |&(offset, bytes)| {
        let gap = &GAP[..offset - end];
        end = offset + bytes.len();
        [gap, bytes]
    })
}

/// Appends `pieces` to `copy` and returns their XXH3-128, each stretch hashed right after
/// it is copied, while it is in cache.
pub(super) fn copy_and_hash<'a>(
    copy: &mut Vec<u8>,
    pieces: impl IntoIterator<Item = &'a [u8]>,
) -> u128 {
    const STRETCH: usize = 1 << 20;
    let mut hasher = twox_hash::XxHash3_128::new();
    for piece in pieces {
        for stretch in piece.chunks(STRETCH) {
            let start = copy.len();
            copy.extend_from_slice(stretch);
            hasher.write(&copy[start..]);
        }
    }
    hasher.finish_128()
}

/// The XXH3-128 of `pieces` one after another, read in place.
pub(super) fn hash<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> u128 {
    let mut hasher = twox_hash::XxHash3_128::new();
    for piece in pieces {
        hasher.write(piece);
    }
    hasher.finish_128()
}

/// Checksums every bucket in place, the buckets shared out over the machine's cores.
fn checksum_buckets(contents: &[Vec<(usize, &[u8])>]) -> Vec<String> {
    let streamed_checksum = |runs: &Vec<(usize, &[u8])>| hex(hash(pieces(runs)));
    let threads = std::thread::available_parallelism()
        .map_or(1, |cores| cores.get())
        .min(contents.len());
    if threads <= 1 {
        return contents.iter().map(streamed_checksum).collect();
    }
    std::thread::scope(|scope| {
        let shares: Vec<_> = contents
            .chunks(contents.len().div_ceil(threads))
            .map(|share| {
                scope.spawn(move || share.iter().map(streamed_checksum).collect::<Vec<_>>())
            })
            .collect();
        shares
            .into_iter()
            .flat_map(|share| {
                share
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}

#[cfg(test)]
#[path = "buckets_tests.rs"]
mod tests;
