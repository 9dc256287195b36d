//! The controller: the training loop that drives every role.
//!
//! Each RL step draws prompts, samples `group_size` completions per prompt (single-turn, or
//! episodes against an environment), scores them, turns rewards into group advantages,
//! packs the sequences into token-budget micro-batches, applies one optimizer update, logs
//! one metrics line and checkpoints when due.

mod advantage;
mod batch;
mod batching;
mod checkpoint;
mod checkpointing;
mod cursor;
mod metrics;
mod multi_agent;
mod offline;
mod pipeline;
mod ppo;
mod refill;
mod rl_step;
mod run_output;
mod sampler;
mod sft;
mod snapshot;
mod state;
mod step_report;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde_json::{Value, json};
use tracing::Instrument;

use crate::config::Config;
use crate::plugins::Record;
use crate::roles::{
    Environments, Generator, Learner, Observer, RoleError, RunStarted, Scorer, Tokenizer,
};

use checkpointing::{CheckpointTimes, CheckpointWrite};
use pipeline::{Pipeline, StepSamples};
use run_output::prepare_output;
use sampler::{Sampler, Trajectory};

pub use advantage::group_advantages;
pub use batch::{PackingStats, TrainSequence, micro_batches};
pub use batching::{pack_by_token_budget, padded_tokens};
pub use checkpoint::{Checkpoint, CheckpointError, CheckpointStore, verify};
pub use cursor::{DataCursor, mix};
pub use metrics::MetricsLog;
use metrics::StepLogs;
pub use multi_agent::{Agent, MultiAgentController, Team};
pub use snapshot::{HostTensor, SnapshotFile, SnapshotFiles, write_files};
pub use state::{DataPosition, RunState};

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

/// The roles a run drives.
#[derive(Clone, Copy)]
pub struct Roles<'a> {
    pub generator: &'a dyn Generator,
    pub scorer: &'a dyn Scorer,
    pub learner: &'a dyn Learner,
    pub tokenizer: &'a dyn Tokenizer,
    pub environments: Option<&'a dyn Environments>,
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

