//! `rollout export`: a checkpoint's policy as a Hugging Face model directory, written by the
//! built-in `python_plugins.checkpoint_export` (sharded checkpoints are assembled there).

use std::path::PathBuf;

use pyo3::prelude::*;

use rollout_core::config::PythonConfig;

use crate::interpreter::PythonError;

/// Exports the policy of `checkpoint` (a `step-N` directory, or its `policy/`) to `out`,
/// which must not exist; returns the directory written.
pub async fn export(checkpoint: PathBuf, out: PathBuf) -> Result<String, PythonError> {
    let worker = crate::interpreter::start(&PythonConfig::default()).await?;
    worker
        .run(move |py| {
            let written = (|| {
                py.import("python_plugins.checkpoint_export")?
                    .call_method1("export_checkpoint", (checkpoint, out))?
                    .str()?
                    .extract::<String>()
            })();
            written.map_err(|err| PythonError::from_py(py, &err))
        })
        .await?
}
