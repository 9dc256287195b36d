//! Sampling a step: prompts to completions (single-turn, or episodes against an
//! environment), scored, with group advantages. A [`Sampler`] holds only shared, read-only
//! state, so the controller can run several steps' sampling while it trains.
//!
//! A sample fails (it is logged with the reason, left out of its group's advantages and
//! not trained on) when its episode's environment failed in the sandbox, or when a reward
//! could not score it; a failed episode is not scored.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use rollout_net::messages::{
    FinishReason, GenerateRequest, GroupRef, PromptRequest, RewardComponent, SamplingParams,
    ScoreFailure, ScoreRequest, ScoreResponse, ScoreSample,
};
use serde_json::Value;
use tracing::Instrument;

use super::advantage::scored_group_advantages;
use super::{PolicyRoles, RunError};
use crate::config::Config;
use crate::roles::{EpisodeFailure, Record, ReplaceReason};
use crate::sandbox::{FailureCounts, check_limits, score_failure};
use crate::seeds::mix;

mod episodes;

pub(super) type GeneratorMetrics = std::collections::BTreeMap<String, f64>;

/// A step's samples with their rewards and advantages.
#[derive(Default)]
pub(super) struct Collected {
    /// The record of each group sampled, in group order (with dynamic sampling, the
    /// groups kept).
    pub records: Vec<usize>,
    pub trajectories: Vec<Trajectory>,
    pub completions: Vec<String>,
    pub rewards: Vec<f64>,
    pub components: Vec<rollout_net::messages::RewardComponent>,
    pub advantages: Vec<f64>,
    /// Per sample: why its reward could not be computed (then its advantage is 0).
    pub failures: Vec<Option<rollout_net::messages::ScoreFailure>>,
    pub zero_std_groups: usize,
    /// Dynamic sampling: groups without reward spread replaced, and the rounds it took.
    pub refilled_groups: usize,
    pub refill_rounds: u32,
    /// Groups generated again, or left out, for lagging past `cluster.max_staleness`.
    pub stale_groups_regenerated: usize,
    pub stale_groups_dropped: usize,
    /// Every group generated for the step, by index, with its record: the first ones,
    /// refills and regenerations (a group the pool dropped has no samples).
    pub generated: BTreeMap<usize, usize>,
    /// Groups generated but not trained: `(group, by, why)`, group `by` took its place.
    pub replaced: Vec<(usize, usize, ReplaceReason)>,
    /// Groups left out of the step for staleness.
    pub left_out: Vec<usize>,
    pub generate_seconds: f64,
    pub score_seconds: f64,
    /// The generator's own measurements, merged over the step's generation requests.
    pub generator_metrics: GeneratorMetrics,
}

/// One sampled episode, token-exact: everything the policy generated and the context around.
#[derive(Debug, Clone)]
pub(super) struct Trajectory {
    pub group: usize,
    pub record: usize,
    /// The episode's first prompt when an environment wrote it (else the record's prompt).
    pub episode_prompt: Option<String>,
    pub tokens: Vec<u32>,
    pub loss_mask: Vec<bool>,
    pub logprobs: Vec<f32>,
    pub prompt_len: usize,
    pub finish_reason: FinishReason,
    pub env_return: f64,
    /// The oldest weight version that generated any of its tokens (the behaviour policy);
    /// `u64::MAX` when none was generated (its episode failed before its first turn).
    pub weight_version: u64,
    /// Why its episode ended early: the environment failed in the sandbox.
    pub failure: Option<EpisodeFailure>,
    /// The generation workers that generated its tokens (none in one process).
    pub producers: Vec<String>,
}

impl Trajectory {
    pub fn prompt<'r>(&'r self, records: &'r [Record]) -> &'r str {
        self.episode_prompt
            .as_deref()
            .unwrap_or(&records[self.record].prompt)
    }

    /// The behaviour policy's weight version, if any of its tokens were generated.
    pub fn generated_by(&self) -> Option<u64> {
        (self.weight_version != u64::MAX).then_some(self.weight_version)
    }

    pub fn generated_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m).count()
    }
}

