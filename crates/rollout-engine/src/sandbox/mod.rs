//! Reward isolation: reward plugins scored in a pool of separate Python processes
//! (`python -m rollout_sdk.sandbox`), one sample per call, with a wall-clock timeout per
//! sample and memory and CPU limits per process.
//!
//! A sample whose reward raises, runs past its timeout or its CPU budget, runs out of
//! memory or takes its process down is reported as failed (with the reason and any
//! traceback) instead of ending the run; the process is killed and replaced when it cannot
//! be trusted again. The run ends only when failures pass `[sandbox] max_failed_fraction`
//! (over the run) or `max_failed_fraction_per_step`.
//!
//! Nothing here touches the embedded interpreter: the processes are plain child processes
//! spoken to in JSON lines ([`protocol`]).

mod pool;
pub mod protocol;
mod worker;

pub use pool::{FailureCounts, PoolSpec, SandboxPool};
pub use worker::{Launch, Outcome, SampleFailure, SandboxWorker, classify_exit};

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot start the reward sandbox `{program}`: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error(
        "a reward sandbox worker did not start within {seconds} s (sandbox.start_timeout_seconds)"
    )]
    StartTimeout { seconds: f64 },
    #[error("a reward sandbox worker died while starting: {status}")]
    DiedAtStart { status: String },
    /// A reward failed to load in a worker; `key` is the path of a bad option.
    #[error("reward {reward} failed to load in the sandbox: {message}\n{traceback}")]
    LoadFailed {
        reward: usize,
        key: Option<Vec<String>>,
        message: String,
        traceback: String,
    },
    #[error("the reward sandbox worker closed its output")]
    Closed,
    #[error("reward sandbox protocol: {0}")]
    Protocol(String),
    #[error("reward sandbox I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error(
        "rewards failed on {failed} of {total} samples {scope} ({percent:.1}%), more than \
         sandbox.{key} = {limit}; {reasons}. Last failure: {last}",
        percent = 100.0 * *failed as f64 / (*total).max(1) as f64
    )]
    TooManyFailures {
        failed: u64,
        total: u64,
        scope: &'static str,
        key: &'static str,
        limit: f64,
        reasons: String,
        last: String,
    },
}
