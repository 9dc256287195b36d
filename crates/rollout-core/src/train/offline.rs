//! Algorithms that train on the data's own completions instead of sampling: SFT (each step
//! a supervised update on `algorithm.completion_key`) and DPO (each step an update on
//! preference pairs, `algorithm.chosen_key` over `algorithm.rejected_key`). Steps, metrics,
//! checkpoints and resume work as for RL steps.

use std::time::Instant;

use rollout_net::messages::{Objective, TrainRequest};
use serde_json::Value;
use tracing::Instrument;

use super::micro_batches::pair_micro_batches;
use super::sampler::Sampler;
use super::{
    Controller, DataCursor, DataPosition, RunError, TrainSequence, micro_batches, step_metrics,
};
use crate::config::Algorithm;
use crate::metrics::StepMetrics;

/// What an SFT or DPO run trains on, tokenised once: every record's prompt and the
/// completion it is trained to (DPO: the chosen one, and the rejected one).
pub(super) struct OfflineData {
    prompts: std::sync::Arc<Vec<Vec<u32>>>,
    first: Vec<Vec<u32>>,
    rejected: Option<Vec<Vec<u32>>>,
}

impl<'a> Controller<'a> {
    /// Tokenises the completions of every record for the run's algorithm.
    pub(super) async fn offline_data(
        &self,
        sampler: &Sampler<'a>,
    ) -> Result<OfflineData, RunError> {
        let algorithm = &self.config.algorithm;
        let (first, rejected) = match algorithm.name {
            Algorithm::Dpo => (
                encode_field(sampler, &algorithm.chosen_key, true).await?,
                Some(encode_field(sampler, &algorithm.rejected_key, true).await?),
            ),
            _ => (
                encode_field(sampler, &algorithm.completion_key, true).await?,
                None,
            ),
        };
        Ok(OfflineData {
            prompts: sampler.prompt_ids.clone(),
            first,
            rejected,
        })
    }

    /// One SFT or DPO step (`step`) on the cursor's next records; returns its metrics and
    /// where the cursor stands after it.
    pub(super) async fn offline_step(
        &self,
        sampler: &Sampler<'a>,
        data: &OfflineData,
        cursor: &mut DataCursor,
        step: u64,
    ) -> Result<(StepMetrics, DataPosition), RunError> {
        let step_started = Instant::now();
        let algorithm = &self.config.algorithm;
        let epoch = cursor.position().epoch;
        let records = cursor.take(self.config.rollout.prompts_per_step);
        let sequence = |index: usize, completions: &[Vec<u32>]| {
            supervised_sequence(&data.prompts[index], &completions[index])
        };
        let (batches, packing) = match &data.rejected {
            Some(rejected) => {
                let pairs: Vec<_> = records
                    .iter()
                    .map(|&i| (sequence(i, &data.first), sequence(i, rejected)))
                    .collect();
                let objective = Objective::Dpo {
                    beta: algorithm.beta,
                };
                pair_micro_batches(&pairs, &objective, self.config.train.micro_batch_tokens)
            }
            None => {
                let sequences: Vec<_> = records.iter().map(|&i| sequence(i, &data.first)).collect();
                micro_batches(
                    &sequences,
                    &Objective::Sft,
                    self.config.train.micro_batch_tokens,
                    false,
                )
            }
        };
        let learning_rate = self.learning_rate(self.state.weight_version);
        let mut response = sampler
            .roles
            .learner
            .train(TrainRequest {
                micro_batches: batches,
                learning_rate,
                epochs: 1,
            })
            .instrument(tracing::info_span!("train"))
            .await?;
        let mut metrics = step_metrics(
            step,
            epoch,
            response.weight_version,
            step_started.elapsed().as_secs_f64(),
        );
        metrics.loss = response.metrics.remove("loss");
        metrics.measured = response.metrics;
        metrics.tokens = Some(packing.real_tokens as u64);
        metrics.micro_batches = Some(packing.micro_batches as u64);
        metrics.learning_rate = Some(learning_rate);
        Ok((metrics, cursor.position()))
    }
}

/// The token ids of `record[key]` for every record (continuations of their prompts), with
/// the end-of-sequence token appended when `append_eos`.
pub(super) async fn encode_field(
    sampler: &Sampler<'_>,
    key: &str,
    append_eos: bool,
) -> Result<Vec<Vec<u32>>, RunError> {
    let mut texts = Vec::with_capacity(sampler.records.len());
    for (index, record) in sampler.records.iter().enumerate() {
        match record.fields.get(key) {
            Some(Value::String(text)) => texts.push(text.clone()),
            Some(other) => texts.push(other.to_string()),
            None => {
                return Err(RunError::Data(format!(
                    "record {index} has no `{key}`, which every record needs here"
                )));
            }
        }
    }
    let tokenizer = sampler.roles.tokenizer;
    let mut encoded = tokenizer.encode(texts, true).await?;
    if append_eos {
        let eos = tokenizer.eos_token_ids().await?;
        let Some(&eos) = eos.first() else {
            return Err(RunError::Data(
                "appending end-of-sequence needs an EOS token, and the policy has none".into(),
            ));
        };
        for ids in &mut encoded {
            ids.push(eos);
        }
    }
    Ok(encoded)
}

/// `prompt` followed by `completion`, the loss on the completion.
pub(super) fn supervised_sequence(prompt: &[u32], completion: &[u32]) -> TrainSequence {
    let tokens: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    TrainSequence {
        loss_mask: (0..tokens.len()).map(|t| t >= prompt.len()).collect(),
        logprobs: vec![0.0; tokens.len()],
        tokens,
        advantage: 0.0,
        staleness: 0,
    }
}
