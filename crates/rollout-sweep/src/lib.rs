//! `rollout sweep CONFIG --grid key=v1,v2 ...`: a campaign of runs of one config, the
//! cartesian product of the grid's values (times `--seeds N` seeds), each a normal `rollout
//! run` (or `rollout launch`) in a child process with its own output directory under the
//! sweep's. Resumable: a rerun skips finished runs and resumes the others; a summary table
//! and an overlaid report are written as runs end. See docs/integrations.md.

mod error;
mod execute;
mod grid;
mod manifest;
mod status;
mod summary;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use error::SweepError;
pub use grid::{Axis, Point, expand, parse_axis};
pub use manifest::{Manifest, ManifestRun};
pub use status::RunStatus;
pub use summary::Row;

use rollout_core::config::{self, ConfigError};

/// What `rollout sweep` was asked for (its command-line arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// The config every run starts from.
    pub config: PathBuf,
    /// A grid axis: a config key and its values, comma-separated, each parsed as `--set`
    /// parses one (e.g. `train.learning_rate=1e-5,3e-5`); repeatable, the runs are every
    /// combination.
    #[arg(long, value_name = "KEY=V1,V2,...")]
    pub grid: Vec<String>,
    /// Run every combination with seeds 0 to N-1 (`run.seed`).
    #[arg(long, value_name = "N")]
    pub seeds: Option<u64>,
    /// Override a config value in every run, e.g. `--set run.steps=20` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<String>,
    /// The sweep's directory: its runs, logs, summary and report (default:
    /// runs/sweep-<config file stem>).
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// Runs at a time (each its own process).
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub parallel: usize,
    /// Run each with `rollout launch` (its `[cluster]` processes) instead of `rollout run`.
    #[arg(long)]
    pub launch: bool,
}

/// One run of the sweep, validated.
#[derive(Debug, Clone)]
pub struct PlannedRun {
    pub point: Point,
    pub dir: PathBuf,
    /// Every `--set` of the run: the sweep's, the point's, its name and directory.
    pub overrides: Vec<String>,
    pub steps: u64,
}

/// The whole sweep, validated before anything runs.
#[derive(Debug, Clone)]
pub struct Plan {
    pub dir: PathBuf,
    pub axes: Vec<Axis>,
    pub runs: Vec<PlannedRun>,
    pub manifest: Manifest,
}

/// What the sweep did.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub dir: PathBuf,
    /// The summary table (Markdown), as in `DIR/summary.md`.
    pub table: String,
}

/// The sweep's directory when `--output` is not given: `runs/sweep-<config stem>`.
pub fn default_dir(config: &Path) -> PathBuf {
    let stem = config
        .file_stem()
        .map_or_else(|| "config".into(), |s| s.to_string_lossy().into_owned());
    PathBuf::from("runs").join(format!("sweep-{stem}"))
}

/// A TOML string literal of `text`, so `--set` takes it as it is.
fn toml_string(text: &str) -> String {
    toml::Value::String(text.to_owned()).to_string()
}

impl Plan {
    /// Parses the grid and checks every run's config (as `rollout run` would load it): any
    /// error stops the sweep before a run starts.
    pub fn new(options: &Options) -> Result<Plan, SweepError> {
        if options.parallel == 0 {
            return Err(SweepError::Parallel);
        }
        let axes = options
            .grid
            .iter()
            .map(|argument| parse_axis(argument))
            .collect::<Result<Vec<_>, _>>()?;
        grid::check_axes(&axes, options.seeds)?;
        check_overrides(options)?;
        let base = config::load(&options.config, &options.overrides)?;
        check_each_value(options, &axes)?;
        let dir = options
            .output
            .clone()
            .unwrap_or_else(|| default_dir(&options.config));
        let points = expand(&axes, options.seeds);
        grid::check_unique(&points)?;
        let runs = points
            .into_iter()
            .map(|point| plan_run(options, &dir, point))
            .collect::<Result<Vec<_>, _>>()?;
        if !options.launch && base.config.cluster != config::ClusterConfig::default() {
            tracing::info!(
                "{} has a [cluster] section: the runs use `rollout run` (one process each); \
                 pass --launch to run each with `rollout launch`",
                options.config.display()
            );
        }
        let config_bytes = std::fs::read(&options.config).map_err(|source| SweepError::Io {
            path: options.config.clone(),
            source,
        })?;
        let manifest = Manifest::new(
            &options.config,
            &config_bytes,
            axes.clone(),
            options.seeds,
            options.overrides.clone(),
            runs.iter()
                .map(|run| ManifestRun {
                    name: run.point.name.clone(),
                    dir: run.point.dir_name.clone(),
                })
                .collect(),
        );
        Ok(Plan {
            dir,
            axes,
            runs,
            manifest,
        })
    }

