//! The memory planner: `rollout plan CONFIG` predicts the peak memory of every process of a
//! run and of each device, part by part, from the config and the models' `config.json`
//! alone (no Python, nothing loaded); `rollout run` and `rollout launch` refuse a run whose
//! peak exceeds what a device has before anything heavy is loaded. See docs/memory.md.

mod estimate;
mod hub_cache;
mod inputs;
mod memory;
mod model;
mod options;
mod plugin_processes;
mod report;
mod roles;
mod workload;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::{Algorithm, ConfigError, KeyPath, LoadedConfig};

pub use estimate::{Component, Phases, PolicyMemory};
pub use memory::{cuda_present, host_available_bytes};
pub use model::{Architecture, ModelShape, ParameterCounts};
pub use options::{Device, Dtype, Lora, Optimizer, PolicyOptions, Quantization};
pub use report::render;
pub use workload::Workload;

use inputs::{ExtraModel, Inputs, Role};

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Config(ConfigError),
    #[error("{}: {message}", path.display())]
    ModelConfig { path: PathBuf, message: String },
    #[error("{location}: `{key}` = \"{}\": {message}", dir.display())]
    Model {
        location: String,
        key: String,
        dir: PathBuf,
        message: String,
    },
    #[error(
        "{location}: the policy `{plugin}` has no `model_path` option; the planner sizes \
         Hugging Face models (python_plugins.hf_policy:HFCausalLM and plugins with its options)"
    )]
    UnknownPolicy { plugin: String, location: String },
    #[error("{0}")]
    WontFit(String),
}

/// Which command's processes to plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `rollout run`: one process.
    Run,
    /// `rollout launch`: a controller, workers and trainer ranks; with `external_roles`
    /// only the controller runs on this machine.
    Launch { external_roles: bool },
}