/// What sampling needs: the config, the roles, the data and its tokenised prompts.
#[derive(Clone)]
pub(super) struct Sampler<'a> {
    pub config: &'a Config,
    pub roles: PolicyRoles<'a>,
    pub records: Arc<Vec<Record>>,
    pub prompt_ids: Arc<Vec<Vec<u32>>>,
    /// Per-record, per-sample token budgets from `rollout.max_new_tokens_field` (empty: the
    /// configured `max_new_tokens`).
    pub budgets: Arc<Vec<Vec<u32>>>,
}

impl<'a> Sampler<'a> {
    /// Tokenises the prompts of the first `count` records and reads their token budgets.
    pub async fn prepare(&mut self, count: usize) -> Result<(), RunError> {
        let prompts = self.records[..count.min(self.records.len())]
            .iter()
            .map(|r| r.prompt.clone())
            .collect();
        self.prompt_ids = Arc::new(self.roles.tokenizer.encode(prompts, false).await?);
        self.budgets = Arc::new(self.token_budgets()?);
        Ok(())
    }

    pub(super) fn sampling(&self, seed: u64) -> SamplingParams {
        sampling_params(self.config, seed)
    }

    /// Generates, scores and computes advantages for the step's groups, one per record of
    /// `records`: the first `prompts_per_step`, the rest held in reserve for dynamic
    /// sampling.
    pub(super) async fn collect(
        &self,
        step: u64,
        records: &[usize],
        seed: u64,
    ) -> Result<Collected, RunError> {
        let wanted = self.config.rollout.prompts_per_step.min(records.len());
        let (first, reserve) = records.split_at(wanted);
        let mut collected = self.collect_groups(step, first, 0, seed).await?;
        if self.config.algorithm.dynamic_sampling_rounds > 0 {
            self.refill(&mut collected, step, reserve, seed).await?;
        }
        self.compute_advantages(&mut collected);
        Ok(collected)
    }

    /// Generates and scores groups `first_group..` of `step`, one per record.
    pub(super) async fn collect_groups(
        &self,
        step: u64,
        records: &[usize],
        first_group: usize,
        seed: u64,
    ) -> Result<Collected, RunError> {
        let started = Instant::now();
        let generating = tracing::info_span!("generate", step, groups = records.len());
        let (trajectories, generator_metrics) = match self.roles.environments {
            Some(environments) => {
                self.run_episodes(environments, step, records, first_group, seed)
                    .instrument(generating)
                    .await?
            }
            None => {
                self.sample_completions(step, records, first_group, seed)
                    .instrument(generating)
                    .await?
            }
        };
        let generate_seconds = started.elapsed().as_secs_f64();

        let scoring = Instant::now();
        let (
            completions,
            Spread {
                totals,
                components,
                failures,
            },
        ) = self
            .score(&trajectories)
            .instrument(tracing::info_span!(
                "score",
                step,
                samples = trajectories.len()
            ))
            .await?;
        let rewards = self.rewards(&trajectories, &totals);
        let score_seconds = scoring.elapsed().as_secs_f64();
        let generated = (first_group..).zip(records.iter().copied()).collect();
        Ok(Collected {
            records: records.to_vec(),
            generated,
            trajectories,
            completions,
            rewards,
            components,
            failures,
            generate_seconds,
            score_seconds,
            generator_metrics,
            ..Collected::default()
        })
    }

    /// Each sample's reward: the reward functions' total, the episode's own return, less
    /// the overlong penalty.
    fn rewards(&self, trajectories: &[Trajectory], totals: &[f64]) -> Vec<f64> {
        trajectories
            .iter()
            .zip(totals)
            .map(|(trajectory, total)| {
                total + trajectory.env_return
                    - overlong_penalty(trajectory.generated_tokens(), self.config)
            })
            .collect()
    }

    /// The advantages of the collected samples, groups numbered in order of appearance.
    pub(super) fn compute_advantages(&self, collected: &mut Collected) {
        let algorithm = &self.config.algorithm;
        let mut dense = std::collections::BTreeMap::new();
        let groups: Vec<usize> = collected
            .trajectories
            .iter()
            .map(|t| {
                let next = dense.len();
                *dense.entry(t.group).or_insert(next)
            })
            .collect();
        let scored: Vec<bool> = collected.failures.iter().map(Option::is_none).collect();
        (collected.advantages, collected.zero_std_groups) = scored_group_advantages(
            &groups,
            &collected.rewards,
            &scored,
            dense.len(),
            algorithm.estimator(),
            algorithm.std_eps,
        );
    }

