//! `rollout`: the command-line entry point.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use clap::{Parser, Subcommand};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rollout_engine::cluster::ClusterError;
use rollout_engine::config::{self, ConfigError};
use rollout_engine::plan::{self, PlanError};
use rollout_engine::python::{PythonError, PythonSetup, PythonWorker};
use rollout_engine::roles::RoleError;
use rollout_engine::session::{Session, SessionError};
use rollout_engine::train::{RunError, Start};

/// Rollout: reinforcement learning for language models, driven from Rust.
#[derive(Debug, Parser)]
#[command(name = "rollout", version, about, propagate_version = true)]
struct Cli {
    /// Log more (debug level); `ROLLOUT_LOG` takes a full filter such as `rollout_engine=trace`.
    #[arg(short, long, global = true)]
    verbose: bool,
    /// Write a Chrome trace of the run's spans (steps, generation, scoring, training, weight
    /// sync, engine steps) to FILE; open it in https://ui.perfetto.dev or chrome://tracing.
    /// `rollout launch` merges its roles' traces into FILE.
    #[arg(long, global = true, value_name = "FILE")]
    trace: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train with the run described by CONFIG.
    Run {
        #[command(flatten)]
        run: RunArgs,
    },
    /// Validate CONFIG, import and instantiate every plugin and read the data, without training.
    Check {
        config: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
    },
    /// Complete the data's prompts (`group_size` samples each) without training; prints
    /// throughput and engine statistics as JSON.
    Generate {
        config: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Write one JSON line per completion here.
        #[arg(long)]
        output: Option<PathBuf>,
        /// Only the first N records.
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Run CONFIG with every role in its own OS process on this machine: the controller here,
    /// `[cluster] workers` generation workers and `[cluster] trainers` trainer ranks.
    Launch {
        #[command(flatten)]
        run: RunArgs,
        /// Start no role processes: wait for `rollout worker`/`rollout trainer` processes
        /// started elsewhere (other machines, torchrun, Slurm, Kubernetes) to connect to
        /// `[cluster] listen`.
        #[arg(long)]
        external_roles: bool,
    },
    /// A generation worker of a distributed run: connects to the controller at ADDRESS.
    Worker {
        #[command(flatten)]
        role: RoleOptions,
    },
    /// A trainer rank of a distributed run: connects to the controller at ADDRESS. Rank and
    /// world size default to torchrun's RANK/WORLD_SIZE, or Slurm's SLURM_PROCID/SLURM_NTASKS.
    Trainer {
        #[command(flatten)]
        role: RoleOptions,
        #[arg(long, env = "RANK")]
        rank: Option<u32>,
        #[arg(long, env = "WORLD_SIZE")]
        world_size: Option<u32>,
    },
    /// Read a distributed run's ledger (OUTPUT_DIR/ledger.jsonl) and print, as JSON, how many
    /// prompt groups were trained, lost, trained twice or dropped; exits 1 if any was lost
    /// or trained twice.
    Audit {
        /// The run's output directory.
        output_dir: PathBuf,
    },
    /// Predict the peak memory of every process of CONFIG's run and of each device, part by
    /// part, from the config and the models' config.json (nothing is loaded); exits 1 when a
    /// device will not hold the run (as `rollout run` would refuse it).
    Plan {
        config: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        overrides: Vec<String>,
        /// Plan `rollout launch`'s processes (controller, workers, trainer ranks); the default
        /// when the config sets anything in `[cluster]`.
        #[arg(long, conflicts_with = "run")]
        launch: bool,
        /// Plan `rollout run`'s single process even when the config has a `[cluster]`.
        #[arg(long)]
        run: bool,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
        /// Memory of each device in GB, overriding `run.memory_limit_gb`.
        #[arg(long, value_name = "GB")]
        memory_limit: Option<f64>,
    },
    /// Write one self-contained HTML page (inline SVG, no scripts or network) with the curves
    /// of each RUN_DIR's metrics.jsonl (reward, loss, KL, completion length, throughput) and
    /// where their time went; several runs are overlaid, one colour each.
    Report {
        /// Run output directories (each holding a metrics.jsonl).
        #[arg(required = true, value_name = "RUN_DIR")]
        run_dirs: Vec<PathBuf>,
        /// Where to write the page (default: report.html in the first RUN_DIR).
        #[arg(short, long, value_name = "PATH")]
        output: Option<PathBuf>,
        /// Smooth each line with an exponential moving average of this weight (0 to 0.99);
        /// the raw values stay, faint, underneath.
        #[arg(long, default_value_t = 0.0, value_name = "WEIGHT")]
        smooth: f64,
    },
    /// Create the quickstart's tiny model, tokenizer and addition dataset (no downloads).
    InitQuickstart {
        /// Where to write them.
        #[arg(long, default_value = "artifacts/quickstart")]
        dir: PathBuf,
        /// Recreate them even if they exist.
        #[arg(long)]
        force: bool,
    },
}

/// A training run: its config and what to do with an existing output directory.
#[derive(Debug, clap::Args)]
struct RunArgs {
    config: PathBuf,
    /// Override a config value, e.g. `--set run.steps=20` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    /// Continue from the newest valid checkpoint in the output directory.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Delete the output directory's previous metrics and checkpoints first.
    #[arg(long)]
    overwrite: bool,
    /// Start even if the memory planner predicts the run will not fit (`run.plan_check`).
    #[arg(long)]
    no_plan_check: bool,
    /// Memory of each device in GB for the memory check, overriding `run.memory_limit_gb`.
    #[arg(long, value_name = "GB")]
    memory_limit: Option<f64>,
}

impl RunArgs {
    fn load(&self) -> anyhow::Result<(config::LoadedConfig, Start)> {
        let loaded = config::load(&self.config, &self.overrides)?;
        let start = match (self.resume, self.overwrite) {
            (true, _) => Start::Resume,
            (_, true) => Start::Overwrite,
            _ => Start::Fresh,
        };
        Ok((loaded, start))
    }

