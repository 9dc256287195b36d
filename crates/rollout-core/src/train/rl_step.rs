//! One RL step's update: the step's samples as micro-batches of its algorithm's objective
//! (with PPO's value targets), trained while later steps are sampled, then the new weights
//! sent to the generators.

use std::time::Instant;

use rollout_net::messages::{
    KlPenalty, MicroBatch, Objective, TrainRequest, TrainResponse, ValuesRequest,
};
use serde_json::Value;
use tracing::Instrument;

use super::outcome;
use super::pipeline::{Pipeline, StepSamples};
use super::sampler::{Collected, Sampler};
use super::step_report::StepReport;
use super::{Controller, PackingStats, RunError, TrainSequence, laid_out_micro_batches, ppo};
use crate::config::{Algorithm, Config, DroppedGroups};
use crate::metrics::StepMetrics;
use crate::roles::{RoleError, StepGroups};

/// The objective of RL step `step`'s update under `[algorithm]`.
pub(super) fn rl_objective(config: &Config, step: u64) -> Objective {
    let algorithm = &config.algorithm;
    let (clip_low, clip_high) = algorithm.clip();
    let temperature = if config.rollout.temperature > 0.0 {
        config.rollout.temperature
    } else {
        1.0
    };
    let kl_coef = algorithm.kl_coef;
    let correction = algorithm.correction();
    match algorithm.name {
        Algorithm::Ppo => Objective::Ppo {
            clip_low,
            clip_high,
            kl_coef,
            temperature,
            value_clip: algorithm.value_clip,
            value_coef: algorithm.value_coef,
            train_policy: step > algorithm.critic_warmup_steps,
            correction,
        },
        Algorithm::Gspo => Objective::Gspo {
            clip_low,
            clip_high,
            kl_coef,
            temperature,
            correction,
        },
        name => Objective::Grpo {
            clip_low,
            clip_high,
            kl_coef,
            temperature,
            kl_penalty: if name == Algorithm::ReinforcePp {
                KlPenalty::Reward
            } else {
                KlPenalty::Loss
            },
            correction,
        },
    }
}

impl<'a> Controller<'a> {
    /// One RL step: trains on one step's samples (sampling of later steps goes on
    /// meanwhile) and sends the new weights to the generators; returns the step's metrics,
    /// the samples to log and what became of each of the step's groups. `started` is when
    /// the previous step ended.
    pub(super) async fn rl_step(
        &self,
        sampler: &Sampler<'a>,
        samples: StepSamples,
        pipeline: &mut Pipeline<'a>,
        started: Instant,
    ) -> Result<(StepMetrics, Vec<Value>, StepGroups), RunError> {
        let StepSamples {
            step,
            epoch,
            records,
            redrawn,
            collected,
            ..
        } = samples;
        let mut collected = collected?;
        let trained_version = self.state.weight_version;
        let seed = crate::seeds::mix(self.config.run.seed, 1000 + step);
        sampler
            .regenerate_stale(
                &mut collected,
                step,
                (trained_version, self.max_staleness()),
                seed,
            )
            .await?;
        let requeue = self.config.cluster.dropped_groups == DroppedGroups::Requeue;
        let per_turn = sampler.roles.environments.is_some();
        let groups = outcome::step_groups(&collected, &redrawn, requeue, per_turn);

        let training = Instant::now();
        let ((response, excluded), packing, learning_rate) =
            self.train_on(sampler, step, &collected, pipeline).await?;
        let train_seconds = training.elapsed().as_secs_f64();
        send_away_producers(sampler, step, &collected, &excluded).await?;
        let sync_started = Instant::now();
        self.send_weights(sampler, step, pipeline).await?;
        let weight_sync_seconds = sync_started.elapsed().as_secs_f64();

        let report = StepReport {
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
            step_seconds: started.elapsed().as_secs_f64(),
            has_environment: sampler.roles.environments.is_some(),
        };
        let (metrics, logged) = report.into_lines(sampler, self.config.run.log_samples);
        Ok((metrics, logged, groups))
    }

