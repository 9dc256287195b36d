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
        let StepReport {
            step,
            epoch,
            records,
            collected,
            response,
            packing,
            learning_rate,
            trained_version,
            train_seconds,
            weight_sync_seconds,
            step_seconds,
            has_environment,
        } = self;
        let Collected {
            trajectories,
            completions,
            rewards,
            components,
            advantages,
            failures,
            zero_std_groups,
            refilled_groups,
            refill_rounds,
            stale_groups_regenerated,
            stale_groups_dropped,
            records: _,
            generate_seconds,
            score_seconds,
            generator_metrics,
        } = collected;
        let staleness: Vec<u64> = trajectories
            .iter()
            .filter_map(Trajectory::generated_by)
            .map(|version| trained_version.saturating_sub(version))
            .collect();
        let generated: Vec<usize> = trajectories
            .iter()
            .map(Trajectory::generated_tokens)
            .collect();
        let generated_tokens: usize = generated.iter().sum();
        let count = trajectories.len().max(1) as f64;
        let TrainResponse {
            metrics: mut trained,
            weight_version,
        } = response;
        let mut line = step_metrics(step, epoch, weight_version, step_seconds);
        rewards_and_failures(&mut line, &rewards, &components, &failures);
        if has_environment {
            // Over the episodes played to their end (a failed one's return is partial).
            let returns: Vec<f64> = trajectories
                .iter()
                .filter(|t| t.failure.is_none())
                .map(|t| t.env_return)
                .collect();
            line.env_return_mean = Some(mean(&returns));
            environment_failures(&mut line, &failures);
        }
        line.loss = trained.remove("loss");
        line.measured.extend(trained);
        line.measured.extend(generator_metrics);
        line.completions = Some(trajectories.len() as u64);
        let prompt_tokens: usize = records
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
        line.zero_std_group_fraction = Some(zero_std_groups as f64 / records.len().max(1) as f64);
        if sampler.config.algorithm.dynamic_sampling_rounds > 0 {
            line.refilled_groups = Some(refilled_groups as u64);
            line.refill_rounds = Some(refill_rounds);
        }
        line.stale_groups_regenerated = Some(stale_groups_regenerated as u64);
        line.stale_groups_dropped = Some(stale_groups_dropped as u64);
        line.micro_batches = Some(packing.micro_batches as u64);
        line.trained_rows = Some(packing.rows as u64);
        line.skipped_rows = Some(packing.skipped_rows as u64);
        line.padding_fraction = Some(if packing.padded_tokens > 0 {
            1.0 - packing.real_tokens as f64 / packing.padded_tokens as f64
        } else {
            0.0
        });
        line.generate_seconds = Some(generate_seconds);
        line.score_seconds = Some(score_seconds);
        line.train_seconds = Some(train_seconds);
        line.weight_sync_seconds = Some(weight_sync_seconds);
        line.staleness_max = Some(staleness.iter().copied().max().unwrap_or(0));
        line.staleness_mean =
            Some(staleness.iter().sum::<u64>() as f64 / staleness.len().max(1) as f64);
        line.samples_per_second = Some(trajectories.len() as f64 / step_seconds);
        line.tokens_per_second = Some(generated_tokens as f64 / step_seconds);
        line.learning_rate = Some(learning_rate);
        let sampled_with = trajectories
            .iter()
            .filter_map(Trajectory::generated_by)
            .min()
            .unwrap_or(trained_version);
        line.generation_weight_version = Some(sampled_with);
        let logged = trajectories
            .iter()
            .zip(completions)
            .take(log_samples)
            .zip(rewards.iter().zip(&advantages).zip(&failures))
            .map(
                |((trajectory, completion), ((reward, advantage), failure))| {
                    json!({
                        "step": step,
                        "group": trajectory.group,
                        "prompt": trajectory.prompt(&sampler.records),
                        "completion": completion,
                        "reward": if failure.is_some() { None } else { Some(reward) },
                        "advantage": advantage,
                        "failed": failure,
                        "finish_reason": trajectory.finish_reason,
                        "weight_version": trajectory.generated_by(),
                        "trained_at_version": trained_version,
                        "tokens": trajectory.tokens,
                        "generated": trajectory.loss_mask,
                    })
                },
            )
            .collect();
        (line, logged)
    }
}

/// `reward_mean`, `reward_std` and `reward/<name>` over the samples that were scored, and
/// the samples whose reward failed, by reason (failed episodes are not scored: they are
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
