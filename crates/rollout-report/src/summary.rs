//! A run in figures: steps, final and best reward, throughput, wall time.

use super::load::Run;

/// One row of the report's summary table.
#[derive(Debug, Clone, PartialEq)]
pub struct RunFigures {
    /// Lines in `metrics.jsonl`, and the last step.
    pub steps_logged: usize,
    pub last_step: Option<f64>,
    /// From `summary.json`, when the run has ended.
    pub steps_planned: Option<f64>,
    pub status: &'static str,
    pub final_reward: Option<f64>,
    /// The highest `reward_mean`, and its step.
    pub best_reward: Option<(f64, f64)>,
    /// Completions (and generated tokens) over the steps' seconds, all steps together.
    pub samples_per_second: Option<f64>,
    pub tokens_per_second: Option<f64>,
    pub wall_seconds: Option<f64>,
}

impl RunFigures {
    pub fn of(run: &Run) -> RunFigures {
        let rewards = run.series("reward_mean");
        let best_reward = rewards.iter().copied().fold(
            None,
            |best: Option<(f64, f64)>, (step, value)| match best {
                Some((_, top)) if top >= value => best,
                _ => Some((step, value)),
            },
        );
        let status = match run.summary.as_ref().map(|s| s.interrupted) {
            None => "running or stopped",
            Some(Some(true)) => "interrupted",
            Some(_) => "finished",
        };
        RunFigures {
            steps_logged: run.steps.len(),
            last_step: run.steps.last().map(|(step, _)| *step),
            steps_planned: run.summary.as_ref().and_then(|s| s.steps_planned),
            status,
            final_reward: rewards.last().map(|p| p.1),
            best_reward,
            samples_per_second: rate(run, "completions", "samples_per_second"),
            tokens_per_second: rate(run, "generated_tokens", "tokens_per_second"),
            wall_seconds: wall_seconds(run),
        }
    }
}

/// `count` summed over the steps per second of `step_seconds` summed; else the mean of the
/// per-step `per_step` rate.
fn rate(run: &Run, count: &str, per_step: &str) -> Option<f64> {
    let mut amount = 0.0;
    let mut seconds = 0.0;
    for (_, metrics) in &run.steps {
        match (metrics.get(count), metrics.get("step_seconds")) {
            (Some(n), Some(s)) if n.is_finite() && s.is_finite() => {
                amount += n;
                seconds += s;
            }
            _ => {}
        }
    }
    if seconds > 0.0 {
        return Some(amount / seconds);
    }
    let rates = run.series(per_step);
    (!rates.is_empty()).then(|| rates.iter().map(|p| p.1).sum::<f64>() / rates.len() as f64)
}

/// `summary.json`'s wall time, else the last `elapsed_seconds`, else the steps' seconds.
fn wall_seconds(run: &Run) -> Option<f64> {
    if let Some(wall) = run.summary.as_ref().and_then(|s| s.wall_seconds) {
        return Some(wall);
    }
    if let Some(&(_, elapsed)) = run.series("elapsed_seconds").last() {
        return Some(elapsed);
    }
    let steps = run.series("step_seconds");
    (!steps.is_empty()).then(|| steps.iter().map(|p| p.1).sum())
}
