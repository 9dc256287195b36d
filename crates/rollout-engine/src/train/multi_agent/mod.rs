//! Multi-agent runs (`[agents.NAME]`): several policies, each with its own optimizer and
//! checkpoint, take turns in a multi-agent environment and are trained together. Each step
//! plays `group_size` episodes per prompt, gives every agent its group advantages of its
//! episode returns, and updates each agent on its own turns.

mod play;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
mod update;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde_json::{Value, json};
use tracing::Instrument;

use super::cursor::{DataCursor, mix};
use super::metrics::StepLogs;
use super::run_output::prepare_output;
use super::{CheckpointStore, RunError, RunState, Start, Summary, io_error};
use crate::config::Config;
use crate::plugins::Record;
use crate::roles::{Generator, Learner, MultiAgentEnvironments, Observer, RunStarted, Tokenizer};

/// One agent's roles.
pub struct Agent<'a> {
    pub name: String,
    pub generator: &'a dyn Generator,
    pub learner: &'a dyn Learner,
    pub tokenizer: &'a dyn Tokenizer,
    pub learning_rate: f64,
}

/// The agents of a run and the environment they play in.
pub struct Team<'a> {
    pub agents: Vec<Agent<'a>>,
    pub environments: &'a dyn MultiAgentEnvironments,
    pub observer: &'a dyn Observer,
}

impl Team<'_> {
    fn index(&self, name: &str) -> Option<usize> {
        self.agents.iter().position(|agent| agent.name == name)
    }
}

pub struct MultiAgentController<'a> {
    config: &'a Config,
    team: Team<'a>,
    records: Vec<Record>,
    store: CheckpointStore,
    state: RunState,
    interrupted: Arc<AtomicBool>,
    last_checkpoint: Option<PathBuf>,
    checkpoints_written: u64,
}

impl<'a> MultiAgentController<'a> {
    pub fn new(
        config: &'a Config,
        team: Team<'a>,
        records: Vec<Record>,
        interrupted: Arc<AtomicBool>,
    ) -> Self {
        MultiAgentController {
            config,
            team,
            records,
            store: CheckpointStore::new(
                config.run.output_dir.join("checkpoints"),
                config.checkpoint.keep,
            ),
            state: RunState::new(config.run.seed),
            interrupted,
            last_checkpoint: None,
            checkpoints_written: 0,
        }
    }

    pub async fn run(&mut self, start: Start) -> Result<Summary, RunError> {
        let started = Instant::now();
        prepare_output(self.config, start)?;
        let resumed = start == Start::Resume && self.resume().await?;
        self.train(resumed, started).await?;
        let current = format!("step-{:08}", self.state.step);
        if self.state.step > 0
            && !self
                .last_checkpoint
                .as_ref()
                .is_some_and(|d| d.ends_with(&current))
        {
            self.checkpoint().await?;
        }
        let summary = Summary::of(&self.state, self.last_checkpoint.clone(), started);
        let agents: Vec<&str> = self.team.agents.iter().map(|a| a.name.as_str()).collect();
        let extra = json!({ "agents": agents, "checkpoints_written": self.checkpoints_written });
        summary.write(self.config, self.stopping(), extra)?;
        if self.stopping() {
            return Err(RunError::Interrupted {
                checkpoint: self.last_checkpoint.clone(),
            });
        }
        Ok(summary)
    }

    /// Tells the observers the run ended (also after an interruption).
    pub async fn finish(&self, summary: Option<&Summary>) {
        let ended = Summary::ended(&self.state, self.stopping(), summary, &self.last_checkpoint);
        self.team.observer.run_ended(ended).await;
    }

    fn stopping(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }

