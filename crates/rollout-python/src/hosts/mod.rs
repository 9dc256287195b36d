//! Roles on this process's embedded interpreter: [`PolicyHost`] (generation, training and
//! the tokenizer, on one policy plugin) and [`Services`] (rewards, environments, data and
//! callbacks). `rollout run` uses both (with [`OverlappedPolicy`] when generation overlaps
//! training); a generation worker or trainer process hosts a policy; a distributed run's
//! controller hosts the services.

mod episodes;
mod live_episodes;
mod overlapped;
mod policy;
mod scoring;
mod services;

use std::sync::atomic::Ordering;

use rollout_core::roles::{RoleError, RoleFuture};
use tracing::Instrument;

use crate::interpreter::PythonError;

pub use overlapped::OverlappedPolicy;
pub use policy::PolicyHost;
pub use services::Services;

/// Seeds the interpreter's global generators from `run.seed`, once per process and before
/// the first plugin is instantiated, so a role loads alike in one process or many.
fn seed_once(py: pyo3::Python<'_>, seed: u64) -> Result<(), PythonError> {
    use pyo3::prelude::*;
    static SEEDED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if SEEDED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    py.import("rollout_sdk.seeding")
        .and_then(|seeding| seeding.call_method1("seed_everything", (seed,)))
        .map(drop)
        .map_err(|err| PythonError::from_py(py, &err))
}

fn boxed<'a, T: Send + 'a>(
    future: impl std::future::Future<Output = Result<T, RoleError>> + Send + 'a,
) -> RoleFuture<'a, T> {
    Box::pin(future)
}

/// A role call in a span that `span` creates when the call first runs, so that it nests in
/// the span of whatever awaits it (`--trace`).
fn traced<'a, T: Send + 'a>(
    span: impl FnOnce() -> tracing::Span + Send + 'a,
    future: impl std::future::Future<Output = Result<T, RoleError>> + Send + 'a,
) -> RoleFuture<'a, T> {
    Box::pin(async move { future.instrument(span()).await })
}
