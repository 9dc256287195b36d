//! The supervised warm start (`[sft]`): prompt -> `record[completion_key]` pairs, trained
//! with the SFT objective before RL.

use std::time::Instant;

use rollout_net::messages::{Objective, TrainRequest};
use serde_json::{Map, Value, json};
use tracing::Instrument;

use super::offline::supervised_sequence;
use super::{
    Controller, DataCursor, MetricsLog, RunError, TrainSequence, io_error, micro_batches, mix,
};
use crate::config::SftConfig;

impl Controller<'_> {
    pub(super) async fn supervised_warm_start(
        &mut self,
        sft: &SftConfig,
        resumed: bool,
    ) -> Result<(), RunError> {
        let completions = self
            .encode_field(&sft.completion_key, sft.append_eos)
            .await?;
        let log_path = self.output("sft_metrics.jsonl");
        let mut log = MetricsLog::open(&log_path, resumed.then_some(self.state.sft_step))
            .map_err(|source| io_error("cannot open", &log_path, source))?;
        let mut cursor = DataCursor::new(
            self.sampler.records.len(),
            mix(self.config.run.seed, 2),
            self.config.data.shuffle,
            self.state.sft_data,
        );
        let report_every = (sft.steps / 10).max(1);
        while self.state.sft_step < sft.steps && !self.stopping() {
            let started = Instant::now();
            let sequences: Vec<TrainSequence> = cursor
                .take(sft.batch_size)
                .into_iter()
                .map(|index| {
                    supervised_sequence(&self.sampler.prompt_ids[index], &completions[index])
                })
                .collect();
            let (batches, packing) = micro_batches(
                &sequences,
                &Objective::Sft,
                self.config.train.micro_batch_tokens,
                false,
            );
            let response = self
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
            let mut line = Map::new();
            line.insert("sft_step".into(), json!(self.state.sft_step));
            for (name, value) in &response.metrics {
                line.insert(name.clone(), json!(value));
            }
            line.insert("tokens".into(), json!(packing.real_tokens));
            line.insert(
                "step_seconds".into(),
                json!(started.elapsed().as_secs_f64()),
            );
            line.insert("weight_version".into(), json!(response.weight_version));
            let loss = response.metrics.get("loss").copied().unwrap_or(f64::NAN);
            log.append(&Value::Object(line))
                .map_err(|source| io_error("cannot write", &log_path, source))?;
            if self.state.sft_step % report_every == 0 || self.state.sft_step == sft.steps {
                tracing::info!(
                    "sft step {}/{}: loss {loss:.4}",
                    self.state.sft_step,
                    sft.steps
                );
            }
        }
        Ok(())
    }
}
