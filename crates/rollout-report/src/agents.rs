//! Per-agent charts of multi-agent runs, whose metrics lines hold `AGENT/metric` keys.

use std::collections::BTreeSet;

use super::line::{LineChart, Series, smooth};
use super::load::Run;
use super::svg::color;

/// `(metric, chart id, title, y label)` of each per-agent chart.
pub(crate) const AGENT_CHARTS: [(&str, &str, &str, &str); 3] = [
    (
        "reward_mean",
        "agents_reward",
        "Reward per agent",
        "reward_mean",
    ),
    ("loss", "agents_loss", "Policy loss per agent", "loss"),
    (
        "completion_length_mean",
        "agents_length",
        "Turn length per agent",
        "tokens",
    ),
];

/// The agents of `run`: every `AGENT` with an `AGENT/reward_mean`.
fn agents(run: &Run) -> BTreeSet<&str> {
    run.steps
        .iter()
        .flat_map(|(_, metrics)| metrics.keys())
        .filter_map(|key| key.strip_suffix("/reward_mean"))
        .collect()
}

/// One chart per per-agent metric that some run logged, a line per run and agent.
pub fn agent_charts(runs: &[Run], smoothing: f64) -> Vec<LineChart> {
    AGENT_CHARTS
        .iter()
        .filter_map(|&(metric, id, title, y_label)| {
            let series = agent_series(runs, metric, smoothing);
            (!series.is_empty()).then(|| LineChart {
                id: id.into(),
                title: title.into(),
                subtitle: (smoothing > 0.0).then(|| format!("smoothed ({smoothing})")),
                y_label: y_label.into(),
                y_from_zero: metric != "loss",
                series,
            })
        })
        .collect()
}

fn agent_series(runs: &[Run], metric: &str, smoothing: f64) -> Vec<Series> {
    let mut series = Vec::new();
    for run in runs {
        for agent in agents(run) {
            let points = run.series(&format!("{agent}/{metric}"));
            if points.is_empty() {
                continue;
            }
            let label = if runs.len() == 1 {
                agent.to_owned()
            } else {
                format!("{} / {agent}", run.name)
            };
            let (points, raw) = if smoothing > 0.0 {
                (smooth(&points, smoothing), Some(points))
            } else {
                (points, None)
            };
            series.push(Series {
                label,
                color: color(series.len()).into(),
                points,
                raw,
                band: Vec::new(),
            });
        }
    }
    series
}