    /// Trains on `collected` (sampling of later steps goes on meanwhile), the colocated
    /// generation workers' device memory released for the update. Returns the trainers'
    /// answer with the trajectory of each row it left out, how the samples were packed, and
    /// the learning rate used.
    async fn train_on(
        &self,
        sampler: &Sampler<'a>,
        step: u64,
        collected: &Collected,
        pipeline: &mut Pipeline<'a>,
    ) -> Result<((TrainResponse, Vec<usize>), PackingStats, f64), RunError> {
        // Colocated generation workers free the devices the trainers are about to use (PPO's
        // value pass included) and take them back once the update is applied.
        let generator = sampler.roles.generator;
        generator
            .release_memory()
            .instrument(tracing::info_span!("generator.release_memory", step))
            .await?;
        let (batches, packing, layout) = self
            .micro_batches(sampler, step, collected, pipeline)
            .await?;
        let learning_rate = self.learning_rate(self.state.weight_version);
        let training_span = tracing::info_span!("train", step, micro_batches = batches.len());
        let response = pipeline
            .while_running(
                sampler
                    .roles
                    .learner
                    .train(TrainRequest {
                        micro_batches: batches,
                        learning_rate,
                        epochs: self.config.algorithm.epochs,
                    })
                    .instrument(training_span),
            )
            .await??;
        generator
            .restore_memory()
            .instrument(tracing::info_span!("generator.restore_memory", step))
            .await?;
        let excluded = response
            .excluded
            .iter()
            .filter_map(|row| {
                let rows = layout.get(row.micro_batch as usize)?;
                rows.get(row.row as usize).copied()
            })
            .collect();
        Ok(((response, excluded), packing, learning_rate))
    }

    /// The step's samples as micro-batches of its objective, and the trajectory of each of
    /// their rows. A sample whose reward failed is not trained on at all (no loss, no KL
    /// term, not in the token count the loss is normalised by). PPO's carry their reward,
    /// which GAE turns into token advantages with the value head's predictions.
    async fn micro_batches(
        &self,
        sampler: &Sampler<'a>,
        step: u64,
        collected: &Collected,
        pipeline: &mut Pipeline<'a>,
    ) -> Result<(Vec<MicroBatch>, PackingStats, Vec<Vec<usize>>), RunError> {
        let algorithm = &self.config.algorithm;
        let ppo = algorithm.name == Algorithm::Ppo;
        let per_sequence = if ppo {
            &collected.rewards
        } else {
            &collected.advantages
        };
        let trained_version = self.state.weight_version;
        let trained: Vec<usize> = (0..collected.trajectories.len())
            .filter(|&i| collected.failures.get(i).is_some_and(Option::is_none))
            .collect();
        let sequences: Vec<TrainSequence> = trained
            .iter()
            .map(|&i| {
                let trajectory = &collected.trajectories[i];
                TrainSequence {
                    tokens: trajectory.tokens.clone(),
                    loss_mask: trajectory.loss_mask.clone(),
                    logprobs: trajectory.logprobs.clone(),
                    advantage: per_sequence.get(i).copied().unwrap_or(0.0) as f32,
                    staleness: staleness(trained_version, trajectory.weight_version),
                }
            })
            .collect();
        let objective = rl_objective(self.config, step);
        // A zero advantage is no gradient, unless a KL term or PPO's value loss remains.
        let skip_zero = algorithm.kl_coef == 0.0 && !ppo;
        let budget = self.config.train.micro_batch_tokens;
        let (mut batches, packing, layout) =
            laid_out_micro_batches(&sequences, &objective, budget, skip_zero);
        let layout = layout
            .into_iter()
            .map(|rows| rows.into_iter().map(|s| trained[s]).collect())
            .collect();
        if ppo {
            let request = ValuesRequest {
                micro_batches: batches.clone(),
            };
            let values = pipeline
                .while_running(
                    sampler
                        .roles
                        .learner
                        .values(request)
                        .instrument(tracing::info_span!("values", step)),
                )
                .await??;
            ppo::attach_targets(&mut batches, values.values, algorithm)
                .map_err(|err| RoleError::Protocol(format!("the value head: {err}")))?;
        }
        Ok((batches, packing, layout))
    }

