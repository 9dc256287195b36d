//! The options of the policy (and of model-backed rewards) that decide memory, read from the
//! config's `options` tables. Options the planner does not know are ignored: the plugin's own
//! `Config` checks them when the run loads.

use std::path::PathBuf;

use super::PlanError;
use crate::config::{KeyPath, LoadedConfig};

/// Bytes of one element of a floating-point dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Float32,
    Bfloat16,
    Float16,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Float32 => 4,
            Dtype::Bfloat16 | Dtype::Float16 => 2,
        }
    }
}

/// Frozen weights stored in fewer bits (bitsandbytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Quantization {
    None,
    Int8,
    Nf4,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    Adamw,
    Adamw8bit,
}

/// LoRA adapters on the frozen base.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Lora {
    pub rank: u64,
    pub target_modules: Vec<String>,
}

/// Where a model lives: the host, or one CUDA device (`None`: the current one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Device {
    Cpu,
    Cuda(Option<u32>),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(None) => write!(f, "cuda"),
            Device::Cuda(Some(index)) => write!(f, "cuda:{index}"),
        }
    }
}

/// What the planner reads of the HF policy's options (`python_plugins/hf_policy.py`).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyOptions {
    pub model_path: PathBuf,
    pub reference_model_path: Option<PathBuf>,
    pub draft_model_path: Option<PathBuf>,
    pub dtype: Dtype,
    pub device: Device,
    pub gradient_checkpointing: bool,
    pub share_prompt_prefix: bool,
    pub lora: Option<Lora>,
    pub quantization: Quantization,
    pub reference_quantization: Quantization,
    pub optimizer: Optimizer,
    pub offload_optimizer: bool,
}

/// A reward (or judge) that loads a model: its path, dtype and device.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardModel {
    pub name: String,
    pub model_path: PathBuf,
    pub dtype: Dtype,
    pub device: Device,
}

/// The PEFT default targets of `HFCausalLM` (`DEFAULT_LORA_TARGETS`).
pub const DEFAULT_LORA_TARGETS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];

/// Reads typed values out of one `options` table, with errors located in the config.
struct Reader<'a> {
    loaded: &'a LoadedConfig,
    table: &'a toml::Table,
    at: KeyPath,
}

