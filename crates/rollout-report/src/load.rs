//! Reading a run directory: `metrics.jsonl`, and `summary.json` and `config.toml` when there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rollout_core::metrics::StepMetrics;
use serde_json::Value;

use crate::error::ReportError;

/// One step's metrics by their names in the line (`StepMetrics::values`).
pub type Metrics = BTreeMap<String, f64>;

/// What a run directory holds.
#[derive(Debug, Clone)]
pub struct Run {
    /// How the report names the run (unique among the report's runs).
    pub name: String,
    pub dir: PathBuf,
    /// `(step, metrics)` by increasing step; a step logged twice keeps its last line.
    pub steps: Vec<(f64, Metrics)>,
    /// `summary.json`, written when a run ends.
    pub summary: Option<Summary>,
    /// A last line that was cut off (a run still writing, or killed mid-write) was skipped.
    pub partial_last_line: bool,
}

/// The fields of `summary.json` that the report shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    pub name: Option<String>,
    pub steps_completed: Option<f64>,
    pub steps_planned: Option<f64>,
    pub interrupted: Option<bool>,
    pub wall_seconds: Option<f64>,
    pub checkpoint_blocked_seconds: Option<f64>,
}

impl Run {
    /// The values of `metric`, as `(step, value)`, over the steps that have it (finite).
    pub fn series(&self, metric: &str) -> Vec<(f64, f64)> {
        self.steps
            .iter()
            .filter_map(|(step, metrics)| {
                let value = *metrics.get(metric)?;
                value.is_finite().then_some((*step, value))
            })
            .collect()
    }

    pub fn has(&self, metric: &str) -> bool {
        self.steps
            .iter()
            .any(|(_, m)| m.get(metric).is_some_and(|v| v.is_finite()))
    }
}

/// Reads the runs in `dirs` and names them (a name shared by two runs gets its directory).
pub fn load_runs(dirs: &[PathBuf]) -> Result<Vec<Run>, ReportError> {
    let mut runs = dirs
        .iter()
        .map(|dir| load_run(dir))
        .collect::<Result<Vec<_>, _>>()?;
    let names: Vec<String> = runs.iter().map(|run| run.name.clone()).collect();
    for run in &mut runs {
        if names.iter().filter(|name| **name == run.name).count() > 1 {
            run.name = format!("{} ({})", run.name, run.dir.display());
        }
    }
    Ok(runs)
}

/// Reads one run directory.
pub fn load_run(dir: &Path) -> Result<Run, ReportError> {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|source| ReportError::Metrics {
        path: path.clone(),
        source,
    })?;
    let (steps, partial_last_line) = parse_metrics(&text, &path)?;
    let summary = read_summary(dir)?;
    let name = summary
        .as_ref()
        .and_then(|summary| summary.name.clone())
        .or_else(|| config_name(dir))
        .unwrap_or_else(|| directory_name(dir));
    Ok(Run {
        name,
        dir: dir.to_path_buf(),
        steps,
        summary,
        partial_last_line,
    })
}

/// Parses `metrics.jsonl`: one [`StepMetrics`] per line, by `step` (else the line's
/// position). A last line that does not parse is skipped (reported by the flag: a run still
/// writing, or killed mid-write); any other is an error naming its line.
pub fn parse_metrics(text: &str, path: &Path) -> Result<(Vec<(f64, Metrics)>, bool), ReportError> {
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .collect();
    let mut by_step: BTreeMap<u64, Metrics> = BTreeMap::new();
    let mut partial = false;
    for (position, &(index, line)) in lines.iter().enumerate() {
        let parsed = serde_json::from_str::<Value>(line).and_then(|value| {
            let logged: Vec<String> = value
                .as_object()
                .map(|fields| fields.keys().cloned().collect())
                .unwrap_or_default();
            Ok((logged, StepMetrics::from_value(value)?))
        });
        match parsed {
            Ok((logged, metrics)) => {
                let step = if logged.iter().any(|key| key == "step") {
                    metrics.step
                } else {
                    position as u64 + 1
                };
                // What the line holds (a reader fills the fields it lacks with defaults).
                let mut values = metrics.values();
                values.retain(|key, _| logged.contains(key));
                by_step.insert(step, values);
            }
            Err(_) if position + 1 == lines.len() => partial = true,
            Err(err) => return Err(bad_line(path, index, err.to_string())),
        }
    }
    let steps = by_step
        .into_iter()
        .map(|(step, metrics)| (step as f64, metrics))
        .collect();
    Ok((steps, partial))
}

fn bad_line(path: &Path, index: usize, message: String) -> ReportError {
    ReportError::BadLine {
        path: path.to_path_buf(),
        line: index + 1,
        message,
    }
}

/// `summary.json`, if the run wrote one.
fn read_summary(dir: &Path) -> Result<Option<Summary>, ReportError> {
    let path = dir.join("summary.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ReportError::Read { path, source }),
    };
    let value: Value = serde_json::from_str(&text).map_err(|err| ReportError::BadFile {
        path: path.clone(),
        message: err.to_string(),
    })?;
    Ok(Some(Summary {
        name: value.get("name").and_then(Value::as_str).map(str::to_owned),
        steps_completed: value.get("steps_completed").and_then(Value::as_f64),
        steps_planned: value.get("steps_planned").and_then(Value::as_f64),
        interrupted: value.get("interrupted").and_then(Value::as_bool),
        wall_seconds: value.get("wall_seconds").and_then(Value::as_f64),
        checkpoint_blocked_seconds: value
            .get("checkpoint_blocked_seconds")
            .and_then(Value::as_f64),
    }))
}

/// `[run] name` of the resolved `config.toml` (a run that has not ended has no summary yet).
fn config_name(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("config.toml")).ok()?;
    let table: toml::Table = toml::from_str(&text).ok()?;
    let name = table.get("run")?.get("name")?.as_str()?;
    Some(name.to_owned())
}

fn directory_name(dir: &Path) -> String {
    let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    absolute
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}
