//! Why a sweep could not run.

use std::path::PathBuf;

use rollout_core::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("--grid {argument}: {message}")]
    Grid { argument: String, message: String },
    /// A grid value the config refuses; the `--set` error is the source.
    #[error("--grid {assignment}")]
    GridValue {
        assignment: String,
        #[source]
        source: ConfigError,
    },
    #[error("run `{run}`")]
    RunConfig {
        run: String,
        #[source]
        source: ConfigError,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(
        "{} holds another sweep ({differences}); rerun with the same config, --grid, --seeds \
         and --set to continue it, or choose another --output",
        dir.display()
    )]
    ManifestMismatch { dir: PathBuf, differences: String },
    #[error(
        "{} is not empty and has no {manifest}: it is not a sweep's directory; choose another \
         --output",
        dir.display()
    )]
    NotASweep {
        dir: PathBuf,
        manifest: &'static str,
    },
    #[error("{}: {message}", path.display())]
    BadManifest { path: PathBuf, message: String },
    #[error("{what} is still running: wait for it or stop it first")]
    StillRunning { what: String },
    #[error("cannot start run `{run}` ({}): {source}", program.display())]
    Spawn {
        run: String,
        program: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--parallel must be at least 1")]
    Parallel,
    #[error("{count} run(s) failed: {names} (their logs are in {})", logs.display())]
    RunsFailed {
        count: usize,
        names: String,
        logs: PathBuf,
    },
    #[error("the sweep was interrupted; rerun the same command to continue it")]
    Interrupted,
}

impl SweepError {
    /// A mistake in the config, `--grid` or `--set` (the exit status of config errors).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            SweepError::Grid { .. }
                | SweepError::GridValue { .. }
                | SweepError::RunConfig { .. }
                | SweepError::Config(_)
        )
    }
}
