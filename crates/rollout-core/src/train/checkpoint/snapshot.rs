//! A policy's checkpoint held in memory (taken at a step boundary) and written later, on a
//! background thread: plain files as bytes, tensors as safetensors files.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use rollout_net::TensorBytes;
use safetensors::tensor::TensorView;
use serde::Deserialize;
use serde::de::IntoDeserializer;

use super::store::CheckpointError;

/// The files of a snapshot, by path relative to the checkpoint's policy directory.
pub type SnapshotFiles = Vec<(PathBuf, SnapshotFile)>;

#[derive(Debug)]
pub enum SnapshotFile {
    Bytes(Vec<u8>),
    /// A safetensors file.
    Tensors {
        tensors: Vec<TensorBytes>,
        metadata: HashMap<String, String>,
    },
}

/// Writes a snapshot's files into `directory` (a pending checkpoint's policy directory);
/// [`super::CheckpointStore::commit`] syncs them.
pub fn write_files(
    directory: &Path,
    files: &[(PathBuf, SnapshotFile)],
) -> Result<(), CheckpointError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CheckpointError::Io { path, source }
    };
    for (name, content) in files {
        let path = directory.join(name);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io(parent))?;
        }
        match content {
            SnapshotFile::Bytes(bytes) => fs::write(&path, bytes).map_err(io(&path))?,
            SnapshotFile::Tensors { tensors, metadata } => {
                write_safetensors(&path, tensors, metadata)?;
            }
        }
    }
    Ok(())
}

fn write_safetensors(
    path: &Path,
    tensors: &[TensorBytes],
    metadata: &HashMap<String, String>,
) -> Result<(), CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let views = tensors
        .iter()
        .map(|tensor| Ok((tensor.name.as_str(), view(tensor).map_err(invalid)?)))
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    let metadata = (!metadata.is_empty()).then(|| metadata.clone());
    safetensors::serialize_to_file(views, metadata, path).map_err(|err| match err {
        safetensors::SafeTensorError::IoError(source) => CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        },
        other => invalid(other.to_string()),
    })
}

/// The safetensors view of `tensor` (its bytes were checked against its shape when it was
/// made).
fn view(tensor: &TensorBytes) -> Result<TensorView<'_>, String> {
    let name = tensor.dtype.safetensors_name();
    let dtype = safetensors::Dtype::deserialize(name.into_deserializer())
        .map_err(|_: serde::de::value::Error| format!("`{}`: dtype {name}", tensor.name))?;
    let shape = tensor.shape.iter().map(|&dim| dim as usize).collect();
    TensorView::new(dtype, shape, &tensor.data).map_err(|err| format!("`{}`: {err}", tensor.name))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use rollout_net::Dtype;

    use super::*;

    #[test]
    fn tensors_are_written_as_safetensors_that_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let weights: Vec<u8> = [1.5f32, -2.0, 0.25, 8.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let files = vec![
            (
                PathBuf::from("model/config.json"),
                SnapshotFile::Bytes(b"{}".to_vec()),
            ),
            (
                PathBuf::from("model/model.safetensors"),
                SnapshotFile::Tensors {
                    tensors: vec![
                        TensorBytes::new("w".into(), Dtype::F32, vec![2, 2], weights.clone())
                            .unwrap(),
                        TensorBytes::new(
                            "step".into(),
                            Dtype::I64,
                            vec![],
                            7i64.to_le_bytes().to_vec(),
                        )
                        .unwrap(),
                    ],
                    metadata: [("format".to_string(), "pt".to_string())].into(),
                },
            ),
        ];
        write_files(dir.path(), &files).unwrap();
        assert_eq!(
            fs::read(dir.path().join("model/config.json")).unwrap(),
            b"{}"
        );
        let bytes = fs::read(dir.path().join("model/model.safetensors")).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            header
                .metadata()
                .as_ref()
                .and_then(|m| m.get("format"))
                .map(String::as_str),
            Some("pt")
        );
        let read = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let w = read.tensor("w").unwrap();
        assert_eq!(
            (w.dtype(), w.shape(), w.data()),
            (safetensors::Dtype::F32, &[2usize, 2][..], &weights[..])
        );
        assert_eq!(read.tensor("step").unwrap().data(), 7i64.to_le_bytes());
    }
}
