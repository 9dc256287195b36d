//! `metrics.jsonl`: one JSON object per step, appended and flushed as the step ends.

use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use crate::metrics::StepMetrics;

pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Opens `path` for appending; when resuming after `keep_through_step`, lines of later
    /// steps (written after that checkpoint, and about to be redone) are dropped first.
    pub fn open(path: &Path, keep_through_step: Option<u64>) -> std::io::Result<Self> {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        match keep_through_step {
            Some(step) if path.exists() => truncate_after(path, step)?,
            None if path.exists() => fs::remove_file(path)?,
            _ => {}
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(MetricsLog {
            path: path.to_path_buf(),
            file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `line` as one JSON object with its keys in sorted order.
    pub fn append(&mut self, line: &impl serde::Serialize) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(&serde_json::to_value(line)?)?;
        line.push(b'\n');
        let before = self.file.metadata()?.len();
        let written = self.file.write_all(&line).and_then(|()| self.file.flush());
        if written.is_err() {
            // A full disk must not leave half a line behind for readers to trip on.
            let _ = self.file.set_len(before);
        }
        written
    }
}

fn truncate_after(path: &Path, step: u64) -> std::io::Result<()> {
    let reader = BufReader::new(File::open(path)?);
    let mut kept = Vec::new();
    for line in reader.lines() {
        let line = line?;
        let line_step = serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64));
        if matches!(line_step, Some(s) if s <= step) {
            kept.push(line);
        }
    }
    let tmp = path.with_extension("jsonl.tmp");
    let mut out = File::create(&tmp)?;
    for line in kept {
        writeln!(out, "{line}")?;
    }
    out.sync_all()?;
    fs::rename(tmp, path)
}

/// A run's `metrics.jsonl` and, with `run.log_samples`, its `samples.jsonl`.
pub(super) struct StepLogs {
    metrics: MetricsLog,
    samples: Option<MetricsLog>,
}

impl StepLogs {
    /// Opens both in `run.output_dir`; a resumed run keeps the lines through `resumed_step`.
    pub(super) fn open(
        config: &crate::config::Config,
        resumed_step: Option<u64>,
    ) -> Result<Self, super::RunError> {
        let open = |name: &str| {
            let path = config.run.output_dir.join(name);
            MetricsLog::open(&path, resumed_step)
                .map_err(|source| super::io_error("cannot open", &path, source))
        };
        Ok(StepLogs {
            metrics: open("metrics.jsonl")?,
            samples: (config.run.log_samples > 0)
                .then(|| open("samples.jsonl"))
                .transpose()?,
        })
    }

    /// Appends a step's logged samples, then its metrics line.
    pub(super) fn append(
        &mut self,
        metrics: &StepMetrics,
        samples: &[serde_json::Value],
    ) -> Result<(), super::RunError> {
        let cannot_write =
            |log: &MetricsLog, source| super::io_error("cannot write", log.path(), source);
        if let Some(log) = self.samples.as_mut() {
            for sample in samples {
                log.append(sample)
                    .map_err(|source| cannot_write(log, source))?;
            }
        }
        self.metrics
            .append(&metrics.to_line())
            .map_err(|source| cannot_write(&self.metrics, source))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn resume_drops_steps_after_the_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.jsonl");
        let mut log = MetricsLog::open(&path, None).unwrap();
        for step in 1..=5 {
            log.append(&serde_json::json!({ "step": step })).unwrap();
        }
        drop(log);
        let mut log = MetricsLog::open(&path, Some(3)).unwrap();
        log.append(&serde_json::json!({ "step": 4, "again": true }))
            .unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let steps: Vec<u64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(steps, [1, 2, 3, 4]);
        assert!(text.contains("again"));
    }

    #[test]
    fn a_fresh_run_starts_an_empty_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("m/metrics.jsonl");
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, "{\"step\": 1}\n").unwrap();
        let mut log = MetricsLog::open(&path, None).unwrap();
        log.append(&serde_json::json!({ "step": 1, "new": 1 }))
            .unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 1);
    }
}
