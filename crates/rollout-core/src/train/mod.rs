//! The controller: the training loop that drives every role.
//!
//! One loop runs every kind of run ([`Controller::run`]): it resumes, asks the run's kind for
//! its next step, then ends the step the same way whatever the kind (state, `metrics.jsonl`,
//! observers, checkpoints). What differs is how a step is made ([`steps`]):
//!
//! - an RL step of one policy draws prompts, samples `group_size` completions per prompt
//!   (single-turn, or episodes against an environment), scores them, turns rewards into group
//!   advantages and trains on token-budget micro-batches, while later steps are sampled
//!   within `max_staleness` ([`rl_step`]);
//! - an SFT or DPO step trains on the data's own completions ([`offline`]);
//! - a multi-agent step plays episodes in which several agents take turns and trains each
//!   agent on its own turns ([`team`]).

mod advantage;
mod checkpoint;
mod cursor;
mod micro_batches;
mod offline;
mod outcome;
mod packing;
mod pipeline;
mod ppo;
mod refill;
mod requeue;
mod rl_step;
mod run_output;
mod sampler;
pub mod screen;
mod sft;
mod stale;
mod state;
mod step_logs;
mod step_report;
mod steps;
mod team;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde_json::{Value, json};
use tracing::Instrument;

use crate::config::Config;
use crate::metrics::StepMetrics;
use crate::roles::{
    Environments, Generator, Learner, MultiAgentEnvironments, Observer, Record, RoleError,
    RunStarted, Scorer, Tokenizer,
};
use crate::seeds::mix;

pub use advantage::group_advantages;
pub use checkpoint::{
    Checkpoint, CheckpointError, CheckpointStore, SnapshotFile, SnapshotFiles, verify, write_files,
};
pub use cursor::DataCursor;
pub use micro_batches::{PackingStats, TrainSequence, laid_out_micro_batches, micro_batches};
pub use packing::{pack_by_token_budget, padded_tokens};
pub use requeue::Requeued;
pub use state::{DataPosition, RunState};
pub use step_logs::MetricsLog;

use checkpoint::{CheckpointTimes, CheckpointWrite};
use sampler::{Sampler, Trajectory};
use step_logs::StepLogs;
use steps::StepDone;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Role(#[from] RoleError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("{context} {}: {source}", path.display())]
    Io {
        context: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{} already holds a run ({what}); pass --resume to continue it or --overwrite to start over",
        dir.display()
    )]
    OutputExists { dir: PathBuf, what: String },
    #[error("{0}")]
    Data(String),
    #[error("interrupted; the last checkpoint is {}", checkpoint.as_deref().map_or("none".into(), |p| p.display().to_string()))]
    Interrupted { checkpoint: Option<PathBuf> },
}

/// How `rollout run` treats an existing output directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Start {
    /// Refuse to touch an output directory that already holds a run.
    #[default]
    Fresh,
    /// Continue from the newest valid checkpoint (from scratch when there is none).
    Resume,
    /// Delete the previous run's metrics and checkpoints first.
    Overwrite,
}

/// The roles of a run that trains one policy: the policy's (in one process, one object
/// generates, learns and tokenizes) and what scores its samples.
#[derive(Clone, Copy)]
pub struct PolicyRoles<'a> {
    pub generator: &'a dyn Generator,
    pub learner: &'a dyn Learner,
    pub tokenizer: &'a dyn Tokenizer,
    pub scorer: &'a dyn Scorer,
    /// Multi-turn runs: the environment the policy's episodes are played against.
    pub environments: Option<&'a dyn Environments>,
}

/// One agent of a multi-agent run: its policy's roles and learning rate.
pub struct Agent<'a> {
    pub name: String,
    pub generator: &'a dyn Generator,
    pub learner: &'a dyn Learner,
    pub tokenizer: &'a dyn Tokenizer,
    pub learning_rate: f64,
}

/// The agents of a multi-agent run and the environment they take turns in.
pub struct Team<'a> {
    pub agents: Vec<Agent<'a>>,
    pub environments: &'a dyn MultiAgentEnvironments,
}

/// What a run trains.
#[derive(Clone, Copy)]
pub enum Trainees<'a> {
    /// One policy.
    Policy(PolicyRoles<'a>),
    /// Several agents (`[agents.NAME]`).
    Team(&'a Team<'a>),
}

