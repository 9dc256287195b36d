//! One RL step's metrics line (`metrics.jsonl`) and logged samples (`samples.jsonl`).

use rollout_net::messages::{
    FailureReason, FinishReason, RewardComponent, ScoreFailure, TrainResponse,
};
use serde_json::{Map, Value, json};

use super::sampler::{Collected, Sampler, Trajectory};
use super::{PackingStats, mean, std_dev};

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
    /// The metrics line and the first `log_samples` samples.
    pub fn into_lines(self, sampler: &Sampler<'_>, log_samples: usize) -> (Value, Vec<Value>) {
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
        let max_staleness = staleness.iter().copied().max().unwrap_or(0);
        let generated: Vec<usize> = trajectories
            .iter()
            .map(Trajectory::generated_tokens)
            .collect();
        let generated_tokens: usize = generated.iter().sum();
        let count = trajectories.len().max(1) as f64;
        let mut line = Map::new();
        line.insert("step".into(), json!(step));
        insert_rewards(&mut line, &rewards, &components, &failures);
        if has_environment {
            // Over the episodes played to their end (a failed one's return is partial).
            let returns: Vec<f64> = trajectories
                .iter()
                .filter(|t| t.failure.is_none())
                .map(|t| t.env_return)
                .collect();
            line.insert("env_return_mean".into(), json!(mean(&returns)));
            insert_failures(&mut line, "environment_failed", &failures, true);
        }
        for (name, value) in &response.metrics {
            line.insert(name.clone(), json!(value));
        }
        line.insert("completions".into(), json!(trajectories.len()));
        let prompt_tokens: usize = records
            .iter()
            .map(|&r| sampler.prompt_ids.get(r).map_or(0, Vec::len))
            .sum();
        line.insert("prompt_tokens".into(), json!(prompt_tokens));
        line.insert(
            "sequence_tokens".into(),
            json!(trajectories.iter().map(|t| t.tokens.len()).sum::<usize>()),
        );
        line.insert("generated_tokens".into(), json!(generated_tokens));
        line.insert(
            "completion_length_mean".into(),
            json!(generated_tokens as f64 / count),
        );
        line.insert(
            "completion_length_max".into(),
            json!(generated.iter().max().copied().unwrap_or(0)),
        );
        let truncated = trajectories
            .iter()
            .filter(|t| t.finish_reason == FinishReason::Length)
            .count();
        line.insert("truncated_fraction".into(), json!(truncated as f64 / count));
        line.insert(
            "zero_std_group_fraction".into(),
            json!(zero_std_groups as f64 / records.len().max(1) as f64),
        );
        if sampler.config.algorithm.dynamic_sampling_rounds > 0 {
            line.insert("refilled_groups".into(), json!(refilled_groups));
            line.insert("refill_rounds".into(), json!(refill_rounds));
        }
        line.insert("micro_batches".into(), json!(packing.micro_batches));
        line.insert("trained_rows".into(), json!(packing.rows));
        line.insert("skipped_rows".into(), json!(packing.skipped_rows));
        let padding = if packing.padded_tokens > 0 {
            1.0 - packing.real_tokens as f64 / packing.padded_tokens as f64
        } else {
            0.0
        };
        line.insert("padding_fraction".into(), json!(padding));
        for (name, value) in generator_metrics {
            line.insert(name, json!(value));
        }
        line.insert("generate_seconds".into(), json!(generate_seconds));
        line.insert("score_seconds".into(), json!(score_seconds));
        line.insert("train_seconds".into(), json!(train_seconds));
        line.insert("weight_sync_seconds".into(), json!(weight_sync_seconds));
        line.insert("staleness_max".into(), json!(max_staleness));
        line.insert(
            "staleness_mean".into(),
            json!(staleness.iter().sum::<u64>() as f64 / staleness.len().max(1) as f64),
        );
        line.insert("step_seconds".into(), json!(step_seconds));
        line.insert(
            "samples_per_second".into(),
            json!(trajectories.len() as f64 / step_seconds),
        );
        line.insert(
            "tokens_per_second".into(),
            json!(generated_tokens as f64 / step_seconds),
        );
        line.insert("learning_rate".into(), json!(learning_rate));
        let sampled_with = trajectories
            .iter()
            .filter_map(Trajectory::generated_by)
            .min()
            .unwrap_or(trained_version);
        line.insert("generation_weight_version".into(), json!(sampled_with));
        line.insert("weight_version".into(), json!(response.weight_version));
        line.insert("epoch".into(), json!(epoch));
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
        (Value::Object(line), logged)
    }
}

/// `reward_mean`, `reward_std` and `reward/<name>` over the samples that were scored, and
/// `reward_failed` with one `reward_failed_<reason>` count per reason (failed episodes are
/// not scored: they are counted in `environment_failed`).
fn insert_rewards(
    line: &mut Map<String, Value>,
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
    line.insert("reward_mean".into(), json!(mean(&scored_rewards)));
    line.insert("reward_std".into(), json!(std_dev(&scored_rewards)));
    for component in components {
        line.insert(
            format!("reward/{}", component.name),
            json!(mean(&scored(&component.scores))),
        );
    }
    insert_failures(line, "reward_failed", failures, false);
}

/// `<name>` (the failures of rewards, or of the environment) and `<name>_<reason>` for each
/// reason (`restarted` only for environments).
fn insert_failures(
    line: &mut Map<String, Value>,
    name: &str,
    failures: &[Option<ScoreFailure>],
    environment: bool,
) {
    let failed: Vec<&ScoreFailure> = failures
        .iter()
        .flatten()
        .filter(|f| f.environment.is_some() == environment)
        .collect();
    line.insert(name.into(), json!(failed.len()));
    for reason in FailureReason::ALL {
        if reason == FailureReason::Restarted && !environment {
            continue;
        }
        let count = failed.iter().filter(|f| f.reason == reason).count();
        line.insert(format!("{name}_{}", reason.as_str()), json!(count));
    }
}
