//! Copying what `Policy.snapshot` returns (`rollout_sdk.snapshot`) out of the interpreter,
//! so the policy can go on training while the files are written.

use std::collections::HashMap;
use std::path::{Component, PathBuf};

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMapping};

use crate::train::{HostTensor, SnapshotFile, SnapshotFiles};

/// Copies every file of a snapshot: `bytes` as they are, a `TensorFile`'s tensors from their
/// buffers. The error says what was wrong with the returned value.
pub(super) fn copy_files(files: &Bound<'_, PyAny>) -> Result<SnapshotFiles, String> {
    let files = files
        .cast::<PyMapping>()
        .map_err(|_| "must return a mapping of path to bytes or TensorFile".to_string())?;
    let mut copied = Vec::new();
    for item in files.items().map_err(|err| err.to_string())?.iter() {
        let (name, content): (String, Bound<'_, PyAny>) = item
            .extract()
            .map_err(|_| "paths must be str".to_string())?;
        let path = PathBuf::from(&name);
        let inside = path
            .components()
            .all(|part| matches!(part, Component::Normal(_)));
        if name.is_empty() || !inside {
            return Err(format!(
                "`{name}` is not a relative path inside the checkpoint"
            ));
        }
        let file = match content.cast::<PyBytes>() {
            Ok(bytes) => SnapshotFile::Bytes(bytes.as_bytes().to_vec()),
            Err(_) => copy_tensor_file(&content).map_err(|reason| format!("`{name}`: {reason}"))?,
        };
        copied.push((path, file));
    }
    Ok(copied)
}

fn copy_tensor_file(file: &Bound<'_, PyAny>) -> Result<SnapshotFile, String> {
    let not_a_file = |_| "is neither bytes nor a TensorFile".to_string();
    let tensors = file.getattr("tensors").map_err(not_a_file)?;
    let metadata: HashMap<String, String> = file
        .getattr("metadata")
        .and_then(|m| m.extract())
        .map_err(|_| "TensorFile.metadata must map str to str".to_string())?;
    let tensors = tensors
        .cast::<PyMapping>()
        .map_err(|_| "TensorFile.tensors must be a mapping".to_string())?;
    let mut copied = Vec::new();
    for item in tensors.items().map_err(|err| err.to_string())?.iter() {
        let (name, tensor): (String, Bound<'_, PyAny>) = item
            .extract()
            .map_err(|_| "tensor names must be str".to_string())?;
        copied.push(copy_tensor(name, &tensor)?);
    }
    Ok(SnapshotFile::Tensors {
        tensors: copied,
        metadata,
    })
}

fn copy_tensor(name: String, tensor: &Bound<'_, PyAny>) -> Result<HostTensor, String> {
    let field = |attribute: &str| {
        tensor
            .getattr(attribute)
            .map_err(|_| format!("`{name}` is not a HostTensor (no `{attribute}`)"))
    };
    let dtype: String = field("dtype")?
        .extract()
        .map_err(|_| format!("`{name}`: dtype must be a str"))?;
    let shape: Vec<usize> = field("shape")?
        .extract()
        .map_err(|_| format!("`{name}`: shape must be a tuple of non-negative ints"))?;
    let data = field("data")?;
    let data = PyBuffer::<u8>::get(&data)
        .and_then(|buffer| buffer.to_vec(data.py()))
        .map_err(|err| format!("`{name}`: data must be a contiguous byte buffer ({err})"))?;
    HostTensor::new(name, &dtype, shape, data)
}