/// The roles a run drives.
#[derive(Clone, Copy)]
pub struct Roles<'a> {
    pub trainees: Trainees<'a>,
    pub observer: &'a dyn Observer,
}

/// What a finished (or interrupted) run reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub steps_completed: u64,
    pub first_rewards_mean: Option<f64>,
    pub last_rewards_mean: Option<f64>,
    pub checkpoint: Option<PathBuf>,
    pub wall_seconds: f64,
}

/// Steps averaged at each end of the run for the summary.
const SUMMARY_WINDOW: usize = 10;

/// What `rollout generate` produced: the completions, their texts (flattened in request
/// order) and the wall time of the generation request.
#[derive(Debug, Clone)]
pub struct Generated {
    pub response: rollout_net::messages::GenerateResponse,
    pub texts: Vec<String>,
    pub seconds: f64,
}

/// What `rollout check` samples: one group of the first prompt, scored.
#[derive(Debug, Clone, PartialEq)]
pub struct DryRun {
    pub completions: Vec<String>,
    pub rewards: Vec<f64>,
    pub generated_tokens: usize,
    pub seconds: f64,
}

/// How a run's steps are made: sampled by one policy, or played by a team.
enum Kind<'a> {
    Policy(Sampler<'a>),
    Team(&'a Team<'a>),
}

pub struct Controller<'a> {
    config: &'a Config,
    kind: Kind<'a>,
    observer: &'a dyn Observer,
    records: Arc<Vec<Record>>,
    store: CheckpointStore,
    state: RunState,
    interrupted: Arc<AtomicBool>,
    last_checkpoint: Option<PathBuf>,
    /// The checkpoint being written in the background, if any.
    writing: Option<CheckpointWrite>,
    checkpoint_times: CheckpointTimes,
}

impl<'a> Controller<'a> {
    pub fn new(
        config: &'a Config,
        roles: Roles<'a>,
        records: Vec<Record>,
        interrupted: Arc<AtomicBool>,
    ) -> Self {
        let records = Arc::new(records);
        let kind = match roles.trainees {
            Trainees::Policy(policy) => Kind::Policy(Sampler {
                config,
                roles: policy,
                records: records.clone(),
                prompt_ids: Arc::default(),
                budgets: Arc::default(),
            }),
            Trainees::Team(team) => Kind::Team(team),
        };
        Controller {
            config,
            kind,
            observer: roles.observer,
            records,
            store: CheckpointStore::new(
                config.run.output_dir.join("checkpoints"),
                config.checkpoint.keep,
            ),
            state: RunState::new(config.run.seed),
            interrupted,
            last_checkpoint: None,
            writing: None,
            checkpoint_times: CheckpointTimes::default(),
        }
    }

    fn output(&self, name: &str) -> PathBuf {
        self.config.run.output_dir.join(name)
    }

    pub async fn run(&mut self, start: Start) -> Result<Summary, RunError> {
        let started = Instant::now();
        run_output::prepare_output(self.config, start)?;
        let resumed = start == Start::Resume && self.resume().await?;
        let trained = self.train(resumed, started).await;
        if let Err(err) = self.checkpoint_settled().await {
            if trained.is_ok() {
                return Err(err);
            }
            tracing::warn!("the checkpoint being written when the run failed is lost: {err}");
        }
        trained?;
        let checkpoint_is_current = self
            .last_checkpoint
            .as_ref()
            .is_some_and(|dir| dir.ends_with(format!("step-{:08}", self.state.step)));
        if !checkpoint_is_current && (self.state.step > 0 || self.state.sft_step > 0) {
            self.final_checkpoint().await?;
            self.checkpoint_settled().await?;
        }
        let summary = Summary::of(&self.state, self.last_checkpoint.clone(), started);
        self.write_summary(&summary)?;
        if self.stopping() {
            return Err(RunError::Interrupted {
                checkpoint: self.last_checkpoint.clone(),
            });
        }
        Ok(summary)
    }