    /// Sends the learner's new weights to generators that hold their own; with no
    /// staleness allowed, waits until they serve them.
    async fn send_weights(
        &self,
        sampler: &Sampler<'a>,
        step: u64,
        pipeline: &mut Pipeline<'a>,
    ) -> Result<(), RunError> {
        let roles = sampler.roles;
        if !roles.learner.needs_weight_sync() {
            return Ok(());
        }
        // A trainer serves one version at a time: the previous one must have reached
        // every generator before the next replaces it.
        pipeline.finish_loading().await?;
        let published = pipeline
            .while_running(
                roles
                    .learner
                    .publish_weights(self.config.cluster.weight_bucket_bytes)
                    .instrument(tracing::info_span!("weights.publish", step)),
            )
            .await??;
        // Its own top-level span: with staleness, the load goes on into later steps.
        let version = published.announced.version;
        let loading = tracing::info_span!(parent: None, "weights.load", step, version);
        pipeline.load(roles.generator.load_weights(published).instrument(loading));
        if self.max_staleness() == 0 {
            pipeline.finish_loading().await?;
        }
        Ok(())
    }

    /// Brings the generators to the learner's current weights and waits for them (at the
    /// start, after the warm start and after a resume).
    pub(super) async fn sync_generators_now(&self, sampler: &Sampler<'a>) -> Result<(), RunError> {
        let roles = sampler.roles;
        if !roles.learner.needs_weight_sync() {
            return Ok(());
        }
        let span = tracing::info_span!("weights.sync");
        let published = roles
            .learner
            .publish_weights(self.config.cluster.weight_bucket_bytes)
            .instrument(tracing::info_span!(parent: &span, "weights.publish"))
            .await?;
        let version = published.announced.version;
        let served = roles
            .generator
            .load_weights(published)
            .instrument(tracing::info_span!(parent: &span, "weights.load", version))
            .await?;
        let checksum = served.first().map_or("", |report| report.checksum.as_str());
        tracing::info!(
            "generators serve weight version {version} (checksum {}, {} workers)",
            checksum.get(..16).unwrap_or(checksum),
            served.len()
        );
        Ok(())
    }

    /// Linear warm-up over `train.warmup_steps` RL updates, then constant.
    pub(super) fn learning_rate(&self, weight_version: u64) -> f64 {
        let rl_updates = weight_version.saturating_sub(self.state.sft_step) + 1;
        warmed_up(self.config.train.learning_rate, self.config, rl_updates)
    }
}

/// The trainer left the trajectories `excluded` (indices into `collected`) out of step
/// `step`'s update: their data was invalid or their loss not finite, which no honest
/// generation worker's sample is, so the workers that produced them are sent away as for a
/// malformed answer.
async fn send_away_producers(
    sampler: &Sampler<'_>,
    step: u64,
    collected: &Collected,
    excluded: &[usize],
) -> Result<(), RunError> {
    if excluded.is_empty() {
        return Ok(());
    }
    let mut producers: Vec<String> = excluded
        .iter()
        .filter_map(|&i| collected.trajectories.get(i))
        .flat_map(|trajectory| trajectory.producers.iter().cloned())
        .collect();
    producers.sort_unstable();
    producers.dedup();
    tracing::warn!(
        "step {step}: the trainer left {} samples out of the update (invalid data or a \
         non-finite loss){}",
        excluded.len(),
        if producers.is_empty() {
            String::new()
        } else {
            format!(
                "; sending away the workers that generated them: {}",
                producers.join(", ")
            )
        }
    );
    if producers.is_empty() {
        return Ok(());
    }
    let reason = format!("the trainer left samples it generated out of step {step}'s update");
    Ok(sampler.roles.generator.send_away(producers, reason).await?)
}

/// Weight versions between the trainer's `trained` ones and those that `generated` a row
/// (0 for a row nothing generated: it has no loss token).
fn staleness(trained: u64, generated: u64) -> u32 {
    if generated == u64::MAX {
        return 0;
    }
    u32::try_from(trained.saturating_sub(generated)).unwrap_or(u32::MAX)
}

/// `rate` for the `rl_update`-th RL update (from 1): linear warm-up over
/// `train.warmup_steps` updates, then constant.
pub(super) fn warmed_up(rate: f64, config: &Config, rl_update: u64) -> f64 {
    let warmup = config.train.warmup_steps;
    if warmup == 0 {
        return rate;
    }
    rate * (rl_update as f64 / warmup as f64).min(1.0)
}

#[cfg(test)]
mod tests {
    use super::staleness;

    #[test]
    fn staleness_is_the_versions_between_trainer_and_generator() {
        assert_eq!(staleness(5, 5), 0);
        assert_eq!(staleness(5, 3), 2);
        // Nothing generated (its episode failed before its first turn).
        assert_eq!(staleness(5, u64::MAX), 0);
    }
}
