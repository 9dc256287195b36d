//! A policy plugin as the generator, learner and tokenizer of a run.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use rollout_core::cluster::buckets::{ExportedVersion, Serving};
use rollout_core::cluster::weights::VersionBuffer;
use rollout_core::config::{ClusterConfig, KeyPath, LoadedConfig, PluginConfig, TrainConfig};
use rollout_core::roles::{
    Generator, Learner, Publication, RoleError, RoleFuture, SaveWritten, Tokenizer,
};
use rollout_core::train::write_files;
use rollout_net::messages::{
    GenerateRequest, GenerateResponse, TrainRequest, TrainResponse, ValuesRequest, ValuesResponse,
    WeightsReport,
};
use tracing::Instrument;

use super::{boxed, seed_once, traced};
use crate::HostError;
use crate::interpreter::{PythonError, PythonWorker};
use crate::paged_generator::PagedGenerator;
use crate::plugins::{GenerationEnginePlugin, PolicyPlugin};

/// The policy plugin of a run, its sampling engine and the version of its weights.
pub struct PolicyHost {
    worker: Arc<PythonWorker>,
    policy: Arc<PolicyPlugin>,
    /// The sampling engine, when the policy can run in it and it is enabled.
    engine: Option<PagedGenerator>,
    /// The generation engine plugin sampling in its place (`[engine] backend`), if any.
    backend: Option<Arc<GenerationEnginePlugin>>,
    eos_token_ids: Vec<u32>,
    weight_version: Arc<AtomicU64>,
    /// Whether an import of arriving weights began and the whole version is not yet served.
    torn: AtomicBool,
}

impl PolicyHost {
    /// Imports and instantiates the config's policy, and the generation backend it samples
    /// with.
    pub async fn load(worker: Arc<PythonWorker>, loaded: &LoadedConfig) -> Result<Self, HostError> {
        let policy = loaded.config.policy.clone();
        let host =
            Self::load_policy(worker, loaded, KeyPath::default().key("policy"), policy).await?;
        host.with_backend(loaded).await
    }

    /// [`PolicyHost::load`] for a process that only trains: no generation backend is
    /// loaded (a trainer rank of `rollout launch`, the learner of an overlapped run).
    pub async fn load_learner(
        worker: Arc<PythonWorker>,
        loaded: &LoadedConfig,
    ) -> Result<Self, HostError> {
        let policy = loaded.config.policy.clone();
        Self::load_policy(worker, loaded, KeyPath::default().key("policy"), policy).await
    }

    /// Loads `[engine] backend`'s generation engine, which then samples instead of Rollout's
    /// engine, with the policy's current weights.
    async fn with_backend(mut self, loaded: &LoadedConfig) -> Result<Self, HostError> {
        let Some(spec) = loaded.config.engine.backend.plugin() else {
            return Ok(self);
        };
        let loaded_config = loaded.clone();
        let backend = self
            .worker
            .run(move |py| GenerationEnginePlugin::load(py, &loaded_config, spec))
            .instrument(tracing::info_span!("engine.load", backend = spec))
            .await??;
        tracing::info!("generation samples with `{spec}`");
        self.backend = Some(Arc::new(backend));
        Ok(self)
    }

    /// Imports and instantiates `policy`, configured at `key` (an agent's, or `[policy]`).
    pub async fn load_policy(
        worker: Arc<PythonWorker>,
        loaded: &LoadedConfig,
        key: KeyPath,
        policy: PluginConfig,
    ) -> Result<Self, HostError> {
        let loaded_config = loaded.clone();
        let policy = worker
            .run(move |py| -> Result<_, HostError> {
                seed_once(py, loaded_config.config.run.seed)?;
                Ok(PolicyPlugin::load(py, &loaded_config, &key, &policy)?)
            })
            .await??;
        let policy = Arc::new(policy);
        let eos_source = policy.clone();
        let eos_token_ids = worker
            .run(move |py| eos_source.eos_token_ids(py))
            .await?
            .map_err(RoleError::from)?;
        // A generation backend (`[engine] backend`) samples in place of Rollout's engine.
        let rollout_samples = loaded.config.engine.backend.plugin().is_none();
        let engine = if loaded.config.engine.enabled && rollout_samples {
            PagedGenerator::start(&worker, policy.clone(), &loaded.config.engine).await?
        } else {
            None
        };
        Ok(PolicyHost {
            worker,
            policy,
            engine,
            backend: None,
            eos_token_ids,
            weight_version: Arc::new(AtomicU64::new(0)),
            torn: AtomicBool::new(false),
        })
    }

