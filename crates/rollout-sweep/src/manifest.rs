//! `DIR/sweep.json`: what a sweep directory was created for (the config's content, the grid,
//! the seeds and the `--set` overrides), so a rerun continues the same campaign and a
//! different one is refused; and `DIR/sweep.lock`, the processes of a sweep in progress.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::grid::Axis;
use crate::error::SweepError;

pub const MANIFEST: &str = "sweep.json";
pub const LOCK: &str = "sweep.lock";
const VERSION: u32 = 1;

/// The identity of a sweep, and its runs' names and directories (for reading).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    /// The config as given on the command line (for reading; its content is what counts).
    pub config: PathBuf,
    /// BLAKE3 of the config file's bytes.
    pub config_hash: String,
    pub grid: Vec<Axis>,
    pub seeds: Option<u64>,
    pub overrides: Vec<String>,
    pub runs: Vec<ManifestRun>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestRun {
    pub name: String,
    pub dir: String,
}

impl Manifest {
    pub fn new(
        config: &Path,
        config_bytes: &[u8],
        grid: Vec<Axis>,
        seeds: Option<u64>,
        overrides: Vec<String>,
        runs: Vec<ManifestRun>,
    ) -> Manifest {
        Manifest {
            version: VERSION,
            config: config.to_path_buf(),
            config_hash: blake3::hash(config_bytes).to_hex().to_string(),
            grid,
            seeds,
            overrides,
            runs,
        }
    }

    /// What differs between the sweep `self` was stored for and `wanted`, in words.
    pub fn differences(&self, wanted: &Manifest) -> Vec<String> {
        let mut differences = Vec::new();
        if self.version != wanted.version {
            differences.push(format!(
                "manifest version {} (this is {})",
                self.version, wanted.version
            ));
        }
        if self.config_hash != wanted.config_hash {
            differences.push(format!(
                "the config: it was {} with another content, now {}",
                self.config.display(),
                wanted.config.display()
            ));
        }
        if self.grid != wanted.grid {
            differences.push(format!(
                "the grid: it was {}, now {}",
                describe_grid(&self.grid),
                describe_grid(&wanted.grid)
            ));
        }
        if self.seeds != wanted.seeds {
            differences.push(format!(
                "--seeds: it was {}, now {}",
                describe_seeds(self.seeds),
                describe_seeds(wanted.seeds)
            ));
        }
        if self.overrides != wanted.overrides {
            differences.push(format!(
                "--set: it was [{}], now [{}]",
                self.overrides.join(" "),
                wanted.overrides.join(" ")
            ));
        }
        differences
    }
}

fn describe_grid(grid: &[Axis]) -> String {
    if grid.is_empty() {
        return "empty".into();
    }
    grid.iter()
        .map(|axis| format!("--grid {}={}", axis.key, axis.values.join(",")))
        .collect::<Vec<_>>()
        .join(" ")
}

fn describe_seeds(seeds: Option<u64>) -> String {
    seeds.map_or_else(|| "none".into(), |n| n.to_string())
}

/// Writes `wanted` into `dir` if it holds no manifest yet; else checks that the stored one is
/// the same sweep. Returns whether the directory already held this sweep.
pub fn create_or_check(dir: &Path, wanted: &Manifest) -> Result<bool, SweepError> {
    let path = dir.join(MANIFEST);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let stored: Manifest =
                serde_json::from_str(&text).map_err(|err| SweepError::BadManifest {
                    path: path.clone(),
                    message: err.to_string(),
                })?;
            let differences = stored.differences(wanted);
            if differences.is_empty() {
                Ok(true)
            } else {
                Err(SweepError::ManifestMismatch {
                    dir: dir.to_path_buf(),
                    differences: differences.join("; "),
                })
            }
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            refuse_foreign_directory(dir)?;
            let text =
                serde_json::to_string_pretty(wanted).map_err(|err| SweepError::BadManifest {
                    path: path.clone(),
                    message: err.to_string(),
                })?;
            write_atomically(&path, text.as_bytes())?;
            Ok(false)
        }
        Err(source) => Err(SweepError::Io { path, source }),
    }
}

/// A directory that exists, is not empty and has no manifest is not a sweep's: refuse it
/// rather than mix runs into it.
fn refuse_foreign_directory(dir: &Path) -> Result<(), SweepError> {
    std::fs::create_dir_all(dir).map_err(|source| SweepError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut entries = std::fs::read_dir(dir).map_err(|source| SweepError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    if entries.next().is_some() {
        return Err(SweepError::NotASweep {
            dir: dir.to_path_buf(),
            manifest: MANIFEST,
        });
    }
    Ok(())
}

pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), SweepError> {
    let io = |source| SweepError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, bytes).map_err(io)?;
    std::fs::rename(&temporary, path).map_err(io)
}

/// The processes of a sweep in progress: the sweep's own, and each running run's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Lock {
    pub sweep: u32,
    /// `(run directory, pid)`.
    pub runs: Vec<(String, u32)>,
}

impl Lock {
    pub fn write(&self, dir: &Path) -> Result<(), SweepError> {
        let text = serde_json::to_string(self).map_err(|err| SweepError::BadManifest {
            path: dir.join(LOCK),
            message: err.to_string(),
        })?;
        write_atomically(&dir.join(LOCK), text.as_bytes())
    }

    pub fn remove(dir: &Path) {
        match std::fs::remove_file(dir.join(LOCK)) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!("cannot remove {}: {err}", dir.join(LOCK).display());
            }
            _ => {}
        }
    }

    /// Refuses to start while the sweep that wrote `DIR/sweep.lock`, or a run it started (a
    /// killed sweep leaves its runs going), is still alive.
    pub fn check_none_alive(dir: &Path) -> Result<(), SweepError> {
        let Ok(text) = std::fs::read_to_string(dir.join(LOCK)) else {
            return Ok(());
        };
        let Ok(lock) = serde_json::from_str::<Lock>(&text) else {
            return Ok(());
        };
        if lock.sweep != std::process::id() && process_mentions(lock.sweep, "sweep") {
            return Err(SweepError::StillRunning {
                what: format!("the sweep writing {} (pid {})", dir.display(), lock.sweep),
            });
        }
        for (run_dir, pid) in &lock.runs {
            if process_mentions(*pid, run_dir) {
                return Err(SweepError::StillRunning {
                    what: format!("the run in {run_dir} (pid {pid}), left by a stopped sweep"),
                });
            }
        }
        Ok(())
    }
}

/// Whether process `pid` is alive and its command line contains `text` (a pid reused by an
/// unrelated process does not count).
fn process_mentions(pid: u32, text: &str) -> bool {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(bytes) => String::from_utf8_lossy(&bytes)
            .split('\0')
            .any(|arg| arg.contains(text)),
        Err(_) => false,
    }
}
