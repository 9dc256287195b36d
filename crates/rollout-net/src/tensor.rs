//! Tensor payloads for weight sync, laid out like safetensors: a table of named tensors (in a
//! frame's JSON header) addressing byte ranges of one raw buffer (the frame's payload).
//!
//! Tensor data is little-endian and row-major, as in safetensors. A table from the wire is
//! untrusted: [`TensorTable::tensor_bytes`] validates it against the payload before slicing.

use std::collections::HashSet;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// Where [`TensorPayloadBuilder`] starts each tensor: a multiple of this many bytes.
pub const TENSOR_ALIGN: usize = 8;

/// An element type; serialized as its safetensors name (`"F32"`, `"BF16"`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Dtype {
    Bool,
    U8,
    I8,
    #[serde(rename = "F8_E4M3")]
    F8E4M3,
    #[serde(rename = "F8_E5M2")]
    F8E5M2,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
}

impl Dtype {
    pub const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::I64,
        Dtype::U64,
        Dtype::F64,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    /// The safetensors name, which is also the serde form.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F64 => "F64",
        }
    }

    pub fn from_safetensors_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|dtype| dtype.safetensors_name() == name)
    }

    /// Bytes a tensor of this type and `shape` occupies, or `None` if that overflows `u64`.
    pub fn byte_len(self, shape: &[u64]) -> Option<u64> {
        shape
            .iter()
            .try_fold(1u64, |numel, &dim| numel.checked_mul(dim))?
            .checked_mul(self.size_bytes())
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

/// One named tensor's bytes in host memory, little-endian and row-major, as safetensors
/// stores them: what a policy exports, a checkpoint snapshot holds and a worker imports.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorBytes {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: Bytes,
}

impl TensorBytes {
    /// Checks that `data` holds exactly the bytes of `shape` elements of `dtype`.
    pub fn new(
        name: String,
        dtype: Dtype,
        shape: Vec<u64>,
        data: impl Into<Bytes>,
    ) -> Result<Self, TensorError> {
        let data = data.into();
        let expected = dtype
            .byte_len(&shape)
            .ok_or_else(|| TensorError::SizeOverflow {
                name: name.clone(),
                dtype,
                shape: shape.clone(),
            })?;
        if data.len() as u64 != expected {
            return Err(TensorError::LengthMismatch {
                name,
                dtype,
                shape,
                len: data.len() as u64,
                expected,
            });
        }
        Ok(TensorBytes {
            name,
            dtype,
            shape,
            data,
        })
    }
}

/// One tensor of a payload, or one piece of a tensor too large for a payload: bytes
/// `offset..offset + len` of the payload are bytes `start..start + len` of the tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub len: u64,
    /// For a piece of a tensor, where it starts in the tensor's bytes; `None` for a whole
    /// tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub piece_start: Option<u64>,
}

impl TensorMeta {
    /// The bytes of the whole tensor.
    pub fn tensor_len(&self) -> Result<u64, TensorError> {
        self.dtype
            .byte_len(&self.shape)
            .ok_or_else(|| TensorError::SizeOverflow {
                name: self.name.clone(),
                dtype: self.dtype,
                shape: self.shape.clone(),
            })
    }

    /// Checks that a whole tensor's length matches its shape and dtype, that a piece is
    /// not empty and lies in its tensor, and that the range lies in the payload.
    fn validate(&self, payload_len: u64) -> Result<(), TensorError> {
        let expected = self.tensor_len()?;
        let fits = match self.piece_start {
            None => self.len == expected,
            Some(start) => {
                self.len > 0
                    && start
                        .checked_add(self.len)
                        .is_some_and(|end| end <= expected)
            }
        };
        if !fits {
            return Err(TensorError::LengthMismatch {
                name: self.name.clone(),
                dtype: self.dtype,
                shape: self.shape.clone(),
                len: self.len,
                expected,
            });
        }
        match self.offset.checked_add(self.len) {
            Some(end) if end <= payload_len => Ok(()),
            _ => Err(TensorError::OutOfRange {
                name: self.name.clone(),
                offset: self.offset,
                len: self.len,
                payload_len,
            }),
        }
    }
}

/// The layout of a tensor payload. Serialized as a plain JSON array of [`TensorMeta`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TensorTable {
    pub tensors: Vec<TensorMeta>,
}

