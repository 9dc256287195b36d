//! Roles on this process's embedded interpreter: [`PolicyHost`] (generation, training and
//! the tokenizer, on one policy plugin) and [`Services`] (rewards, environments, data and
//! callbacks). `rollout run` uses both; a generation worker or trainer process hosts a
//! policy; a distributed run's controller hosts the services.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rollout_net::messages::{
    GenerateRequest, GenerateResponse, ScoreRequest, ScoreResponse, TrainRequest, TrainResponse,
    ValuesRequest, ValuesResponse, WeightsReport,
};
use rollout_net::tensor::TensorMeta;
use tracing::Instrument;

use crate::cluster::weights::{TensorBytes, VersionBuffer};
use crate::config::{ClusterConfig, KeyPath, LoadedConfig, PluginConfig};
use crate::environments::EpisodeHost;
use crate::generation::PagedGenerator;
use crate::live_episodes::LiveEpisodes;
use crate::plugins::{
    CallbackSet, DataPlugins, EnvironmentPlugin, MultiAgentEnvironmentPlugin, PluginError,
    PluginLoadError, PolicyPlugin, Record, RewardSet, Sdk,
};
use crate::python::{PythonError, PythonWorker};
use crate::roles::{
    AgentTurn, Environments, EpisodeResult, EpisodeStart, Generator, JointOutcome, Learner,
    MultiAgentEnvironments, Observer, RoleError, RoleFuture, RunStarted, SaveWritten, Scorer,
    StepOutcome, Tokenizer,
};
use crate::sandbox::FailureLedger;
use crate::scoring::Scoring;
use crate::train::write_files;

impl From<PluginError> for RoleError {
    fn from(err: PluginError) -> Self {
        RoleError::Plugin(err.to_string())
    }
}

impl From<PythonError> for RoleError {
    fn from(err: PythonError) -> Self {
        RoleError::Runtime(err.to_string())
    }
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

/// The policy plugin of a run, its sampling engine and the version of its weights.
pub struct PolicyHost {
    worker: Arc<PythonWorker>,
    policy: Arc<PolicyPlugin>,
    /// The sampling engine, when the policy can run in it and it is enabled.
    engine: Option<PagedGenerator>,
    eos_token_ids: Vec<u32>,
    weight_version: Arc<AtomicU64>,
}

impl PolicyHost {
    /// Imports and instantiates the config's policy.
    pub async fn load(
        worker: Arc<PythonWorker>,
        loaded: &LoadedConfig,
    ) -> Result<Self, LocalError> {
        let policy = loaded.config.policy.clone();
        Self::load_policy(worker, loaded, KeyPath::default().key("policy"), policy).await
    }

