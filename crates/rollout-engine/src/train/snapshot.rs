//! A policy's checkpoint held in memory (taken at a step boundary) and written later, on a
//! background thread: plain files as bytes, tensors as safetensors files.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde::Deserialize;
use serde::de::IntoDeserializer;

use super::checkpoint::CheckpointError;

/// The files of a snapshot, by path relative to the checkpoint's policy directory.
pub type SnapshotFiles = Vec<(PathBuf, SnapshotFile)>;

#[derive(Debug)]
pub enum SnapshotFile {
    Bytes(Vec<u8>),
    /// A safetensors file.
    Tensors {
        tensors: Vec<HostTensor>,
        metadata: HashMap<String, String>,
    },
}

/// One tensor's bytes, copied out of the policy.
#[derive(Debug)]
pub struct HostTensor {
    pub name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl HostTensor {
    /// Checks that `dtype` is a safetensors dtype name and that `data` holds exactly the
    /// bytes of `shape`.
    pub fn new(
        name: String,
        dtype: &str,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<Self, String> {
        let dtype = Dtype::deserialize(dtype.into_deserializer())
            .map_err(|_: serde::de::value::Error| format!("`{name}`: unknown dtype `{dtype}`"))?;
        let tensor = HostTensor {
            name,
            dtype,
            shape,
            data,
        };
        tensor.view()?;
        Ok(tensor)
    }

    fn view(&self) -> Result<TensorView<'_>, String> {
        TensorView::new(self.dtype, self.shape.clone(), &self.data).map_err(|err| {
            format!(
                "`{}`: {} bytes do not make a {:?} tensor of shape {:?} ({err})",
                self.name,
                self.data.len(),
                self.dtype,
                self.shape
            )
        })
    }
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
    tensors: &[HostTensor],
    metadata: &HashMap<String, String>,
) -> Result<(), CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason,
    };
    let views = tensors
        .iter()
        .map(|tensor| Ok((tensor.name.as_str(), tensor.view().map_err(invalid)?)))
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
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
                        HostTensor::new("w".into(), "F32", vec![2, 2], weights.clone()).unwrap(),
                        HostTensor::new("step".into(), "I64", vec![], 7i64.to_le_bytes().to_vec())
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
            (Dtype::F32, &[2usize, 2][..], &weights[..])
        );
        assert_eq!(read.tensor("step").unwrap().data(), 7i64.to_le_bytes());
    }

    #[test]
    fn a_tensor_whose_bytes_do_not_fit_its_shape_or_dtype_is_refused() {
        let short = HostTensor::new("w".into(), "F32", vec![3], vec![0; 8]).unwrap_err();
        assert!(short.contains("8 bytes"), "{short}");
        let unknown = HostTensor::new("w".into(), "float32", vec![1], vec![0; 4]).unwrap_err();
        assert!(unknown.contains("unknown dtype `float32`"), "{unknown}");
    }
}
