//! Every role in this process, on the embedded interpreter's worker thread.

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rollout_net::messages::{
    GenerateRequest, GenerateResponse, ScoreRequest, ScoreResponse, TrainRequest, TrainResponse,
};

use crate::config::LoadedConfig;
use crate::generation::PagedGenerator;
use crate::plugins::{
    CallbackSet, DataPlugins, EnvironmentPlugin, Episode, PluginLoadError, PolicyPlugin, Record,
    RewardSet, Sdk, StepOutcome,
};
use crate::python::{PythonError, PythonWorker};
use crate::roles::{
    Environments, EpisodeStart, Generator, Learner, Observer, RoleError, RoleFuture, RunStarted,
    Scorer, Tokenizer,
};

/// The loaded plugins of a run and the interpreter that hosts them.
pub struct LocalRoles {
    worker: PythonWorker,
    policy: Arc<PolicyPlugin>,
    /// The sampling engine, when the policy can run in it and it is enabled.
    engine: Option<PagedGenerator>,
    eos_token_ids: Vec<u32>,
    rewards: Arc<RewardSet>,
    environment: Option<Arc<EnvironmentPlugin>>,
    callbacks: Arc<CallbackSet>,
    data: Arc<DataPlugins>,
    weight_version: Arc<AtomicU64>,
    /// Live episodes by id. Their Python objects are dropped inside `finish`, on the worker.
    episodes: Arc<Mutex<HashMap<u64, Episode>>>,
}

#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error(transparent)]
    Load(#[from] PluginLoadError),
    #[error(transparent)]
    Python(#[from] PythonError),
    #[error(transparent)]
    Role(#[from] RoleError),
}

impl LocalRoles {
    /// Imports and instantiates every plugin the config names.
    pub async fn load(worker: PythonWorker, loaded: &LoadedConfig) -> Result<Self, LocalError> {
        let loaded_config = loaded.clone();
        let plugins = worker
            .run(move |py| -> Result<_, LocalError> {
                let sdk = Sdk::import(py)?;
                let policy = PolicyPlugin::load(py, &loaded_config, sdk.clone())?;
                let data = DataPlugins::load(py, &loaded_config)?;
                let rewards = RewardSet::load(py, &loaded_config, sdk.clone())?;
                let environment = EnvironmentPlugin::load(py, &loaded_config)?;
                let callbacks = CallbackSet::load(py, &loaded_config, sdk)?;
                Ok((policy, data, rewards, environment, callbacks))
            })
            .await??;
        let (policy, data, rewards, environment, callbacks) = plugins;
        let policy = Arc::new(policy);
        let eos_source = policy.clone();
        let eos_token_ids = worker
            .run(move |py| eos_source.eos_token_ids(py))
            .await?
            .map_err(RoleError::from)?;
        let engine = if loaded.config.engine.enabled {
            PagedGenerator::start(&worker, policy.clone(), &loaded.config.engine).await?
        } else {
            None
        };
        Ok(LocalRoles {
            worker,
            policy,
            engine,
            eos_token_ids,
            rewards: Arc::new(rewards),
            environment: environment.map(Arc::new),
            callbacks: Arc::new(callbacks),
            data: Arc::new(data),
            weight_version: Arc::new(AtomicU64::new(0)),
            episodes: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// Whether generation runs in the sampling engine (else in the policy's `generate`).
    pub fn uses_engine(&self) -> bool {
        self.engine.is_some()
    }

    pub fn has_environment(&self) -> bool {
        self.environment.is_some()
    }

    pub fn reward_names(&self) -> Vec<String> {
        self.rewards.names().map(str::to_owned).collect()
    }

    /// Every data record, through the transforms.
    pub async fn records(&self) -> Result<Vec<Record>, RoleError> {
        let data = self.data.clone();
        Ok(self.worker.run(move |py| data.records(py)).await??)
    }

    pub async fn describe_policy(&self) -> Result<serde_json::Value, RoleError> {
        let policy = self.policy.clone();
        Ok(self.worker.run(move |py| policy.describe(py)).await??)
    }

    pub fn policy_spec(&self) -> &str {
        self.policy.spec()
    }
}

fn boxed<'a, T: Send + 'a>(
    future: impl std::future::Future<Output = Result<T, RoleError>> + Send + 'a,
) -> RoleFuture<'a, T> {
    Box::pin(future)
}

impl Generator for LocalRoles {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let policy = self.policy.clone();
        let version = self.weight_version.load(Ordering::SeqCst);
        boxed(async move {
            if let Some(engine) = &self.engine {
                return engine
                    .generate(&self.worker, &policy, request, &self.eos_token_ids, version)
                    .await;
            }
            let sampling = &request.sampling;
            if !sampling.stop_strings.is_empty() || sampling.ignore_eos {
                return Err(RoleError::Protocol(format!(
                    "`rollout.stop_strings` and `rollout.ignore_eos` need the sampling engine, \
                     which the policy `{}` cannot run in (or `[engine] enabled = false`)",
                    policy.spec()
                )));
            }
            Ok(self
                .worker
                .run(move |py| policy.generate(py, &request, version))
                .await??)
        })
    }
}

impl Scorer for LocalRoles {
    fn score(&self, request: ScoreRequest) -> RoleFuture<'_, ScoreResponse> {
        let rewards = self.rewards.clone();
        boxed(async move {
            Ok(self
                .worker
                .run(move |py| rewards.score(py, &request))
                .await??)
        })
    }
}

impl Learner for LocalRoles {
    fn train(&self, request: TrainRequest) -> RoleFuture<'_, TrainResponse> {
        let policy = self.policy.clone();
        boxed(async move {
            let metrics = self
                .worker
                .run(move |py| policy.train(py, &request))
                .await??;
            let weight_version = self.weight_version.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(TrainResponse {
                metrics,
                weight_version,
            })
        })
    }

    fn save(&self, directory: PathBuf) -> RoleFuture<'_, ()> {
        let policy = self.policy.clone();
        boxed(async move {
            Ok(self
                .worker
                .run(move |py| policy.save(py, &directory))
                .await??)
        })
    }

    fn restore(&self, directory: PathBuf, weight_version: u64) -> RoleFuture<'_, ()> {
        let policy = self.policy.clone();
        boxed(async move {
            self.worker
                .run(move |py| policy.load_state(py, &directory))
                .await??;
            self.weight_version.store(weight_version, Ordering::SeqCst);
            Ok(())
        })
    }
}

