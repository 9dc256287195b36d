//! `rollout`: the command-line entry point.

mod allocator;
mod cli;
mod interrupt;
mod processes;
mod session;
mod trace;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::processes::ClusterError;
use crate::session::{Purpose, Session, SessionError};
use clap::Parser;
use cli::{Cli, Command, RoleOptions, RunArgs, slurm_rank};
use rollout_core::config::{self, ConfigError};
use rollout_core::plan::{self, PlanError};
use rollout_core::telemetry;
use rollout_core::train::RunError;

const EXIT_FAILURE: u8 = 1;
const EXIT_CONFIG: u8 = 2;

fn main() -> ExitCode {
    processes::secret::take_from_environment();
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
            trace::finish_and_log();
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

/// Ends the process once everything is written and synced (without the interpreter's
/// teardown, where Python was started).
fn exit_without_teardown(code: u8) -> ExitCode {
    trace::finish_and_log();
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    rollout_python::interpreter::exit_if_started(code);
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
            trace::log_filter(),
        ));
    // Not an `Option` layer: a `None` one would have every span created (and dropped) even
    // though no layer records it; without a trace, spans cost nothing.
    match trace {
        Some(path) => {
            let trace = trace::layer(path, &process_name(command))?;
            tracing_subscriber::registry().with(logs).with(trace).init();
            trace::anchor();
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

fn exit_code(err: &anyhow::Error) -> u8 {
    for cause in err.chain() {
        if cause.downcast_ref::<ConfigError>().is_some() {
            return EXIT_CONFIG;
        }
        if let Some(RunError::Interrupted { .. }) = cause.downcast_ref::<RunError>() {
            return interrupt::EXIT_CODE;
        }
        if let Some(SessionError::Run(RunError::Interrupted { .. })) =
            cause.downcast_ref::<SessionError>()
        {
            return interrupt::EXIT_CODE;
        }
        if let Some(ClusterError::Run(RunError::Interrupted { .. })) =
            cause.downcast_ref::<ClusterError>()
        {
            return interrupt::EXIT_CODE;
        }
        if let Some(sweep) = cause.downcast_ref::<rollout_sweep::SweepError>() {
            match sweep {
                rollout_sweep::SweepError::Interrupted => return interrupt::EXIT_CODE,
                sweep if sweep.is_config() => return EXIT_CONFIG,
                _ => {}
            }
        }
        if let Some(PlanError::Config(_)) = cause.downcast_ref::<PlanError>() {
            return EXIT_CONFIG;
        }
        if let Some(ClusterError::Config(_)) = cause.downcast_ref::<ClusterError>() {
            return EXIT_CONFIG;
        }
        if let Some(SessionError::Host(rollout_python::HostError::Load(
            rollout_python::plugins::PluginLoadError::Config(_),
        ))) = cause.downcast_ref::<SessionError>()
        {
            return EXIT_CONFIG;
        }
    }
    EXIT_FAILURE
}

async fn execute(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run { run } => run_command(run).await,
        Command::Check { config, overrides } => {
            let loaded = config::load(&config, &overrides)?;
            let report = Session::open(loaded, Purpose::Sample)
                .await?
                .report()
                .await?;
            println!("{report}");
            Ok(())
        }
        Command::Generate {
            config,
            overrides,
            output,
            limit,
        } => generate_command(&config, &overrides, output.as_deref(), limit).await,
        Command::Launch {
            run,
            external_roles,
        } => launch_command(run, external_roles).await,
        Command::Worker { role } => {
            let args = role.into_args(0, 1)?;
            Ok(crate::processes::worker::run_worker(args).await?)
        }
        Command::Trainer {
            role,
            rank,
            world_size,
        } => trainer_command(role, rank, world_size).await,
        Command::Audit { output_dir, groups } => audit_command(&output_dir, groups),
        Command::Plan {
            config,
            overrides,
            launch,
            run,
            json,
            memory_limit,
        } => plan_command(&config, &overrides, launch, run, json, memory_limit),
        Command::Report {
            run_dirs,
            output,
            smooth,
            png,
            png_dir,
        } => report_command(run_dirs, output, smooth, png, png_dir),
        Command::Sweep { sweep } => {
            let outcome = rollout_sweep::run(&sweep).await?;
            println!("{}\nsweep done: {}", outcome.table, outcome.dir.display());
            Ok(())
        }
        Command::Export { checkpoint, dir } => {
            let written = rollout_python::export::export(checkpoint.clone(), dir).await?;
            println!("exported {} to {written}", checkpoint.display());
            Ok(())
        }
        Command::InitQuickstart { dir, force } => init_quickstart(dir, force).await,
    }
}

/// `rollout run`: trains in this process and prints the run's summary.
async fn run_command(run: RunArgs) -> anyhow::Result<()> {
    let (loaded, start) = run.load()?;
    run.check_memory(&loaded, plan::Mode::Run)?;
    let interrupted = interrupt::watch_ctrl_c();
    // Bound before the plugins load, so a busy port fails at once.
    let metrics = telemetry::start(&loaded.config.metrics).await?;
    let telemetry = metrics.as_ref().map(telemetry::MetricsServer::telemetry);
    let session = Session::open(loaded, Purpose::Train).await?;
    let summary = session.run(start, interrupted, telemetry).await?;
    println!("{}", session::format_summary(&summary));
    Ok(())
}

/// `rollout generate`: completes the data's prompts and prints the generation statistics.
async fn generate_command(
    config: &Path,
    overrides: &[String],
    output: Option<&Path>,
    limit: Option<usize>,
) -> anyhow::Result<()> {
    let loaded = config::load(config, overrides)?;
    single_policy(&loaded, "generate")?;
    let session = Session::open(loaded, Purpose::Sample).await?;
    let stats = session.generate(limit, output).await?;
    println!("{stats}");
    Ok(())
}

/// `rollout launch`: the run with its roles in processes of their own.
async fn launch_command(run: RunArgs, external_roles: bool) -> anyhow::Result<()> {
    let (loaded, start) = run.load()?;
    single_policy(&loaded, "launch")?;
    run.check_memory(&loaded, plan::Mode::Launch { external_roles })?;
    processes::launch::launch(loaded, start, external_roles).await
}

/// `rollout trainer`: one rank; its rank and world size as given (or torchrun's), else
/// Slurm's, else rank 0 of 1.
async fn trainer_command(
    role: RoleOptions,
    rank: Option<u32>,
    world_size: Option<u32>,
) -> anyhow::Result<()> {
    let slurm = slurm_rank();
    let rank = rank.or(slurm.map(|s| s.0)).unwrap_or(0);
    let world_size = world_size.or(slurm.map(|s| s.1)).unwrap_or(1);
    anyhow::ensure!(
        rank < world_size,
        "trainer rank {rank} is not below the world size {world_size}"
    );
    let args = role.into_args(rank, world_size)?;
    Ok(crate::processes::trainer::run_trainer(args).await?)
}

/// `rollout audit`: prints the ledger's audit (with `groups`, each update's groups); fails
/// when a prompt group was lost or trained twice.
fn audit_command(output_dir: &Path, groups: bool) -> anyhow::Result<()> {
    let journal = output_dir.join("ledger.jsonl");
    let audit = rollout_core::cluster::ledger::audit_with_steps(&journal, groups)?;
    println!("{}", serde_json::to_string(&audit)?);
    anyhow::ensure!(
        audit.groups_lost == 0 && audit.groups_duplicated == 0,
        "{} prompt groups lost and {} trained twice",
        audit.groups_lost,
        audit.groups_duplicated
    );
    Ok(())
}

/// `rollout plan`: prints the memory plan; exits 1 when a device would not hold the run.
fn plan_command(
    config: &Path,
    overrides: &[String],
    launch: bool,
    run: bool,
    json: bool,
    memory_limit: Option<f64>,
) -> anyhow::Result<()> {
    let loaded = config::load(config, overrides)?;
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

/// `rollout report`: the HTML page of the runs' curves (and PNGs of its charts).
fn report_command(
    run_dirs: Vec<PathBuf>,
    output: Option<PathBuf>,
    smoothing: f64,
    png: bool,
    png_dir: Option<PathBuf>,
) -> anyhow::Result<()> {
    use rollout_report::PngOutput;
    let png = match (png_dir, png) {
        (Some(dir), _) => PngOutput::Dir(dir),
        (None, true) => PngOutput::NextToPage,
        (None, false) => PngOutput::Off,
    };
    let options = rollout_report::Options {
        run_dirs,
        output,
        smoothing,
    };
    let written = rollout_report::write_with_png(&options, &png)?;
    println!(
        "report of {} run(s), {} charts: {}",
        written.runs,
        written.charts.len(),
        written.html.display()
    );
    if let Some(dir) = written.pngs.first().and_then(|path| path.parent()) {
        println!("{} PNG charts: {}", written.pngs.len(), dir.display());
    }
    Ok(())
}

/// Refuses a multi-agent config for a command that drives one policy.
fn single_policy(loaded: &config::LoadedConfig, command: &str) -> Result<(), ConfigError> {
    if !loaded.config.multi_agent() {
        return Ok(());
    }
    Err(loaded.error_at(
        &config::KeyPath::default().key("agents"),
        format!(
            "`rollout {command}` drives one policy; a multi-agent run trains in one process \
             with `rollout run`"
        ),
    ))
}

async fn init_quickstart(dir: PathBuf, force: bool) -> anyhow::Result<()> {
    let created = rollout_python::quickstart::create(dir, force).await?;
    println!("quickstart files ready: {created}");
    Ok(())
}
