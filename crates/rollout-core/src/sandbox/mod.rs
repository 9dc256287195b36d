//! Plugin isolation: reward plugins scored, and environment episodes played, in pools of
//! separate Python processes (`python -m rollout_sdk.sandbox`), with a wall-clock timeout
//! per call and memory and CPU limits per process.
//!
//! A sample whose reward raises, runs past its timeout or its CPU budget, runs out of
//! memory or takes its process down is reported as failed (with the reason and any
//! traceback) instead of ending the run; so is an episode whose environment does any of
//! that in `reset` or `step` ([`EnvironmentPool`], one process per live episode's state).
//! A process is killed and replaced when it cannot be trusted again. The run ends only when
//! failures pass `[sandbox] max_failed_fraction` (over the run) or
//! `max_failed_fraction_per_step`.
//!
//! Nothing here touches the embedded interpreter: the processes are plain child processes
//! spoken to in JSON lines ([`protocol`]).

mod episodes;
mod limits;
mod pool;
pub mod protocol;
mod worker;

use crate::roles::RoleError;
pub use episodes::{EnvironmentPool, EnvironmentPoolSpec, score_failure};
pub use limits::{FailureCounts, FailureLedger, RunCounts, check_limits, describe, reason_counts};
pub use pool::{PoolSpec, SandboxPool};

pub use worker::{
    CallFailure, INHERITED_ENVIRONMENT, Launch, Outcome, SampleFailure, SandboxWorker,
    classify_exit, inherited_environment,
};

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot start the sandbox `{program}`: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("a sandbox worker did not start within {seconds} s (sandbox.start_timeout_seconds)")]
    StartTimeout { seconds: f64 },
    #[error("a sandbox worker died while starting: {status}")]
    DiedAtStart { status: String },
    /// A reward (`reward` is its index) or the environment (`None`) failed to load in a
    /// worker; `key` is the path of a bad option.
    #[error(
        "{} failed to load in the sandbox: {message}\n{traceback}",
        reward.map_or_else(|| "the environment".to_owned(), |r| format!("reward {r}"))
    )]
    LoadFailed {
        reward: Option<usize>,
        key: Option<Vec<String>>,
        message: String,
        traceback: String,
    },
    #[error("the sandbox worker closed its output")]
    Closed,
    #[error("sandbox protocol: {0}")]
    Protocol(String),
    #[error("sandbox I/O: {0}")]
    Io(#[from] std::io::Error),
    /// `what` failed: "rewards", "environments" or "environments and rewards".
    #[error(
        "{what} failed on {failed} of {total} samples {scope} ({percent:.1}%), more than \
         sandbox.{key} = {limit}; {reasons}. Last failure: {last}",
        percent = 100.0 * *failed as f64 / (*total).max(1) as f64
    )]
    TooManyFailures {
        what: &'static str,
        failed: u64,
        total: u64,
        scope: &'static str,
        key: &'static str,
        limit: f64,
        reasons: String,
        last: String,
    },
}

impl From<SandboxError> for RoleError {
    fn from(err: SandboxError) -> Self {
        match err {
            SandboxError::TooManyFailures { .. } | SandboxError::LoadFailed { .. } => {
                RoleError::Plugin(err.to_string())
            }
            other => RoleError::Runtime(other.to_string()),
        }
    }
}
