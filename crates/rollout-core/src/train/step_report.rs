//! One RL step's metrics line (`metrics.jsonl`) and logged samples (`samples.jsonl`).

use rollout_net::messages::{
    FailureReason, FinishReason, RewardComponent, ScoreFailure, TrainResponse,
};
use serde_json::{Value, json};

use super::sampler::{Collected, Sampler, Trajectory};
use super::{PackingStats, mean, std_dev, step_metrics};
use crate::metrics::StepMetrics;

/// Everything a step produced, for its report.
pub(super) struct StepReport {
    pub step: u64,
    pub epoch: u64,
    pub records: Vec<usize>,
    pub collected: Collected,
    pub response: TrainResponse,
    pub packing: PackingStats,
    pub learning_rate: f64,
    /// The weight version the update started from.
    pub trained_version: u64,
    pub train_seconds: f64,
    pub weight_sync_seconds: f64,
    /// Since the previous step ended.
    pub step_seconds: f64,
    pub has_environment: bool,
}

impl StepReport {
    /// The step's metrics and its first `log_samples` samples.
    pub fn into_lines(
        self,
        sampler: &Sampler<'_>,
        log_samples: usize,
    ) -> (StepMetrics, Vec<Value>) {
        let logged = self.logged_samples(sampler, log_samples);
        (self.into_metrics(sampler), logged)
    }

    /// The step's `metrics.jsonl` line.
    fn into_metrics(self, sampler: &Sampler<'_>) -> StepMetrics {
        let mut line = step_metrics(
            self.step,
            self.epoch,
            self.response.weight_version,
            self.step_seconds,
        );
        let collected = &self.collected;
        rewards_and_failures(
            &mut line,
            &collected.rewards,
            &collected.components,
            &collected.failures,
        );
        if self.has_environment {
            self.environment_outcomes(&mut line);
        }
        self.completion_volumes(&mut line, sampler);
        self.group_outcomes(&mut line, sampler);
        packing_efficiency(&mut line, &self.packing);
        self.durations(&mut line);
        self.weight_versions(&mut line);
        line.learning_rate = Some(self.learning_rate);
        let mut trained = crate::mismatch::finish(self.response.metrics);
        line.loss = trained.remove("loss");
        line.measured.extend(trained);
        line.measured.extend(self.collected.generator_metrics);
        line
    }

    /// `env_return_mean` over the episodes played to their end (a failed one's return is
    /// partial), and the episodes whose environment failed.
    fn environment_outcomes(&self, line: &mut StepMetrics) {
        let returns: Vec<f64> = self
            .collected
            .trajectories
            .iter()
            .filter(|t| t.failure.is_none())
            .map(|t| t.env_return)
            .collect();
        line.env_return_mean = Some(mean(&returns));
        environment_failures(line, &self.collected.failures);
    }

    /// How many samples and tokens the step produced, how long the completions ran, and how
    /// fast.
    fn completion_volumes(&self, line: &mut StepMetrics, sampler: &Sampler<'_>) {
        let trajectories = &self.collected.trajectories;
        let generated: Vec<usize> = trajectories
            .iter()
            .map(Trajectory::generated_tokens)
            .collect();
        let generated_tokens: usize = generated.iter().sum();
        let count = trajectories.len().max(1) as f64;
        line.completions = Some(trajectories.len() as u64);
        let prompt_tokens: usize = self
            .records
            .iter()
            .map(|&r| sampler.prompt_ids.get(r).map_or(0, Vec::len))
            .sum();
        line.prompt_tokens = Some(prompt_tokens as u64);
        let sequence_tokens: usize = trajectories.iter().map(|t| t.tokens.len()).sum();
        line.sequence_tokens = Some(sequence_tokens as u64);
        line.generated_tokens = Some(generated_tokens as u64);
        line.completion_length_mean = Some(generated_tokens as f64 / count);
        line.completion_length_max = Some(generated.iter().max().copied().unwrap_or(0) as u64);
        let truncated = trajectories
            .iter()
            .filter(|t| t.finish_reason == FinishReason::Length)
            .count();
        line.truncated_fraction = Some(truncated as f64 / count);
        line.samples_per_second = Some(trajectories.len() as f64 / self.step_seconds);
        line.tokens_per_second = Some(generated_tokens as f64 / self.step_seconds);
    }

    /// The prompt groups without reward spread, refilled by dynamic sampling, or regenerated
    /// or dropped for staleness.
    fn group_outcomes(&self, line: &mut StepMetrics, sampler: &Sampler<'_>) {
        let collected = &self.collected;
        line.zero_std_group_fraction =
            Some(collected.zero_std_groups as f64 / self.records.len().max(1) as f64);
        if sampler.config.algorithm.dynamic_sampling_rounds > 0 {
            line.refilled_groups = Some(collected.refilled_groups as u64);
            line.refill_rounds = Some(collected.refill_rounds);
        }
        line.stale_groups_regenerated = Some(collected.stale_groups_regenerated as u64);
        line.stale_groups_dropped = Some(collected.stale_groups_dropped as u64);
    }

    /// The seconds each phase of the step took.
    fn durations(&self, line: &mut StepMetrics) {
        line.generate_seconds = Some(self.collected.generate_seconds);
        line.score_seconds = Some(self.collected.score_seconds);
        line.train_seconds = Some(self.train_seconds);
        line.weight_sync_seconds = Some(self.weight_sync_seconds);
    }

