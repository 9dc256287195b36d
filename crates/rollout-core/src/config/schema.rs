//! The run configuration: every option, its default and its meaning. `docs/config.md`
//! mirrors this file and the sections kept in files of their own (`algorithm.rs`,
//! `cluster.rs`, `train.rs`). Unknown keys are rejected everywhere except inside plugin
//! `options` tables, which the plugin's own `Config` dataclass checks.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::algorithm::AlgorithmConfig;
use super::cluster::ClusterConfig;
use super::train::TrainConfig;

/// A whole run.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub run: RunConfig,
    #[serde(default)]
    pub python: PythonConfig,
    pub policy: PluginConfig,
    pub data: DataConfig,
    #[serde(default)]
    pub rewards: Vec<RewardConfig>,
    pub environment: Option<EnvironmentConfig>,
    #[serde(default)]
    pub callbacks: Vec<PluginConfig>,
    #[serde(default)]
    pub rollout: RolloutConfig,
    #[serde(default)]
    pub engine: EngineSection,
    #[serde(default)]
    pub algorithm: AlgorithmConfig,
    #[serde(default)]
    pub train: TrainConfig,
    pub sft: Option<SftConfig>,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// Separate processes for generation and training (`rollout launch`); `rollout run`
    /// ignores it.
    #[serde(default)]
    pub cluster: ClusterConfig,
    /// Reward plugins in separate, limited processes (0 processes: in this process).
    #[serde(default)]
    pub sandbox: SandboxConfig,
    /// Prometheus metrics served over HTTP at `/metrics` (off unless `listen` is set).
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Several policies trained together, taking turns in a multi-agent environment
    /// (`[agents.NAME]`, see `config/agents.rs`); empty: one policy, `[policy]`.
    #[serde(default)]
    pub agents: std::collections::BTreeMap<String, super::AgentConfig>,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Shown in logs and the summary.
    pub name: String,
    /// Where metrics, checkpoints and logs go; relative paths are relative to the working
    /// directory.
    pub output_dir: PathBuf,
    /// Seeds data order, sampling and everything else random.
    pub seed: u64,
    /// Number of RL steps (one generation batch and one optimizer update each).
    pub steps: u64,
    /// Samples of every step written to `samples.jsonl` (text, tokens, reward, advantage);
    /// 0 writes none.
    pub log_samples: usize,
    /// Memory each device may use, in GB (10^9 bytes), for the memory planner's check before
    /// loading (`rollout plan`): CUDA devices cannot be checked without it; on the host the
    /// smaller of this and the available memory counts. 0: only what is detected.
    pub memory_limit_gb: f64,
    /// Refuse to start a run whose predicted peak memory exceeds what a device has.
    pub plan_check: bool,
    /// Prompt tokens the planner assumes (it does not read the data); 0: as many as
    /// `rollout.max_new_tokens`.
    pub plan_prompt_tokens: u64,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            name: "rollout".into(),
            output_dir: PathBuf::from("runs/rollout"),
            seed: 0,
            steps: 100,
            log_samples: 0,
            memory_limit_gb: 0.0,
            plan_check: true,
            plan_prompt_tokens: 0,
        }
    }
}

/// Which Python environment the embedded interpreter uses.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PythonConfig {
    /// A virtual environment directory. Default: `$ROLLOUT_VENV`, then the venv the `rollout`
    /// executable is installed in (`<venv>/bin/rollout`), then `$VIRTUAL_ENV`, then a `.venv`
    /// found upwards from the working directory or from the `rollout` executable.
    pub venv: Option<PathBuf>,
    /// Extra directories put on `sys.path` (for plugin modules outside the environment).
    pub paths: Vec<PathBuf>,
}

/// A Python plugin: `"package.module:Class"` plus the table its `Config` is built from.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PluginConfig {
    pub plugin: String,
    #[serde(default)]
    pub options: toml::Table,
}