    /// The steps of the run (and the warm start before them), checkpointing when due.
    async fn train(&mut self, resumed: bool, started: Instant) -> Result<(), RunError> {
        let mut logs = StepLogs::open(self.config, resumed.then_some(self.state.step))?;
        if resumed {
            for generator in self.generators() {
                generator.resumed_from(self.state.step).await?;
            }
        }
        if let Kind::Policy(sampler) = &mut self.kind {
            sampler.prepare(usize::MAX).await?;
        }
        tracing::info!(
            "run `{}`: {} RL steps from step {}, output in {}",
            self.config.run.name,
            self.config.run.steps,
            self.state.step,
            self.config.run.output_dir.display()
        );
        self.observer
            .run_started(RunStarted {
                name: self.config.run.name.clone(),
                output_dir: self.config.run.output_dir.clone(),
                total_steps: self.config.run.steps,
                start_step: self.state.step,
                config: serde_json::to_value(self.config).unwrap_or(Value::Null),
            })
            .await;
        let mut steps = self.steps(resumed).await?;
        while self.state.step < self.config.run.steps && !self.stopping() {
            let Some(done) = self.next_step(&mut steps).await? else {
                break;
            };
            self.step_ended(done, started, &mut logs).await?;
        }
        steps.finish().await
    }

    /// What every step shares at its end: the run state, the step's lines in
    /// `metrics.jsonl` (and `samples.jsonl`), the observers, and a checkpoint when due.
    async fn step_ended(
        &mut self,
        done: StepDone,
        started: Instant,
        logs: &mut StepLogs,
    ) -> Result<(), RunError> {
        let StepDone {
            mut metrics,
            position,
            requeued,
            samples,
            span,
        } = done;
        metrics.elapsed_seconds = started.elapsed().as_secs_f64();
        let step = metrics.step;
        if metrics.weight_version < self.state.weight_version {
            return Err(RoleError::Protocol(format!(
                "step {step}: the trainer answered with weight version {}, older than the {} \
                 it already had",
                metrics.weight_version, self.state.weight_version
            ))
            .into());
        }
        self.state.step = step;
        self.state.data = position;
        self.state.requeued = requeued;
        self.state.weight_version = metrics.weight_version;
        if let Some(reward) = metrics.reward_mean {
            self.state.reward_history.push(reward);
        }
        logs.append(&metrics, &samples)?;
        self.observer
            .step_ended(metrics)
            .instrument(span.clone())
            .await;
        self.reap_checkpoint().instrument(span.clone()).await?;
        let every = self.config.checkpoint.every;
        if every > 0 && step % every == 0 {
            if step >= self.config.run.steps {
                self.final_checkpoint().instrument(span).await?;
            } else {
                self.checkpoint().instrument(span).await?;
            }
        }
        Ok(())
    }