pub struct Controller<'a> {
    config: &'a Config,
    roles: Roles<'a>,
    sampler: Sampler<'a>,
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
        let store = CheckpointStore::new(
            config.run.output_dir.join("checkpoints"),
            config.checkpoint.keep,
        );
        Controller {
            config,
            roles,
            sampler: Sampler {
                config,
                roles,
                records: Arc::new(records),
                prompt_ids: Arc::default(),
                budgets: Arc::default(),
            },
            store,
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
        prepare_output(self.config, start)?;
        let resumed = if start == Start::Resume {
            self.resume().await?
        } else {
            false
        };
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
            self.checkpoint().await?;
            self.checkpoint_settled().await?;
        }
        let summary = self.summary(started);
        self.write_summary(&summary)?;
        if self.stopping() {
            return Err(RunError::Interrupted {
                checkpoint: self.last_checkpoint.clone(),
            });
        }
        Ok(summary)
    }

    /// The warm start, if any, and the RL steps, checkpointing when due.
    async fn train(&mut self, resumed: bool, started: Instant) -> Result<(), RunError> {
        let mut logs = StepLogs::open(self.config, resumed.then_some(self.state.step))?;
        if resumed {
            self.roles.generator.resumed_from(self.state.step).await?;
        }
        self.sampler.prepare(usize::MAX).await?;
        tracing::info!(
            "run `{}`: {} RL steps from step {}, output in {}",
            self.config.run.name,
            self.config.run.steps,
            self.state.step,
            self.config.run.output_dir.display()
        );
        self.roles
            .observer
            .run_started(RunStarted {
                name: self.config.run.name.clone(),
                output_dir: self.config.run.output_dir.clone(),
                total_steps: self.config.run.steps,
                start_step: self.state.step,
                config: serde_json::to_value(self.config).unwrap_or(Value::Null),
            })
            .await;

        if !self.config.algorithm.name.samples() {
            return self.offline_steps(&mut logs.metrics).await;
        }
        if let Some(sft) = &self.config.sft {
            if self.state.sft_step < sft.steps {
                self.supervised_warm_start(sft, resumed).await?;
                if !self.stopping() {
                    self.checkpoint().await?;
                }
            }
        }
        let mut cursor = DataCursor::new(
            self.sampler.records.len(),
            mix(self.config.run.seed, 1),
            self.config.data.shuffle,
            self.state.data,
        );
        self.sync_generators_now().await?;
        let sampler = self.sampler.clone();
        let mut pipeline = Pipeline::default();
        // Where the data cursor stands after each step's prompts were drawn.
        let mut positions = std::collections::BTreeMap::new();
        let mut next_step = self.state.step + 1;
        let mut last_step_end = Instant::now();
        while self.state.step < self.config.run.steps && !self.stopping() {
            while next_step <= self.config.run.steps
                && next_step <= self.state.step + 1 + self.max_staleness()
            {
                let records = cursor.take(self.prompts_drawn_per_step());
                let position = cursor.position();
                positions.insert(next_step, position);
                let seed = mix(self.config.run.seed, 1000 + next_step);
                let (sampler, step) = (&sampler, next_step);
                // A step's span runs from the start of its sampling (with staleness, while
                // earlier steps train) to the end of its update.
                let span = tracing::info_span!(parent: None, "step", step);
                let sampling = tracing::info_span!(parent: &span, "sample", step);
                pipeline.start(async move {
                    let collected = sampler
                        .collect(step, &records, seed)
                        .instrument(sampling)
                        .await;
                    let records = collected.as_ref().map_or(records, |c| c.records.clone());
                    StepSamples {
                        step,
                        epoch: position.epoch,
                        records,
                        collected,
                        span,
                    }
                });
                next_step += 1;
            }
            let Some(sampled) = pipeline.next_samples().await? else {
                break;
            };
            let step = sampled.step;
            let span = sampled.span.clone();
            let (mut line, logged) = self
                .rl_step(sampled, &mut pipeline, last_step_end)
                .instrument(span.clone())
                .await?;
            last_step_end = Instant::now();
            let pool = self
                .roles
                .generator
                .step_trained(step)
                .instrument(span.clone())
                .await?;
            if let Some(fields) = line.as_object_mut() {
                fields.extend(pool.into_iter().map(|(name, value)| (name, json!(value))));
                fields.insert(
                    "elapsed_seconds".into(),
                    json!(started.elapsed().as_secs_f64()),
                );
            }
            self.state.step = step;
            if let Some(position) = positions.remove(&step) {
                self.state.data = position;
            }
            if let Some(reward) = line.get("reward_mean").and_then(Value::as_f64) {
                self.state.reward_history.push(reward);
            }
            logs.append(&line, &logged)?;
            self.roles
                .observer
                .step_ended(step, line)
                .instrument(span.clone())
                .await;
            self.reap_checkpoint().instrument(span.clone()).await?;
            let every = self.config.checkpoint.every;
            if every > 0 && step % every == 0 {
                self.checkpoint().instrument(span).await?;
            }
        }
        Ok(pipeline.finish_loading().await?)
    }

    /// Records drawn for each step: its prompts and, with dynamic sampling, a reserve of
    /// `prompts_per_step` per refill round, drawn whether used or not so that the data
    /// order never depends on rewards (a resumed run draws exactly the same).
    fn prompts_drawn_per_step(&self) -> usize {
        let rounds = self.config.algorithm.dynamic_sampling_rounds as usize;
        self.config.rollout.prompts_per_step * (1 + rounds)
    }

    /// Versions a trained sample may lag: 0 unless generators hold their own weights.
    fn max_staleness(&self) -> u64 {
        if self.roles.learner.needs_weight_sync() {
            self.config.cluster.max_staleness
        } else {
            0
        }
    }

    /// Brings the generators to the learner's current weights and waits for them (at the
    /// start, after the warm start and after a resume).
    async fn sync_generators_now(&mut self) -> Result<(), RunError> {
        if !self.roles.learner.needs_weight_sync() {
            return Ok(());
        }
        let span = tracing::info_span!("weights.sync");
        let published = self
            .roles
            .learner
            .publish_weights(self.config.cluster.weight_bucket_bytes)
            .instrument(tracing::info_span!(parent: &span, "weights.publish"))
            .await?;
        let served = self
            .roles
            .generator
            .load_weights(published.clone())
            .instrument(
                tracing::info_span!(parent: &span, "weights.load", version = published.version),
            )
            .await?;
        tracing::info!(
            "generators serve weight version {} (checksum {}, {} workers)",
            published.version,
            &published.checksum[..published.checksum.len().min(16)],
            served.len()
        );
        Ok(())
    }

    fn stopping(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }

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
        self.roles
            .learner
            .restore(checkpoint.policy_dir(), checkpoint.state.weight_version)
            .instrument(tracing::info_span!("resume", step = checkpoint.state.step))
            .await?;
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

    /// Samples and scores the first prompt's group without training, for `rollout check`.
    pub async fn dry_run(&mut self) -> Result<DryRun, RunError> {
        self.sampler.prepare(1).await?;
        let collected = self
            .sampler
            .collect(0, &[0], mix(self.config.run.seed, 999))
            .await?;
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
        let total = self.sampler.records.len();
        let count = limit.unwrap_or(total).min(total);
        self.sampler.prepare(count).await?;
        let records: Vec<usize> = (0..count).collect();
        let started = Instant::now();
        let request = self
            .sampler
            .generate_request(0, &records, 0, mix(self.config.run.seed, 998));
        let response = self.roles.generator.generate(request).await?;
        let seconds = started.elapsed().as_secs_f64();
        let flat: Vec<Vec<u32>> = response
            .groups
            .iter()
            .flatten()
            .map(|c| c.token_ids.clone())
            .collect();
        let texts = self.roles.tokenizer.decode(flat).await?;
        Ok(Generated {
            response,
            texts,
            seconds,
        })
    }

    fn summary(&self, started: Instant) -> Summary {
        Summary::of(&self.state, self.last_checkpoint.clone(), started)
    }

    fn write_summary(&self, summary: &Summary) -> Result<(), RunError> {
        let times = json!({
            "checkpoints_written": self.checkpoint_times.written,
            "checkpoint_blocked_seconds": self.checkpoint_times.blocked_seconds,
            "checkpoint_write_seconds": self.checkpoint_times.write_seconds,
        });
        summary.write(self.config, self.stopping(), times)
    }

    /// Tells the observers the run ended (also after an interruption).
    pub async fn finish(&self, summary: Option<&Summary>) {
        let ended = Summary::ended(&self.state, self.stopping(), summary, &self.last_checkpoint);
        self.roles.observer.run_ended(ended).await;
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
