//! The sweep's summary table, one row per run read from its files: `DIR/summary.md`
//! (Markdown, also printed), `DIR/summary.csv` and `DIR/summary.json`.

use std::path::{Path, PathBuf};

use rollout_report::{RunFigures, load_run};
use serde::Serialize;

use super::grid::Point;
use super::manifest::write_atomically;
use super::status::RunStatus;
use crate::error::SweepError;

/// Steps at the end of a run whose mean `reward_mean` is its final reward (as
/// `summary.json`'s `reward_mean_last_steps`).
pub const FINAL_WINDOW: usize = 10;

/// One run of the sweep as the summary shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub name: String,
    pub dir: PathBuf,
    /// `(key, raw value)` of each grid axis (a `{key: value}` object in JSON).
    #[serde(serialize_with = "as_object")]
    pub values: Vec<(String, String)>,
    pub seed: Option<u64>,
    pub status: String,
    pub steps_logged: usize,
    pub steps_planned: u64,
    /// Mean `reward_mean` of the last `FINAL_WINDOW` steps logged.
    pub final_reward: Option<f64>,
    pub best_reward: Option<f64>,
    pub best_reward_step: Option<f64>,
    pub samples_per_second: Option<f64>,
    pub tokens_per_second: Option<f64>,
    pub wall_seconds: Option<f64>,
}

impl Row {
    /// Reads the run of `point` in `dir`; `failure` is how it failed in this sweep, if it did
    /// (shown unless its files say it finished after all).
    pub fn read(point: &Point, dir: &Path, steps_planned: u64, failure: Option<&str>) -> Row {
        let status = RunStatus::of(dir);
        let mut row = Row {
            name: point.name.clone(),
            dir: dir.to_path_buf(),
            values: point.values.clone(),
            seed: point.seed,
            status: match failure {
                Some(failure) if status != RunStatus::Finished => failure.to_owned(),
                _ => status.label().to_owned(),
            },
            steps_logged: 0,
            steps_planned,
            final_reward: None,
            best_reward: None,
            best_reward_step: None,
            samples_per_second: None,
            tokens_per_second: None,
            wall_seconds: None,
        };
        if dir.join("metrics.jsonl").exists() {
            match load_run(dir) {
                Ok(run) => row.fill(&run),
                Err(err) => tracing::warn!("summary: cannot read {}: {err}", dir.display()),
            }
        }
        row
    }

    fn fill(&mut self, run: &rollout_report::Run) {
        let figures = RunFigures::of(run);
        let rewards = run.series("reward_mean");
        let last = &rewards[rewards.len().saturating_sub(FINAL_WINDOW)..];
        self.steps_logged = figures.steps_logged;
        self.final_reward =
            (!last.is_empty()).then(|| last.iter().map(|p| p.1).sum::<f64>() / last.len() as f64);
        self.best_reward = figures.best_reward.map(|(_, value)| value);
        self.best_reward_step = figures.best_reward.map(|(step, _)| step);
        self.samples_per_second = figures.samples_per_second;
        self.tokens_per_second = figures.tokens_per_second;
        self.wall_seconds = figures.wall_seconds;
    }
}

fn as_object<S: serde::Serializer>(
    values: &[(String, String)],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(values.iter().map(|(key, value)| (key, value)))
}

/// The column headers: the run, the grid's keys (and the seed), then `columns`.
fn headers(keys: &[String], seeds: bool, columns: &[&str]) -> Vec<String> {
    let mut headers = vec!["run".to_owned()];
    headers.extend(keys.iter().cloned());
    if seeds {
        headers.push("seed".into());
    }
    headers.extend(columns.iter().map(|&c| c.to_owned()));
    headers
}

fn number(value: Option<f64>, decimals: usize) -> String {
    value.map_or_else(String::new, |v| format!("{v:.decimals$}"))
}