/// The memory a device has for the run, and where that figure comes from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceCheck {
    pub device: String,
    /// The sum of the peaks of this machine's processes on the device.
    pub predicted_peak_bytes: u64,
    pub available_bytes: Option<u64>,
    pub available_from: String,
    /// `None` when the device cannot be checked (CUDA without a memory limit).
    pub fits: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComponentPlan {
    pub name: &'static str,
    pub bytes: u64,
    pub phases: Vec<&'static str>,
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DevicePlan {
    pub device: String,
    #[serde(skip)]
    pub key: Device,
    pub peak_bytes: u64,
    pub peak_phase: &'static str,
    pub components: Vec<ComponentPlan>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RolePlan {
    pub role: String,
    pub devices: Vec<DevicePlan>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    pub path: PathBuf,
    pub model_type: String,
    pub architecture: Architecture,
    pub parameters: u64,
    pub trainable_parameters: u64,
    pub dtype: Dtype,
    pub device: String,
    pub lora_rank: u64,
    pub quantization: Quantization,
}

/// A run's predicted memory.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub config: PathBuf,
    pub command: &'static str,
    pub algorithm: String,
    pub model: ModelSummary,
    pub workload: Workload,
    pub roles: Vec<RolePlan>,
    pub devices: Vec<DeviceCheck>,
    pub notes: Vec<String>,
}

/// Plans `loaded` for `mode`; `limit_gb` (from `--memory-limit`) overrides
/// `[run] memory_limit_gb`.
pub fn plan(loaded: &LoadedConfig, mode: Mode, limit_gb: Option<f64>) -> Result<Plan, PlanError> {
    // A multi-agent run's own role holds its first agent's policy.
    let first_agent = loaded
        .config
        .agent_specs()
        .first()
        .map(|spec| with_policy(loaded, spec.policy));
    let loaded = first_agent.as_ref().unwrap_or(loaded);
    let config = &loaded.config;
    let cuda = cuda_present();
    let options = PolicyOptions::read(loaded, cuda)?;
    let shape = read_model(loaded, &options.model_path, "model_path")?;
    let algorithm = config.algorithm.name;
    let limit = memory_limit(limit_gb, config.run.memory_limit_gb);
    let host = host_available_bytes();
    let inputs = gather_inputs(loaded, &options, &shape, algorithm, cuda, host, limit)?;
    let mut roles = match mode {
        Mode::Run => roles::in_process(&inputs),
        Mode::Launch { .. } => roles::launch(&inputs),
    };
    if mode == Mode::Run {
        roles.extend(other_agents(loaded, cuda, host, limit)?);
    }
    let local = |role: &RolePlan| match mode {
        Mode::Launch {
            external_roles: true,
        } => role.role == "controller" || role.role.starts_with("sandbox"),
        _ => true,
    };
    let mut notes = Vec::new();
    if config.run.plan_prompt_tokens == 0 {
        notes.push(format!(
            "prompts are assumed as long as the completion budget (rollout.max_new_tokens = \
             {}); set run.plan_prompt_tokens to the typical prompt length for a closer plan",
            config.rollout.max_new_tokens
        ));
    }
    let role_plans: Vec<RolePlan> = roles.iter().map(role_plan).collect();
    let devices = device_checks(&role_plans, local, host, limit, &mut notes);
    Ok(Plan {
        config: loaded.path.clone(),
        command: match mode {
            Mode::Run => "run",
            Mode::Launch { .. } => "launch",
        },
        model: ModelSummary::of(&options, &shape, &inputs),
        workload: Workload::of(config, &shape, inputs.samples, 1),
        algorithm: algorithm_name(algorithm),
        roles: role_plans,
        devices,
        notes,
    })
}

/// The memory limit in bytes: `--memory-limit` if given, else `run.memory_limit_gb` if set.
fn memory_limit(flag_gb: Option<f64>, configured_gb: f64) -> Option<u64> {
    flag_gb
        .or((configured_gb > 0.0).then_some(configured_gb))
        .filter(|gb| gb.is_finite() && *gb > 0.0)
        .map(|gb| (gb * 1e9) as u64)
}

impl ModelSummary {
    fn of(options: &PolicyOptions, shape: &ModelShape, inputs: &Inputs<'_>) -> Self {
        ModelSummary {
            path: options.model_path.clone(),
            model_type: shape.model_type.clone(),
            architecture: shape.architecture,
            parameters: inputs.policy.params.total(),
            trainable_parameters: inputs.policy.trainable + inputs.policy.value_head,
            dtype: options.dtype,
            device: options.device.to_string(),
            lora_rank: options.lora.as_ref().map_or(0, |l| l.rank),
            quantization: options.quantization,
        }
    }
}

/// A multi-agent run holds one policy per agent: every agent after the first (which the
/// run's own role plans, as `[policy]`) adds its own.
fn other_agents(
    loaded: &LoadedConfig,
    cuda: bool,
    host: Option<u64>,
    limit: Option<u64>,
) -> Result<Vec<Role>, PlanError> {
    let mut agents = Vec::new();
    for spec in loaded.config.agent_specs().into_iter().skip(1) {
        let agent = with_policy(loaded, spec.policy);
        let options = PolicyOptions::read(&agent, cuda)?;
        let shape = read_model(&agent, &options.model_path, "model_path")?;
        let algorithm = agent.config.algorithm.name;
        let inputs = gather_inputs(&agent, &options, &shape, algorithm, cuda, host, limit)?;
        agents.push(roles::agent_in_process(spec.name, &inputs));
    }
    Ok(agents)
}

/// `loaded` with `policy` as its `[policy]`.
fn with_policy(loaded: &LoadedConfig, policy: &crate::config::PluginConfig) -> LoadedConfig {
    let mut copy = loaded.clone();
    copy.config.policy = policy.clone();
    copy
}

/// The models and figures the role estimates need, read from the config and `config.json`s.
fn gather_inputs<'a>(
    loaded: &'a LoadedConfig,
    options: &'a PolicyOptions,
    shape: &'a ModelShape,
    algorithm: Algorithm,
    cuda: bool,
    host: Option<u64>,
    limit: Option<u64>,
) -> Result<Inputs<'a>, PlanError> {
    let draft = match &options.draft_model_path {
        Some(path) => Some(read_model(loaded, path, "draft_model_path")?),
        None => None,
    };
    let mut reward_models = Vec::new();
    for reward in options::RewardModel::read_all(loaded, cuda)? {
        let shape = ModelShape::read(&reward.model_path)?;
        reward_models.push((reward, shape));
    }
    Ok(Inputs {
        config: &loaded.config,
        // PPO trains a value head on the policy (python_plugins/value_head.py).
        policy: PolicyMemory::new(shape, options, algorithm == Algorithm::Ppo),
        reference: reference(loaded, options, shape, algorithm)?,
        draft,
        reward_models,
        samples: algorithm.samples(),
        pairs: algorithm == Algorithm::Dpo,
        device_free: match options.device {
            Device::Cpu => host,
            Device::Cuda(_) => limit,
        },
    })
}