impl PluginConfig {
    /// The plugin's `torch_threads` option when above 0 (the count the Hugging Face policy
    /// gives torch); `None` leaves the count to torch.
    pub fn torch_threads(&self) -> Option<u64> {
        self.options
            .get("torch_threads")
            .and_then(toml::Value::as_integer)
            .and_then(|threads| u64::try_from(threads).ok())
            .filter(|&threads| threads > 0)
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub plugin: String,
    #[serde(default)]
    pub options: toml::Table,
    /// Applied in order to every record of the source.
    #[serde(default)]
    pub transforms: Vec<PluginConfig>,
    /// Shuffle the records every epoch (seeded by `run.seed`).
    #[serde(default = "default_true")]
    pub shuffle: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {
    pub plugin: String,
    /// The sample's reward is the weighted sum of every reward's score.
    #[serde(default = "default_one")]
    pub weight: f64,
    /// Metric name (`reward/<name>`); defaults to the class name in snake case.
    pub name: Option<String>,
    #[serde(default)]
    pub options: toml::Table,
}

/// A multi-turn environment; without one, each record's prompt is a single-turn episode.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentConfig {
    pub plugin: String,
    #[serde(default)]
    pub options: toml::Table,
    /// Policy turns per episode at most.
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
}

/// Sampling of the completions for each step.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutConfig {
    /// Prompts drawn per step.
    pub prompts_per_step: usize,
    /// Completions sampled per prompt (the GRPO group).
    pub group_size: usize,
    /// Most tokens generated per turn.
    pub max_new_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// Token ids that end a completion besides the model's end-of-sequence ids.
    pub stop_token_ids: Vec<u32>,
    /// Texts that end a completion once it contains one (needs the sampling engine).
    pub stop_strings: Vec<String>,
    /// Keep generating past end-of-sequence tokens (for benchmarks).
    pub ignore_eos: bool,
    /// A record field holding that prompt's token budget: an integer, or a list with one
    /// integer per sample of the group. Records without it use `max_new_tokens`.
    pub max_new_tokens_field: Option<String>,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            prompts_per_step: 16,
            group_size: 8,
            max_new_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            max_new_tokens_field: None,
        }
    }
}

/// The sampling engine: continuous batching over a paged KV cache, scheduled from Rust.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// Use the engine when the policy supports it (`kv_layout`); otherwise, or when false,
    /// the policy's own `generate` samples.
    pub enabled: bool,
    /// Which engine samples: Rollout's own, or vLLM with weights of its own.
    pub backend: EngineBackend,
    /// Options of the vLLM backend (`python_plugins.vllm_engine:VllmEngine`'s `Config`).
    pub vllm: toml::Table,
    /// Tokens per KV-cache block.
    pub block_size: usize,
    /// KV-cache size in bytes; 0 uses `kv_cache_fraction` of the memory the policy reports
    /// available on its device.
    pub kv_cache_bytes: u64,
    pub kv_cache_fraction: f64,
    /// Query tokens per forward pass at most: decodes, drafts and prefill chunks together.
    pub max_batch_tokens: usize,
    /// Sequences decoding at once at most.
    pub max_running: usize,
    /// Reuse the KV of identical prompt prefixes across requests (multi-turn contexts).
    pub prefix_caching: bool,
    pub speculation: SpeculationSection,
}

impl Default for EngineSection {
    fn default() -> Self {
        Self {
            enabled: true,
            backend: EngineBackend::Rollout,
            vllm: toml::Table::new(),
            block_size: 16,
            kv_cache_bytes: 0,
            kv_cache_fraction: 0.25,
            max_batch_tokens: 2048,
            max_running: 256,
            prefix_caching: true,
            speculation: SpeculationSection::default(),
        }
    }
}

/// The engine that samples a run's completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineBackend {
    /// Rollout's sampling engine, running the policy's own model.
    Rollout,
    /// vLLM, in the process that generates, its weights replaced at every version.
    Vllm,
}

impl EngineBackend {
    /// The generation engine plugin that implements this backend, if it is not Rollout's.
    pub fn plugin(self) -> Option<&'static str> {
        match self {
            EngineBackend::Rollout => None,
            EngineBackend::Vllm => Some("python_plugins.vllm_engine:VllmEngine"),
        }
    }
}

/// Speculative decoding: drafts verified by the policy in one forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpeculationMethod {
    Off,
    /// Prompt lookup: drafts copied from earlier in the sequence (no draft model).
    Ngram,
    /// The policy's draft model (`draft_model_path` of the built-in HF policy).
    DraftModel,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculationSection {
    pub method: SpeculationMethod,
    /// Tokens drafted per step and sequence.
    pub num_tokens: usize,
    /// Longest and shortest n-gram matched by prompt lookup.
    pub max_ngram: usize,
    pub min_ngram: usize,
}

impl Default for SpeculationSection {
    fn default() -> Self {
        Self {
            method: SpeculationMethod::Off,
            num_tokens: 4,
            max_ngram: 3,
            min_ngram: 1,
        }
    }
}