    /// How many weight versions the samples lag the update, and the oldest that generated any.
    fn weight_versions(&self, line: &mut StepMetrics) {
        let trajectories = &self.collected.trajectories;
        let staleness: Vec<u64> = trajectories
            .iter()
            .filter_map(Trajectory::generated_by)
            .map(|version| self.trained_version.saturating_sub(version))
            .collect();
        line.staleness_max = Some(staleness.iter().copied().max().unwrap_or(0));
        line.staleness_mean =
            Some(staleness.iter().sum::<u64>() as f64 / staleness.len().max(1) as f64);
        let sampled_with = trajectories
            .iter()
            .filter_map(Trajectory::generated_by)
            .min()
            .unwrap_or(self.trained_version);
        line.generation_weight_version = Some(sampled_with);
    }

    /// The `samples.jsonl` lines of the step's first `log_samples` samples.
    fn logged_samples(&self, sampler: &Sampler<'_>, log_samples: usize) -> Vec<Value> {
        let collected = &self.collected;
        collected
            .trajectories
            .iter()
            .zip(&collected.completions)
            .take(log_samples)
            .zip(
                collected
                    .rewards
                    .iter()
                    .zip(&collected.advantages)
                    .zip(&collected.failures),
            )
            .map(
                |((trajectory, completion), ((reward, advantage), failure))| {
                    json!({
                        "step": self.step,
                        "group": trajectory.group,
                        "prompt": trajectory.prompt(&sampler.records),
                        "completion": completion,
                        "reward": if failure.is_some() { None } else { Some(reward) },
                        "advantage": advantage,
                        "failed": failure,
                        "finish_reason": trajectory.finish_reason,
                        "weight_version": trajectory.generated_by(),
                        "trained_at_version": self.trained_version,
                        "tokens": trajectory.tokens,
                        "generated": trajectory.loss_mask,
                    })
                },
            )
            .collect()
    }
}

/// `micro_batches`, `trained_rows`, `skipped_rows` and the share of the packed tokens that
/// were padding.
fn packing_efficiency(line: &mut StepMetrics, packing: &PackingStats) {
    line.micro_batches = Some(packing.micro_batches as u64);
    line.trained_rows = Some(packing.rows as u64);
    line.skipped_rows = Some(packing.skipped_rows as u64);
    line.padding_fraction = Some(if packing.padded_tokens > 0 {
        1.0 - packing.real_tokens as f64 / packing.padded_tokens as f64
    } else {
        0.0
    });
}

/// `reward_mean`, `reward_std` and `reward/<name>` over the samples that were scored, and
/// the samples whose reward failed, by reason and by reward (`reward_failed/<name>`) (failed episodes are not scored: they are
/// counted in `environment_failed`).
fn rewards_and_failures(
    line: &mut StepMetrics,
    rewards: &[f64],
    components: &[RewardComponent],
    failures: &[Option<ScoreFailure>],
) {
    let scored = |values: &[f64]| -> Vec<f64> {
        values
            .iter()
            .zip(failures)
            .filter(|(_, failure)| failure.is_none())
            .map(|(value, _)| *value)
            .collect()
    };
    let scored_rewards = scored(rewards);
    line.reward_mean = Some(mean(&scored_rewards));
    line.reward_std = Some(std_dev(&scored_rewards));
    for component in components {
        line.measured.insert(
            format!("reward/{}", component.name),
            mean(&scored(&component.scores)),
        );
        let failed = failures
            .iter()
            .flatten()
            .filter(|failure| failure.reward.as_deref() == Some(component.name.as_str()))
            .count();
        line.measured
            .insert(format!("reward_failed/{}", component.name), failed as f64);
    }
    let count = failure_counter(failures, false);
    line.reward_failed = Some(count(None));
    line.reward_failed_raised = Some(count(Some(FailureReason::Raised)));
    line.reward_failed_timeout = Some(count(Some(FailureReason::Timeout)));
    line.reward_failed_crashed = Some(count(Some(FailureReason::Crashed)));
    line.reward_failed_memory = Some(count(Some(FailureReason::Memory)));
    line.reward_failed_invalid = Some(count(Some(FailureReason::Invalid)));
}

/// The episodes whose environment failed, in all and by reason.
fn environment_failures(line: &mut StepMetrics, failures: &[Option<ScoreFailure>]) {
    let count = failure_counter(failures, true);
    line.environment_failed = Some(count(None));
    line.environment_failed_raised = Some(count(Some(FailureReason::Raised)));
    line.environment_failed_timeout = Some(count(Some(FailureReason::Timeout)));
    line.environment_failed_crashed = Some(count(Some(FailureReason::Crashed)));
    line.environment_failed_memory = Some(count(Some(FailureReason::Memory)));
    line.environment_failed_invalid = Some(count(Some(FailureReason::Invalid)));
    line.environment_failed_restarted = Some(count(Some(FailureReason::Restarted)));
}

/// Counts the failures of rewards (or, with `environment`, of the environment): all of them
/// for `None`, else those of one reason.
fn failure_counter(
    failures: &[Option<ScoreFailure>],
    environment: bool,
) -> impl Fn(Option<FailureReason>) -> u64 {
    let failed: Vec<FailureReason> = failures
        .iter()
        .flatten()
        .filter(|f| f.environment.is_some() == environment)
        .map(|f| f.reason)
        .collect();
    move |reason| {
        failed
            .iter()
            .filter(|&&r| reason.is_none_or(|wanted| r == wanted))
            .count() as u64
    }
}
