//! Training through the policy plugin: optimizer updates over micro-batches, and the value
//! head's predictions PPO asks for before an update.
//!
//! Nothing a sample carries can poison an update. Each micro-batch is screened first (token
//! ids inside the vocabulary, behaviour logprobs a sampler could give): a row that fails is
//! left out (`samples_excluded_invalid`). Rows whose loss is not finite are left out by the
//! objective (`samples_excluded_nonfinite`, from `train_step`'s `excluded_rows`). Before each
//! optimizer step every trainer rank says whether its losses and gradients are finite; if
//! any is not, every rank drops the update (`updates_skipped_nonfinite`) and warns.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use numpy::{PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping};
use rollout_core::metrics::is_trainer_count;
use rollout_core::mismatch;
use rollout_core::train::screen::{invalid_rows, without_rows};
use rollout_net::messages::{ExcludedRow, Exclusion, MicroBatch, TrainRequest, ValuesRequest};

use super::PluginError;
use super::policy::PolicyPlugin;
use crate::contract::{Array, TrainBatch, to_python};

/// One `train_step`'s answer: its metrics, the rows it left out of the loss, and the
/// trainer's logprobs at its first evaluation when a rollout correction asks for them back in
/// later epochs (`[rows, width]` row-major).
struct StepOutcome {
    metrics: BTreeMap<String, f64>,
    excluded_rows: Vec<u32>,
    first_logprobs: Option<Vec<f32>>,
}

/// An update's metrics as they accumulate over micro-batches and epochs.
#[derive(Default)]
struct Accumulated {
    /// Token-weighted sums (times and counts: plain sums).
    sums: BTreeMap<String, f64>,
    tokens: f64,
    /// The last update's own metrics (counts added up over updates).
    update: BTreeMap<String, f64>,
    skipped: f64,
    /// The first epoch's raw mismatch measurements, combined by their rules: they compare
    /// the generator with the trainer at its first evaluation of the samples.
    mismatch: BTreeMap<String, f64>,
}

impl Accumulated {
    fn add_step(&mut self, metrics: BTreeMap<String, f64>, tokens: f64, first_epoch: bool) {
        self.tokens += tokens;
        for (name, value) in metrics.into_iter().filter(|(_, v)| v.is_finite()) {
            if let Some(rule) = mismatch::rule(&name) {
                if first_epoch {
                    mismatch::merge(&mut self.mismatch, &name, value, rule);
                }
                continue;
            }
            // Times and counts add up; everything else is a token-weighted mean (over
            // epochs too).
            let weight = if name.ends_with("_seconds") || is_trainer_count(&name) {
                1.0
            } else {
                tokens
            };
            *self.sums.entry(name).or_default() += value * weight;
        }
    }

    fn add_update(&mut self, metrics: BTreeMap<String, f64>) {
        for (name, value) in metrics {
            let entry = self.update.entry(name.clone()).or_default();
            *entry = if is_trainer_count(&name) {
                *entry + value
            } else {
                value
            };
        }
    }

    fn into_metrics(self, excluded: &BTreeSet<ExcludedRow>) -> BTreeMap<String, f64> {
        let (sums, tokens) = (self.sums, self.tokens);
        let mut metrics: BTreeMap<String, f64> = sums
            .into_iter()
            .map(|(name, sum)| {
                let value = if name.ends_with("_seconds") || is_trainer_count(&name) {
                    sum
                } else if tokens > 0.0 {
                    sum / tokens
                } else {
                    0.0
                };
                (name, value)
            })
            .collect();
        metrics.extend(self.update);
        metrics.extend(self.mismatch);
        let count = |reason| excluded.iter().filter(|row| row.reason == reason).count();
        metrics.insert(
            "samples_excluded_invalid".into(),
            count(Exclusion::Invalid) as f64,
        );
        metrics.insert(
            "samples_excluded_nonfinite".into(),
            count(Exclusion::NonFinite) as f64,
        );
        *metrics
            .entry("updates_skipped_nonfinite".into())
            .or_default() += self.skipped;
        metrics
    }
}

