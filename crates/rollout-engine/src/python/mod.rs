//! The embedded CPython interpreter: environment discovery, the worker thread and errors.

pub mod convert;
mod env;
mod error;
mod worker;

pub use env::{PythonSetup, rollout_home};
pub use error::PythonError;
pub use worker::PythonWorker;