    async fn train(&mut self, resumed: bool, started: Instant) -> Result<(), RunError> {
        let mut logs = StepLogs::open(self.config, resumed.then_some(self.state.step))?;
        self.team
            .observer
            .run_started(RunStarted {
                name: self.config.run.name.clone(),
                output_dir: self.config.run.output_dir.clone(),
                total_steps: self.config.run.steps,
                start_step: self.state.step,
                config: serde_json::to_value(self.config).unwrap_or(Value::Null),
            })
            .await;
        let mut cursor = DataCursor::new(
            self.records.len(),
            mix(self.config.run.seed, 1),
            self.config.data.shuffle,
            self.state.data,
        );
        while self.state.step < self.config.run.steps && !self.stopping() {
            let step = self.state.step + 1;
            let picked = cursor.take(self.config.rollout.prompts_per_step);
            let position = cursor.position();
            let span = tracing::info_span!(parent: None, "step", step);
            let (line, logged) = self
                .step(step, position.epoch, &picked, started)
                .instrument(span.clone())
                .await?;
            self.state.step = step;
            self.state.data = position;
            if let Some(reward) = line.get("reward_mean").and_then(Value::as_f64) {
                self.state.reward_history.push(reward);
            }
            logs.append(&line, &logged)?;
            self.team
                .observer
                .step_ended(step, line)
                .instrument(span.clone())
                .await;
            let every = self.config.checkpoint.every;
            if every > 0 && step % every == 0 {
                self.checkpoint().instrument(span).await?;
            }
        }
        Ok(())
    }

    /// Plays step `step`'s episodes and trains every agent; returns the metrics line and
    /// the samples to log.
    async fn step(
        &mut self,
        step: u64,
        epoch: u64,
        picked: &[usize],
        started: Instant,
    ) -> Result<(Value, Vec<Value>), RunError> {
        let step_started = Instant::now();
        let records: Vec<Value> = picked
            .iter()
            .map(|&i| self.records[i].fields.clone())
            .collect();
        let seed = mix(self.config.run.seed, 1000 + step);
        let played = play::play(self.config, &self.team, step, &records, seed)
            .instrument(tracing::info_span!("sample", step))
            .await?;
        let trained = update::train_agents(self.config, &self.team, step, &played).await?;
        if let Some(version) = trained.iter().map(|t| t.response.weight_version).max() {
            self.state.weight_version = version;
        }
        let mut line = update::metrics_line(&self.team, step, epoch, &played, &trained);
        if let Some(fields) = line.as_object_mut() {
            fields.insert("weight_version".into(), json!(self.state.weight_version));
            fields.insert(
                "step_seconds".into(),
                json!(step_started.elapsed().as_secs_f64()),
            );
            fields.insert(
                "elapsed_seconds".into(),
                json!(started.elapsed().as_secs_f64()),
            );
        }
        let limit = self.config.run.log_samples;
        let logged = update::sample_lines(&self.team, step, &played, &trained, limit);
        Ok((line, logged))
    }

    /// Writes every agent's policy under `policy/<agent>/` of one checkpoint, with the run
    /// state, and commits it.
    async fn checkpoint(&mut self) -> Result<(), RunError> {
        let step = self.state.step;
        let span = tracing::info_span!("checkpoint", step);
        let pending = self.store.begin(step)?;
        for agent in &self.team.agents {
            let directory = pending.policy_dir().join(&agent.name);
            std::fs::create_dir_all(&directory)
                .map_err(|source| io_error("cannot create", &directory, source))?;
            agent
                .learner
                .save(directory)
                .instrument(span.clone())
                .await?;
        }
        let dir = self.store.commit(pending, &self.state)?;
        self.checkpoints_written += 1;
        tracing::info!("checkpoint written: {}", dir.display());
        self.team
            .observer
            .checkpoint_written(step, dir.clone())
            .await;
        self.last_checkpoint = Some(dir);
        Ok(())
    }

    /// Restores every agent from the newest valid checkpoint; false when there is none.
    async fn resume(&mut self) -> Result<bool, RunError> {
        let Some(checkpoint) = self.store.latest_valid()? else {
            tracing::info!("no checkpoint to resume from; starting from scratch");
            return Ok(false);
        };
        for agent in &self.team.agents {
            let directory = checkpoint.policy_dir().join(&agent.name);
            if !directory.is_dir() {
                return Err(RunError::Data(format!(
                    "{} holds no policy of agent `{}`: the checkpoint was written by a run \
                     with other [agents]",
                    checkpoint.dir.display(),
                    agent.name
                )));
            }
            agent
                .learner
                .restore(directory, checkpoint.state.weight_version)
                .await?;
        }
        tracing::info!(
            "resumed {} agents from {} (step {})",
            self.team.agents.len(),
            checkpoint.dir.display(),
            checkpoint.state.step
        );
        self.state = checkpoint.state;
        self.last_checkpoint = Some(checkpoint.dir);
        Ok(true)
    }
}
