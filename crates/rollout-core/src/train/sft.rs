//! The supervised warm start (`[sft]`): prompt -> `record[completion_key]` pairs, trained
//! with the SFT objective before RL.

use std::time::Instant;

use rollout_net::messages::{Objective, TrainRequest};
use tracing::Instrument;

use super::offline::{encode_field, supervised_sequence};
use super::sampler::Sampler;
use super::{Controller, DataCursor, MetricsLog, RunError, TrainSequence, io_error, micro_batches};
use crate::config::SftConfig;
use crate::metrics::WarmStartMetrics;
use crate::seeds::mix;

impl<'a> Controller<'a> {
    pub(super) async fn supervised_warm_start(
        &mut self,
        sampler: &Sampler<'a>,
        sft: &SftConfig,
        resumed: bool,
    ) -> Result<(), RunError> {
        let completions = encode_field(sampler, &sft.completion_key, sft.append_eos).await?;
        let log_path = self.output("sft_metrics.jsonl");
        let mut log = MetricsLog::open(&log_path, resumed.then_some(self.state.sft_step))
            .map_err(|source| io_error("cannot open", &log_path, source))?;
        let mut cursor = DataCursor::new(
            sampler.records.len(),
            mix(self.config.run.seed, 2),
            self.config.data.shuffle,
            self.state.sft_data,
        );
        let report_every = (sft.steps / 10).max(1);
        while self.state.sft_step < sft.steps && !self.stopping() {
            let line = self
                .supervised_step(sampler, sft, &completions, &mut cursor)
                .await?;
            log.append(&line)
                .map_err(|source| io_error("cannot write", &log_path, source))?;
            if self.state.sft_step % report_every == 0 || self.state.sft_step == sft.steps {
                tracing::info!(
                    "sft step {}/{}: loss {:.4}",
                    self.state.sft_step,
                    sft.steps,
                    line.loss.unwrap_or(f64::NAN)
                );
            }
        }
        Ok(())
    }

    /// One optimizer step on the cursor's next batch of (prompt, completion) pairs.
    async fn supervised_step(
        &mut self,
        sampler: &Sampler<'a>,
        sft: &SftConfig,
        completions: &[Vec<u32>],
        cursor: &mut DataCursor,
    ) -> Result<WarmStartMetrics, RunError> {
        let started = Instant::now();
        let sequences: Vec<TrainSequence> = cursor
            .take(sft.batch_size)
            .into_iter()
            .map(|index| supervised_sequence(&sampler.prompt_ids[index], &completions[index]))
            .collect();
        let (batches, packing) = micro_batches(
            &sequences,
            &Objective::Sft,
            self.config.train.micro_batch_tokens,
            false,
        );
        let mut response = sampler
            .roles
            .learner
            .train(TrainRequest {
                micro_batches: batches,
                learning_rate: sft.learning_rate,
                epochs: 1,
            })
            .instrument(tracing::info_span!(
                "sft.step",
                step = self.state.sft_step + 1
            ))
            .await?;
        self.state.sft_step += 1;
        self.state.sft_data = cursor.position();
        self.state.weight_version = response.weight_version;
        Ok(WarmStartMetrics {
            sft_step: self.state.sft_step,
            weight_version: response.weight_version,
            tokens: packing.real_tokens as u64,
            step_seconds: started.elapsed().as_secs_f64(),
            loss: response.metrics.remove("loss"),
            measured: response.metrics,
        })
    }
}
