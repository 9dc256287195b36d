//! The run's series, set from each step's `metrics.jsonl` line.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::StepMetrics;
use crate::roles::RunStarted;

pub(super) type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RewardLabels {
    pub reward: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct WorkerLabel {
    pub worker: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReasonLabel {
    pub reason: String,
}

/// Every series the step lines feed.
#[derive(Default)]
pub(super) struct Series {
    step: Gauge,
    run_steps: Gauge,
    start_step: Gauge,
    steps: Counter,
    last_step_time: FloatGauge,
    checkpoint_step: Gauge,
    reward_mean: FloatGauge,
    reward_std: FloatGauge,
    rewards: Family<RewardLabels, FloatGauge>,
    loss: FloatGauge,
    tokens_per_second: FloatGauge,
    samples_per_second: FloatGauge,
    step_seconds: FloatGauge,
    generated_tokens: Counter,
    completions: Counter,
    reward_failed: Counter,
    kv_utilisation: FloatGauge,
    kv_occupancy: FloatGauge,
    kv_blocks: FloatGauge,
    weight_version: Gauge,
    generation_weight_version: Gauge,
    staleness_max: FloatGauge,
    staleness_mean: FloatGauge,
    worker_completions: Family<WorkerLabel, Counter>,
    samples_excluded: Family<ReasonLabel, Counter>,
    updates_skipped: Family<ReasonLabel, Counter>,
}

/// A series' name and HELP text.
type Described<'a, M> = (&'static str, &'static str, &'a M);

/// A float gauge set from a field of the step's metrics.
type Keyed<'a> = (
    &'static str,
    &'static str,
    &'a FloatGauge,
    fn(&StepMetrics) -> Option<f64>,
);

impl Series {
    pub fn register(registry: &mut Registry) -> Self {
        let series = Series::default();
        for (name, help, gauge) in series.integer_gauges() {
            registry.register(name, help, gauge.clone());
        }
        let keyed = series.step_gauges().into_iter();
        for (name, help, gauge, _) in keyed.chain(series.engine_gauges()) {
            registry.register(name, help, gauge.clone());
        }
        registry.register(
            "rollout_last_step_timestamp_seconds",
            "When the last RL step ended (Unix time)",
            series.last_step_time.clone(),
        );
        for (name, help, counter) in series.counters() {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "rollout_reward_component",
            "Mean of each reward over the last step's scored samples (reward/<name>)",
            series.rewards.clone(),
        );
        registry.register(
            "rollout_worker_completions",
            "Completions each generation worker delivered in completed steps",
            series.worker_completions.clone(),
        );
        registry.register(
            "rollout_samples_excluded",
            "Samples left out of training, by reason (samples_excluded_<reason>)",
            series.samples_excluded.clone(),
        );
        registry.register(
            "rollout_updates_skipped",
            "Optimizer updates not applied, by reason (updates_skipped_<reason>)",
            series.updates_skipped.clone(),
        );
        series
    }

    fn integer_gauges(&self) -> [Described<'_, Gauge>; 6] {
        [
            ("rollout_step", "The last RL step completed", &self.step),
            (
                "rollout_run_steps",
                "RL steps the run is configured for (run.steps)",
                &self.run_steps,
            ),
            (
                "rollout_start_step",
                "The RL step this process started or resumed from",
                &self.start_step,
            ),
            (
                "rollout_checkpoint_step",
                "The step of the last checkpoint written",
                &self.checkpoint_step,
            ),
            (
                "rollout_weight_version",
                "The policy's weight version after the last update",
                &self.weight_version,
            ),
            (
                "rollout_generation_weight_version",
                "The oldest weight version that generated a sample of the last step",
                &self.generation_weight_version,
            ),
        ]
    }

    fn counters(&self) -> [Described<'_, Counter>; 4] {
        [
            (
                "rollout_steps",
                "RL steps completed by this process",
                &self.steps,
            ),
            (
                "rollout_generated_tokens",
                "Completion tokens generated in completed steps",
                &self.generated_tokens,
            ),
            (
                "rollout_completions",
                "Completions sampled in completed steps",
                &self.completions,
            ),
            (
                "rollout_reward_failed",
                "Samples whose reward failed: raised, timed out, crashed or ran out of memory",
                &self.reward_failed,
            ),
        ]
    }

