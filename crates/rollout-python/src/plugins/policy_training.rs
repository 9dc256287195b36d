//! Training through the policy plugin: optimizer updates over micro-batches, and the value
//! head's predictions PPO asks for before an update.

use std::collections::BTreeMap;

use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use rollout_net::messages::{MicroBatch, TrainRequest, ValuesRequest};

use super::PluginError;
use super::policy::PolicyPlugin;
use crate::contract::{TrainBatch, to_python};

impl PolicyPlugin {
    /// `request.epochs` optimizer updates, each `train_step` on every micro-batch, then
    /// `apply_update`. Returns micro-batch metrics averaged by loss tokens (names ending in
    /// `_seconds` are summed) plus the last update's metrics.
    pub fn train(
        &self,
        py: Python<'_>,
        request: &TrainRequest,
    ) -> Result<BTreeMap<String, f64>, PluginError> {
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut total_tokens = 0.0;
        let mut update = BTreeMap::new();
        let passes = request.micro_batches.len();
        for _ in 0..request.epochs.max(1) {
            for (index, micro_batch) in request.micro_batches.iter().enumerate() {
                if let Some(group) = self.data_parallel.get() {
                    self.before_micro_batch(py, group, index + 1 == passes)?;
                }
                let metrics = self.train_step(py, micro_batch)?;
                let tokens = micro_batch.loss_tokens() as f64;
                total_tokens += tokens;
                for (name, value) in metrics {
                    // Times add up; everything else is a token-weighted mean (over epochs too).
                    let weight = if name.ends_with("_seconds") {
                        1.0
                    } else {
                        tokens
                    };
                    *sums.entry(name).or_default() += value * weight;
                }
            }
            if let Some(reducer) = self.data_parallel.get() {
                update.extend(self.all_reduce_gradients(py, reducer)?);
            }
            let hook = "apply_update";
            self.settle_served_version(py);
            let applied = self.plugin.call(py, hook, (request.learning_rate,))?;
            update.extend(self.float_metrics(hook, &applied)?);
        }
        if request.micro_batches.is_empty() {
            // Every sequence had a zero advantage: the loss, and its gradient, are exactly 0.
            sums.insert("loss".into(), 0.0);
        }
        let mut metrics: BTreeMap<String, f64> = sums
            .into_iter()
            .map(|(name, sum)| {
                let value = if name.ends_with("_seconds") {
                    sum
                } else if total_tokens > 0.0 {
                    sum / total_tokens
                } else {
                    0.0
                };
                (name, value)
            })
            .collect();
        metrics.extend(update);
        Ok(metrics)
    }

    fn train_step(
        &self,
        py: Python<'_>,
        batch: &MicroBatch,
    ) -> Result<BTreeMap<String, f64>, PluginError> {
        let hook = "train_step";
        let train_batch = self
            .train_batch(py, batch)
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let result = self.plugin.call(py, hook, (train_batch,))?;
        let metrics = self.float_metrics(hook, &result)?;
        match metrics.get("loss") {
            Some(loss) if loss.is_finite() => Ok(metrics),
            Some(loss) => Err(self.plugin.bad_return(
                hook,
                format!("the loss is {loss}; refusing to apply a non-finite update"),
            )),
            None => Err(self
                .plugin
                .bad_return(hook, "the returned metrics have no `loss`")),
        }
    }

    fn train_batch<'py>(&self, py: Python<'py>, batch: &MicroBatch) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, TrainBatch::from(batch))
    }

    /// The `values` hook on every micro-batch: `[rows, width]` row-major predictions each.
    pub fn values(
        &self,
        py: Python<'_>,
        request: &ValuesRequest,
    ) -> Result<Vec<Vec<f32>>, PluginError> {
        let hook = "values";
        let mut values = Vec::with_capacity(request.micro_batches.len());
        for batch in &request.micro_batches {
            let train_batch = self
                .train_batch(py, batch)
                .map_err(|err| self.plugin.raised(py, hook, &err))?;
            let result = self.plugin.call(py, hook, (train_batch,))?;
            let bad = |what: &str| self.plugin.bad_return(hook, what.to_owned());
            let array = result
                .extract::<PyReadonlyArray2<f32>>()
                .map_err(|_| bad("must return a 2-D float32 array"))?;
            if array.shape() != [batch.rows, batch.width] {
                return Err(bad(&format!(
                    "returned shape {:?}, the micro-batch is [{}, {}]",
                    array.shape(),
                    batch.rows,
                    batch.width
                )));
            }
            let row_major: Vec<f32> = array.as_array().iter().copied().collect();
            if row_major.iter().any(|v| !v.is_finite()) {
                return Err(bad("a value is NaN or infinite"));
            }
            values.push(row_major);
        }
        Ok(values)
    }
}