    /// The memory planner's check, before anything heavy is loaded.
    fn check_memory(&self, loaded: &config::LoadedConfig, mode: plan::Mode) -> anyhow::Result<()> {
        Ok(plan::gate(
            loaded,
            mode,
            self.memory_limit,
            !self.no_plan_check,
        )?)
    }
}

#[derive(Debug, clap::Args)]
struct RoleOptions {
    /// The controller's `host:port` (its `[cluster] listen`).
    #[arg(long, value_name = "ADDRESS")]
    connect: String,
    /// A name for logs, unique in the run (default: the host name and process id).
    #[arg(long)]
    name: Option<String>,
    /// Where this process serves weights to other processes (a worker relays them on).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// A file holding the cluster secret; else `ROLLOUT_CLUSTER_SECRET`.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Encrypt links with TLS: required when the controller's `[cluster] tls` is on.
    #[arg(long)]
    tls: bool,
    /// Keep trying to reach a controller that is not listening yet for this many seconds.
    #[arg(long, default_value_t = 120.0, value_name = "SECONDS")]
    connect_retry: f64,
}

impl RoleOptions {
    fn into_args(
        self,
        rank: u32,
        world_size: u32,
    ) -> anyhow::Result<rollout_engine::cluster::serve::RoleArgs> {
        let key = rollout_engine::cluster::cluster_key(self.secret_file.as_deref())?;
        let name = self.name.unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        });
        Ok(rollout_engine::cluster::serve::RoleArgs {
            connect: self.connect,
            name,
            listen: self.listen,
            key,
            rank,
            world_size,
            connect_retry: std::time::Duration::from_secs_f64(self.connect_retry.max(0.0)),
            limits: rollout_net::LinkLimits {
                tls: if self.tls {
                    Some(rollout_net::tls::TlsContext::new()?)
                } else {
                    None
                },
                ..rollout_net::LinkLimits::default()
            },
        })
    }
}

/// Slurm's task rank and count, when `srun` started this process.
fn slurm_rank() -> Option<(u32, u32)> {
    let rank = std::env::var("SLURM_PROCID").ok()?.parse().ok()?;
    let world = std::env::var("SLURM_NTASKS").ok()?.parse().ok()?;
    Some((rank, world))
}

const EXIT_FAILURE: u8 = 1;
const EXIT_CONFIG: u8 = 2;
const EXIT_INTERRUPTED: u8 = 130;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = init_logging(cli.verbose, cli.trace.as_deref(), &cli.command) {
        eprintln!("error: {err}");
        return ExitCode::from(EXIT_FAILURE);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            finish_trace();
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let code = match runtime.block_on(execute(cli.command)) {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("error: {err:#}");
            exit_code(&err)
        }
    };
    drop(runtime);
    exit_without_teardown(code)
}

/// Ends the process once everything is written and synced. Where Python was started, through
/// `os._exit`: at a normal exit the libraries torch loads (the CUDA ones too, even on a CPU)
/// run static destructors that page about 100 MB back into memory and take time, for nothing.
fn exit_without_teardown(code: u8) -> ExitCode {
    finish_trace();
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    Python::try_attach(|py| {
        // Plugins may have printed through Python's own buffered streams.
        let _ = py.run(
            c"import sys; sys.stdout.flush(); sys.stderr.flush()",
            None,
            None,
        );
        if let Ok(os) = py.import("os") {
            let _ = os.call_method1("_exit", (code,));
        }
    });
    ExitCode::from(code)
}