/// A row's cells, in `headers`' order.
fn cells(row: &Row, seeds: bool) -> Vec<String> {
    let mut cells = vec![row.name.clone()];
    cells.extend(row.values.iter().map(|(_, value)| value.clone()));
    if seeds {
        cells.push(row.seed.map_or_else(String::new, |s| s.to_string()));
    }
    cells.extend([
        row.status.clone(),
        format!("{}/{}", row.steps_logged, row.steps_planned),
        number(row.final_reward, 4),
        match (row.best_reward, row.best_reward_step) {
            (Some(best), Some(step)) => format!("{best:.4} (step {step})"),
            (best, _) => number(best, 4),
        },
        number(row.samples_per_second, 1),
        number(row.tokens_per_second, 1),
        number(row.wall_seconds, 1),
    ]);
    cells
}

/// The table in Markdown.
pub fn markdown(keys: &[String], seeds: bool, rows: &[Row]) -> String {
    let line = |cells: &[String]| {
        let escaped: Vec<String> = cells.iter().map(|c| c.replace('|', "\\|")).collect();
        format!("| {} |\n", escaped.join(" | "))
    };
    let headers = headers(
        keys,
        seeds,
        &[
            "status",
            "steps",
            "final reward",
            "best reward",
            "samples/s",
            "tokens/s",
            "wall s",
        ],
    );
    let mut text = line(&headers);
    text.push_str(&line(&vec!["---".to_owned(); headers.len()]));
    for row in rows {
        text.push_str(&line(&cells(row, seeds)));
    }
    text
}

/// The table as CSV (RFC 4180 quoting), with raw numbers and the run's directory.
pub fn csv(keys: &[String], seeds: bool, rows: &[Row]) -> String {
    let headers = headers(
        keys,
        seeds,
        &[
            "status",
            "steps_logged",
            "steps_planned",
            "final_reward",
            "best_reward",
            "best_reward_step",
            "samples_per_second",
            "tokens_per_second",
            "wall_seconds",
            "dir",
        ],
    );
    let raw = |value: Option<f64>| value.map_or_else(String::new, |v| v.to_string());
    let mut text = csv_line(&headers);
    for row in rows {
        let mut cells = vec![row.name.clone()];
        cells.extend(row.values.iter().map(|(_, value)| value.clone()));
        if seeds {
            cells.push(row.seed.map_or_else(String::new, |s| s.to_string()));
        }
        cells.extend([
            row.status.clone(),
            row.steps_logged.to_string(),
            row.steps_planned.to_string(),
            raw(row.final_reward),
            raw(row.best_reward),
            raw(row.best_reward_step),
            raw(row.samples_per_second),
            raw(row.tokens_per_second),
            raw(row.wall_seconds),
            row.dir.display().to_string(),
        ]);
        text.push_str(&csv_line(&cells));
    }
    text
}

fn csv_line(cells: &[String]) -> String {
    let quoted: Vec<String> = cells
        .iter()
        .map(|cell| {
            if cell.contains([',', '"', '\n', '\r']) {
                format!("\"{}\"", cell.replace('"', "\"\""))
            } else {
                cell.clone()
            }
        })
        .collect();
    format!("{}\n", quoted.join(","))
}

/// Writes `summary.md`, `summary.csv` and `summary.json` into `dir`; returns the Markdown.
pub fn write(dir: &Path, keys: &[String], seeds: bool, rows: &[Row]) -> Result<String, SweepError> {
    let table = markdown(keys, seeds, rows);
    write_atomically(&dir.join("summary.md"), table.as_bytes())?;
    write_atomically(&dir.join("summary.csv"), csv(keys, seeds, rows).as_bytes())?;
    let json = serde_json::to_string_pretty(rows).map_err(|err| SweepError::BadManifest {
        path: dir.join("summary.json"),
        message: err.to_string(),
    })?;
    write_atomically(&dir.join("summary.json"), json.as_bytes())?;
    Ok(table)
}