impl TensorTable {
    /// Checks the table against a payload of `payload_len` bytes: every length matches its
    /// shape and dtype, every range lies inside the payload, no two ranges overlap and no
    /// name repeats. Gaps (alignment padding) are allowed.
    pub fn validate(&self, payload_len: u64) -> Result<(), TensorError> {
        let mut names = HashSet::with_capacity(self.tensors.len());
        for tensor in &self.tensors {
            tensor.validate(payload_len)?;
            if !names.insert(tensor.name.as_str()) {
                return Err(TensorError::DuplicateName {
                    name: tensor.name.clone(),
                });
            }
        }
        // Sorted by start, ranges overlap somewhere only if some neighbours do. Empty tensors
        // occupy no bytes and so overlap nothing.
        let mut ranges: Vec<&TensorMeta> = self.tensors.iter().filter(|t| t.len > 0).collect();
        ranges.sort_unstable_by_key(|t| t.offset);
        for pair in ranges.windows(2) {
            if let [a, b] = pair {
                // `a`'s range is in the payload, so its end does not overflow.
                if b.offset < a.offset + a.len {
                    return Err(TensorError::Overlap {
                        first: a.name.clone(),
                        second: b.name.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Validates the table against `payload`, then returns each tensor with its bytes, in
    /// table order.
    pub fn tensor_bytes<'a>(
        &'a self,
        payload: &'a [u8],
    ) -> Result<Vec<(&'a TensorMeta, &'a [u8])>, TensorError> {
        let payload_len = payload.len() as u64;
        self.validate(payload_len)?;
        self.tensors
            .iter()
            .map(|tensor| {
                // Validated to lie inside `payload`, so these conversions cannot fail.
                let range = usize::try_from(tensor.offset)
                    .ok()
                    .zip(usize::try_from(tensor.len).ok())
                    .and_then(|(start, len)| payload.get(start..start.checked_add(len)?));
                range
                    .map(|bytes| (tensor, bytes))
                    .ok_or_else(|| TensorError::OutOfRange {
                        name: tensor.name.clone(),
                        offset: tensor.offset,
                        len: tensor.len,
                        payload_len,
                    })
            })
            .collect()
    }
}

/// The XXH3-128 digest of a payload as 32 lowercase hex digits: the integrity check of weight
/// buckets ([`crate::messages::WeightsBucket::checksum`]). A non-cryptographic hash, fast
/// enough (tens of GB/s) to verify every byte at the receiver without slowing the transfer;
/// who may send is settled by the connection's authentication.
pub fn checksum(payload: &[u8]) -> String {
    format!("{:032x}", twox_hash::XxHash3_128::oneshot(payload))
}

/// Lays named tensors out one after another in a single payload, each starting at a multiple
/// of [`TENSOR_ALIGN`] bytes (gaps are zero-filled).
#[derive(Debug, Default)]
pub struct TensorPayloadBuilder {
    table: TensorTable,
    payload: Vec<u8>,
    names: HashSet<String>,
}

impl TensorPayloadBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A builder whose payload buffer starts with room for `bytes` bytes.
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            payload: Vec::with_capacity(bytes),
            ..Self::default()
        }
    }

    /// Appends a tensor; `data` is its little-endian, row-major bytes.
    pub fn push(
        &mut self,
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        data: &[u8],
    ) -> Result<&mut Self, TensorError> {
        let name = name.into();
        let Some(expected) = dtype.byte_len(&shape) else {
            return Err(TensorError::SizeOverflow { name, dtype, shape });
        };
        let len = data.len() as u64;
        if len != expected {
            return Err(TensorError::LengthMismatch {
                name,
                dtype,
                shape,
                len,
                expected,
            });
        }
        if self.names.contains(&name) {
            return Err(TensorError::DuplicateName { name });
        }
        let offset = self.payload.len().next_multiple_of(TENSOR_ALIGN);
        self.payload.resize(offset, 0);
        self.payload.extend_from_slice(data);
        self.names.insert(name.clone());
        self.table.tensors.push(TensorMeta {
            name,
            dtype,
            shape,
            offset: offset as u64,
            len,
            piece_start: None,
        });
        Ok(self)
    }

    /// The table and the payload it describes.
    pub fn finish(self) -> (TensorTable, Bytes) {
        (self.table, Bytes::from(self.payload))
    }
}

/// Why a tensor table does not describe a payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    #[error("tensor {name:?} appears more than once")]
    DuplicateName { name: String },
    #[error("tensor {name:?} of shape {shape:?} and dtype {dtype} is too large to address")]
    SizeOverflow {
        name: String,
        dtype: Dtype,
        shape: Vec<u64>,
    },
    #[error(
        "tensor {name:?} is {len} bytes, but shape {shape:?} of dtype {dtype} needs {expected}"
    )]
    LengthMismatch {
        name: String,
        dtype: Dtype,
        shape: Vec<u64>,
        len: u64,
        expected: u64,
    },
    #[error(
        "tensor {name:?} at offset {offset} with length {len} lies outside the {payload_len}-byte payload"
    )]
    OutOfRange {
        name: String,
        offset: u64,
        len: u64,
        payload_len: u64,
    },
    #[error("tensors {first:?} and {second:?} overlap in the payload")]
    Overlap { first: String, second: String },
    #[error("payload checksum is {found}, but the sender's is {expected}")]
    ChecksumMismatch { expected: String, found: String },
}

#[cfg(test)]
#[path = "tensor_tests.rs"]
mod tests;