    /// The grid's keys, in axis order (the summary's columns).
    pub fn keys(&self) -> Vec<String> {
        self.axes.iter().map(|axis| axis.key.clone()).collect()
    }
}

/// The sweep sets each run's name and directory (and seed, with `--seeds`) itself.
fn check_overrides(options: &Options) -> Result<(), SweepError> {
    for assignment in &options.overrides {
        let key = assignment
            .split_once('=')
            .map_or(assignment.as_str(), |p| p.0);
        let key = key.trim();
        let reserved = key == "run.output_dir"
            || key == "run.name"
            || (key == grid::SEED_KEY && options.seeds.is_some());
        if reserved {
            return Err(SweepError::Config(ConfigError::Override {
                assignment: assignment.clone(),
                message: "`rollout sweep` sets this key itself for each run".into(),
            }));
        }
    }
    Ok(())
}

/// Each grid value on its own, so a bad key or value is named by its `--grid`.
fn check_each_value(options: &Options, axes: &[Axis]) -> Result<(), SweepError> {
    for axis in axes {
        for value in &axis.values {
            let assignment = format!("{}={value}", axis.key);
            let mut overrides = options.overrides.clone();
            overrides.push(assignment.clone());
            config::load(&options.config, &overrides)
                .map_err(|source| SweepError::GridValue { assignment, source })?;
        }
    }
    Ok(())
}

fn plan_run(options: &Options, dir: &Path, point: Point) -> Result<PlannedRun, SweepError> {
    let run_dir = dir.join(&point.dir_name);
    let mut overrides = options.overrides.clone();
    overrides.extend(point.assignments());
    overrides.push(format!("run.name={}", toml_string(&point.name)));
    overrides.push(format!(
        "run.output_dir={}",
        toml_string(&run_dir.to_string_lossy())
    ));
    let loaded =
        config::load(&options.config, &overrides).map_err(|source| SweepError::RunConfig {
            run: point.name.clone(),
            source,
        })?;
    Ok(PlannedRun {
        steps: loaded.config.run.steps,
        point,
        dir: run_dir,
        overrides,
    })
}

/// Runs the sweep: checks (or creates) its directory's manifest, runs what is not finished
/// and writes the summary and the report.
pub async fn run(options: &Options) -> Result<Outcome, SweepError> {
    let plan = Plan::new(options)?;
    let continued = manifest::create_or_check(&plan.dir, &plan.manifest)?;
    manifest::Lock::check_none_alive(&plan.dir)?;
    tracing::info!(
        "sweep of {} runs in {}{}",
        plan.runs.len(),
        plan.dir.display(),
        if continued { " (continued)" } else { "" }
    );
    let ended = execute::run_all(&plan, options).await;
    manifest::Lock::remove(&plan.dir);
    let ended = ended?;
    let table = execute::write_outputs(&plan, &ended.failures, true)?;
    if ended.interrupted {
        println!("{table}");
        return Err(SweepError::Interrupted);
    }
    let failed: Vec<&str> = plan
        .runs
        .iter()
        .zip(&ended.failures)
        .filter(|(_, failure)| failure.is_some())
        .map(|(run, _)| run.point.name.as_str())
        .collect();
    if !failed.is_empty() {
        println!("{table}");
        return Err(SweepError::RunsFailed {
            count: failed.len(),
            names: failed.join("; "),
            logs: plan.dir.join(execute::LOGS),
        });
    }
    Ok(Outcome {
        dir: plan.dir,
        table,
    })
}