/// Logs to stderr and, with `--trace FILE`, records spans into FILE: the two are separate
/// layers with filters of their own, so log lines are the same with or without a trace.
fn init_logging(verbose: bool, trace: Option<&Path>, command: &Command) -> std::io::Result<()> {
    use tracing_subscriber::layer::{Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;
    let default = if verbose { "debug" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("ROLLOUT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let logs = tracing_subscriber::fmt::layer()
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_filter(tracing_subscriber::filter::FilterExt::and(
            filter,
            rollout_engine::trace::log_filter(),
        ));
    // Not an `Option` layer: a `None` one would have every span created (and dropped) even
    // though no layer records it; without a trace, spans cost nothing.
    match trace {
        Some(path) => {
            let trace = rollout_engine::trace::layer(path, &process_name(command))?;
            tracing_subscriber::registry().with(logs).with(trace).init();
            rollout_engine::trace::anchor();
        }
        None => tracing_subscriber::registry().with(logs).init(),
    }
    Ok(())
}

/// This process in a trace: the controller of `rollout launch`, a role by its `--name`.
fn process_name(command: &Command) -> String {
    match command {
        Command::Launch { .. } => "controller".into(),
        Command::Worker { role } => role.name.clone().unwrap_or_else(|| "worker".into()),
        Command::Trainer { role, .. } => role.name.clone().unwrap_or_else(|| "trainer".into()),
        _ => "rollout".into(),
    }
}

/// Writes out the `--trace` file, if any (and merges the traces of `rollout launch`'s
/// roles into it); on every way out of the process.
fn finish_trace() {
    match rollout_engine::trace::finish() {
        Ok(Some(written)) => tracing::info!(
            "trace written to {}{} (open it in https://ui.perfetto.dev)",
            written.path.display(),
            match written.merged {
                0 => String::new(),
                merged => format!(", with the traces of {merged} role processes merged in"),
            }
        ),
        Ok(None) => {}
        Err(err) => eprintln!("warning: the trace could not be written: {err}"),
    }
}

fn exit_code(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if cause.downcast_ref::<ConfigError>().is_some() {
            return EXIT_CONFIG;
        }
        if let Some(RunError::Interrupted { .. }) = cause.downcast_ref::<RunError>() {
            return EXIT_INTERRUPTED;
        }
        if let Some(SessionError::Run(RunError::Interrupted { .. })) =
            cause.downcast_ref::<SessionError>()
        {
            return EXIT_INTERRUPTED;
        }
        if let Some(ClusterError::Run(RunError::Interrupted { .. })) =
            cause.downcast_ref::<ClusterError>()
        {
            return EXIT_INTERRUPTED;
        }
        if let Some(PlanError::Config(_)) = cause.downcast_ref::<PlanError>() {
            return EXIT_CONFIG;
        }
        if let Some(ClusterError::Config(_)) = cause.downcast_ref::<ClusterError>() {
            return EXIT_CONFIG;
        }
        if let Some(SessionError::Local(rollout_engine::local::LocalError::Load(
            rollout_engine::plugins::PluginLoadError::Config(_),
        ))) = cause.downcast_ref::<SessionError>()
        {
            return EXIT_CONFIG;
        }
    }
    EXIT_FAILURE
}

async fn execute(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run { run } => {
            let (loaded, start) = run.load()?;
            run.check_memory(&loaded, plan::Mode::Run)?;
            let interrupted = watch_ctrl_c();
            let session = Session::open(loaded).await?;
            let summary = session.run(start, interrupted).await?;
            println!("{}", format_summary(&summary));
            Ok(())
        }
        Command::Check { config, overrides } => {
            let loaded = config::load(&config, &overrides)?;
            let session = Session::open(loaded).await?;
            println!("{}", session.report().await?);
            Ok(())
        }
        Command::Generate {
            config,
            overrides,
            output,
            limit,
        } => {
            let loaded = config::load(&config, &overrides)?;
            let session = Session::open(loaded).await?;
            let stats = session.generate(limit, output.as_deref()).await?;
            println!("{stats}");
            Ok(())
        }
        Command::Launch {
            run,
            external_roles,
        } => {
            let (loaded, start) = run.load()?;
            run.check_memory(&loaded, plan::Mode::Launch { external_roles })?;
            launch(loaded, start, external_roles).await
        }
        Command::Worker { role } => {
            let args = role.into_args(0, 1)?;
            Ok(rollout_engine::cluster::worker::run_worker(args).await?)
        }
        Command::Trainer {
            role,
            rank,
            world_size,
        } => {
            let slurm = slurm_rank();
            let rank = rank.or(slurm.map(|s| s.0)).unwrap_or(0);
            let world_size = world_size.or(slurm.map(|s| s.1)).unwrap_or(1);
            anyhow::ensure!(
                rank < world_size,
                "trainer rank {rank} is not below the world size {world_size}"
            );
            let args = role.into_args(rank, world_size)?;
            Ok(rollout_engine::cluster::serve::run_trainer(args).await?)
        }
        Command::Audit { output_dir } => {
            let audit = rollout_engine::cluster::ledger::audit(&output_dir.join("ledger.jsonl"))?;
            println!("{}", serde_json::to_string(&audit)?);
            anyhow::ensure!(
                audit.groups_lost == 0 && audit.groups_duplicated == 0,
                "{} prompt groups lost and {} trained twice",
                audit.groups_lost,
                audit.groups_duplicated
            );
            Ok(())
        }
        Command::Plan {
            config,
            overrides,
            launch,
            run,
            json,
            memory_limit,
        } => {
            let loaded = config::load(&config, &overrides)?;
            let clustered = loaded.config.cluster != config::ClusterConfig::default();
            let mode = if launch || (clustered && !run) {
                plan::Mode::Launch {
                    external_roles: false,
                }
            } else {
                plan::Mode::Run
            };
            let plan = plan::plan(&loaded, mode, memory_limit)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&plan)?);
            } else {
                print!("{}", plan::render(&plan));
            }
            // The plan is printed either way; a run that would be refused exits 1.
            Ok(plan::check(&plan)?)
        }
        Command::Report {
            run_dirs,
            output,
            smooth,
        } => {
            let written = rollout_engine::report::write(&rollout_engine::report::Options {
                run_dirs,
                output,
                smoothing: smooth,
            })?;
            println!(
                "report of {} run(s), {} charts: {}",
                written.runs,
                written.charts.len(),
                written.html.display()
            );
            Ok(())
        }
        Command::InitQuickstart { dir, force } => init_quickstart(dir, force).await,
    }
}