    /// Whether generation runs in an engine (Rollout's or a backend's), else in the
    /// policy's `generate`.
    pub fn uses_engine(&self) -> bool {
        self.engine.is_some() || self.backend.is_some()
    }

    pub async fn describe(&self) -> Result<serde_json::Value, RoleError> {
        let policy = self.policy.clone();
        Ok(self.worker.run(move |py| policy.describe(py)).await??)
    }

    pub fn spec(&self) -> &str {
        self.policy.spec()
    }

    /// How many token ids the policy takes (see `PolicyPlugin::vocabulary`).
    pub fn vocabulary(&self) -> u64 {
        self.policy.vocabulary()
    }

    pub fn weight_version(&self) -> u64 {
        self.weight_version.load(Ordering::SeqCst)
    }

    /// Joins the trainers' process group (see `rollout_sdk.distributed`): `train` then
    /// all-reduces gradients before each update, or the policy is sharded across the group.
    pub async fn join_data_parallel(
        &self,
        rank: u32,
        world_size: u32,
        cluster: ClusterConfig,
        train: TrainConfig,
    ) -> Result<(), RoleError> {
        let policy = self.policy.clone();
        Ok(self
            .worker
            .run(move |py| policy.join_data_parallel(py, rank, world_size, &cluster, &train))
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

    /// The current weights as a version cut into buckets of about `bucket_bytes`. To serve
    /// it, pass `serving`, with an earlier version's bucket allocations (see
    /// [`rollout_core::cluster::weights::VersionBuffer::into_allocations`]); it is then
    /// reported before its checksum is known, with a buffer that seals once every bucket is
    /// hashed. Copied, the buckets are filled by the next job on the interpreter, so the
    /// weights do not change meanwhile; in place, they are sent from the weights, which the
    /// policy copies before it next changes them (see [`PolicyPlugin::export_version`]).
    pub async fn export_weights(
        &self,
        bucket_bytes: u64,
        serving: Option<Serving>,
    ) -> Result<ExportedVersion, RoleError> {
        let policy = self.policy.clone();
        let version = self.weight_version();
        let (report, reported) = tokio::sync::oneshot::channel();
        let span = tracing::info_span!("weights.export", version);
        self.worker.run_detached(move |py| {
            policy.export_version(py, version, bucket_bytes, serving, |exported| {
                let _ = report.send(exported);
            });
        })?;
        let exported = reported
            .instrument(span)
            .await
            .map_err(|_| PythonError::WorkerGone)??;
        Ok(exported)
    }

    /// Frees the device memory generation holds (colocated with trainers), until
    /// [`PolicyHost::restore_memory`].
    pub async fn release_memory(&self) -> Result<(), RoleError> {
        let policy = self.policy.clone();
        let backend = self.backend.clone();
        Ok(self
            .worker
            .run(move |py| {
                policy.release_memory(py)?;
                backend.map_or(Ok(()), |backend| backend.release_memory(py))
            })
            .instrument(tracing::info_span!("policy.release_memory"))
            .await??)
    }

    /// Takes back the memory [`PolicyHost::release_memory`] freed; the KV cache comes back
    /// empty, so no cached prefix is reused.
    pub async fn restore_memory(&self) -> Result<(), RoleError> {
        let policy = self.policy.clone();
        let backend = self.backend.clone();
        self.worker
            .run(move |py| {
                policy.restore_memory(py)?;
                backend.map_or(Ok(()), |backend| backend.restore_memory(py))
            })
            .instrument(tracing::info_span!("policy.restore_memory"))
            .await??;
        if let Some(engine) = &self.engine {
            engine.forget_cached_prefixes().await;
        }
        Ok(())
    }

    /// Imports a pulled (and verified) weight version, its tensors viewing the received
    /// bytes. Runs as one job on the interpreter thread, so it falls between two engine
    /// steps, never inside one. From here until [`PolicyHost::serve_version`] the weights may
    /// be part of one version, part of another (if the policy's import fails midway), and
    /// generation refuses to run (a worker holds the generations that arrive meanwhile until
    /// a whole version is swapped in).
    pub async fn import_version(&self, version: &VersionBuffer) -> Result<(), RoleError> {
        let tensors = version
            .tensors()
            .map_err(|err| RoleError::Protocol(err.to_string()))?;
        self.torn.store(true, Ordering::SeqCst);
        let policy = self.policy.clone();
        let backend = self.backend.clone();
        // A backend samples with weights of its own: the policy's are not used to generate.
        self.worker
            .run(move |py| match backend {
                Some(backend) => backend.load_received(py, tensors),
                None => policy.import_received(py, tensors),
            })
            .instrument(tracing::info_span!("weights.import"))
            .await??;
        Ok(())
    }

    /// Whether the weights are one whole version: not after an import that failed midway,
    /// until a later import is served.
    pub fn serves_whole_version(&self) -> bool {
        !self.torn.load(Ordering::SeqCst)
    }

    /// The weights imported last are the whole of `version`, verified: generation may use
    /// them.
    pub fn serve_version(&self, version: u64) {
        self.weight_version.store(version, Ordering::SeqCst);
        self.torn.store(false, Ordering::SeqCst);
    }
}

impl Generator for PolicyHost {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let policy = self.policy.clone();
        let version = self.weight_version.load(Ordering::SeqCst);
        let prompts = request.prompts.len();
        let span = move || tracing::info_span!("policy.generate", prompts, version);
        traced(span, async move {
            if self.torn.load(Ordering::SeqCst) {
                return Err(RoleError::Protocol(
                    "this worker's weights are part of a version whose import failed; it \
                     generates again once a whole version is imported"
                        .into(),
                ));
            }
            if let Some(engine) = &self.engine {
                return engine
                    .generate(&self.worker, &policy, request, &self.eos_token_ids, version)
                    .await;
            }
            if let Some(backend) = self.backend.clone() {
                let eos = self.eos_token_ids.clone();
                return Ok(self
                    .worker
                    .run(move |py| backend.generate(py, &policy, &request, &eos, version))
                    .await??);
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

    /// In one process generation and training share the model: nothing to load, but for
    /// a generation backend, which gets the learner's weights.
    fn load_weights(&self, weights: Publication) -> RoleFuture<'_, Vec<WeightsReport>> {
        boxed(async move {
            let report = weights.sealed.await?;
            if let Some(backend) = self.backend.clone() {
                let policy = self.policy.clone();
                self.worker
                    .run(move |py| backend.load_from_policy(py, &policy))
                    .instrument(tracing::info_span!("weights.import", backend = true))
                    .await??;
            }
            Ok(vec![report])
        })
    }
}

impl Learner for PolicyHost {
    fn train(&self, request: TrainRequest) -> RoleFuture<'_, TrainResponse> {
        let policy = self.policy.clone();
        traced(|| tracing::info_span!("policy.train"), async move {
            let (metrics, excluded) = self
                .worker
                .run(move |py| policy.train(py, &request))
                .await??;
            let weight_version = self.weight_version.fetch_add(1, Ordering::SeqCst) + 1;
            Ok(TrainResponse {
                metrics,
                weight_version,
                excluded,
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
    fn publish_weights(&self, bucket_bytes: u64) -> RoleFuture<'_, Publication> {
        traced(|| tracing::info_span!("policy.publish"), async move {
            let exported = self.export_weights(bucket_bytes, None).await?;
            let checksum = exported.checksum.ok_or_else(|| {
                RoleError::Protocol(
                    "a version exported to no puller came without its checksum".into(),
                )
            })?;
            Ok(Publication::sealed(WeightsReport {
                version: exported.version,
                checksum,
                bytes: exported.bytes,
                source: String::new(),
                holder: "local".into(),
            }))
        })
    }

    /// Only a generation backend holds weights of its own.
    fn needs_weight_sync(&self) -> bool {
        self.backend.is_some()
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