/// `Err(WontFit)` naming each device whose predicted peak exceeds what it has.
pub fn check(plan: &Plan) -> Result<(), PlanError> {
    let over: Vec<String> = plan
        .devices
        .iter()
        .filter(|d| d.fits == Some(false))
        .map(|d| {
            format!(
                "{}: predicted peak {} but {} available ({})",
                d.device,
                report::size(d.predicted_peak_bytes),
                report::size(d.available_bytes.unwrap_or(0)),
                d.available_from
            )
        })
        .collect();
    if over.is_empty() {
        return Ok(());
    }
    Err(PlanError::WontFit(format!(
        "the run will not fit in memory: {}. `rollout plan {}` shows the parts; lower the \
         batch (train.micro_batch_tokens, rollout.prompts_per_step), turn on \
         gradient_checkpointing, LoRA or quantization, or skip this check with \
         --no-plan-check (run.plan_check = false)",
        over.join("; "),
        plan.config.display()
    )))
}

/// The size of the policy's vocabulary, from its `model_path`'s `config.json`; `None` for
/// a policy the planner cannot read, and for multi-agent runs (one per agent).
pub fn policy_vocabulary(loaded: &LoadedConfig) -> Option<u64> {
    if !loaded.config.agent_specs().is_empty() {
        return None;
    }
    let options = PolicyOptions::read(loaded, false).ok()?;
    ModelShape::read(&options.model_path)
        .ok()
        .map(|shape| shape.vocab_size)
}

