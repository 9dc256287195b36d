//! The run state saved with every checkpoint: everything besides the policy that an exact
//! resume needs.

use serde::{Deserialize, Serialize};

/// Position in the shuffled data: `offset` records into epoch `epoch`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    pub epoch: u64,
    pub offset: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Format of this file; bumped on incompatible changes.
    pub format: u32,
    /// RL steps completed.
    pub step: u64,
    /// Supervised warm-start steps completed.
    pub sft_step: u64,
    /// Optimizer updates applied to the policy (SFT and RL).
    pub weight_version: u64,
    pub data: DataPosition,
    /// Records of dropped groups waiting to be drawn again by a later step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requeued: Vec<super::Requeued>,
    pub sft_data: DataPosition,
    pub seed: u64,
    /// Mean reward of every RL step so far, for the run summary.
    pub reward_history: Vec<f64>,
    /// The `rollout` version that wrote it.
    pub rollout_version: String,
}

pub const STATE_FORMAT: u32 = 1;

impl RunState {
    pub fn new(seed: u64) -> Self {
        RunState {
            format: STATE_FORMAT,
            step: 0,
            sft_step: 0,
            weight_version: 0,
            data: DataPosition::default(),
            requeued: Vec::new(),
            sft_data: DataPosition::default(),
            seed,
            reward_history: Vec::new(),
            rollout_version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }
}