impl Tokenizer for LocalRoles {
    fn encode(&self, texts: Vec<String>, continuation: bool) -> RoleFuture<'_, Vec<Vec<u32>>> {
        let policy = self.policy.clone();
        boxed(async move {
            Ok(self
                .worker
                .run(move |py| policy.encode(py, &texts, continuation))
                .await??)
        })
    }

    fn decode(&self, sequences: Vec<Vec<u32>>) -> RoleFuture<'_, Vec<String>> {
        let policy = self.policy.clone();
        boxed(async move {
            Ok(self
                .worker
                .run(move |py| {
                    let slices: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
                    policy.decode(py, &slices)
                })
                .await??)
        })
    }

    fn eos_token_ids(&self) -> RoleFuture<'_, Vec<u32>> {
        let policy = self.policy.clone();
        boxed(async move {
            Ok(self
                .worker
                .run(move |py| policy.eos_token_ids(py))
                .await??)
        })
    }
}

impl Environments for LocalRoles {
    fn start(&self, first_id: u64, starts: Vec<EpisodeStart>) -> RoleFuture<'_, Vec<String>> {
        let environment = self.environment.clone();
        let episodes = self.episodes.clone();
        boxed(async move {
            let Some(environment) = environment else {
                return Ok(Vec::new());
            };
            Ok(self
                .worker
                .run(move |py| {
                    let mut prompts = Vec::with_capacity(starts.len());
                    for (offset, start) in starts.into_iter().enumerate() {
                        let episode = environment.new_episode(py)?;
                        prompts.push(environment.reset(py, &episode, &start.record, start.seed)?);
                        if let Ok(mut live) = episodes.lock() {
                            live.insert(first_id + offset as u64, episode);
                        }
                    }
                    Ok::<_, crate::plugins::PluginError>(prompts)
                })
                .await??)
        })
    }

    fn step(&self, actions: Vec<(u64, String)>) -> RoleFuture<'_, Vec<StepOutcome>> {
        let environment = self.environment.clone();
        let episodes = self.episodes.clone();
        boxed(async move {
            let Some(environment) = environment else {
                return Ok(Vec::new());
            };
            self.worker
                .run(move |py| {
                    let live = episodes
                        .lock()
                        .map_err(|_| RoleError::Protocol("the episode table is poisoned".into()))?;
                    let mut outcomes = Vec::with_capacity(actions.len());
                    for (id, action) in &actions {
                        let Some(episode) = live.get(id) else {
                            return Err(RoleError::Protocol(format!(
                                "episode {id} is not running"
                            )));
                        };
                        outcomes.push(environment.step(py, episode, action)?);
                    }
                    Ok(outcomes)
                })
                .await?
        })
    }

    fn finish(&self, ids: Vec<u64>) -> RoleFuture<'_, ()> {
        let episodes = self.episodes.clone();
        boxed(async move {
            self.worker
                .run(move |_py| {
                    if let Ok(mut live) = episodes.lock() {
                        for id in ids {
                            live.remove(&id);
                        }
                    }
                })
                .await?;
            Ok(())
        })
    }
}

type Notify<'a> = Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

impl LocalRoles {
    fn notify(
        &self,
        event: impl for<'py> FnOnce(pyo3::Python<'py>, &CallbackSet) + Send + 'static,
    ) -> Notify<'_> {
        let callbacks = self.callbacks.clone();
        Box::pin(async move {
            if let Err(err) = self.worker.run(move |py| event(py, &callbacks)).await {
                tracing::error!("callbacks could not run: {err}");
            }
        })
    }
}

impl Observer for LocalRoles {
    fn run_started(&self, info: RunStarted) -> Notify<'_> {
        self.notify(move |py, callbacks| callbacks.on_run_start(py, &info))
    }

    fn step_ended(&self, step: u64, metrics: serde_json::Value) -> Notify<'_> {
        self.notify(move |py, callbacks| callbacks.on_step_end(py, step, &metrics))
    }

    fn checkpoint_written(&self, step: u64, path: PathBuf) -> Notify<'_> {
        self.notify(move |py, callbacks| callbacks.on_checkpoint(py, step, &path))
    }

    fn run_ended(&self, summary: serde_json::Value) -> Notify<'_> {
        self.notify(move |py, callbacks| callbacks.on_run_end(py, &summary))
    }
}
