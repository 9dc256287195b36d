//! Which charts a report has, and each run's series in them.

use super::line::{LineChart, Series, smooth};
use super::load::Run;
use super::svg::color;

/// A chart of one metric, drawn when some run logged it.
pub(crate) struct Definition {
    id: &'static str,
    /// A field of `StepMetrics`, or a measurement the policy names.
    pub metric: &'static str,
    title: &'static str,
    subtitle: Option<&'static str>,
    y_label: &'static str,
    y_from_zero: bool,
}

pub(crate) const DEFINITIONS: [Definition; 8] = [
    Definition {
        id: "reward",
        metric: "reward_mean",
        title: "Reward",
        subtitle: None,
        y_label: "reward_mean",
        y_from_zero: false,
    },
    Definition {
        id: "loss",
        metric: "loss",
        title: "Policy loss",
        subtitle: Some("token-mean loss of the update"),
        y_label: "loss",
        y_from_zero: false,
    },
    Definition {
        id: "kl",
        metric: "kl",
        title: "KL to the reference policy",
        subtitle: None,
        y_label: "kl",
        y_from_zero: true,
    },
    Definition {
        id: "value_loss",
        metric: "value_loss",
        title: "Value loss (critic)",
        subtitle: None,
        y_label: "value_loss",
        y_from_zero: true,
    },
    Definition {
        id: "env_return",
        metric: "env_return_mean",
        title: "Environment return",
        subtitle: Some("mean over the episodes played to their end"),
        y_label: "env_return_mean",
        y_from_zero: false,
    },
    Definition {
        id: "length",
        metric: "completion_length_mean",
        title: "Completion length",
        subtitle: Some("mean generated tokens per completion"),
        y_label: "tokens",
        y_from_zero: true,
    },
    Definition {
        id: "samples_per_second",
        metric: "samples_per_second",
        title: "Throughput: completions per second",
        subtitle: Some("completions of the step over its wall time"),
        y_label: "samples / s",
        y_from_zero: true,
    },
    Definition {
        id: "tokens_per_second",
        metric: "tokens_per_second",
        title: "Throughput: generated tokens per second",
        subtitle: Some("generated tokens of the step over its wall time"),
        y_label: "tokens / s",
        y_from_zero: true,
    },
];

/// The line charts for `runs`, in a fixed order, leaving out metrics that no run logged.
/// `smoothing` is the weight of the moving average (0: none).
pub fn line_charts(runs: &[Run], smoothing: f64) -> Vec<LineChart> {
    DEFINITIONS
        .iter()
        .filter(|definition| runs.iter().any(|run| run.has(definition.metric)))
        .map(|definition| line_chart(definition, runs, smoothing))
        .collect()
}

fn line_chart(definition: &Definition, runs: &[Run], smoothing: f64) -> LineChart {
    let series = runs
        .iter()
        .enumerate()
        .filter(|(_, run)| run.has(definition.metric))
        .map(|(index, run)| {
            let band = if definition.id == "reward" {
                reward_band(run)
            } else {
                Vec::new()
            };
            run_series(run, index, definition.metric, band, smoothing)
        })
        .collect();
    let subtitle = if definition.id == "reward" {
        Some(reward_subtitle(runs))
    } else {
        definition.subtitle.map(str::to_owned)
    };
    let subtitle = match (subtitle, smoothing > 0.0) {
        (Some(text), true) => Some(format!("{text}; smoothed ({smoothing})")),
        (None, true) => Some(format!("smoothed ({smoothing})")),
        (subtitle, false) => subtitle,
    };
    LineChart {
        id: definition.id.into(),
        title: definition.title.into(),
        subtitle,
        y_label: definition.y_label.into(),
        y_from_zero: definition.y_from_zero,
        series,
    }
}

fn run_series(
    run: &Run,
    index: usize,
    metric: &str,
    band: Vec<(f64, f64, f64)>,
    smoothing: f64,
) -> Series {
    let points = run.series(metric);
    if smoothing <= 0.0 {
        return Series {
            label: run.name.clone(),
            color: color(index).into(),
            points,
            raw: None,
            band,
        };
    }
    let lows: Vec<(f64, f64)> = band.iter().map(|b| (b.0, b.1)).collect();
    let highs: Vec<(f64, f64)> = band.iter().map(|b| (b.0, b.2)).collect();
    let band = smooth(&lows, smoothing)
        .into_iter()
        .zip(smooth(&highs, smoothing))
        .map(|((step, low), (_, high))| (step, low, high))
        .collect();
    Series {
        label: run.name.clone(),
        color: color(index).into(),
        points: smooth(&points, smoothing),
        raw: Some(points),
        band,
    }
}

/// `reward_min`..`reward_max` where logged, else `reward_mean` ± `reward_std`.
fn reward_band(run: &Run) -> Vec<(f64, f64, f64)> {
    let finite = |value: Option<&f64>| value.copied().filter(|v| v.is_finite());
    run.steps
        .iter()
        .filter_map(|(step, metrics)| {
            let mean = finite(metrics.get("reward_mean"))?;
            match (
                finite(metrics.get("reward_min")),
                finite(metrics.get("reward_max")),
            ) {
                (Some(low), Some(high)) => Some((*step, low, high)),
                _ => {
                    let std = finite(metrics.get("reward_std"))?;
                    Some((*step, mean - std, mean + std))
                }
            }
        })
        .collect()
}

fn reward_subtitle(runs: &[Run]) -> String {
    let min_max = runs
        .iter()
        .any(|run| run.has("reward_min") && run.has("reward_max"));
    let std = runs.iter().any(|run| run.has("reward_std"));
    let band = match (min_max, std) {
        (true, _) => "; band: min to max",
        (false, true) => "; band: ± one standard deviation",
        (false, false) => "",
    };
    format!("mean over the step's completions{band}")
}