    /// Every generator of the run (one per agent in a multi-agent run).
    fn generators(&self) -> Vec<&'a dyn Generator> {
        match &self.kind {
            Kind::Policy(sampler) => vec![sampler.roles.generator],
            Kind::Team(team) => team.agents.iter().map(|agent| agent.generator).collect(),
        }
    }

    /// Every learner of the run, with the directory of its checkpoint within the
    /// checkpoint's `policy/` (`policy/<agent>/` in a multi-agent run).
    fn learners(&self) -> Vec<(Option<&'a str>, &'a dyn Learner)> {
        match &self.kind {
            Kind::Policy(sampler) => vec![(None, sampler.roles.learner)],
            Kind::Team(team) => team
                .agents
                .iter()
                .map(|agent| (Some(agent.name.as_str()), agent.learner))
                .collect(),
        }
    }

    /// Versions a trained sample may lag: 0 unless generators hold their own weights.
    fn max_staleness(&self) -> u64 {
        match &self.kind {
            Kind::Policy(sampler) if sampler.roles.learner.needs_weight_sync() => {
                self.config.cluster.max_staleness
            }
            _ => 0,
        }
    }

    fn stopping(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }

    /// Restores every learner from the newest valid checkpoint; false when there is none.
    async fn resume(&mut self) -> Result<bool, RunError> {
        let Some(checkpoint) = self.store.latest_valid()? else {
            tracing::info!("no checkpoint to resume from; starting from scratch");
            return Ok(false);
        };
        if checkpoint.state.seed != self.config.run.seed {
            tracing::warn!(
                "resuming a run seeded {} with run.seed = {}; the data order continues from the checkpoint's seed",
                checkpoint.state.seed,
                self.config.run.seed
            );
        }
        for (agent, learner) in self.learners() {
            let directory = match agent {
                None => checkpoint.policy_dir(),
                Some(agent) => checkpoint.policy_dir().join(agent),
            };
            if let Some(agent) = agent.filter(|_| !directory.is_dir()) {
                return Err(RunError::Data(format!(
                    "{} holds no policy of agent `{agent}`: the checkpoint was written by a \
                     run with other [agents]",
                    checkpoint.dir.display(),
                )));
            }
            learner
                .restore(directory, checkpoint.state.weight_version)
                .instrument(tracing::info_span!("resume", step = checkpoint.state.step))
                .await?;
        }
        tracing::info!(
            "resumed from {} (step {}, weight version {})",
            checkpoint.dir.display(),
            checkpoint.state.step,
            checkpoint.state.weight_version
        );
        self.state = checkpoint.state;
        self.last_checkpoint = Some(checkpoint.dir);
        Ok(true)
    }

    /// The run's single policy, for what only a single-policy run does.
    fn sampler(&self, what: &str) -> Result<&Sampler<'a>, RunError> {
        match &self.kind {
            Kind::Policy(sampler) => Ok(sampler),
            Kind::Team(_) => Err(RunError::Data(format!(
                "{what} drives one policy; this run has [agents]"
            ))),
        }
    }

    /// Samples and scores the first prompt's group without training, for `rollout check`.
    pub async fn dry_run(&mut self) -> Result<DryRun, RunError> {
        let seed = mix(self.config.run.seed, 999);
        let mut sampler = self.sampler("a dry run")?.clone();
        sampler.prepare(1).await?;
        let collected = sampler.collect(0, &[0], seed).await?;
        let generated_tokens = collected
            .trajectories
            .iter()
            .map(Trajectory::generated_tokens)
            .sum();
        Ok(DryRun {
            completions: collected.completions,
            rewards: collected.rewards,
            generated_tokens,
            seconds: collected.generate_seconds + collected.score_seconds,
        })
    }

    /// Completes the first `limit` records (all when `None`) `group_size` times each in one
    /// generation request, without training: for evaluation and generation benchmarks.
    pub async fn generate_all(&mut self, limit: Option<usize>) -> Result<Generated, RunError> {
        let mut sampler = self.sampler("`rollout generate`")?.clone();
        let count = limit.unwrap_or(self.records.len()).min(self.records.len());
        sampler.prepare(count).await?;
        let records: Vec<usize> = (0..count).collect();
        let started = Instant::now();
        let request = sampler.generate_request(0, &records, 0, mix(self.config.run.seed, 998));
        let response = sampler.roles.generator.generate(request).await?;
        let seconds = started.elapsed().as_secs_f64();
        let flat: Vec<Vec<u32>> = response
            .groups
            .iter()
            .flatten()
            .map(|c| c.token_ids.clone())
            .collect();
        let texts = sampler.roles.tokenizer.decode(flat).await?;
        Ok(Generated {
            response,
            texts,
            seconds,
        })
    }

    fn write_summary(&self, summary: &Summary) -> Result<(), RunError> {
        let mut extra = json!({
            "checkpoints_written": self.checkpoint_times.written,
            "checkpoint_blocked_seconds": self.checkpoint_times.blocked_seconds,
            "checkpoint_write_seconds": self.checkpoint_times.write_seconds,
        });
        if let (Kind::Team(team), Some(fields)) = (&self.kind, extra.as_object_mut()) {
            let agents: Vec<&str> = team.agents.iter().map(|a| a.name.as_str()).collect();
            fields.insert("agents".into(), json!(agents));
        }
        summary.write(self.config, self.stopping(), extra)
    }

    /// Tells the observers the run ended (also after an interruption).
    pub async fn finish(&self, summary: Option<&Summary>) {
        let ended = Summary::ended(&self.state, self.stopping(), summary, &self.last_checkpoint);
        self.observer.run_ended(ended).await;
    }
}

/// A step's metrics with what every step reports set, the rest to be filled in.
fn step_metrics(step: u64, epoch: u64, weight_version: u64, step_seconds: f64) -> StepMetrics {
    StepMetrics {
        step,
        epoch,
        weight_version,
        step_seconds,
        ..StepMetrics::default()
    }
}

fn io_error(context: &'static str, path: &Path, source: std::io::Error) -> RunError {
    RunError::Io {
        context,
        path: path.to_path_buf(),
        source,
    }
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

fn std_dev(values: &[f64]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let m = mean(values);
    (values.iter().map(|v| (v - m).powi(2)).sum::<f64>() / values.len() as f64).sqrt()
}
