//! Algorithms that train on the data's own completions instead of sampling: SFT (each step
//! a supervised update on `algorithm.completion_key`) and DPO (each step an update on
//! preference pairs, `algorithm.chosen_key` over `algorithm.rejected_key`). Steps, metrics,
//! checkpoints and resume work as for RL steps.

use std::time::Instant;

use rollout_net::messages::{Objective, TrainRequest};
use serde_json::{Map, Value, json};
use tracing::Instrument;

use super::batch::{PackingStats, pair_micro_batches};
use super::{
    Controller, DataCursor, MetricsLog, RunError, TrainSequence, io_error, micro_batches, mix,
};
use crate::config::Algorithm;

impl Controller<'_> {
    /// Every step of an SFT or DPO run, checkpointing when due.
    pub(super) async fn offline_steps(&mut self, metrics: &mut MetricsLog) -> Result<(), RunError> {
        let algorithm = &self.config.algorithm;
        let prompts = self.sampler.prompt_ids.clone();
        let (first, second) = match algorithm.name {
            Algorithm::Dpo => (
                self.encode_field(&algorithm.chosen_key, true).await?,
                Some(self.encode_field(&algorithm.rejected_key, true).await?),
            ),
            _ => (
                self.encode_field(&algorithm.completion_key, true).await?,
                None,
            ),
        };
        let mut cursor = DataCursor::new(
            self.sampler.records.len(),
            mix(self.config.run.seed, 1),
            self.config.data.shuffle,
            self.state.data,
        );
        let started = Instant::now();
        while self.state.step < self.config.run.steps && !self.stopping() {
            let step_started = Instant::now();
            let epoch = cursor.position().epoch;
            let records = cursor.take(self.config.rollout.prompts_per_step);
            let sequence = |index: usize, completions: &[Vec<u32>]| {
                supervised_sequence(&prompts[index], &completions[index])
            };
            let (batches, packing) = match &second {
                Some(rejected) => {
                    let pairs: Vec<_> = records
                        .iter()
                        .map(|&i| (sequence(i, &first), sequence(i, rejected)))
                        .collect();
                    let objective = Objective::Dpo {
                        beta: algorithm.beta,
                    };
                    pair_micro_batches(&pairs, &objective, self.config.train.micro_batch_tokens)
                }
                None => {
                    let sequences: Vec<_> = records.iter().map(|&i| sequence(i, &first)).collect();
                    micro_batches(
                        &sequences,
                        &Objective::Sft,
                        self.config.train.micro_batch_tokens,
                        false,
                    )
                }
            };
            let learning_rate = self.learning_rate(self.state.weight_version);
            let span = tracing::info_span!("step", step = self.state.step + 1);
            let response = self
                .roles
                .learner
                .train(TrainRequest {
                    micro_batches: batches,
                    learning_rate,
                    epochs: 1,
                })
                .instrument(tracing::info_span!(parent: &span, "train"))
                .await?;
            self.state.step += 1;
            self.state.data = cursor.position();
            self.state.weight_version = response.weight_version;
            let line = step_line(
                self.state.step,
                epoch,
                &response.metrics,
                &packing,
                [
                    ("learning_rate", learning_rate),
                    ("step_seconds", step_started.elapsed().as_secs_f64()),
                    ("elapsed_seconds", started.elapsed().as_secs_f64()),
                    ("weight_version", response.weight_version as f64),
                ],
            );
            metrics
                .append(&line)
                .map_err(|source| io_error("cannot write", metrics.path(), source))?;
            self.roles
                .observer
                .step_ended(self.state.step, line)
                .instrument(span.clone())
                .await;
            self.reap_checkpoint().instrument(span.clone()).await?;
            let every = self.config.checkpoint.every;
            if every > 0 && self.state.step % every == 0 {
                self.checkpoint().instrument(span).await?;
            }
        }
        Ok(())
    }

    /// The token ids of `record[key]` for every record (continuations of their prompts),
    /// with the end-of-sequence token appended when `append_eos`.
    pub(super) async fn encode_field(
        &self,
        key: &str,
        append_eos: bool,
    ) -> Result<Vec<Vec<u32>>, RunError> {
        let mut texts = Vec::with_capacity(self.sampler.records.len());
        for (index, record) in self.sampler.records.iter().enumerate() {
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
        let mut encoded = self.roles.tokenizer.encode(texts, true).await?;
        if append_eos {
            let eos = self.roles.tokenizer.eos_token_ids().await?;
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
}

/// `prompt` followed by `completion`, the loss on the completion.
pub(super) fn supervised_sequence(prompt: &[u32], completion: &[u32]) -> TrainSequence {
    let tokens: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    TrainSequence {
        loss_mask: (0..tokens.len()).map(|t| t >= prompt.len()).collect(),
        logprobs: vec![0.0; tokens.len()],
        tokens,
        advantage: 0.0,
    }
}

fn step_line<const N: usize>(
    step: u64,
    epoch: u64,
    trained: &std::collections::BTreeMap<String, f64>,
    packing: &PackingStats,
    extra: [(&str, f64); N],
) -> Value {
    let mut line = Map::new();
    line.insert("step".into(), json!(step));
    line.insert("epoch".into(), json!(epoch));
    for (name, value) in trained {
        line.insert(name.clone(), json!(value));
    }
    line.insert("tokens".into(), json!(packing.real_tokens));
    line.insert("micro_batches".into(), json!(packing.micro_batches));
    for (name, value) in extra {
        line.insert(name.into(), json!(value));
    }
    Value::Object(line)
}