/// Supervised warm start before RL, on `prompt` -> `record[completion_key]` pairs of the data.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SftConfig {
    pub steps: u64,
    /// Records per update.
    #[serde(default = "default_sft_batch")]
    pub batch_size: usize,
    pub learning_rate: f64,
    /// The record field holding the target completion.
    #[serde(default = "default_completion_key")]
    pub completion_key: String,
    /// Append the model's end-of-sequence token so the policy learns to stop.
    #[serde(default = "default_true")]
    pub append_eos: bool,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Write a checkpoint every this many RL steps (0: only at the end).
    pub every: u64,
    /// Complete checkpoints kept on disk (older ones are deleted).
    pub keep: usize,
    /// Copy the state at the step boundary and write it while training goes on.
    pub background: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            every: 0,
            keep: 2,
            background: true,
        }
    }
}

/// Prometheus metrics of the run (`rollout run`, or the controller of `rollout launch`),
/// served at `http://<listen>/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `IP:PORT` to serve on, e.g. "127.0.0.1:9400"; empty (the default): no server. Port 0
    /// picks a free one (logged). Use a non-loopback address only on a trusted network: the
    /// endpoint has no authentication.
    pub listen: String,
}

/// Plugin isolation: `[[rewards]]` scored in a pool of worker processes, one sample per call,
/// so a reward that raises, hangs, crashes or runs out of memory costs a sample, not the run;
/// and (`environments`) the `[environment]`'s episodes played in a pool of their own, so a
/// failing `reset` or `step` costs its episode.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxConfig {
    /// Worker processes scoring rewards; 0 scores in the embedded interpreter (a reward
    /// that raises then ends the run).
    pub processes: usize,
    /// Wall-clock seconds one sample's scoring (every reward) may take.
    pub timeout_seconds: f64,
    /// Seconds a worker may take to start and load the reward plugins.
    pub start_timeout_seconds: f64,
    /// Address-space limit of each worker process in MiB (RLIMIT_AS); 0 is unlimited.
    pub memory_mb: u64,
    /// CPU seconds one sample's scoring may use (RLIMIT_CPU); 0 is unlimited.
    pub cpu_seconds: u64,
    /// The run ends when more than this fraction of all samples scored so far failed.
    pub max_failed_fraction: f64,
    /// The run ends when more than this fraction of one step's samples failed.
    pub max_failed_fraction_per_step: f64,
    /// With `processes > 0`, play the `[environment]`'s episodes in sandbox processes too
    /// (`processes` more of them); `false` keeps them in the embedded interpreter.
    pub environments: bool,
    /// Environment variables the workers inherit besides locale, paths, device, thread and
    /// cache settings (`sandbox::INHERITED_ENVIRONMENT`); nothing else reaches them.
    pub pass_environment: Vec<String>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            processes: 0,
            timeout_seconds: 60.0,
            start_timeout_seconds: 120.0,
            memory_mb: 0,
            cpu_seconds: 0,
            max_failed_fraction: 0.25,
            max_failed_fraction_per_step: 0.5,
            environments: true,
            pass_environment: Vec::new(),
        }
    }
}

impl Config {
    /// Whether rewards are scored in `[sandbox]` processes instead of the interpreter of the
    /// run (or of a launch's controller).
    pub fn rewards_sandboxed(&self) -> bool {
        self.sandbox.processes > 0 && !self.rewards.is_empty()
    }

    /// Whether the `[environment]`'s episodes play in `[sandbox]` processes of their own.
    pub fn environment_sandboxed(&self) -> bool {
        self.sandbox.processes > 0 && self.sandbox.environments && self.environment.is_some()
    }

    /// Whether `rollout run` generates on a copy of the policy while it trains: a single
    /// policy that samples, with `[cluster] max_staleness` above 0.
    pub fn overlaps_generation_in_process(&self) -> bool {
        self.cluster.max_staleness > 0 && self.algorithm.name.samples() && !self.multi_agent()
    }
}

fn default_true() -> bool {
    true
}

fn default_one() -> f64 {
    1.0
}

fn default_max_turns() -> u32 {
    1
}

fn default_sft_batch() -> usize {
    64
}

fn default_completion_key() -> String {
    "answer".into()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::PluginConfig;

    #[test]
    fn only_a_positive_torch_threads_sets_the_count() {
        let policy = |options: &str| PluginConfig {
            plugin: "p:P".into(),
            options: options.parse().unwrap(),
        };
        assert_eq!(policy("torch_threads = 2").torch_threads(), Some(2));
        assert_eq!(policy("torch_threads = 0").torch_threads(), None);
        assert_eq!(policy("torch_threads = -1").torch_threads(), None);
        assert_eq!(policy("model_path = 'm'").torch_threads(), None);
    }
}
