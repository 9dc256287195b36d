//! Running the sweep's runs as child processes of this binary (`rollout run`, or `rollout
//! launch`), up to `--parallel` at a time, and writing the summary and report as they end.
//!
//! Children get their own process group, so a Ctrl-C in the terminal reaches the sweep alone:
//! on SIGINT or SIGTERM it starts no more runs and passes one SIGINT to each running run,
//! which finishes its step, checkpoints and exits; a second signal is passed on too (the run
//! then stops at once, its checkpoints safe).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Instant;

use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;

use super::manifest::Lock;
use super::status::RunStatus;
use super::summary::{self, Row};
use super::{Options, Plan, PlannedRun, SweepError};

/// The runs' logs (stdout and stderr), one file per run, under the sweep's directory.
pub const LOGS: &str = "logs";
/// `rollout run`'s exit status when a run was interrupted (Ctrl-C).
const EXIT_INTERRUPTED: i32 = 130;

/// How the runs of this invocation ended.
#[derive(Debug, Default)]
pub struct Ended {
    /// Per planned run: how it failed in this invocation (`None`: it did not, or did not run).
    pub failures: Vec<Option<String>>,
    pub interrupted: bool,
}

/// Runs every run that has not finished, up to `options.parallel` at a time.
pub async fn run_all(plan: &Plan, options: &Options) -> Result<Ended, SweepError> {
    let mut ended = Ended {
        failures: vec![None; plan.runs.len()],
        interrupted: false,
    };
    let mut queue = unfinished(plan);
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|source| io(&plan.dir, source))?;
    let mut terminate = signal(SignalKind::terminate()).map_err(|source| io(&plan.dir, source))?;
    let mut tasks: JoinSet<(usize, std::io::Result<ExitStatus>, f64)> = JoinSet::new();
    let mut running: BTreeMap<usize, u32> = BTreeMap::new();
    let total = plan.runs.len();
    loop {
        while !ended.interrupted && tasks.len() < options.parallel {
            let Some(index) = queue.pop_front() else {
                break;
            };
            let (child, resumed) = spawn(plan, options, index)?;
            let pid = child.id().unwrap_or(0);
            running.insert(index, pid);
            write_lock(plan, &running)?;
            tracing::info!(
                "run {}/{total} `{}` started (pid {pid}{}), log {}",
                index + 1,
                plan.runs[index].point.name,
                if resumed {
                    ", --resume: it was unfinished"
                } else {
                    ""
                },
                log_path(&plan.dir, &plan.runs[index]).display()
            );
            tasks.spawn(wait(index, child));
        }
        if tasks.is_empty() {
            break;
        }
        tokio::select! {
            Some(joined) = tasks.join_next() => {
                let Ok((index, status, seconds)) = joined else { continue };
                running.remove(&index);
                write_lock(plan, &running)?;
                let run = &plan.runs[index];
                ended.failures[index] = judge(run, status, seconds, &plan.dir, ended.interrupted);
                // The runs go on whatever happens to the table; it is written again at the end.
                if let Err(err) = write_outputs(plan, &ended.failures, false) {
                    tracing::warn!("the summary was not written: {err}");
                }
            }
            _ = interrupt.recv() => stop(&mut ended, &running, "SIGINT"),
            _ = terminate.recv() => stop(&mut ended, &running, "SIGTERM"),
        }
    }
    Ok(ended)
}

/// The runs to start, in order: all but those whose files say they finished (skipped, and
/// never touched).
fn unfinished(plan: &Plan) -> VecDeque<usize> {
    let mut queue = VecDeque::new();
    for (index, run) in plan.runs.iter().enumerate() {
        if RunStatus::of(&run.dir) == RunStatus::Finished {
            tracing::info!(
                "skipped run `{}`: finished already ({})",
                run.point.name,
                run.dir.display()
            );
        } else {
            queue.push_back(index);
        }
    }
    queue
}