impl Reader<'_> {
    fn error(&self, key: &str, message: &str) -> PlanError {
        PlanError::Config(self.loaded.error_at(&self.at.clone().key(key), message))
    }

    fn string(&self, key: &str) -> Result<Option<&str>, PlanError> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::String(text)) => Ok(Some(text)),
            Some(_) => Err(self.error(key, "must be a string")),
        }
    }

    fn path(&self, key: &str) -> Result<Option<PathBuf>, PlanError> {
        Ok(self.string(key)?.map(PathBuf::from))
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, PlanError> {
        match self.table.get(key) {
            None => Ok(default),
            Some(toml::Value::Boolean(value)) => Ok(*value),
            Some(_) => Err(self.error(key, "must be true or false")),
        }
    }

    fn integer(&self, key: &str) -> Result<u64, PlanError> {
        match self.table.get(key) {
            None => Ok(0),
            Some(toml::Value::Integer(value)) => {
                u64::try_from(*value).map_err(|_| self.error(key, "must not be negative"))
            }
            Some(_) => Err(self.error(key, "must be an integer")),
        }
    }

    /// One of `choices` (the first is the default).
    fn choice<T: Copy>(&self, key: &str, choices: &[(&str, T)]) -> Result<T, PlanError> {
        let Some((_, default)) = choices.first() else {
            return Err(self.error(key, "has no choices"));
        };
        let Some(value) = self.string(key)? else {
            return Ok(*default);
        };
        choices
            .iter()
            .find(|(name, _)| *name == value)
            .map(|(_, choice)| *choice)
            .ok_or_else(|| {
                let names: Vec<String> = choices.iter().map(|(n, _)| format!("\"{n}\"")).collect();
                self.error(key, &format!("must be one of {}", names.join(", ")))
            })
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<String>>, PlanError> {
        match self.table.get(key) {
            None => Ok(None),
            Some(toml::Value::Array(items)) => items
                .iter()
                .map(|item| match item {
                    toml::Value::String(text) => Ok(text.clone()),
                    _ => Err(self.error(key, "must be a list of strings")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(self.error(key, "must be a list of strings")),
        }
    }

    fn dtype(&self) -> Result<Dtype, PlanError> {
        self.choice(
            "dtype",
            &[
                ("float32", Dtype::Float32),
                ("bfloat16", Dtype::Bfloat16),
                ("float16", Dtype::Float16),
            ],
        )
    }

    fn quantization(&self, key: &str) -> Result<Quantization, PlanError> {
        self.choice(
            key,
            &[
                ("none", Quantization::None),
                ("int8", Quantization::Int8),
                ("nf4", Quantization::Nf4),
            ],
        )
    }

    /// `"cpu"`, `"cuda"`, `"cuda:N"`; `"auto"` is CUDA when `cuda_present`.
    fn device(&self, cuda_present: bool) -> Result<Device, PlanError> {
        let text = self.string("device")?.unwrap_or("cpu");
        match text {
            "cpu" => Ok(Device::Cpu),
            "auto" if cuda_present => Ok(Device::Cuda(None)),
            "auto" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(None)),
            _ => text
                .strip_prefix("cuda:")
                .and_then(|index| index.parse().ok())
                .map(|index| Device::Cuda(Some(index)))
                .ok_or_else(|| {
                    self.error(
                        "device",
                        "must be \"cpu\", \"cuda\", \"cuda:N\" or \"auto\"",
                    )
                }),
        }
    }
}

impl PolicyOptions {
    /// The policy's options, when it is a policy the planner can size: one whose options
    /// name a `model_path` (the built-in `HFCausalLM` and plugins built like it).
    pub fn read(loaded: &LoadedConfig, cuda_present: bool) -> Result<Self, PlanError> {
        let policy = &loaded.config.policy;
        let reader = Reader {
            loaded,
            table: &policy.options,
            at: KeyPath::default().key("policy").key("options"),
        };
        let Some(model_path) = reader.path("model_path")? else {
            return Err(PlanError::UnknownPolicy {
                plugin: policy.plugin.clone(),
                location: loaded.describe_location(&KeyPath::default().key("policy")),
            });
        };
        let rank = reader.integer("lora_rank")?;
        let lora = (rank > 0)
            .then(|| -> Result<Lora, PlanError> {
                let default = || DEFAULT_LORA_TARGETS.iter().map(|s| s.to_string()).collect();
                Ok(Lora {
                    rank,
                    target_modules: reader
                        .strings("lora_target_modules")?
                        .unwrap_or_else(default),
                })
            })
            .transpose()?;
        Ok(PolicyOptions {
            model_path,
            reference_model_path: reader.path("reference_model_path")?,
            draft_model_path: reader.path("draft_model_path")?,
            dtype: reader.dtype()?,
            device: reader.device(cuda_present)?,
            gradient_checkpointing: reader.flag("gradient_checkpointing", false)?,
            share_prompt_prefix: reader.flag("share_prompt_prefix", true)?,
            lora,
            quantization: reader.quantization("quantization")?,
            reference_quantization: reader.quantization("reference_quantization")?,
            optimizer: reader.choice(
                "optimizer",
                &[
                    ("adamw", Optimizer::Adamw),
                    ("adamw_8bit", Optimizer::Adamw8bit),
                ],
            )?,
            offload_optimizer: reader.flag("offload_optimizer", false)?,
        })
    }
}

impl RewardModel {
    /// Every `[[rewards]]` entry whose options name a `model_path` (reward models, judges).
    pub fn read_all(loaded: &LoadedConfig, cuda_present: bool) -> Result<Vec<Self>, PlanError> {
        let mut models = Vec::new();
        for (index, reward) in loaded.config.rewards.iter().enumerate() {
            let reader = Reader {
                loaded,
                table: &reward.options,
                at: KeyPath::default()
                    .key("rewards")
                    .index(index)
                    .key("options"),
            };
            let Some(model_path) = reader.path("model_path")? else {
                continue;
            };
            models.push(RewardModel {
                name: crate::config::reward_name(reward),
                model_path,
                dtype: reader.dtype()?,
                device: reader.device(cuda_present)?,
            });
        }
        Ok(models)
    }
}
