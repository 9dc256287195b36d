//! Why a report could not be written.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(
        "cannot read {}: each RUN_DIR must be a run's output directory (its `[run] output_dir`)",
        path.display()
    )]
    Metrics {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}:{line}: {message}", path.display())]
    BadLine {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("cannot read {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    BadFile { path: PathBuf, message: String },
    #[error("cannot write {}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("none of the runs has logged a step yet ({})", paths.join(", "))]
    NoSteps { paths: Vec<String> },
    #[error("--smooth must be at least 0 and below 1, not {0}")]
    Smoothing(f64),
    #[error("no run directory given")]
    NoRuns,
    #[error("cannot draw the chart `{chart}` as PNG")]
    Png {
        chart: String,
        source: crate::png::PngError,
    },
}