/// `rollout launch`: the controller in this process and, unless `external_roles`, every
/// role as a child process of this one.
async fn launch(
    loaded: config::LoadedConfig,
    start: Start,
    external_roles: bool,
) -> anyhow::Result<()> {
    use rollout_engine::cluster;
    let cluster_config = &loaded.config.cluster;
    let secret = match (
        &cluster_config.secret_file,
        std::env::var(cluster::SECRET_ENV),
    ) {
        (Some(path), _) => std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the cluster secret {}", path.display()))?,
        (None, Ok(secret)) => secret,
        (None, Err(_)) if !external_roles => rollout_net::ClusterKey::random_secret(),
        (None, Err(_)) => anyhow::bail!(
            "roles started elsewhere must prove a shared secret: set [cluster] secret_file or {}",
            cluster::SECRET_ENV
        ),
    };
    let key = rollout_net::ClusterKey::from_secret(secret.as_bytes())?;
    let interrupted = watch_ctrl_c();
    let mut start = start;
    let mut restarts = 0;
    loop {
        let attempt = launch_once(&loaded, start, &key, &secret, external_roles, &interrupted);
        let failure = match attempt.await {
            Attempt::Finished(result) => {
                let summary = result?;
                println!("{}", format_summary(&summary));
                return Ok(());
            }
            Attempt::RoleLost(failure) => failure,
        };
        let limit = cluster_config.max_run_restarts;
        if restarts >= limit || interrupted.load(Ordering::SeqCst) {
            return Err(failure.context(format!(
                "the run was restarted {restarts} times already (cluster.max_run_restarts = {limit})"
            )));
        }
        restarts += 1;
        tracing::warn!(
            "{failure:#}; restarting every role from the last checkpoint ({restarts} of {limit})"
        );
        start = Start::Resume;
    }
}

/// How one launch of a run's processes ended.
enum Attempt {
    Finished(anyhow::Result<rollout_engine::train::Summary>),
    /// A trainer rank (or every generation worker) was lost: the run can restart from its
    /// last checkpoint.
    RoleLost(anyhow::Error),
}

