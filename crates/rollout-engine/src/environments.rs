//! Where a run's environment plays its episodes: on the embedded interpreter (`[sandbox]
//! processes = 0`, or `environments = false`), where a call that raises ends the run, or in
//! the sandbox's environment pool, where a call that raises, hangs, crashes or runs out of
//! memory costs its episode only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::config::{Config, LoadedConfig};
use crate::local::LocalError;
use crate::plugins::{
    EnvironmentPlugin, Episode, PluginError, environment_pool_spec, sandbox_launch,
    sandbox_load_error,
};
use crate::python::PythonWorker;
use crate::roles::{EpisodeResult, EpisodeStart, RoleError, StepOutcome};
use crate::sandbox::{EnvironmentPool, FailureLedger};

pub enum EpisodeHost {
    /// Live episodes by id; their Python objects are dropped inside `finish`, on the worker.
    InProcess {
        plugin: Arc<EnvironmentPlugin>,
        live: Arc<Mutex<HashMap<u64, Episode>>>,
    },
    Sandboxed(Box<EnvironmentPool>),
}

impl EpisodeHost {
    /// Whether the config plays its environment's episodes in the sandbox pool.
    pub fn sandboxed(config: &Config) -> bool {
        config.sandbox.processes > 0 && config.sandbox.environments && config.environment.is_some()
    }

    /// `in_process` is the loaded environment; `None` starts the sandbox pool when the
    /// config has an environment (and `ledger` is the run's failure counts it adds to).
    pub async fn new(
        worker: &PythonWorker,
        loaded: &LoadedConfig,
        in_process: Option<EnvironmentPlugin>,
        ledger: Arc<FailureLedger>,
    ) -> Result<Option<Self>, LocalError> {
        if let Some(plugin) = in_process {
            return Ok(Some(EpisodeHost::InProcess {
                plugin: Arc::new(plugin),
                live: Arc::default(),
            }));
        }
        if !Self::sandboxed(&loaded.config) {
            return Ok(None);
        }
        let launch = worker.run(sandbox_launch).await??;
        let Some(spec) = environment_pool_spec(loaded, launch, ledger) else {
            return Ok(None);
        };
        match EnvironmentPool::start(spec).await {
            Ok(pool) => Ok(Some(EpisodeHost::Sandboxed(Box::new(pool)))),
            Err(err) => Err(match sandbox_load_error(loaded, err) {
                Ok(load) => LocalError::Load(load),
                Err(other) => LocalError::Role(other.into()),
            }),
        }
    }

    pub async fn start(
        &self,
        worker: &PythonWorker,
        first_id: u64,
        starts: Vec<EpisodeStart>,
    ) -> Result<Vec<EpisodeResult<String>>, RoleError> {
        let (plugin, live) = match self {
            EpisodeHost::Sandboxed(pool) => {
                return Ok(pool.start_episodes(first_id, &starts).await?);
            }
            EpisodeHost::InProcess { plugin, live } => (plugin.clone(), live.clone()),
        };
        Ok(worker
            .run(move |py| {
                let mut prompts = Vec::with_capacity(starts.len());
                for (offset, start) in starts.into_iter().enumerate() {
                    let episode = plugin.new_episode(py)?;
                    prompts.push(Ok(plugin.reset(py, &episode, &start.record, start.seed)?));
                    if let Ok(mut live) = live.lock() {
                        live.insert(first_id.wrapping_add(offset as u64), episode);
                    }
                }
                Ok::<_, PluginError>(prompts)
            })
            .await??)
    }

    pub async fn step(
        &self,
        worker: &PythonWorker,
        actions: Vec<(u64, String)>,
    ) -> Result<Vec<EpisodeResult<StepOutcome>>, RoleError> {
        let (plugin, live) = match self {
            EpisodeHost::Sandboxed(pool) => return Ok(pool.step(&actions).await?),
            EpisodeHost::InProcess { plugin, live } => (plugin.clone(), live.clone()),
        };
        worker
            .run(move |py| {
                let live = live
                    .lock()
                    .map_err(|_| RoleError::Protocol("the episode table is poisoned".into()))?;
                let mut outcomes = Vec::with_capacity(actions.len());
                for (id, action) in &actions {
                    let Some(episode) = live.get(id) else {
                        return Err(RoleError::Protocol(format!("episode {id} is not running")));
                    };
                    outcomes.push(Ok(plugin.step(py, episode, action)?));
                }
                Ok(outcomes)
            })
            .await?
    }

    pub async fn finish(&self, worker: &PythonWorker, ids: Vec<u64>) -> Result<(), RoleError> {
        let live = match self {
            EpisodeHost::Sandboxed(pool) => return Ok(pool.finish(&ids).await?),
            EpisodeHost::InProcess { live, .. } => live.clone(),
        };
        worker
            .run(move |_py| {
                if let Ok(mut live) = live.lock() {
                    for id in ids {
                        live.remove(&id);
                    }
                }
            })
            .await?;
        Ok(())
    }
}