impl PolicyPlugin {
    /// `request.epochs` optimizer updates, each `train_step` on every micro-batch, then
    /// `apply_update` (unless the update is dropped for not being finite). Returns
    /// micro-batch metrics averaged by loss tokens (names ending in `_seconds`, and counts,
    /// are summed) plus the last update's metrics, and the rows left out.
    pub fn train(
        &self,
        py: Python<'_>,
        request: &TrainRequest,
    ) -> Result<(BTreeMap<String, f64>, Vec<ExcludedRow>), PluginError> {
        let (batches, mut excluded) = self.screen(&request.micro_batches);
        let mut accumulated = Accumulated::default();
        let passes = batches.len();
        let epochs = request.epochs.max(1);
        let mut first_logprobs: Vec<Option<Vec<f32>>> = vec![None; passes];
        for epoch in 0..epochs {
            let mut losses_finite = true;
            for (index, micro_batch) in batches.iter().enumerate() {
                if let Some(group) = self.data_parallel.get() {
                    self.before_micro_batch(py, group, index + 1 == passes)?;
                }
                let first = first_logprobs[index].as_deref();
                let mut outcome = self.train_step(py, micro_batch, first)?;
                if epoch == 0 && epochs > 1 {
                    first_logprobs[index] = outcome.first_logprobs.take();
                }
                losses_finite &= outcome.metrics.get("loss").is_some_and(|l| l.is_finite());
                excluded.extend(outcome.excluded_rows.iter().map(|&row| ExcludedRow {
                    micro_batch: index as u32,
                    row,
                    reason: Exclusion::NonFinite,
                }));
                let tokens = micro_batch.loss_tokens() as f64;
                accumulated.add_step(outcome.metrics, tokens, epoch == 0);
            }
            if !self.update_is_finite(py, losses_finite)? {
                accumulated.skipped += 1.0;
                continue;
            }
            if let Some(reducer) = self.data_parallel.get() {
                accumulated.add_update(self.all_reduce_gradients(py, reducer)?);
            }
            let hook = "apply_update";
            self.settle_served_version(py);
            let applied = self.plugin.call(py, hook, (request.learning_rate,))?;
            accumulated.add_update(self.float_metrics(hook, &applied)?);
        }
        if request.micro_batches.is_empty() {
            // Every sequence had a zero advantage: the loss, and its gradient, are exactly 0.
            accumulated.sums.insert("loss".into(), 0.0);
        }
        let metrics = accumulated.into_metrics(&excluded);
        warn_of_skipped_updates(&metrics);
        Ok((metrics, excluded.into_iter().collect()))
    }