/// Whether `err` is a role lost or silent (the run can restart from its last checkpoint),
/// rather than a failure that would happen again (plugin error, bad config).
fn is_role_loss(err: &ClusterError) -> bool {
    matches!(
        err,
        ClusterError::Role(RoleError::WorkerLost { .. } | RoleError::TimedOut { .. })
            | ClusterError::Run(RunError::Role(
                RoleError::WorkerLost { .. } | RoleError::TimedOut { .. }
            ))
    )
}

/// Listens, starts the roles (unless `external_roles`) and runs the controller until the
/// run ends or a role it cannot do without is lost.
async fn launch_once(
    loaded: &config::LoadedConfig,
    start: Start,
    key: &rollout_net::ClusterKey,
    secret: &str,
    external_roles: bool,
    interrupted: &Arc<AtomicBool>,
) -> Attempt {
    use rollout_engine::cluster::{self, launch::Exited, launch::spawn_roles};
    let cluster_config = &loaded.config.cluster;
    let listener = match rollout_net::link::listen(&cluster_config.listen).await {
        Ok(listener) => listener,
        Err(err) => return Attempt::Finished(Err(err.into())),
    };
    tracing::info!(
        "{}",
        cluster::controller::describe_listener(&listener, &loaded.path)
    );
    let mut children = if external_roles {
        None
    } else {
        let Ok(address) = listener.local_addr() else {
            return Attempt::Finished(Err(anyhow::anyhow!("the listener has no address")));
        };
        let debug = tracing::enabled!(tracing::Level::DEBUG);
        match spawn_roles(cluster_config, address, secret, debug) {
            Ok(children) => Some(children),
            Err(err) => return Attempt::Finished(Err(err.into())),
        }
    };
    let run = cluster::controller::run(loaded, listener, key.clone(), start, interrupted.clone());
    let mut run = std::pin::pin!(run);
    // A trainer rank that exits before the controller shuts it down ends this attempt at
    // once (its connection would otherwise only be missed after the heartbeat timeout); a
    // generation worker that dies is started again and rejoins.
    let result = match children.as_mut() {
        None => run.await,
        Some(roles) => loop {
            tokio::select! {
                result = &mut run => break result,
                Some(exited) = roles.next_exit() => {
                    if let Exited::Fatal(reason) = exited {
                        return Attempt::RoleLost(anyhow::anyhow!(reason));
                    }
                }
            }
        },
    };
    if let Some(children) = children {
        children.reap(std::time::Duration::from_secs(30)).await;
    }
    match result {
        Err(err) if is_role_loss(&err) => Attempt::RoleLost(err.into()),
        result => Attempt::Finished(result.map_err(Into::into)),
    }
}

/// The first Ctrl-C asks the run to stop after the current step (and checkpoint); the second
/// exits at once, which is safe because checkpoints are only ever replaced atomically.
fn watch_ctrl_c() -> Arc<AtomicBool> {
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            flag.store(true, Ordering::SeqCst);
            eprintln!(
                "\nstopping after the current step and writing a checkpoint (Ctrl-C again to stop now)"
            );
            if tokio::signal::ctrl_c().await.is_ok() {
                finish_trace();
                std::process::exit(i32::from(EXIT_INTERRUPTED));
            }
        }
    });
    interrupted
}

fn format_summary(summary: &rollout_engine::train::Summary) -> String {
    let mut lines = vec![format!(
        "done: {} steps in {:.1}s",
        summary.steps_completed, summary.wall_seconds
    )];
    if let (Some(first), Some(last)) = (summary.first_rewards_mean, summary.last_rewards_mean) {
        lines.push(format!(
            "reward_mean: first 10 steps {first:.3}, last 10 steps {last:.3} ({:+.3})",
            last - first
        ));
    }
    if let Some(checkpoint) = &summary.checkpoint {
        lines.push(format!("checkpoint: {}", checkpoint.display()));
    }
    lines.join("\n")
}

async fn init_quickstart(dir: PathBuf, force: bool) -> anyhow::Result<()> {
    let setup = PythonSetup::discover(None, &[])?;
    let worker = tokio::task::spawn_blocking(move || PythonWorker::start(setup))
        .await
        .context("the Python start-up task failed")??;
    let created = worker
        .run(move |py| -> Result<String, PythonError> {
            let result = (|| {
                let kwargs = PyDict::new(py);
                kwargs.set_item("force", force)?;
                let created = py.import("python_plugins.quickstart")?.call_method(
                    "create",
                    (dir,),
                    Some(&kwargs),
                )?;
                py.import("json")?
                    .call_method1("dumps", (created,))?
                    .extract::<String>()
            })();
            result.map_err(|err| PythonError::from_py(py, &err))
        })
        .await??;
    println!("quickstart files ready: {created}");
    Ok(())
}
