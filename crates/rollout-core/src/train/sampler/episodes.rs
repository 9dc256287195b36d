//! Multi-turn sampling: episodes played against an environment, turn by turn.

use rollout_net::messages::{
    FinishReason, GenerateRequest, GenerateResponse, GroupRef, PromptRequest,
};

use super::{GeneratorMetrics, Sampler, Trajectory};
use crate::metrics::merge_metrics;
use crate::roles::{Environments, EpisodeResult, EpisodeStart, StepResult};
use crate::seeds::mix;
use crate::train::RunError;

impl Sampler<'_> {
    /// Multi-turn: each group plays `group_size` episodes seeded alike; turns of all live
    /// episodes are generated together. Observations are appended as context tokens (not
    /// trained on); generated tokens are kept exactly as sampled. In the ledger, each turn
    /// of each episode is a unit of its own. An episode whose environment call fails ends
    /// there, marked failed; the others play on.
    pub(in crate::train) async fn run_episodes(
        &self,
        environments: &dyn Environments,
        step: u64,
        records: &[usize],
        first_group: usize,
        seed: u64,
    ) -> Result<(Vec<Trajectory>, GeneratorMetrics), RunError> {
        let group_size = self.config.rollout.group_size;
        let first_id = seed;
        let starts: Vec<EpisodeStart> = records
            .iter()
            .enumerate()
            .flat_map(|(group, &record)| {
                let episode_seed = mix(seed, group as u64);
                (0..group_size).map(move |_| (record, episode_seed))
            })
            .map(|(record, seed)| EpisodeStart {
                record: self.records[record].fields.clone(),
                seed,
            })
            .collect();
        let ids: Vec<u64> = (0..starts.len() as u64)
            .map(|i| first_id.wrapping_add(i))
            .collect();
        let prompts = environments.start(first_id, starts).await?;
        let played = self
            .play(
                environments,
                (step, first_group),
                records,
                seed,
                &ids,
                prompts,
            )
            .await;
        // Every episode is finished (released, and failures counted), whatever happened.
        let finished = environments.finish(ids).await;
        let (trajectories, generator_metrics) = played?;
        finished?;
        Ok((trajectories, merge_metrics(&generator_metrics)))
    }

    /// The turns of started episodes, until each is done, failed or out of turns.
    /// `groups`: the step and the index of the first group.
    async fn play(
        &self,
        environments: &dyn Environments,
        (step, first_group): (u64, usize),
        records: &[usize],
        seed: u64,
        ids: &[u64],
        prompts: Vec<EpisodeResult<String>>,
    ) -> Result<(Vec<Trajectory>, Vec<GeneratorMetrics>), RunError> {
        let max_turns = self.config.environment.as_ref().map_or(1, |e| e.max_turns);
        let mut trajectories = self.first_prompts(records, first_group, prompts).await?;
        let mut live: Vec<usize> = (0..trajectories.len())
            .filter(|&i| trajectories[i].failure.is_none())
            .collect();
        let mut generator_metrics = Vec::new();
        for turn in 0..max_turns {
            if live.is_empty() {
                break;
            }
            let response = self
                .generate_turn(step, seed, turn, &trajectories, &live)
                .await?;
            generator_metrics.push(response.metrics);
            let mut producers = response.producers.into_iter();
            let mut acting = Vec::with_capacity(live.len());
            let mut actions = Vec::with_capacity(live.len());
            for (&i, mut group) in live.iter().zip(response.groups) {
                let producer = producers.next().unwrap_or_default();
                let Some(completion) = group.pop() else {
                    continue;
                };
                let trajectory = &mut trajectories[i];
                if !producer.is_empty() && !trajectory.producers.contains(&producer) {
                    trajectory.producers.push(producer);
                }
                trajectory.tokens.extend_from_slice(&completion.token_ids);
                trajectory.logprobs.extend_from_slice(&completion.logprobs);
                trajectory
                    .loss_mask
                    .extend(std::iter::repeat_n(true, completion.token_ids.len()));
                trajectory.finish_reason = completion.finish_reason;
                trajectory.weight_version =
                    trajectory.weight_version.min(completion.weight_version);
                acting.push(i);
                actions.push(completion.token_ids);
            }
            let texts = self.roles.tokenizer.decode(actions).await?;
            let outcomes = environments
                .step(acting.iter().map(|&i| ids[i]).zip(texts).collect())
                .await?;
            let last_turn = turn + 1 >= max_turns;
            live = self
                .observe(&mut trajectories, &acting, outcomes, last_turn)
                .await?;
        }
        Ok((trajectories, generator_metrics))
    }

    /// One trajectory per started episode (of groups `first_group..`): its first prompt as
    /// context, or its failure.
    async fn first_prompts(
        &self,
        records: &[usize],
        first_group: usize,
        prompts: Vec<EpisodeResult<String>>,
    ) -> Result<Vec<Trajectory>, RunError> {
        let group_size = self.config.rollout.group_size;
        let texts: Vec<String> = prompts.iter().flatten().cloned().collect();
        let mut encoded = self.roles.tokenizer.encode(texts, false).await?.into_iter();
        let mut trajectories = Vec::with_capacity(prompts.len());
        for (index, prompt) in prompts.into_iter().enumerate() {
            let (tokens, episode_prompt, failure) = match prompt {
                Ok(prompt) => (encoded.next().unwrap_or_default(), Some(prompt), None),
                Err(failure) => (Vec::new(), None, Some(failure)),
            };
            trajectories.push(Trajectory {
                group: first_group + index / group_size,
                record: records[index / group_size],
                episode_prompt,
                loss_mask: vec![false; tokens.len()],
                logprobs: vec![0.0; tokens.len()],
                prompt_len: tokens.len(),
                tokens,
                finish_reason: FinishReason::Stop,
                env_return: 0.0,
                weight_version: u64::MAX,
                failure,
                producers: Vec::new(),
            });
        }
        Ok(trajectories)
    }

    /// Generates one turn of each `live` episode.
    async fn generate_turn(
        &self,
        step: u64,
        seed: u64,
        turn: u32,
        trajectories: &[Trajectory],
        live: &[usize],
    ) -> Result<GenerateResponse, RunError> {
        let group_size = self.config.rollout.group_size;
        let max_turns = self.config.environment.as_ref().map_or(1, |e| e.max_turns) as usize;
        let turn_seed = mix(seed, 1 + turn as u64);
        let request = GenerateRequest {
            prompts: live
                .iter()
                .map(|&i| PromptRequest {
                    prompt_ids: trajectories[i].tokens.clone(),
                    n: 1,
                    // `rollout.max_new_tokens_field` budgets every turn of the sample.
                    max_new_tokens: self
                        .budgets
                        .get(trajectories[i].record)
                        .and_then(|budgets| budgets.get(i % group_size))
                        .map(|&budget| vec![budget])
                        .unwrap_or_default(),
                    seed: Some(mix(turn_seed, i as u64)),
                    // Each turn of each episode of the step is a unit of its own, also
                    // across the step's refills and regenerations (later groups).
                    group: Some(GroupRef {
                        step,
                        index: ((trajectories[i].group * group_size + i % group_size) * max_turns
                            + turn as usize) as u32,
                    }),
                })
                .collect(),
            sampling: self.sampling(turn_seed),
        };
        Ok(self.roles.generator.generate(request).await?)
    }

    /// Applies the environment's answers to the episodes that acted: rewards add up,
    /// failures end their episode, and the observations of those that go on are appended
    /// as context. Returns the episodes that go on.
    async fn observe(
        &self,
        trajectories: &mut [Trajectory],
        acting: &[usize],
        outcomes: Vec<EpisodeResult<StepResult>>,
        last_turn: bool,
    ) -> Result<Vec<usize>, RunError> {
        let mut observations = Vec::new();
        let mut still_live = Vec::new();
        for (&i, outcome) in acting.iter().zip(outcomes) {
            match outcome {
                Ok(outcome) => {
                    trajectories[i].env_return += outcome.reward;
                    if !outcome.done && !last_turn {
                        observations.push(outcome.observation);
                        still_live.push(i);
                    }
                }
                Err(failure) => trajectories[i].failure = Some(failure),
            }
        }
        if still_live.is_empty() {
            return Ok(still_live);
        }
        let observation_ids = self.roles.tokenizer.encode(observations, true).await?;
        let stopped = |t: &Trajectory| t.finish_reason == FinishReason::Stop;
        let eos = if still_live.iter().any(|&i| stopped(&trajectories[i])) {
            self.roles.tokenizer.eos_token_ids().await?
        } else {
            Vec::new()
        };
        for (&i, mut tokens) in still_live.iter().zip(observation_ids) {
            let trajectory = &mut trajectories[i];
            // A chat template's next turn opens with the end-of-turn token; a turn that
            // stopped on that very token already holds it, so it is not repeated (a turn cut
            // at `max_new_tokens` gets it from the observation). See docs/chat.md.
            let repeats_end = tokens.first().is_some_and(|first| {
                stopped(trajectory)
                    && eos.contains(first)
                    && trajectory.tokens.last() == Some(first)
            });
            if repeats_end {
                tokens.remove(0);
            }
            trajectory
                .loss_mask
                .extend(std::iter::repeat_n(false, tokens.len()));
            trajectory
                .logprobs
                .extend(std::iter::repeat_n(0.0, tokens.len()));
            trajectory.tokens.extend(tokens);
        }
        Ok(still_live)
    }
}
