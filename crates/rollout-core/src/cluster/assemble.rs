//! Turning a weight version's buckets back into its tensors, joining the pieces of a tensor
//! that was split across buckets.

use bytes::Bytes;
use rollout_net::tensor::{TensorBytes, TensorMeta};

use super::weights::{Bucket, VersionBuffer, WeightsError};

impl VersionBuffer {
    /// Every tensor with its bytes, once all buckets are in (see [`TensorAssembler`]).
    pub fn tensors(&self) -> Result<Vec<TensorBytes>, WeightsError> {
        let mut assembler = TensorAssembler::default();
        let mut tensors = Vec::new();
        let mut index = 0;
        while let Some(bucket) = self.bucket(index) {
            tensors.extend(assembler.add(&bucket)?);
            index += 1;
        }
        assembler.finish()?;
        Ok(tensors)
    }
}

/// Turns a version's buckets, in order, back into its tensors: a whole tensor is a slice of
/// its bucket (not copied); one that travelled in pieces is joined into one buffer once its
/// last piece is in.
#[derive(Default)]
struct TensorAssembler {
    joining: Option<Pieces>,
}

impl TensorAssembler {
    /// The tensors `bucket` completes.
    fn add(&mut self, bucket: &Bucket) -> Result<Vec<TensorBytes>, WeightsError> {
        let payload = bucket.payload.contiguous();
        let mut tensors = Vec::new();
        for meta in &bucket.header.tensors.tensors {
            let start = meta.offset as usize;
            let bytes = payload.slice(start..start + meta.len as usize);
            if self.joining.is_none() && meta.piece_start.is_none() {
                tensors.push(TensorBytes::new(
                    meta.name.clone(),
                    meta.dtype,
                    meta.shape.clone(),
                    bytes,
                )?);
                continue;
            }
            let mut pieces = match self.joining.take() {
                Some(pieces) => pieces,
                None => Pieces::first(meta)?,
            };
            pieces.add(meta, bytes)?;
            match pieces.joined()? {
                Some(tensor) => tensors.push(tensor),
                None => self.joining = Some(pieces),
            }
        }
        Ok(tensors)
    }

    /// Checks that no tensor was left waiting for pieces.
    fn finish(self) -> Result<(), WeightsError> {
        match self.joining {
            Some(pieces) => Err(pieces.broken("its last piece never arrived")),
            None => Ok(()),
        }
    }
}

/// The pieces of one tensor so far, in order.
struct Pieces {
    first: TensorMeta,
    parts: Vec<Bytes>,
    next: u64,
    total: u64,
}

impl Pieces {
    fn first(meta: &TensorMeta) -> Result<Self, WeightsError> {
        let pieces = Self {
            first: meta.clone(),
            parts: Vec::new(),
            next: 0,
            total: meta.tensor_len()?,
        };
        if meta.piece_start != Some(0) {
            return Err(pieces.broken("its first piece does not start at byte 0"));
        }
        Ok(pieces)
    }

    fn broken(&self, reason: &str) -> WeightsError {
        WeightsError::Pieces {
            name: self.first.name.clone(),
            reason: reason.to_owned(),
        }
    }

    fn add(&mut self, meta: &TensorMeta, bytes: Bytes) -> Result<(), WeightsError> {
        let same = meta.name == self.first.name
            && meta.dtype == self.first.dtype
            && meta.shape == self.first.shape;
        if !same || meta.piece_start != Some(self.next) {
            return Err(self.broken(&format!(
                "`{}` ({}) came where its bytes from {} were due",
                meta.name,
                meta.piece_start.map_or_else(
                    || "a whole tensor".to_owned(),
                    |start| format!("bytes from {start}")
                ),
                self.next
            )));
        }
        self.next += meta.len;
        self.parts.push(bytes);
        Ok(())
    }

    /// The whole tensor, once the pieces cover it (their bytes have all arrived, so joining
    /// them allocates nothing a peer merely claimed).
    fn joined(&self) -> Result<Option<TensorBytes>, WeightsError> {
        if self.next < self.total {
            return Ok(None);
        }
        let mut data = Vec::with_capacity(self.parts.iter().map(Bytes::len).sum());
        for part in &self.parts {
            data.extend_from_slice(part);
        }
        let first = &self.first;
        Ok(Some(TensorBytes::new(
            first.name.clone(),
            first.dtype,
            first.shape.clone(),
            data,
        )?))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cluster::weights::tests::tensors;

    #[test]
    fn each_tensor_is_assembled_as_soon_as_its_last_bucket_is_in() {
        let tensors = tensors();
        for bucket_bytes in [48, 100, 1 << 20] {
            let buffer = VersionBuffer::from_tensors(3, &tensors, bucket_bytes).unwrap();
            let buckets: Vec<_> = (0..buffer.count)
                .map(|i| buffer.bucket(i).unwrap())
                .collect();
            let mut assembler = TensorAssembler::default();
            let mut assembled = Vec::new();
            for bucket in &buckets {
                let done = assembler.add(bucket).unwrap();
                let last_piece_here = |name: &str| {
                    let metas = &bucket.header.tensors.tensors;
                    metas.iter().any(|meta| meta.name == name)
                };
                assert!(done.iter().all(|tensor| last_piece_here(&tensor.name)));
                assembled.extend(done);
            }
            assembler.finish().unwrap();
            assert_eq!(assembled, tensors, "{bucket_bytes}-byte buckets");
        }
        // Cut short in the middle of a tensor's pieces: the assembler says so.
        let buffer = VersionBuffer::from_tensors(3, &tensors, 48).unwrap();
        let first = buffer.bucket(0).unwrap();
        let mut assembler = TensorAssembler::default();
        assert!(assembler.add(&first).unwrap().is_empty());
        let err = assembler.finish().unwrap_err();
        assert!(err.to_string().contains("never arrived"), "{err}");
    }
}