    /// Imports and instantiates `policy`, configured at `key` (an agent's, or `[policy]`).
    pub async fn load_policy(
        worker: Arc<PythonWorker>,
        loaded: &LoadedConfig,
        key: KeyPath,
        policy: PluginConfig,
    ) -> Result<Self, LocalError> {
        let loaded_config = loaded.clone();
        let policy = worker
            .run(move |py| -> Result<_, LocalError> {
                seed_once(py, loaded_config.config.run.seed)?;
                let sdk = Sdk::import(py)?;
                Ok(PolicyPlugin::load(py, &loaded_config, &key, &policy, sdk)?)
            })
            .await??;
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
        Ok(PolicyHost {
            worker,
            policy,
            engine,
            eos_token_ids,
            weight_version: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Whether generation runs in the sampling engine (else in the policy's `generate`).
    pub fn uses_engine(&self) -> bool {
        self.engine.is_some()
    }

    pub async fn describe(&self) -> Result<serde_json::Value, RoleError> {
        let policy = self.policy.clone();
        Ok(self.worker.run(move |py| policy.describe(py)).await??)
    }

    pub fn spec(&self) -> &str {
        self.policy.spec()
    }

    pub fn weight_version(&self) -> u64 {
        self.weight_version.load(Ordering::SeqCst)
    }

    /// Has `train` all-reduce gradients over the trainers' process group (see
    /// `rollout_sdk.distributed`) before each update.
    pub async fn join_data_parallel(
        &self,
        rank: u32,
        world_size: u32,
        cluster: ClusterConfig,
    ) -> Result<(), RoleError> {
        let policy = self.policy.clone();
        Ok(self
            .worker
            .run(move |py| policy.join_data_parallel(py, rank, world_size, &cluster))
            .await??)
    }

    /// Leaves the trainers' process group (a no-op for a rank that never joined one).
    pub async fn leave_data_parallel(&self) -> Result<(), RoleError> {
        let policy = self.policy.clone();
        Ok(self
            .worker
            .run(move |py| policy.leave_data_parallel(py))
            .await??)
    }

    /// The current weights, tensor by tensor, and the version they are.
    pub async fn export_weights(&self) -> Result<(u64, Vec<TensorBytes>), RoleError> {
        let policy = self.policy.clone();
        let version = self.weight_version();
        let tensors = self
            .worker
            .run(move |py| policy.export_weights(py))
            .instrument(tracing::info_span!("weights.export", version))
            .await??;
        Ok((version, tensors))
    }

    /// Replaces the weights with `tensors` as `version`. Runs as one job on the interpreter
    /// thread, so it falls between two engine steps, never inside one.
    pub async fn import_weights(
        &self,
        version: u64,
        tensors: Arc<Vec<(TensorMeta, bytes::Bytes)>>,
    ) -> Result<(), RoleError> {
        let policy = self.policy.clone();
        let weight_version = self.weight_version.clone();
        self.worker
            .run(move |py| {
                policy.import_weights(py, &tensors)?;
                weight_version.store(version, Ordering::SeqCst);
                Ok::<_, PluginError>(())
            })
            .instrument(tracing::info_span!("weights.import", version))
            .await??;
        Ok(())
    }
}

impl Generator for PolicyHost {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let policy = self.policy.clone();
        let version = self.weight_version.load(Ordering::SeqCst);
        let prompts = request.prompts.len();
        let span = move || tracing::info_span!("policy.generate", prompts, version);
        traced(span, async move {
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

    /// In one process generation and training share the model: nothing to load.
    fn load_weights(&self, weights: WeightsReport) -> RoleFuture<'_, Vec<WeightsReport>> {
        boxed(async move { Ok(vec![weights]) })
    }
}

impl Learner for PolicyHost {
    fn train(&self, request: TrainRequest) -> RoleFuture<'_, TrainResponse> {
        let policy = self.policy.clone();
        traced(|| tracing::info_span!("policy.train"), async move {
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

    fn values(&self, request: ValuesRequest) -> RoleFuture<'_, ValuesResponse> {
        let policy = self.policy.clone();
        traced(|| tracing::info_span!("policy.values"), async move {
            let values = self
                .worker
                .run(move |py| policy.values(py, &request))
                .await??;
            Ok(ValuesResponse { values })
        })
    }

    fn save(&self, directory: PathBuf) -> RoleFuture<'_, ()> {
        let policy = self.policy.clone();
        traced(|| tracing::info_span!("policy.save"), async move {
            Ok(self
                .worker
                .run(move |py| policy.save(py, &directory))
                .await??)
        })
    }

    /// Takes the policy's snapshot on the interpreter and writes it on a blocking thread;
    /// a policy without `snapshot` saves in the foreground.
    fn save_in_background(&self, directory: PathBuf) -> RoleFuture<'_, SaveWritten> {
        let policy = self.policy.clone();
        traced(|| tracing::info_span!("policy.snapshot"), async move {
            let Some(files) = self.worker.run(move |py| policy.snapshot(py)).await?? else {
                self.save(directory).await?;
                return Ok(Box::pin(async { Ok(()) }) as SaveWritten);
            };
            let write = tokio::task::spawn_blocking(move || write_files(&directory, &files));
            Ok(Box::pin(async move {
                match write.await {
                    Ok(written) => written.map_err(|err| RoleError::Runtime(err.to_string())),
                    Err(err) => Err(RoleError::Runtime(format!(
                        "the checkpoint writer stopped: {err}"
                    ))),
                }
            }) as SaveWritten)
        })
    }

    fn restore(&self, directory: PathBuf, weight_version: u64) -> RoleFuture<'_, ()> {
        let policy = self.policy.clone();
        traced(|| tracing::info_span!("policy.restore"), async move {
            self.worker
                .run(move |py| policy.load_state(py, &directory))
                .await??;
            self.weight_version.store(weight_version, Ordering::SeqCst);
            Ok(())
        })
    }

    /// Reports the version and checksum of the weights this process holds; nothing is
    /// copied for an in-process generator.
    fn publish_weights(&self, bucket_bytes: u64) -> RoleFuture<'_, WeightsReport> {
        traced(|| tracing::info_span!("policy.publish"), async move {
            let (version, tensors) = self.export_weights().await?;
            let buffer = VersionBuffer::from_tensors(version, &tensors, bucket_bytes)
                .map_err(|err| RoleError::Protocol(err.to_string()))?;
            Ok(WeightsReport {
                version,
                checksum: buffer.checksum(),
                bytes: buffer.bytes(),
                source: String::new(),
                holder: "local".into(),
            })
        })
    }

    fn needs_weight_sync(&self) -> bool {
        false
    }
}

impl Tokenizer for PolicyHost {
    fn encode(&self, texts: Vec<String>, continuation: bool) -> RoleFuture<'_, Vec<Vec<u32>>> {
        let policy = self.policy.clone();
        let count = texts.len();
        let span = move || tracing::info_span!("tokenizer.encode", texts = count);
        traced(span, async move {
            Ok(self
                .worker
                .run(move |py| policy.encode(py, &texts, continuation))
                .await??)
        })
    }

    fn decode(&self, sequences: Vec<Vec<u32>>) -> RoleFuture<'_, Vec<String>> {
        let policy = self.policy.clone();
        let count = sequences.len();
        let span = move || tracing::info_span!("tokenizer.decode", sequences = count);
        traced(span, async move {
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
        let ids = self.eos_token_ids.clone();
        boxed(async move { Ok(ids) })
    }
}

/// The run's data, rewards, environment and callbacks.
pub struct Services {
    worker: Arc<PythonWorker>,
    rewards: Scoring,
    environment: Option<EpisodeHost>,
    /// A multi-agent run's environment (then `environment` is `None`).
    joint: Option<LiveEpisodes<MultiAgentEnvironmentPlugin>>,
    callbacks: Arc<CallbackSet>,
    data: Arc<DataPlugins>,
}

impl Services {
    /// Imports and instantiates every plugin the config names except the policy.
    pub async fn load(
        worker: Arc<PythonWorker>,
        loaded: &LoadedConfig,
    ) -> Result<Self, LocalError> {
        let loaded_config = loaded.clone();
        let sandboxed = Scoring::sandboxed(&loaded.config);
        let environment_sandboxed = EpisodeHost::sandboxed(&loaded.config);
        let multi_agent = loaded.config.multi_agent();
        let (data, rewards, environment, joint, callbacks) = worker
            .run(move |py| -> Result<_, LocalError> {
                seed_once(py, loaded_config.config.run.seed)?;
                let sdk = Sdk::import(py)?;
                let data = DataPlugins::load(py, &loaded_config)?;
                let rewards = (!sandboxed)
                    .then(|| RewardSet::load(py, &loaded_config, sdk.clone()))
                    .transpose()?;
                let environment = if environment_sandboxed || multi_agent {
                    None
                } else {
                    EnvironmentPlugin::load(py, &loaded_config)?
                };
                let joint = MultiAgentEnvironmentPlugin::load(py, &loaded_config)?;
                let callbacks = CallbackSet::load(py, &loaded_config, sdk)?;
                Ok((data, rewards, environment, joint, callbacks))
            })
            .await??;
        // Every sample counts once toward the sandbox's failure limits.
        let ledger = Arc::new(FailureLedger::new(environment_sandboxed));
        let rewards = Scoring::new(&worker, loaded, rewards, ledger.clone()).await?;
        let environment = EpisodeHost::new(&worker, loaded, environment, ledger).await?;
        Ok(Services {
            worker,
            rewards,
            environment,
            joint: joint.map(LiveEpisodes::new),
            callbacks: Arc::new(callbacks),
            data: Arc::new(data),
        })
    }

    /// The multi-agent environment's episodes, in a run with `[agents]`.
    pub fn multi_agent(&self) -> Option<&dyn MultiAgentEnvironments> {
        self.joint
            .as_ref()
            .map(|_| self as &dyn MultiAgentEnvironments)
    }

    pub fn has_environment(&self) -> bool {
        self.environment.is_some()
    }

    pub fn reward_names(&self) -> Vec<String> {
        self.rewards.names()
    }

    /// Every data record, through the transforms.
    pub async fn records(&self) -> Result<Vec<Record>, RoleError> {
        let data = self.data.clone();
        Ok(self.worker.run(move |py| data.records(py)).await??)
    }
}

impl Scorer for Services {
    fn score(&self, request: ScoreRequest) -> RoleFuture<'_, ScoreResponse> {
        let samples = request.samples.len();
        traced(
            move || tracing::info_span!("rewards.score", samples),
            self.rewards.score(&self.worker, request),
        )
    }
}

impl Environments for Services {
    fn start(
        &self,
        first_id: u64,
        starts: Vec<EpisodeStart>,
    ) -> RoleFuture<'_, Vec<EpisodeResult<String>>> {
        let episodes = starts.len();
        let span = move || tracing::info_span!("env.start", episodes);
        traced(span, async move {
            match &self.environment {
                Some(host) => host.start(&self.worker, first_id, starts).await,
                None => Ok(Vec::new()),
            }
        })
    }

