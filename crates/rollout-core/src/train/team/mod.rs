//! The steps of a multi-agent run (`[agents.NAME]`): several policies, each with its own
//! optimizer and checkpoint, take turns in a multi-agent environment and are trained
//! together. Each step plays `group_size` episodes per prompt, gives every agent its group
//! advantages of its episode returns, and updates each agent on its own turns.

mod play;
mod update;

use std::time::Instant;

use serde_json::Value;
use tracing::Instrument;

use super::{RunError, Team};
use crate::config::Config;
use crate::metrics::StepMetrics;
use crate::seeds::mix;

impl Team<'_> {
    fn index(&self, name: &str) -> Option<usize> {
        self.agents.iter().position(|agent| agent.name == name)
    }
}

/// Plays step `step`'s episodes of `records` (drawn in `epoch`) and trains every agent;
/// returns the step's metrics and the turns to log. `weight_version` is the newest before
/// the step.
pub(super) async fn step(
    config: &Config,
    team: &Team<'_>,
    step: u64,
    epoch: u64,
    records: &[Value],
    weight_version: u64,
) -> Result<(StepMetrics, Vec<Value>), RunError> {
    let started = Instant::now();
    let seed = mix(config.run.seed, 1000 + step);
    let played = play::play(config, team, step, records, seed)
        .instrument(tracing::info_span!("sample", step))
        .await?;
    let trained = update::train_agents(config, team, step, &played).await?;
    let weight_version = trained
        .iter()
        .map(|t| t.response.weight_version)
        .max()
        .unwrap_or(weight_version);
    let step_seconds = started.elapsed().as_secs_f64();
    let metrics = update::metrics(
        team,
        super::step_metrics(step, epoch, weight_version, step_seconds),
        &played,
        &trained,
    );
    let samples = update::sample_lines(team, step, &played, &trained, config.run.log_samples);
    Ok((metrics, samples))
}