    /// `batches` with their invalid rows left out (a copy only of the batches that have
    /// one), and those rows.
    fn screen<'b>(
        &self,
        batches: &'b [MicroBatch],
    ) -> (Vec<Cow<'b, MicroBatch>>, BTreeSet<ExcludedRow>) {
        let mut excluded = BTreeSet::new();
        let screened = batches
            .iter()
            .enumerate()
            .map(|(index, batch)| {
                let rows = invalid_rows(batch, self.vocabulary);
                if rows.is_empty() {
                    return Cow::Borrowed(batch);
                }
                excluded.extend(rows.iter().map(|&row| ExcludedRow {
                    micro_batch: index as u32,
                    row: row as u32,
                    reason: Exclusion::Invalid,
                }));
                Cow::Owned(without_rows(batch, &rows))
            })
            .collect();
        (screened, excluded)
    }

    /// Whether the update may be applied: every trainer rank's losses (`losses_finite` here)
    /// and gradients are finite. Otherwise the gradients are dropped on every rank. A policy
    /// without `trainable_parameters` (no data-parallel group) is trusted with its own
    /// gradients, but a non-finite loss still fails the update there: it cannot be dropped.
    fn update_is_finite(&self, py: Python<'_>, losses_finite: bool) -> Result<bool, PluginError> {
        let hook = "trainable_parameters";
        let parameters = match self.plugin.object.bind(py).call_method0(hook) {
            Ok(parameters) => parameters,
            Err(err) if err.is_instance_of::<pyo3::exceptions::PyNotImplementedError>(py) => {
                return if losses_finite {
                    Ok(true)
                } else {
                    Err(self.plugin.bad_return(
                        "train_step",
                        "the loss is not finite, and without `trainable_parameters` the \
                         update cannot be dropped; refusing to apply it",
                    ))
                };
            }
            Err(err) => return Err(self.plugin.raised(py, hook, &err)),
        };
        let distributed = py
            .import("rollout_sdk.distributed")
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let finite: bool = distributed
            .call_method1("update_is_finite", (parameters.clone(), losses_finite))
            .and_then(|finite| finite.extract())
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        if !finite {
            distributed
                .call_method1("discard_gradients", (parameters,))
                .map_err(|err| self.plugin.raised(py, hook, &err))?;
        }
        Ok(finite)
    }

    /// `train_step` on `batch`, given the trainer's logprobs at its `first` evaluation of it
    /// (from the second epoch on, when a rollout correction returned them).
    fn train_step(
        &self,
        py: Python<'_>,
        batch: &MicroBatch,
        first: Option<&[f32]>,
    ) -> Result<StepOutcome, PluginError> {
        let hook = "train_step";
        let mut contract = TrainBatch::from(batch);
        contract.first_logprobs = first.map(|v| Array::matrix(v.to_vec(), batch.rows, batch.width));
        let train_batch =
            to_python(py, contract).map_err(|err| self.plugin.raised(py, hook, &err))?;
        let result = self.plugin.call(py, hook, (train_batch,))?;
        let bad = |reason: &str| self.plugin.bad_return(hook, reason.to_owned());
        let returned = result
            .cast::<PyMapping>()
            .map_err(|_| bad("must return a mapping of str to float"))?;
        let metrics = PyDict::new(py);
        metrics
            .update(returned)
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let excluded_rows: Vec<u32> = match metrics.get_item("excluded_rows") {
            Ok(Some(rows)) => rows
                .extract()
                .map_err(|_| bad("`excluded_rows` must be a list of row indices"))?,
            _ => Vec::new(),
        };
        if let Some(row) = excluded_rows
            .iter()
            .find(|&&row| row as usize >= batch.rows)
        {
            return Err(bad(&format!(
                "`excluded_rows` names row {row} of a micro-batch of {} rows",
                batch.rows
            )));
        }
        let _ = metrics.del_item("excluded_rows");
        let first_logprobs = self.returned_first_logprobs(&metrics, batch)?;
        let metrics = self.float_metrics(hook, metrics.as_any())?;
        if !metrics.contains_key("loss") {
            return Err(bad("the returned metrics have no `loss`"));
        }
        Ok(StepOutcome {
            metrics,
            excluded_rows,
            first_logprobs,
        })
    }

    /// The `first_logprobs` entry of `train_step`'s answer (taken out of `metrics`): a
    /// float32 array of the micro-batch's shape, row-major.
    fn returned_first_logprobs(
        &self,
        metrics: &Bound<'_, PyDict>,
        batch: &MicroBatch,
    ) -> Result<Option<Vec<f32>>, PluginError> {
        let hook = "train_step";
        let Ok(Some(returned)) = metrics.get_item("first_logprobs") else {
            return Ok(None);
        };
        let _ = metrics.del_item("first_logprobs");
        let bad = |reason: String| self.plugin.bad_return(hook, reason);
        let array = returned
            .extract::<PyReadonlyArray2<f32>>()
            .map_err(|_| bad("`first_logprobs` must be a 2-D float32 array".into()))?;
        if array.shape() != [batch.rows, batch.width] {
            return Err(bad(format!(
                "`first_logprobs` has shape {:?}, the micro-batch is [{}, {}]",
                array.shape(),
                batch.rows,
                batch.width
            )));
        }
        Ok(Some(array.as_array().iter().copied().collect()))
    }

    fn train_batch<'py>(&self, py: Python<'py>, batch: &MicroBatch) -> PyResult<Bound<'py, PyAny>> {
        to_python(py, TrainBatch::from(batch))
    }

    /// The `values` hook on every micro-batch (screened as for training): `[rows, width]`
    /// row-major predictions each.
    pub fn values(
        &self,
        py: Python<'_>,
        request: &ValuesRequest,
    ) -> Result<Vec<Vec<f32>>, PluginError> {
        let hook = "values";
        let (batches, _) = self.screen(&request.micro_batches);
        let mut values = Vec::with_capacity(batches.len());
        for batch in &batches {
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

/// An update not applied is never silent: it is counted and warned of.
fn warn_of_skipped_updates(metrics: &BTreeMap<String, f64>) {
    let skipped = metrics
        .get("updates_skipped_nonfinite")
        .copied()
        .unwrap_or(0.0);
    if skipped > 0.0 {
        tracing::warn!(
            "{skipped} optimizer update(s) dropped on every trainer rank: a loss or gradient \
             was not finite (updates_skipped_nonfinite)"
        );
    }
}