    /// The completions' texts and their scores. A failed episode is not scored; the step's
    /// failures (environment or reward) are held to their limit.
    async fn score(&self, trajectories: &[Trajectory]) -> Result<(Vec<String>, Spread), RunError> {
        let completions = self
            .roles
            .tokenizer
            .decode(
                trajectories
                    .iter()
                    .map(|t| t.tokens[t.prompt_len..].to_vec())
                    .collect(),
            )
            .await?;
        let scored: Vec<usize> = (0..trajectories.len())
            .filter(|&i| trajectories[i].failure.is_none())
            .collect();
        let samples = scored
            .iter()
            .map(|&i| ScoreSample {
                prompt: trajectories[i].prompt(&self.records).to_owned(),
                completion: completions[i].clone(),
                record: self.records[trajectories[i].record].fields.clone(),
                finish_reason: trajectories[i].finish_reason,
            })
            .collect();
        let scores = self.roles.scorer.score(ScoreRequest { samples }).await?;
        let spread = spread(scores, &scored, trajectories);
        self.check_failures(&spread.failures)?;
        Ok((completions, spread))
    }

    /// Holds the step's failed samples (environment or reward) to
    /// `sandbox.max_failed_fraction_per_step`.
    fn check_failures(&self, failures: &[Option<ScoreFailure>]) -> Result<(), RunError> {
        let failed: Vec<ScoreFailure> = failures.iter().flatten().cloned().collect();
        if failed.is_empty() {
            return Ok(());
        }
        let step = FailureCounts {
            total: failures.len() as u64,
            failed: failed.len() as u64,
        };
        check_limits(&self.config.sandbox, Some(step), None, &failed)
            .map_err(|err| RunError::Role(err.into()))
    }

    /// Reads `rollout.max_new_tokens_field` from every record.
    pub(super) fn token_budgets(&self) -> Result<Vec<Vec<u32>>, RunError> {
        let rollout = &self.config.rollout;
        let Some(field) = &rollout.max_new_tokens_field else {
            return Ok(Vec::new());
        };
        let group = rollout.group_size;
        let as_budget = |value: &Value| {
            value
                .as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .filter(|&v| v > 0)
        };
        self.records
            .iter()
            .enumerate()
            .map(|(index, record)| {
                let invalid = || {
                    RunError::Data(format!(
                        "record {index}: `{field}` must be a positive integer or a list of {group} of them"
                    ))
                };
                match record.fields.get(field) {
                    None => Ok(Vec::new()),
                    Some(Value::Array(items)) if items.len() == group => {
                        items.iter().map(|v| as_budget(v).ok_or_else(invalid)).collect()
                    }
                    Some(value) => as_budget(value).map(|v| vec![v; group]).ok_or_else(invalid),
                }
            })
            .collect()
    }

    /// One request completing each of `records` `group_size` times, as groups
    /// `first_group..` of `step`.
    pub(super) fn generate_request(
        &self,
        step: u64,
        records: &[usize],
        first_group: usize,
        seed: u64,
    ) -> GenerateRequest {
        GenerateRequest {
            prompts: records
                .iter()
                .enumerate()
                .map(|(offset, &record)| (first_group + offset, record))
                .map(|(group, record)| PromptRequest {
                    prompt_ids: self.prompt_ids[record].clone(),
                    n: self.config.rollout.group_size as u32,
                    max_new_tokens: self.budgets.get(record).cloned().unwrap_or_default(),
                    seed: Some(mix(seed, group as u64)),
                    group: Some(GroupRef {
                        step,
                        index: group as u32,
                    }),
                })
                .collect(),
            sampling: self.sampling(seed),
        }
    }

