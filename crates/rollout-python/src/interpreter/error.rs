//! Python exceptions as Rust errors that carry their traceback.

use pyo3::prelude::*;
use pyo3::types::PyList;

#[derive(Debug, thiserror::Error)]
pub enum PythonError {
    #[error("cannot set up Python: {0}")]
    Setup(String),
    #[error("{summary}\n{traceback}")]
    Exception { summary: String, traceback: String },
    #[error("the Python worker thread has stopped")]
    WorkerGone,
}

impl PythonError {
    /// Converts `err`, formatting its traceback with Python's own `traceback` module.
    pub fn from_py(py: Python<'_>, err: &PyErr) -> Self {
        let value = err.value(py);
        let summary = value
            .str()
            .map(|s| format!("{}: {s}", type_name(value.as_any())))
            .unwrap_or_else(|_| type_name(value.as_any()));
        let traceback = py
            .import("traceback")
            .and_then(|tb| {
                tb.call_method1(
                    "format_exception",
                    (err.get_type(py), value, err.traceback(py)),
                )
            })
            .and_then(|lines| Ok(lines.cast_into::<PyList>()?))
            .map(|lines| {
                lines
                    .iter()
                    .filter_map(|line| line.extract::<String>().ok())
                    .collect::<String>()
            })
            .unwrap_or_default();
        PythonError::Exception {
            summary,
            traceback: traceback.trim_end().to_owned(),
        }
    }

    /// The one-line part: the exception type and message.
    pub fn summary(&self) -> String {
        match self {
            PythonError::Exception { summary, .. } => summary.clone(),
            other => other.to_string(),
        }
    }

    pub fn traceback(&self) -> Option<&str> {
        match self {
            PythonError::Exception { traceback, .. } => Some(traceback),
            _ => None,
        }
    }
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .qualname()
        .map(|name| name.to_string())
        .unwrap_or_else(|_| "Exception".to_owned())
}