    fn step(&self, actions: Vec<(u64, String)>) -> RoleFuture<'_, Vec<EpisodeResult<StepOutcome>>> {
        let episodes = actions.len();
        let span = move || tracing::info_span!("env.step", episodes);
        traced(span, async move {
            match &self.environment {
                Some(host) => host.step(&self.worker, actions).await,
                None => Ok(Vec::new()),
            }
        })
    }

    fn finish(&self, ids: Vec<u64>) -> RoleFuture<'_, ()> {
        traced(|| tracing::info_span!("env.finish"), async move {
            match &self.environment {
                Some(host) => host.finish(&self.worker, ids).await,
                None => Ok(()),
            }
        })
    }
}

impl MultiAgentEnvironments for Services {
    fn start(&self, first_id: u64, starts: Vec<EpisodeStart>) -> RoleFuture<'_, Vec<AgentTurn>> {
        let episodes = starts.len();
        let span = move || tracing::info_span!("env.start", episodes);
        traced(span, async move {
            match &self.joint {
                Some(joint) => joint.start(&self.worker, first_id, starts).await,
                None => Ok(Vec::new()),
            }
        })
    }

    fn step(&self, actions: Vec<(u64, String)>) -> RoleFuture<'_, Vec<JointOutcome>> {
        let episodes = actions.len();
        let span = move || tracing::info_span!("env.step", episodes);
        traced(span, async move {
            match &self.joint {
                Some(joint) => joint.step(&self.worker, actions).await,
                None => Ok(Vec::new()),
            }
        })
    }

    fn finish(&self, ids: Vec<u64>) -> RoleFuture<'_, ()> {
        traced(|| tracing::info_span!("env.finish"), async move {
            match &self.joint {
                Some(joint) => joint.finish(&self.worker, ids).await,
                None => Ok(()),
            }
        })
    }
}

