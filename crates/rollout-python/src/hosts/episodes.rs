//! Where a run's environment plays its episodes: on the embedded interpreter (`[sandbox]
//! processes = 0`, or `environments = false`), where a call that raises ends the run, or in
//! the sandbox's environment pool, where a call that raises, hangs, crashes or runs out of
//! memory costs its episode only.

use std::sync::Arc;

use rollout_core::config::LoadedConfig;
use rollout_core::roles::{EpisodeResult, EpisodeStart, RoleError, StepResult};
use rollout_core::sandbox::{EnvironmentPool, FailureLedger};

use super::live_episodes::LiveEpisodes;
use crate::HostError;
use crate::interpreter::PythonWorker;
use crate::plugins::{
    EnvironmentPlugin, environment_pool_spec, sandbox_launch, sandbox_load_error,
};

pub enum EpisodeHost {
    InProcess(LiveEpisodes<EnvironmentPlugin>),
    Sandboxed(Box<EnvironmentPool>),
}

impl EpisodeHost {
    /// `in_process` is the loaded environment; `None` starts the sandbox pool when the
    /// config has an environment (and `ledger` is the run's failure counts it adds to).
    pub async fn new(
        worker: &PythonWorker,
        loaded: &LoadedConfig,
        in_process: Option<EnvironmentPlugin>,
        ledger: Arc<FailureLedger>,
    ) -> Result<Option<Self>, HostError> {
        if let Some(plugin) = in_process {
            return Ok(Some(EpisodeHost::InProcess(LiveEpisodes::new(plugin))));
        }
        if !loaded.config.environment_sandboxed() {
            return Ok(None);
        }
        let launch = worker.run(sandbox_launch).await??;
        let Some(spec) = environment_pool_spec(loaded, launch, ledger) else {
            return Ok(None);
        };
        match EnvironmentPool::start(spec).await {
            Ok(pool) => Ok(Some(EpisodeHost::Sandboxed(Box::new(pool)))),
            Err(err) => Err(match sandbox_load_error(loaded, err) {
                Ok(load) => HostError::Load(load),
                Err(other) => HostError::Role(other.into()),
            }),
        }
    }

    pub async fn start(
        &self,
        worker: &PythonWorker,
        first_id: u64,
        starts: Vec<EpisodeStart>,
    ) -> Result<Vec<EpisodeResult<String>>, RoleError> {
        match self {
            EpisodeHost::Sandboxed(pool) => Ok(pool.start_episodes(first_id, &starts).await?),
            EpisodeHost::InProcess(episodes) => {
                let prompts = episodes.start(worker, first_id, starts).await?;
                Ok(prompts.into_iter().map(Ok).collect())
            }
        }
    }

    pub async fn step(
        &self,
        worker: &PythonWorker,
        actions: Vec<(u64, String)>,
    ) -> Result<Vec<EpisodeResult<StepResult>>, RoleError> {
        match self {
            EpisodeHost::Sandboxed(pool) => Ok(pool.step(&actions).await?),
            EpisodeHost::InProcess(episodes) => {
                let outcomes = episodes.step(worker, actions).await?;
                Ok(outcomes.into_iter().map(Ok).collect())
            }
        }
    }

    pub async fn finish(&self, worker: &PythonWorker, ids: Vec<u64>) -> Result<(), RoleError> {
        match self {
            EpisodeHost::Sandboxed(pool) => Ok(pool.finish(&ids).await?),
            EpisodeHost::InProcess(episodes) => episodes.finish(worker, ids).await,
        }
    }
}
