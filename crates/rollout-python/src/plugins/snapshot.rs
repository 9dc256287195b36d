//! Copying what `Policy.snapshot` returns (`rollout_sdk.snapshot`) out of the interpreter,
//! so the policy can go on training while the files are written.

use std::path::{Component, PathBuf};

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyMapping};
use rollout_core::train::{SnapshotFile, SnapshotFiles};

use crate::contract::{self, TensorFile};

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
    let file: TensorFile = contract::from_python(file)
        .map_err(|reason| format!("is neither bytes nor a TensorFile: {reason}"))?;
    let tensors = file
        .tensors
        .0
        .into_iter()
        .map(|(name, tensor)| tensor.into_tensor(name))
        .collect::<Result<Vec<_>, String>>()?;
    Ok(SnapshotFile::Tensors {
        tensors,
        metadata: file.metadata.into_iter().collect(),
    })
}