/// The algorithm's name as the config spells it (`[algorithm] name`).
fn algorithm_name(algorithm: Algorithm) -> String {
    serde_json::to_value(algorithm)
        .ok()
        .and_then(|value| value.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{algorithm:?}"))
}

fn read_model(loaded: &LoadedConfig, dir: &Path, key: &str) -> Result<ModelShape, PlanError> {
    ModelShape::read(dir).map_err(|err| {
        let message = match err {
            PlanError::ModelConfig { path, message } => {
                format!("cannot read {}: {message}", path.display())
            }
            other => other.to_string(),
        };
        let at = KeyPath::default().key("policy").key("options").key(key);
        PlanError::Model {
            location: loaded.describe_location(&at),
            key: at.to_string(),
            dir: dir.to_path_buf(),
            message,
        }
    })
}

/// The reference the run uses, if any: `Some(None)` for the LoRA base with its adapters
/// disabled, `Some(Some(model))` for a separately loaded one.
fn reference(
    loaded: &LoadedConfig,
    options: &PolicyOptions,
    shape: &ModelShape,
    algorithm: Algorithm,
) -> Result<Option<Option<ExtraModel>>, PlanError> {
    let needed = loaded.config.algorithm.kl_coef > 0.0 || algorithm == Algorithm::Dpo;
    if !needed {
        return Ok(None);
    }
    let shape = match &options.reference_model_path {
        Some(path) => read_model(loaded, path, "reference_model_path")?,
        None if options.lora.is_some() => return Ok(Some(None)),
        None => shape.clone(),
    };
    Ok(Some(Some(ExtraModel {
        shape,
        quantization: options.reference_quantization,
    })))
}

fn role_plan(role: &Role) -> RolePlan {
    let mut by_device: BTreeMap<Device, Vec<&Component>> = BTreeMap::new();
    for part in &role.components {
        by_device.entry(part.device).or_default().push(part);
    }
    RolePlan {
        role: role.name.clone(),
        devices: by_device
            .into_iter()
            .map(|(device, parts)| {
                let (peak_bytes, peak_phase) = peak(&parts);
                DevicePlan {
                    device: device.to_string(),
                    key: device,
                    peak_bytes,
                    peak_phase,
                    components: parts
                        .iter()
                        .map(|p| ComponentPlan {
                            name: p.name,
                            bytes: p.bytes,
                            phases: p.phases.names(),
                            detail: p.detail.clone(),
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// The largest sum of the components alive in one phase, and that phase.
fn peak(parts: &[&Component]) -> (u64, &'static str) {
    // Reversed, so that of equal sums the earliest phase is named.
    Phases::NAMES
        .iter()
        .rev()
        .map(|(phase, name)| {
            let sum = parts
                .iter()
                .filter(|p| p.phases.contains(*phase))
                .map(|p| p.bytes)
                .fold(0u64, u64::saturating_add);
            (sum, *name)
        })
        .max_by_key(|(sum, _)| *sum)
        .unwrap_or((0, "load"))
}

/// Per device of this machine: the summed peaks of its processes against what it has.
fn device_checks(
    roles: &[RolePlan],
    local: impl Fn(&RolePlan) -> bool,
    host: Option<u64>,
    limit: Option<u64>,
    notes: &mut Vec<String>,
) -> Vec<DeviceCheck> {
    let mut totals: BTreeMap<Device, u64> = BTreeMap::new();
    for role in roles.iter().filter(|r| local(r)) {
        for device in &role.devices {
            let total = totals.entry(device.key).or_default();
            *total = total.saturating_add(device.peak_bytes);
        }
    }
    totals
        .into_iter()
        .map(|(device, predicted)| {
            let (available, from) = match (device, host, limit) {
                (Device::Cpu, Some(h), Some(l)) if l < h => (Some(l), "memory limit".to_owned()),
                (Device::Cpu, Some(h), _) => (Some(h), "available host memory".to_owned()),
                (Device::Cpu, None, Some(l)) => (Some(l), "memory limit".to_owned()),
                (Device::Cuda(_), _, Some(l)) => (Some(l), "memory limit".to_owned()),
                _ => (None, "unknown".to_owned()),
            };
            if available.is_none() {
                notes.push(format!(
                    "{device} cannot be checked here: set run.memory_limit_gb or \
                     --memory-limit to its memory in GB"
                ));
            }
            DeviceCheck {
                device: device.to_string(),
                predicted_peak_bytes: predicted,
                available_bytes: available,
                available_from: from,
                fits: available.map(|a| predicted <= a),
            }
        })
        .collect()
}

/// What `rollout run` and `rollout launch` do before loading: plan the run and refuse it when
/// a device will not hold it. A run the planner cannot size (a policy without `model_path`,
/// a model directory it cannot read) goes ahead with a warning: loading will say more.
pub fn gate(
    loaded: &LoadedConfig,
    mode: Mode,
    limit_gb: Option<f64>,
    enabled: bool,
) -> Result<(), PlanError> {
    if !enabled || !loaded.config.run.plan_check {
        tracing::info!("memory plan check off");
        return Ok(());
    }
    let plan = match plan(loaded, mode, limit_gb) {
        Ok(plan) => plan,
        Err(err) => {
            tracing::warn!("memory plan skipped: {err}");
            return Ok(());
        }
    };
    check(&plan)?;
    for device in &plan.devices {
        match device.available_bytes {
            Some(available) => tracing::info!(
                "memory plan: predicted peak {} of {} {} on {}",
                report::size(device.predicted_peak_bytes),
                report::size(available),
                device.available_from,
                device.device
            ),
            None => tracing::warn!(
                "memory plan: predicted peak {} on {}, which cannot be checked here (set \
                 run.memory_limit_gb or --memory-limit)",
                report::size(device.predicted_peak_bytes),
                device.device
            ),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
