//! What a run reports: [`StepMetrics`], one line of `metrics.jsonl` per step, defined once for
//! everything that writes or reads it (the controller, `/metrics`, `rollout report`, `rollout
//! sweep` and, through `rollout_sdk.StepMetrics`, Python callbacks); and merging generators'
//! measurements over a step's requests.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Defines [`StepMetrics`]: the required fields as written, the optional ones wrapped in
/// `Option` (left out of the line when absent), and the list of both for the SDK's mirror.
macro_rules! step_metrics {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            required { $( $(#[$required_doc:meta])* $required:ident : $required_ty:ty ),* $(,)? }
            optional { $( $(#[$optional_doc:meta])* $optional:ident : $optional_ty:ty ),* $(,)? }
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            // Required of a writer; a reader takes a line without one (an older run's).
            $( $(#[$required_doc])* #[serde(default)] pub $required: $required_ty, )*
            $(
                $(#[$optional_doc])*
                #[serde(default, skip_serializing_if = "Option::is_none")]
                pub $optional: Option<$optional_ty>,
            )*
            /// Measurements named by whoever took them: the policy's training metrics besides
            /// `loss` (`grad_norm`, `kl`...), each reward's mean (`reward/<name>`), the sampling
            /// engine's (`engine/...`), the generation pool's (`workers`, `leases`...,
            /// `worker_completions/<worker>`), samples and updates left out of training
            /// (`samples_excluded_<reason>`, `updates_skipped_<reason>`) and, in a multi-agent
            /// run, each agent's (`<agent>/...`).
            #[serde(flatten)]
            pub measured: BTreeMap<String, f64>,
        }

        impl $name {
            /// Every named field and whether it is optional (`measured` aside).
            pub const FIELDS: &'static [MetricField] = &[
                $( MetricField { name: stringify!($required), optional: false }, )*
                $( MetricField { name: stringify!($optional), optional: true }, )*
            ];
        }
    };
}

/// A field of [`StepMetrics`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricField {
    pub name: &'static str,
    pub optional: bool,
}

step_metrics! {
    /// One step of a run. A sampling (RL) step fills the sampling fields, an SFT or DPO step
    /// (`[algorithm] name = "sft"|"dpo"`) the update's, a multi-agent step the episodes' and,
    /// per agent, `<agent>/...` in `measured`.
    #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
    pub struct StepMetrics {
        required {
            step: u64,
            /// The data epoch the step's records were drawn in.
            epoch: u64,
            /// The policy's weight version after the step's update.
            weight_version: u64,
            /// Wall time since the previous step ended.
            step_seconds: f64,
            /// Wall time since the run (or its resume) started.
            elapsed_seconds: f64,
        }
        optional {
            learning_rate: f64,
            /// The update's token-mean loss.
            loss: f64,
            /// Mean and deviation of the scored samples' rewards (multi-agent: the agents'
            /// mean returns, averaged).
            reward_mean: f64,
            reward_std: f64,
            /// Samples whose reward could not be computed, in all and by reason.
            reward_failed: u64,
            reward_failed_raised: u64,
            reward_failed_timeout: u64,
            reward_failed_crashed: u64,
            reward_failed_memory: u64,
            reward_failed_invalid: u64,
            /// Multi-turn: the mean return of the episodes played to their end.
            env_return_mean: f64,
            /// Multi-turn: episodes whose environment failed, in all and by reason.
            environment_failed: u64,
            environment_failed_raised: u64,
            environment_failed_timeout: u64,
            environment_failed_crashed: u64,
            environment_failed_memory: u64,
            environment_failed_invalid: u64,
            environment_failed_restarted: u64,
            completions: u64,
            prompt_tokens: u64,
            /// Tokens of the trained sequences, prompts and observations included.
            sequence_tokens: u64,
            generated_tokens: u64,
            completion_length_mean: f64,
            completion_length_max: u64,
            /// Completions cut off at `max_new_tokens`.
            truncated_fraction: f64,
            /// Groups whose rewards were all equal (no advantage).
            zero_std_group_fraction: f64,
            /// DAPO dynamic sampling: groups replaced, and the rounds it took.
            refilled_groups: u64,
            refill_rounds: u32,
            /// Groups generated again for lagging past `cluster.max_staleness`, and those
            /// still stale after the last round, left out of the update.
            stale_groups_regenerated: u64,
            stale_groups_dropped: u64,
            micro_batches: u64,
            trained_rows: u64,
            /// Rows with exactly zero advantage, left out of the update.
            skipped_rows: u64,
            padding_fraction: f64,
            /// SFT and DPO: tokens the loss was computed on.
            tokens: u64,
            generate_seconds: f64,
            score_seconds: f64,
            train_seconds: f64,
            weight_sync_seconds: f64,
            /// Weight versions the step's samples lag the trained policy: most and mean.
            staleness_max: u64,
            staleness_mean: f64,
            samples_per_second: f64,
            tokens_per_second: f64,
            /// The oldest weight version that generated any of the step's samples.
            generation_weight_version: u64,
            /// Multi-agent: episodes played, their mean turns, those cut at `max_turns`.
            episodes: u64,
            episode_turns_mean: f64,
            truncated_episodes: u64,
            environment_seconds: f64,
        }
    }
}

/// One line of `sft_metrics.jsonl`: a step of the supervised warm start (`[sft]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WarmStartMetrics {
    pub sft_step: u64,
    /// The policy's weight version after the step's update.
    pub weight_version: u64,
    /// Tokens the loss was computed on.
    pub tokens: u64,
    pub step_seconds: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// The policy's other training metrics.
    #[serde(flatten)]
    pub measured: BTreeMap<String, f64>,
}

impl StepMetrics {
    /// The line as `metrics.jsonl` holds it (and callbacks receive it): a JSON object with its
    /// keys in sorted order.
    pub fn to_line(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// Reads a line of `metrics.jsonl`.
    pub fn from_line(line: &str) -> Result<Self, serde_json::Error> {
        Self::from_value(serde_json::from_str(line)?)
    }

    /// Reads a line of `metrics.jsonl` parsed as JSON. Counts written as floats (`2.0`, as
    /// earlier versions wrote some) read as the integers they are.
    pub fn from_value(mut value: serde_json::Value) -> Result<Self, serde_json::Error> {
        if let serde_json::Value::Object(fields) = &mut value {
            for field in fields.values_mut() {
                if let Some(integer) = field.as_f64().and_then(as_count) {
                    *field = integer.into();
                }
            }
        }
        serde_json::from_value(value)
    }

    /// Every numeric field by its name in the line, `measured` ones included.
    pub fn values(&self) -> BTreeMap<String, f64> {
        match self.to_line() {
            serde_json::Value::Object(fields) => fields
                .into_iter()
                .filter_map(|(name, value)| Some((name, value.as_f64()?)))
                .collect(),
            _ => BTreeMap::new(),
        }
    }
}

/// `value` as a count, when it is a whole number a `u64` holds.
fn as_count(value: f64) -> Option<u64> {
    (value.fract() == 0.0 && (0.0..=u64::MAX as f64).contains(&value)).then_some(value as u64)
}

/// Whether a trainer's measurement counts events rather than averaging them: samples left
/// out of an update (`samples_excluded_<reason>`) and updates not applied
/// (`updates_skipped_<reason>`). Counts add up over micro-batches and updates.
pub fn is_trainer_count(name: &str) -> bool {
    name.starts_with("samples_excluded_") || name.starts_with("updates_skipped_")
}

/// Combines the metrics of several generation requests (the turns of a multi-turn step):
/// counts add up, per-step means are weighted by steps and ratios are recomputed.
pub fn merge_metrics(parts: &[BTreeMap<String, f64>]) -> BTreeMap<String, f64> {
    let sum = |name: &str| -> f64 { parts.iter().filter_map(|p| p.get(name)).sum() };
    let mut merged = BTreeMap::new();
    for part in parts {
        for (name, value) in part {
            let entry = merged.entry(name.clone()).or_insert(0.0);
            match name.as_str() {
                "engine/kv_blocks" => *entry = f64::max(*entry, *value),
                "engine/kv_utilisation_mean"
                | "engine/kv_occupancy_mean"
                | "engine/batch_tokens_mean" => {
                    *entry += value * part.get("engine/steps").copied().unwrap_or(0.0)
                }
                _ => *entry += value,
            }
        }
    }
    let steps = sum("engine/steps");
    for name in [
        "engine/kv_utilisation_mean",
        "engine/kv_occupancy_mean",
        "engine/batch_tokens_mean",
    ] {
        if let Some(value) = merged.get_mut(name) {
            *value = if steps > 0.0 { *value / steps } else { 0.0 };
        }
    }
    let seconds = sum("engine/seconds");
    if let Some(value) = merged.get_mut("engine/overhead_fraction") {
        *value = if seconds > 0.0 {
            (1.0 - sum("engine/forward_seconds") / seconds).max(0.0)
        } else {
            0.0
        };
    }
    if let Some(value) = merged.get_mut("engine/acceptance_rate") {
        let drafted = sum("engine/drafted_tokens");
        *value = if drafted > 0.0 {
            sum("engine/accepted_tokens") / drafted
        } else {
            0.0
        };
    }
    merged
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_line_keeps_sorted_keys_leaves_out_what_is_absent_and_reads_back() {
        let metrics = StepMetrics {
            step: 3,
            epoch: 1,
            weight_version: 7,
            step_seconds: 0.5,
            elapsed_seconds: 2.0,
            reward_mean: Some(0.25),
            completions: Some(8),
            measured: BTreeMap::from([("grad_norm".to_owned(), 1.0)]),
            ..StepMetrics::default()
        };
        let text = serde_json::to_string(&metrics.to_line()).unwrap();
        assert_eq!(
            text,
            r#"{"completions":8,"elapsed_seconds":2.0,"epoch":1,"grad_norm":1.0,"reward_mean":0.25,"step":3,"step_seconds":0.5,"weight_version":7}"#
        );
        assert_eq!(StepMetrics::from_line(&text).unwrap(), metrics);
    }

    #[test]
    fn counts_written_as_floats_read_as_integers() {
        let line = r#"{"step":2,"epoch":0,"weight_version":2.0,"step_seconds":1,"elapsed_seconds":3.5,"loss":1.0}"#;
        let metrics = StepMetrics::from_line(line).unwrap();
        assert_eq!((metrics.weight_version, metrics.loss), (2, Some(1.0)));
        assert!(StepMetrics::from_line(r#"{"step":"two"}"#).is_err());
    }

    #[test]
    fn fields_list_every_named_field_with_its_optionality() {
        let full = serde_json::to_value(StepMetrics {
            learning_rate: Some(0.0),
            ..StepMetrics::default()
        })
        .unwrap();
        let required: Vec<&str> = StepMetrics::FIELDS
            .iter()
            .filter(|f| !f.optional)
            .map(|f| f.name)
            .collect();
        let mut present: Vec<&str> = full
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        present.retain(|name| *name != "learning_rate");
        present.sort_unstable();
        let mut expected = required.clone();
        expected.sort_unstable();
        assert_eq!(present, expected);
        assert!(
            StepMetrics::FIELDS
                .iter()
                .any(|f| f.name == "learning_rate" && f.optional)
        );
    }
    #[test]
    fn merging_adds_counts_and_reweights_means() {
        let first = BTreeMap::from([
            ("engine/steps".to_owned(), 2.0),
            ("engine/seconds".to_owned(), 1.0),
            ("engine/forward_seconds".to_owned(), 0.9),
            ("engine/overhead_fraction".to_owned(), 0.1),
            ("engine/kv_utilisation_mean".to_owned(), 0.5),
            ("engine/kv_blocks".to_owned(), 64.0),
            ("engine/drafted_tokens".to_owned(), 10.0),
            ("engine/accepted_tokens".to_owned(), 5.0),
            ("engine/acceptance_rate".to_owned(), 0.5),
        ]);
        let second = BTreeMap::from([
            ("engine/steps".to_owned(), 6.0),
            ("engine/seconds".to_owned(), 3.0),
            ("engine/forward_seconds".to_owned(), 2.1),
            ("engine/overhead_fraction".to_owned(), 0.3),
            ("engine/kv_utilisation_mean".to_owned(), 0.9),
            ("engine/kv_blocks".to_owned(), 64.0),
            ("engine/drafted_tokens".to_owned(), 30.0),
            ("engine/accepted_tokens".to_owned(), 27.0),
            ("engine/acceptance_rate".to_owned(), 0.9),
        ]);
        let merged = merge_metrics(&[first, second]);
        let close = |name: &str, expected: f64| {
            let got = merged[name];
            assert!(
                (got - expected).abs() < 1e-12,
                "{name}: {got} != {expected}"
            );
        };
        close("engine/steps", 8.0);
        close("engine/seconds", 4.0);
        close("engine/overhead_fraction", 0.25);
        close("engine/kv_utilisation_mean", (0.5 * 2.0 + 0.9 * 6.0) / 8.0);
        close("engine/kv_blocks", 64.0);
        close("engine/acceptance_rate", 32.0 / 40.0);
    }
}