type Notify<'a> = Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

impl Services {
    fn notify(
        &self,
        hook: &'static str,
        event: impl for<'py> FnOnce(pyo3::Python<'py>, &CallbackSet) + Send + 'static,
    ) -> Notify<'_> {
        let callbacks = self.callbacks.clone();
        Box::pin(async move {
            let run = self.worker.run(move |py| event(py, &callbacks));
            if let Err(err) = run.instrument(tracing::info_span!("callbacks", hook)).await {
                tracing::error!("callbacks could not run: {err}");
            }
        })
    }
}

impl Observer for Services {
    fn run_started(&self, info: RunStarted) -> Notify<'_> {
        self.notify("on_run_start", move |py, callbacks| {
            callbacks.on_run_start(py, &info)
        })
    }

    fn step_ended(&self, step: u64, metrics: serde_json::Value) -> Notify<'_> {
        self.notify("on_step_end", move |py, callbacks| {
            callbacks.on_step_end(py, step, &metrics)
        })
    }

    fn checkpoint_written(&self, step: u64, path: PathBuf) -> Notify<'_> {
        self.notify("on_checkpoint", move |py, callbacks| {
            callbacks.on_checkpoint(py, step, &path)
        })
    }

    fn run_ended(&self, summary: serde_json::Value) -> Notify<'_> {
        self.notify("on_run_end", move |py, callbacks| {
            callbacks.on_run_end(py, &summary)
        })
    }
}
