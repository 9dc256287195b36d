//! What a run leaves in its output directory besides metrics and checkpoints: the
//! resolved config (after checking what a previous run left) and `summary.json`.

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{Value, json};

use super::{RunError, RunState, SUMMARY_WINDOW, Start, Summary, io_error, mean};
use crate::config::Config;

impl Summary {
    /// The summary of a run that reached `state`, started at `started`.
    pub(super) fn of(state: &RunState, checkpoint: Option<PathBuf>, started: Instant) -> Self {
        let history = &state.reward_history;
        let window = SUMMARY_WINDOW.min(history.len());
        let (first, last) = if window == 0 {
            (None, None)
        } else {
            (
                Some(mean(&history[..window])),
                Some(mean(&history[history.len() - window..])),
            )
        };
        Summary {
            steps_completed: state.step,
            first_rewards_mean: first,
            last_rewards_mean: last,
            checkpoint,
            wall_seconds: started.elapsed().as_secs_f64(),
        }
    }

    /// Writes `summary.json`: the summary and the fields of `extra` (a JSON object).
    pub(super) fn write(
        &self,
        config: &Config,
        interrupted: bool,
        extra: Value,
    ) -> Result<(), RunError> {
        let mut value = json!({
            "name": config.run.name,
            "steps_completed": self.steps_completed,
            "steps_planned": config.run.steps,
            "interrupted": interrupted,
            "reward_mean_first_steps": self.first_rewards_mean,
            "reward_mean_last_steps": self.last_rewards_mean,
            "summary_window": SUMMARY_WINDOW,
            "checkpoint": self.checkpoint,
            "wall_seconds": self.wall_seconds,
        });
        if let (Some(fields), Value::Object(extra)) = (value.as_object_mut(), extra) {
            fields.extend(extra);
        }
        let path = config.run.output_dir.join("summary.json");
        let text = serde_json::to_string_pretty(&value).unwrap_or_default();
        std::fs::write(&path, text).map_err(|source| io_error("cannot write", &path, source))
    }

    /// What the observers' `on_run_end` receives.
    pub(super) fn ended(
        state: &RunState,
        interrupted: bool,
        summary: Option<&Summary>,
        checkpoint: &Option<PathBuf>,
    ) -> Value {
        json!({
            "steps_completed": state.step,
            "interrupted": interrupted,
            "reward_mean_first_steps": summary.and_then(|s| s.first_rewards_mean),
            "reward_mean_last_steps": summary.and_then(|s| s.last_rewards_mean),
            "checkpoint": checkpoint,
        })
    }
}

/// Checks `start` against what the output directory holds, clears it for `Overwrite`, and
/// writes the resolved config there.
pub(super) fn prepare_output(config: &Config, start: Start) -> Result<(), RunError> {
    let dir = &config.run.output_dir;
    // Only files with content count as a previous run: a run that failed before its
    // first step can be started again as it is.
    let previous: Vec<&str> = [
        "metrics.jsonl",
        "checkpoints",
        "sft_metrics.jsonl",
        "samples.jsonl",
        "summary.json",
        "ledger.jsonl",
    ]
    .into_iter()
    .filter(|name| {
        let path = dir.join(name);
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_dir() => {
                std::fs::read_dir(&path).is_ok_and(|mut d| d.next().is_some())
            }
            Ok(meta) => meta.len() > 0,
            Err(_) => false,
        }
    })
    .collect();
    match start {
        Start::Fresh if !previous.is_empty() => {
            return Err(RunError::OutputExists {
                dir: dir.clone(),
                what: previous.join(", "),
            });
        }
        Start::Overwrite => {
            for name in previous {
                let path = dir.join(name);
                let removed = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                removed.map_err(|source| io_error("cannot remove", &path, source))?;
            }
        }
        _ => {}
    }
    std::fs::create_dir_all(dir).map_err(|source| io_error("cannot create", dir, source))?;
    let resolved = dir.join("config.toml");
    let text = toml::to_string_pretty(config).unwrap_or_default();
    std::fs::write(&resolved, text).map_err(|source| io_error("cannot write", &resolved, source))
}
