//! What the planner estimates each process from ([`Inputs`]), and what it gives for each
//! ([`Role`]).

use super::estimate::{Component, PolicyMemory};
use super::model::ModelShape;
use super::options::{Quantization, RewardModel};
use crate::config::Config;

/// A separately loaded model the policy holds besides its own (reference, draft).
#[derive(Debug, Clone, PartialEq)]
pub struct ExtraModel {
    pub shape: ModelShape,
    pub quantization: Quantization,
}

/// Everything the role estimates are computed from.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    pub config: &'a Config,
    pub policy: PolicyMemory<'a>,
    /// `Some` when the run uses a reference; its model is `None` when it is the policy's base
    /// with the adapters disabled (LoRA: no second copy).
    pub reference: Option<Option<ExtraModel>>,
    pub draft: Option<ModelShape>,
    pub reward_models: Vec<(RewardModel, ModelShape)>,
    /// Whether the run samples (not DPO or SFT).
    pub samples: bool,
    /// Preference pairs (DPO): two sequences per record.
    pub pairs: bool,
    /// Free memory of the policy's device, for the engine's `kv_cache_fraction` budget.
    pub device_free: Option<u64>,
}

/// One process and its memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Role {
    pub name: String,
    pub components: Vec<Component>,
}
