//! The embedded CPython interpreter: environment discovery, the worker thread and errors.

mod env;
mod error;
mod worker;

pub use env::{PythonSetup, rollout_home};
pub use error::PythonError;
pub use worker::PythonWorker;

/// Ends the process through `os._exit(code)` once Python's own buffered streams are flushed,
/// when this process started the interpreter; returns when it did not. At a normal exit the
/// libraries torch loads (the CUDA ones too, even on a CPU) run static destructors that page
/// about 100 MB back into memory and take time, for nothing.
pub fn exit_if_started(code: u8) {
    use pyo3::prelude::*;
    Python::try_attach(|py| {
        // Plugins may have printed through Python's own buffered streams.
        let _ = py.run(
            c"import sys; sys.stdout.flush(); sys.stderr.flush()",
            None,
            None,
        );
        if let Ok(os) = py.import("os") {
            let _ = os.call_method1("_exit", (code,));
        }
    });
}

/// Starts the interpreter that `[python]` describes on its own thread (its start-up blocks,
/// so it runs off the async threads).
pub async fn start(
    python: &rollout_core::config::PythonConfig,
) -> Result<std::sync::Arc<PythonWorker>, PythonError> {
    let setup = PythonSetup::discover(python.venv.as_deref(), &python.paths)?;
    let worker = tokio::task::spawn_blocking(move || PythonWorker::start(setup))
        .await
        .map_err(|err| PythonError::Setup(format!("the Python start-up task failed: {err}")))??;
    Ok(std::sync::Arc::new(worker))
}
