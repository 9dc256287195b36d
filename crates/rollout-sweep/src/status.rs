//! Where a run of the sweep stands, read from its own output directory: `summary.json` is
//! written when a run ends (with `interrupted` and the steps completed and planned);
//! `metrics.jsonl` and `checkpoints/` while it trains.

use std::path::Path;

use serde_json::Value;

/// A run's state, from its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    /// Nothing written yet.
    Pending,
    /// Metrics or checkpoints, but no `summary.json`: killed, failed or still running.
    Incomplete,
    /// `summary.json` says it stopped early (Ctrl-C).
    Interrupted,
    /// `summary.json` says every planned step was completed.
    Finished,
}

impl RunStatus {
    pub fn of(dir: &Path) -> RunStatus {
        if let Some(summary) = read_summary(dir) {
            let interrupted = summary.get("interrupted").and_then(Value::as_bool);
            let completed = summary.get("steps_completed").and_then(Value::as_u64);
            let planned = summary.get("steps_planned").and_then(Value::as_u64);
            let all_steps = matches!((completed, planned), (Some(c), Some(p)) if c >= p);
            return if interrupted == Some(false) && all_steps {
                RunStatus::Finished
            } else {
                RunStatus::Interrupted
            };
        }
        let written = ["metrics.jsonl", "sft_metrics.jsonl", "checkpoints"]
            .iter()
            .any(|name| has_content(&dir.join(name)));
        if written {
            RunStatus::Incomplete
        } else {
            RunStatus::Pending
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            RunStatus::Pending => "pending",
            RunStatus::Incomplete => "incomplete",
            RunStatus::Interrupted => "interrupted",
            RunStatus::Finished => "finished",
        }
    }

    /// Whether starting the run again continues from its files (`--resume`) rather than
    /// from nothing.
    pub fn resumes(self) -> bool {
        matches!(self, RunStatus::Incomplete | RunStatus::Interrupted)
    }
}

fn read_summary(dir: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(dir.join("summary.json")).ok()?;
    serde_json::from_str(&text).ok()
}

fn has_content(path: &Path) -> bool {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::read_dir(path).is_ok_and(|mut d| d.next().is_some()),
        Ok(meta) => meta.len() > 0,
        Err(_) => false,
    }
}
