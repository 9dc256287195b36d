//! Where the time went: each step's seconds by phase, stacked, and each phase's share of the
//! whole run.

use std::fmt::Write;

use super::line::{band_path, extent};
use super::load::Run;
use super::scale::format_duration;
use super::svg::escape;
use super::svg::{Frame, Plot};

/// A part of a step, as `metrics.jsonl` times it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Phase {
    /// The metric (`None`: computed, not logged).
    pub key: Option<&'static str>,
    pub label: &'static str,
    pub color: &'static str,
}

/// The phases of a step, in the order they are stacked. `reference_seconds` and
/// `grad_allreduce_seconds` are parts of `train_seconds`, so they are not stacked again.
pub const PHASES: [Phase; 4] = [
    Phase {
        key: Some("generate_seconds"),
        label: "generate",
        color: "#4e79a7",
    },
    Phase {
        key: Some("score_seconds"),
        label: "score",
        color: "#f28e2b",
    },
    Phase {
        key: Some("train_seconds"),
        label: "train",
        color: "#59a14f",
    },
    Phase {
        key: Some("weight_sync_seconds"),
        label: "weight sync",
        color: "#b07aa1",
    },
];

/// The rest of `step_seconds`: logging, callbacks, waiting for checkpoints.
pub const OTHER: Phase = Phase {
    key: None,
    label: "other",
    color: "#bab0ac",
};

/// Each step's seconds in each phase that the run logged (and `other`).
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseSteps {
    pub phases: Vec<Phase>,
    /// `(step, seconds of each phase, in the order of `phases`)`.
    pub steps: Vec<(f64, Vec<f64>)>,
}

/// The run's phases per step; `None` when it logged none of them.
pub fn phase_steps(run: &Run) -> Option<PhaseSteps> {
    let mut phases: Vec<Phase> = PHASES
        .iter()
        .filter(|phase| phase.key.is_some_and(|key| run.has(key)))
        .copied()
        .collect();
    if phases.is_empty() {
        return None;
    }
    let has_total = run.has("step_seconds");
    if has_total {
        phases.push(OTHER);
    }
    let steps = run
        .steps
        .iter()
        .map(|(step, metrics)| {
            let value = |key: &str| {
                metrics
                    .get(key)
                    .copied()
                    .filter(|v| v.is_finite())
                    .unwrap_or(0.0)
                    .max(0.0)
            };
            let mut seconds: Vec<f64> = phases
                .iter()
                .filter_map(|phase| phase.key.map(value))
                .collect();
            if has_total {
                let known: f64 = seconds.iter().sum();
                seconds.push((value("step_seconds") - known).max(0.0));
            }
            (*step, seconds)
        })
        .collect();
    Some(PhaseSteps { phases, steps })
}

/// Each phase's seconds over the whole run (the sum of its steps).
pub fn shares(run: &Run) -> Vec<(Phase, f64)> {
    let Some(steps) = phase_steps(run) else {
        return Vec::new();
    };
    steps
        .phases
        .iter()
        .enumerate()
        .map(|(index, phase)| {
            let total = steps
                .steps
                .iter()
                .map(|(_, s)| s.get(index).copied().unwrap_or(0.0))
                .sum();
            (*phase, total)
        })
        .collect()
}

/// The run's phases stacked per step, as an `<svg>` (one `<path class="area">` per phase);
/// `None` when it logged no phase.
pub fn stacked_chart(run: &Run, id: &str, title: &str) -> Option<String> {
    let steps = phase_steps(run)?;
    let tops = steps.steps.iter().map(|(_, s)| s.iter().sum::<f64>());
    let frame = Frame {
        id: id.into(),
        title: title.into(),
        subtitle: Some(
            "seconds per step, stacked; in `rollout launch` generation overlaps training".into(),
        ),
        x_label: "step".into(),
        y_label: "seconds".into(),
        legend: steps
            .phases
            .iter()
            .map(|p| (p.label.to_owned(), p.color.to_owned()))
            .collect(),
        x: extent(steps.steps.iter().map(|(step, _)| *step)),
        y: extent(tops),
        y_from_zero: true,
    };
    Some(frame.render(|plot| areas(&steps, plot)))
}

/// One closed path per phase, between the sum of the phases below it and that plus itself.
fn areas(steps: &PhaseSteps, plot: &Plot) -> String {
    let mut svg = String::new();
    let mut below: Vec<f64> = vec![0.0; steps.steps.len()];
    for (index, phase) in steps.phases.iter().enumerate() {
        let above: Vec<f64> = steps
            .steps
            .iter()
            .zip(&below)
            .map(|((_, s), low)| low + s.get(index).copied().unwrap_or(0.0))
            .collect();
        let band: Vec<(f64, f64, f64)> = steps
            .steps
            .iter()
            .zip(below.iter().zip(&above))
            .map(|((step, _), (low, high))| (*step, *low, *high))
            .collect();
        let data = match band.as_slice() {
            // A single step: a bar rather than a line of zero width.
            &[(step, low, high)] => {
                band_path(&[(step - 0.4, low, high), (step + 0.4, low, high)], plot)
            }
            band => band_path(band, plot),
        };
        let _ = write!(
            svg,
            r#"<path class="area" data-phase="{}" d="{data}" fill="{}" fill-opacity="0.85" stroke="{}" stroke-width="0.5"><title>{}</title></path>"#,
            escape(phase.label),
            phase.color,
            phase.color,
            escape(phase.label)
        );
        below = above;
    }
    svg
}

/// A horizontal bar split by share, as a small `<svg class="share-bar">` for the table.
pub fn share_bar(shares: &[(Phase, f64)]) -> String {
    let total: f64 = shares.iter().map(|(_, s)| s).sum();
    let mut svg = String::from(
        r#"<svg xmlns="http://www.w3.org/2000/svg" class="share-bar" viewBox="0 0 200 14" width="200" height="14">"#,
    );
    let mut x = 0.0;
    if total > 0.0 {
        for (phase, seconds) in shares {
            let width = seconds / total * 200.0;
            let _ = write!(
                svg,
                r#"<rect x="{x:.2}" width="{width:.2}" height="14" fill="{}"><title>{}: {}</title></rect>"#,
                phase.color,
                escape(phase.label),
                escape(&format_duration(*seconds))
            );
            x += width;
        }
    }
    svg.push_str("</svg>");
    svg
}
