//! `rollout init-quickstart`: the quickstart's tiny local model, tokenizer and data, made by
//! the built-in `python_plugins.quickstart`.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use rollout_core::config::PythonConfig;

use crate::interpreter::PythonError;

/// Creates the quickstart's files under `dir` (replacing them with `force`); returns what was
/// created, as JSON.
pub async fn create(dir: PathBuf, force: bool) -> Result<String, PythonError> {
    let worker = crate::interpreter::start(&PythonConfig::default()).await?;
    worker
        .run(move |py| {
            let created = (|| {
                let kwargs = PyDict::new(py);
                kwargs.set_item("force", force)?;
                let created = py.import("python_plugins.quickstart")?.call_method(
                    "create",
                    (dir,),
                    Some(&kwargs),
                )?;
                py.import("json")?
                    .call_method1("dumps", (created,))?
                    .extract::<String>()
            })();
            created.map_err(|err| PythonError::from_py(py, &err))
        })
        .await?
}