fn io(path: &Path, source: std::io::Error) -> SweepError {
    SweepError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Starts no more runs and passes SIGINT on to the running ones.
fn stop(ended: &mut Ended, running: &BTreeMap<usize, u32>, signal: &str) {
    if !ended.interrupted {
        tracing::warn!(
            "{signal}: stopping the sweep; {} running run(s) finish their step and checkpoint \
             (again to stop them at once); rerun the same command to continue",
            running.len()
        );
    }
    ended.interrupted = true;
    for pid in running.values() {
        let pid = i32::try_from(*pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw);
        if let Some(pid) = pid {
            // The run may have just exited; nothing to do then.
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
    }
}

fn write_lock(plan: &Plan, running: &BTreeMap<usize, u32>) -> Result<(), SweepError> {
    Lock {
        sweep: std::process::id(),
        runs: running
            .iter()
            .map(|(index, pid)| (plan.runs[*index].dir.to_string_lossy().into_owned(), *pid))
            .collect(),
    }
    .write(&plan.dir)
}

/// The log file of a run: `DIR/logs/<run dir name>.log`.
pub fn log_path(sweep_dir: &Path, run: &PlannedRun) -> PathBuf {
    sweep_dir
        .join(LOGS)
        .join(format!("{}.log", run.point.dir_name))
}

/// Starts run `index`, with `--resume` when its directory holds an unfinished run (then
/// `true`).
fn spawn(
    plan: &Plan,
    options: &Options,
    index: usize,
) -> Result<(tokio::process::Child, bool), SweepError> {
    let run = &plan.runs[index];
    let resume = RunStatus::of(&run.dir).resumes();
    let log = log_path(&plan.dir, run);
    if let Some(parent) = log.parent() {
        std::fs::create_dir_all(parent).map_err(|source| io(parent, source))?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .map_err(|source| io(&log, source))?;
    let errors = file.try_clone().map_err(|source| io(&log, source))?;
    let program = std::env::current_exe().map_err(|source| io(Path::new("rollout"), source))?;
    let mut command = tokio::process::Command::new(&program);
    if tracing::enabled!(tracing::Level::DEBUG) {
        command.arg("--verbose");
    }
    command
        .arg(if options.launch { "launch" } else { "run" })
        .arg(&options.config);
    for assignment in &run.overrides {
        command.arg("--set").arg(assignment);
    }
    if resume {
        command.arg("--resume");
    }
    command
        .stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(errors))
        .process_group(0);
    let child = command.spawn().map_err(|source| SweepError::Spawn {
        run: run.point.name.clone(),
        program,
        source,
    })?;
    Ok((child, resume))
}

async fn wait(
    index: usize,
    mut child: tokio::process::Child,
) -> (usize, std::io::Result<ExitStatus>, f64) {
    let started = Instant::now();
    let status = child.wait().await;
    (index, status, started.elapsed().as_secs_f64())
}

/// Logs how a run ended; returns its failure, if it failed (a run the sweep stopped did not:
/// it may have been stopped before it could checkpoint).
fn judge(
    run: &PlannedRun,
    status: std::io::Result<ExitStatus>,
    seconds: f64,
    dir: &Path,
    stopping: bool,
) -> Option<String> {
    let name = &run.point.name;
    let failure = match status {
        Ok(status) if status.success() => None,
        Ok(status) if status.code() == Some(EXIT_INTERRUPTED) => None,
        Ok(_) if stopping => None,
        Ok(status) => Some(match status.code() {
            Some(code) => format!("failed (exit {code})"),
            None => "failed (killed by a signal)".to_owned(),
        }),
        Err(err) => Some(format!("failed ({err})")),
    };
    let files = RunStatus::of(&run.dir);
    let log = log_path(dir, run);
    match &failure {
        None => tracing::info!("run `{name}`: {} after {seconds:.1}s", files.label()),
        Some(failure) => tracing::error!(
            "run `{name}` {failure} after {seconds:.1}s; the end of its log ({}):\n{}",
            log.display(),
            log_tail(&log, 8)
        ),
    }
    failure
}

fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Writes the summary table (`summary.md`, `.csv`, `.json`) and, with `report`, the
/// overlaid `report.html` of every run that has logged steps; returns the table.
pub fn write_outputs(
    plan: &Plan,
    failures: &[Option<String>],
    final_report: bool,
) -> Result<String, SweepError> {
    let rows: Vec<Row> = plan
        .runs
        .iter()
        .zip(failures)
        .map(|(run, failure)| Row::read(&run.point, &run.dir, run.steps, failure.as_deref()))
        .collect();
    let seeds = plan.manifest.seeds.is_some();
    let table = summary::write(&plan.dir, &plan.keys(), seeds, &rows)?;
    write_report(plan, final_report);
    Ok(table)
}

/// `DIR/report.html`: `rollout report` of the runs that have metrics. A failure is logged,
/// not fatal: the runs and the summary are what matter.
fn write_report(plan: &Plan, at_end: bool) {
    let run_dirs: Vec<PathBuf> = plan
        .runs
        .iter()
        .filter(|run| run.dir.join("metrics.jsonl").exists())
        .map(|run| run.dir.clone())
        .collect();
    if run_dirs.is_empty() {
        return;
    }
    let options = rollout_report::Options {
        run_dirs,
        output: Some(plan.dir.join("report.html")),
        smoothing: 0.0,
    };
    match rollout_report::write(&options) {
        Ok(written) if at_end => tracing::info!(
            "report of {} run(s): {}",
            written.runs,
            written.html.display()
        ),
        Ok(_) => {}
        Err(err) => tracing::warn!("the sweep's report was not written: {err}"),
    }
}