    fn step_gauges(&self) -> [Keyed<'_>; 6] {
        [
            (
                "rollout_reward_mean",
                "Mean reward of the last step's scored samples",
                &self.reward_mean,
                |m| m.reward_mean,
            ),
            (
                "rollout_reward_std",
                "Standard deviation of the last step's rewards",
                &self.reward_std,
                |m| m.reward_std,
            ),
            (
                "rollout_loss",
                "The last update's training loss",
                &self.loss,
                |m| m.loss,
            ),
            (
                "rollout_tokens_per_second",
                "Generated tokens per second of the last step",
                &self.tokens_per_second,
                |m| m.tokens_per_second,
            ),
            (
                "rollout_samples_per_second",
                "Completions per second of the last step",
                &self.samples_per_second,
                |m| m.samples_per_second,
            ),
            (
                "rollout_step_seconds",
                "Wall time of the last step",
                &self.step_seconds,
                |m| Some(m.step_seconds),
            ),
        ]
    }

    fn engine_gauges(&self) -> [Keyed<'_>; 5] {
        [
            (
                "rollout_kv_cache_utilisation",
                "Live tokens over the slots of held KV-cache blocks, mean over the last step's engine steps",
                &self.kv_utilisation,
                |m| m.measured.get("engine/kv_utilisation_mean").copied(),
            ),
            (
                "rollout_kv_cache_occupancy",
                "Live tokens over the whole KV cache, mean over the last step's engine steps",
                &self.kv_occupancy,
                |m| m.measured.get("engine/kv_occupancy_mean").copied(),
            ),
            (
                "rollout_kv_cache_blocks",
                "Blocks in the KV cache(s) that generated the last step",
                &self.kv_blocks,
                |m| m.measured.get("engine/kv_blocks").copied(),
            ),
            (
                "rollout_staleness_max",
                "Most weight versions a sample of the last step lagged the trained policy",
                &self.staleness_max,
                |m| m.staleness_max.map(|s| s as f64),
            ),
            (
                "rollout_staleness_mean",
                "Mean weight versions the last step's samples lagged the trained policy",
                &self.staleness_mean,
                |m| m.staleness_mean,
            ),
        ]
    }

    pub fn run_started(&self, info: &RunStarted) {
        self.run_steps.set(as_i64(info.total_steps));
        self.start_step.set(as_i64(info.start_step));
        self.step.set(as_i64(info.start_step));
    }

    pub fn checkpoint_written(&self, step: u64) {
        self.checkpoint_step.set(as_i64(step));
    }

    /// Sets the series from one step's metrics, ended at `now` (Unix seconds).
    pub fn step_ended(&self, metrics: &StepMetrics, now: f64) {
        self.step.set(as_i64(metrics.step));
        self.steps.inc();
        self.last_step_time.set(now);
        for (_, _, gauge, field) in self.step_gauges().into_iter().chain(self.engine_gauges()) {
            if let Some(value) = field(metrics) {
                gauge.set(value);
            }
        }
        self.weight_version.set(as_i64(metrics.weight_version));
        if let Some(version) = metrics.generation_weight_version {
            self.generation_weight_version.set(as_i64(version));
        }
        let counts = [
            (&self.generated_tokens, metrics.generated_tokens),
            (&self.completions, metrics.completions),
            (&self.reward_failed, metrics.reward_failed),
        ];
        for (counter, count) in counts {
            if let Some(count) = count.filter(|&n| n > 0) {
                counter.inc_by(count);
            }
        }
        self.per_name(&metrics.measured);
    }

    /// `reward/<name>`, `worker_completions/<name>`, `samples_excluded_<reason>` and
    /// `updates_skipped_<reason>`.
    fn per_name(&self, measured: &std::collections::BTreeMap<String, f64>) {
        for (key, &value) in measured {
            let counted = [
                ("samples_excluded_", &self.samples_excluded),
                ("updates_skipped_", &self.updates_skipped),
            ];
            for (prefix, family) in counted {
                if let Some(reason) = key.strip_prefix(prefix)
                    && value.is_finite()
                    && value > 0.0
                {
                    let labels = ReasonLabel {
                        reason: reason.to_owned(),
                    };
                    family.get_or_create(&labels).inc_by(value as u64);
                }
            }
            if let Some(reward) = key.strip_prefix("reward/") {
                let labels = RewardLabels {
                    reward: reward.to_owned(),
                };
                self.rewards.get_or_create(&labels).set(value);
            } else if let Some(worker) = key.strip_prefix("worker_completions/") {
                let labels = WorkerLabel {
                    worker: worker.to_owned(),
                };
                if value.is_finite() && value > 0.0 {
                    self.worker_completions
                        .get_or_create(&labels)
                        .inc_by(value as u64);
                }
            }
        }
    }
}

fn as_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
