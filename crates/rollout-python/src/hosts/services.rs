//! The run's rewards, environments, data and callbacks as roles.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use rollout_core::config::LoadedConfig;
use rollout_core::metrics::StepMetrics;
use rollout_core::roles::{
    AgentTurn, Environments, EpisodeResult, EpisodeStart, JointOutcome, MultiAgentEnvironments,
    Observer, Record, RoleError, RoleFuture, RunStarted, Scorer, StepResult,
};
use rollout_core::sandbox::FailureLedger;
use rollout_net::messages::{ScoreRequest, ScoreResponse};
use tracing::Instrument;

use super::episodes::EpisodeHost;
use super::live_episodes::LiveEpisodes;
use super::scoring::Scoring;
use super::{seed_once, traced};
use crate::HostError;
use crate::interpreter::PythonWorker;
use crate::plugins::{
    CallbackSet, DataPlugins, EnvironmentPlugin, MultiAgentEnvironmentPlugin, RewardSet,
};

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
    pub async fn load(worker: Arc<PythonWorker>, loaded: &LoadedConfig) -> Result<Self, HostError> {
        let loaded_config = loaded.clone();
        let sandboxed = loaded.config.rewards_sandboxed();
        let environment_sandboxed = loaded.config.environment_sandboxed();
        let multi_agent = loaded.config.multi_agent();
        let (data, rewards, environment, joint, callbacks) = worker
            .run(move |py| -> Result<_, HostError> {
                seed_once(py, loaded_config.config.run.seed)?;
                let data = DataPlugins::load(py, &loaded_config)?;
                let rewards = (!sandboxed)
                    .then(|| RewardSet::load(py, &loaded_config))
                    .transpose()?;
                let environment = if environment_sandboxed || multi_agent {
                    None
                } else {
                    EnvironmentPlugin::load(py, &loaded_config)?
                };
                let joint = MultiAgentEnvironmentPlugin::load(py, &loaded_config)?;
                let callbacks = CallbackSet::load(py, &loaded_config)?;
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

    fn step(&self, actions: Vec<(u64, String)>) -> RoleFuture<'_, Vec<EpisodeResult<StepResult>>> {
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

    fn step_ended(&self, metrics: StepMetrics) -> Notify<'_> {
        self.notify("on_step_end", move |py, callbacks| {
            callbacks.on_step_end(py, &metrics)
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
