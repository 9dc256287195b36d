//! Where a run's rewards are scored: on the embedded interpreter (`[sandbox] processes = 0`,
//! where a reward that raises ends the run, and a `SampleFailure` it returns costs only the
//! sample), or in the sandbox pool of worker processes, where a raise costs only the sample
//! too. Either way failures count toward the `[sandbox]` failure limits.

use std::sync::Arc;

use rollout_core::config::LoadedConfig;
use rollout_core::config::SandboxConfig;
use rollout_core::roles::RoleError;
use rollout_core::sandbox::{
    FailureCounts, FailureLedger, SandboxPool, check_limits, describe, reason_counts,
};
use rollout_net::messages::{ScoreRequest, ScoreResponse};

use crate::HostError;
use crate::interpreter::PythonWorker;
use crate::plugins::{RewardSet, pool_spec, sandbox_launch, sandbox_load_error};

pub enum Scoring {
    InProcess {
        rewards: Arc<RewardSet>,
        ledger: Arc<FailureLedger>,
        limits: SandboxConfig,
    },
    Sandboxed(Box<SandboxPool>),
}

impl Scoring {
    /// `in_process` is the loaded reward set, or `None` to start the sandbox pool (adding
    /// its failures to the run's `ledger`).
    pub async fn new(
        worker: &PythonWorker,
        loaded: &LoadedConfig,
        in_process: Option<RewardSet>,
        ledger: Arc<FailureLedger>,
    ) -> Result<Self, HostError> {
        if let Some(rewards) = in_process {
            return Ok(Scoring::InProcess {
                rewards: Arc::new(rewards),
                ledger,
                limits: loaded.config.sandbox.clone(),
            });
        }
        let launch = worker.run(sandbox_launch).await??;
        match SandboxPool::start(pool_spec(loaded, launch, ledger)).await {
            Ok(pool) => Ok(Scoring::Sandboxed(Box::new(pool))),
            Err(err) => Err(match sandbox_load_error(loaded, err) {
                Ok(load) => HostError::Load(load),
                Err(other) => HostError::Role(other.into()),
            }),
        }
    }

    pub fn names(&self) -> Vec<String> {
        match self {
            Scoring::InProcess { rewards, .. } => rewards.names().map(str::to_owned).collect(),
            Scoring::Sandboxed(pool) => pool.names().to_vec(),
        }
    }

    pub async fn score(
        &self,
        worker: &PythonWorker,
        request: ScoreRequest,
    ) -> Result<ScoreResponse, RoleError> {
        match self {
            Scoring::InProcess {
                rewards,
                ledger,
                limits,
            } => {
                let rewards = rewards.clone();
                let total = request.samples.len() as u64;
                let response = worker.run(move |py| rewards.score(py, &request)).await??;
                if !response.failed.is_empty() {
                    tracing::warn!(
                        "rewards failed on {} of {total} samples ({}); first: {}",
                        response.failed.len(),
                        reason_counts(&response.failed),
                        describe(&response.failed[0])
                    );
                }
                let step = FailureCounts {
                    total,
                    failed: response.failed.len() as u64,
                };
                let run = ledger.add_scored(step);
                check_limits(limits, Some(step), Some(run), &response.failed)?;
                Ok(response)
            }
            Scoring::Sandboxed(pool) => Ok(pool.score(&request).await?),
        }
    }
}