    /// Single-turn: every prompt is completed `group_size` times in one generation call.
    pub(super) async fn sample_completions(
        &self,
        step: u64,
        records: &[usize],
        first_group: usize,
        seed: u64,
    ) -> Result<(Vec<Trajectory>, GeneratorMetrics), RunError> {
        let group_size = self.config.rollout.group_size;
        let request = self.generate_request(step, records, first_group, seed);
        let response = self.roles.generator.generate(request).await?;
        let metrics = response.metrics;
        let mut producers = response.producers.into_iter();
        let mut trajectories = Vec::with_capacity(records.len() * group_size);
        for (offset, (&record, completions)) in records.iter().zip(response.groups).enumerate() {
            let group = first_group + offset;
            let producer: Vec<String> = producers
                .next()
                .filter(|p| !p.is_empty())
                .into_iter()
                .collect();
            let prompt = &self.prompt_ids[record];
            for completion in completions {
                let mut tokens = prompt.clone();
                tokens.extend_from_slice(&completion.token_ids);
                let mut logprobs = vec![0.0; prompt.len()];
                logprobs.extend_from_slice(&completion.logprobs);
                trajectories.push(Trajectory {
                    group,
                    record,
                    episode_prompt: None,
                    loss_mask: (0..tokens.len()).map(|t| t >= prompt.len()).collect(),
                    tokens,
                    logprobs,
                    prompt_len: prompt.len(),
                    finish_reason: completion.finish_reason,
                    env_return: 0.0,
                    weight_version: completion.weight_version,
                    failure: None,
                    producers: producer.clone(),
                });
            }
        }
        Ok((trajectories, metrics))
    }
}

/// The sampling parameters of `[rollout]`, seeded.
pub(super) fn sampling_params(config: &Config, seed: u64) -> SamplingParams {
    let rollout = &config.rollout;
    SamplingParams {
        max_new_tokens: rollout.max_new_tokens,
        temperature: rollout.temperature,
        top_p: rollout.top_p,
        top_k: rollout.top_k,
        stop_token_ids: rollout.stop_token_ids.clone(),
        stop_strings: rollout.stop_strings.clone(),
        ignore_eos: rollout.ignore_eos,
        seed,
    }
}

/// A step's scores spread back over all its samples (failed episodes were not scored).
struct Spread {
    totals: Vec<f64>,
    components: Vec<RewardComponent>,
    failures: Vec<Option<ScoreFailure>>,
}

/// `scores` answered for the samples `scored` (indices into `trajectories`); every other
/// sample's episode failed. Unscored samples score 0 and carry their failure.
fn spread(scores: ScoreResponse, scored: &[usize], trajectories: &[Trajectory]) -> Spread {
    let count = trajectories.len();
    let mut totals = vec![0.0; count];
    for (&i, total) in scored.iter().zip(scores.totals) {
        totals[i] = total;
    }
    let components = scores
        .components
        .into_iter()
        .map(|component| {
            let mut all = vec![0.0; count];
            for (&i, score) in scored.iter().zip(component.scores) {
                all[i] = score;
            }
            RewardComponent {
                scores: all,
                ..component
            }
        })
        .collect();
    let mut failures: Vec<Option<ScoreFailure>> = trajectories
        .iter()
        .enumerate()
        .map(|(i, t)| t.failure.clone().map(|failure| score_failure(i, failure)))
        .collect();
    for mut failure in scores.failed {
        if let Some(&i) = scored.get(failure.index) {
            failure.index = i;
            failures[i] = Some(failure);
        }
    }
    Spread {
        totals,
        components,
        failures,
    }
}

/// DAPO's soft overlong punishment: 0 up to `max_new_tokens - overlong_buffer` generated
/// tokens, then rising linearly to `overlong_penalty` at `max_new_tokens`.
fn overlong_penalty(generated: usize, config: &Config) -> f64 {
    let algorithm = &config.algorithm;
    let buffer = algorithm.overlong_buffer as usize;
    let limit = config.rollout.max_new_tokens as usize;
    if buffer == 0 || generated <= limit.saturating_sub(buffer) {
        return 0.0;
    }
    let over = generated - (limit - buffer);
    algorithm.overlong_penalty * (over.min(buffer) as f64 / buffer as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_penalty_rises_linearly_over_the_buffer() {
        let mut config: Config = match toml::from_str(
            "[policy]\nplugin = \"p:P\"\n[data]\nplugin = \"d:D\"\n[rollout]\nmax_new_tokens = 10\n",
        ) {
            Ok(config) => config,
            Err(err) => panic!("{err}"),
        };
        assert_eq!(overlong_penalty(10, &config), 0.0);
        config.algorithm.overlong_buffer = 4;
        config.algorithm.overlong_penalty = 2.0;
        let penalties: Vec<f64> = (5..=11).map(|n| overlong_penalty(n, &config)).collect();
        assert_eq!(penalties, [0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.0]);
    }
}
