//! `[train]`: the optimizer update, and how trainer ranks hold the policy (`sharding`,
//! `[train.fsdp]`).

use serde::{Deserialize, Serialize};

/// The optimizer update of each step.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub learning_rate: f64,
    /// Linear warm-up from 0 over this many updates.
    pub warmup_steps: u64,
    /// Padded tokens per micro-batch at most (rows x longest row); sequences are sorted by
    /// length and packed greedily, so the number of rows follows the sequence lengths.
    pub micro_batch_tokens: usize,
    /// How the trainer ranks of `rollout launch` hold the policy.
    pub sharding: Sharding,
    /// FSDP2's options, for `sharding = "fsdp"`.
    pub fsdp: FsdpConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            learning_rate: 1e-6,
            warmup_steps: 0,
            micro_batch_tokens: 8192,
            sharding: Sharding::Replicate,
            fsdp: FsdpConfig::default(),
        }
    }
}

/// Whole on every rank (gradients all-reduced), or sharded across the ranks (FSDP2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Sharding {
    Replicate,
    Fsdp,
}

impl Sharding {
    pub fn as_str(self) -> &'static str {
        match self {
            Sharding::Replicate => "replicate",
            Sharding::Fsdp => "fsdp",
        }
    }
}

/// A floating-point dtype FSDP2 computes or reduces in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FloatDtype {
    Float32,
    Bfloat16,
    Float16,
}

impl FloatDtype {
    pub fn as_str(self) -> &'static str {
        match self {
            FloatDtype::Float32 => "float32",
            FloatDtype::Bfloat16 => "bfloat16",
            FloatDtype::Float16 => "float16",
        }
    }

    pub fn bytes(self) -> u64 {
        match self {
            FloatDtype::Float32 => 4,
            FloatDtype::Bfloat16 | FloatDtype::Float16 => 2,
        }
    }
}

/// `[train.fsdp]`: FSDP2's mixed precision, resharding and offload.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct FsdpConfig {
    /// The dtype gathered blocks compute in; unset, the policy's own `dtype`.
    pub param_dtype: Option<FloatDtype>,
    /// The dtype gradients are reduce-scattered in.
    pub reduce_dtype: FloatDtype,
    /// Free a block's gathered parameters after its forward pass (gathered again for the
    /// backward pass); false keeps them until the backward pass, trading memory for traffic.
    pub reshard_after_forward: bool,
    /// Keep the sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
    /// `CPUOffloadPolicy`); the optimizer steps on the CPU.
    pub offload: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            param_dtype: None,
            reduce_dtype: FloatDtype::Float32,
            reshard_after_forward: true,
            offload: false,
        }
    }
}
