//! The command line: every subcommand and its options.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use rollout_core::config;
use rollout_core::plan;
use rollout_core::train::Start;

/// Rollout: reinforcement learning for language models, driven from Rust.
#[derive(Debug, Parser)]
#[command(name = "rollout", version, about, propagate_version = true)]
pub(crate) struct Cli {
    /// Log more (debug level); `ROLLOUT_LOG` takes a full filter such as `rollout=trace`.
    #[arg(short, long, global = true)]
    pub(crate) verbose: bool,
    /// Write a Chrome trace of the run's spans (steps, generation, scoring, training, weight
    /// sync, engine steps) to FILE; open it in https://ui.perfetto.dev or chrome://tracing.
    /// `rollout launch` merges its roles' traces into FILE.
    #[arg(long, global = true, value_name = "FILE")]
    pub(crate) trace: Option<PathBuf>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
    /// prompt groups went into the run's updates, were replaced, dropped or requeued, lost
    /// or trained twice; exits 1 if any was lost or trained twice.
    Audit {
        /// The run's output directory.
        output_dir: PathBuf,
        /// Also list, step by step, the groups each update trained, replaced and dropped.
        #[arg(long)]
        groups: bool,
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
        /// Also write each chart as a PNG, in a folder beside the page (report.html ->
        /// report_files/reward.png, ...).
        #[arg(long)]
        png: bool,
        /// Write the PNG charts into this directory instead (implies --png).
        #[arg(long, value_name = "DIR")]
        png_dir: Option<PathBuf>,
    },
    /// Run a campaign: one run of CONFIG per combination of the `--grid` values (times
    /// `--seeds`), each in its own directory under `--output`; a rerun skips finished runs and
    /// resumes the others. Writes summary.md/.csv/.json and report.html there.
    Sweep {
        #[command(flatten)]
        sweep: rollout_sweep::Options,
    },
    /// Write a checkpoint's policy as a Hugging Face model directory that `from_pretrained`
    /// loads (a LoRA policy as a PEFT adapter directory), from replicated or sharded
    /// checkpoints alike.
    Export {
        /// A checkpoint directory (`OUTPUT_DIR/checkpoints/step-N`).
        checkpoint: PathBuf,
        /// Where to write the model; must not exist.
        dir: PathBuf,
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
pub(crate) struct RunArgs {
    pub(crate) config: PathBuf,
    /// Override a config value, e.g. `--set run.steps=20` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(crate) overrides: Vec<String>,
    /// Continue from the newest valid checkpoint in the output directory.
    #[arg(long, conflicts_with = "overwrite")]
    pub(crate) resume: bool,
    /// Delete the output directory's previous metrics and checkpoints first.
    #[arg(long)]
    pub(crate) overwrite: bool,
    /// Start even if the memory planner predicts the run will not fit (`run.plan_check`).
    #[arg(long)]
    pub(crate) no_plan_check: bool,
    /// Memory of each device in GB for the memory check, overriding `run.memory_limit_gb`.
    #[arg(long, value_name = "GB")]
    pub(crate) memory_limit: Option<f64>,
}

impl RunArgs {
    pub(crate) fn load(&self) -> anyhow::Result<(config::LoadedConfig, Start)> {
        let loaded = config::load(&self.config, &self.overrides)?;
        let start = match (self.resume, self.overwrite) {
            (true, _) => Start::Resume,
            (_, true) => Start::Overwrite,
            _ => Start::Fresh,
        };
        Ok((loaded, start))
    }

    /// The memory planner's check, before anything heavy is loaded.
    pub(crate) fn check_memory(
        &self,
        loaded: &config::LoadedConfig,
        mode: plan::Mode,
    ) -> anyhow::Result<()> {
        Ok(plan::gate(
            loaded,
            mode,
            self.memory_limit,
            !self.no_plan_check,
        )?)
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct RoleOptions {
    /// The controller's `host:port` (its `[cluster] listen`).
    #[arg(long, value_name = "ADDRESS")]
    pub(crate) connect: String,
    /// A name for logs, unique in the run (default: the host name and process id).
    #[arg(long)]
    pub(crate) name: Option<String>,
    /// Where this process serves weights to other processes (a worker relays them on).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: String,
    /// A file holding the cluster secret (not readable by every user); else
    /// `ROLLOUT_CLUSTER_SECRET`.
    #[arg(long)]
    pub(crate) secret_file: Option<PathBuf>,
    /// Encrypt every link with TLS, loopback included: what the controller's
    /// `[cluster] tls = true` needs. Without it or `--no-tls`, links with other machines are
    /// encrypted and loopback links are not, as the controller's default.
    #[arg(long, conflicts_with = "no_tls")]
    pub(crate) tls: bool,
    /// Encrypt no link, not even with other machines: what the controller's
    /// `[cluster] tls = false` needs.
    #[arg(long)]
    pub(crate) no_tls: bool,
    /// Keep trying to reach a controller that is not listening yet for this many seconds.
    #[arg(long, default_value_t = 120.0, value_name = "SECONDS")]
    pub(crate) connect_retry: f64,
}

impl RoleOptions {
    fn tls_setting(&self) -> Option<bool> {
        match (self.tls, self.no_tls) {
            (true, _) => Some(true),
            (false, true) => Some(false),
            (false, false) => None,
        }
    }

    pub(crate) fn into_args(
        self,
        rank: u32,
        world_size: u32,
    ) -> anyhow::Result<crate::processes::joining::RoleArgs> {
        let key = crate::processes::secret::cluster_key(self.secret_file.as_deref())?;
        let encryption = rollout_net::Encryption::from_setting(self.tls_setting())?;
        let name = self.name.unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            format!("{}-{}", host.trim(), std::process::id())
        });
        Ok(crate::processes::joining::RoleArgs {
            connect: self.connect,
            name,
            listen: self.listen,
            key,
            rank,
            world_size,
            connect_retry: std::time::Duration::from_secs_f64(self.connect_retry.max(0.0)),
            limits: rollout_net::LinkLimits {
                encryption,
                ..rollout_net::LinkLimits::default()
            },
        })
    }
}

/// Slurm's task rank and count, when `srun` started this process.
pub(crate) fn slurm_rank() -> Option<(u32, u32)> {
    let rank = std::env::var("SLURM_PROCID").ok()?.parse().ok()?;
    let world = std::env::var("SLURM_NTASKS").ok()?.parse().ok()?;
    Some((rank, world))
}
