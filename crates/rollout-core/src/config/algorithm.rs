//! `[algorithm]`: the training algorithm, its advantage estimator and the knobs of its
//! objective (docs/algorithms.md).

use rollout_net::messages::{CorrectionLevel, CorrectionMode, RolloutCorrection};
use serde::{Deserialize, Serialize};

/// The training algorithm: its advantage estimator and objective (see docs/algorithms.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    #[default]
    Grpo,
    DrGrpo,
    Rloo,
    ReinforcePp,
    Gspo,
    /// PPO with a critic: a value head on the policy, GAE advantages per token.
    Ppo,
    /// Preference pairs from the data, no generation.
    Dpo,
    /// Supervised updates on the data's completions, no generation.
    Sft,
}

impl Algorithm {
    pub fn default_estimator(self) -> AdvantageEstimator {
        match self {
            Algorithm::DrGrpo => AdvantageEstimator::GroupMean,
            Algorithm::Rloo => AdvantageEstimator::LeaveOneOut,
            Algorithm::ReinforcePp => AdvantageEstimator::BatchNorm,
            _ => AdvantageEstimator::GroupNorm,
        }
    }

    /// Whether the run samples completions and scores them (not DPO or SFT).
    pub fn samples(self) -> bool {
        !matches!(self, Algorithm::Dpo | Algorithm::Sft)
    }
}

/// How rewards become advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// GRPO: `(r - mean(group)) / (std(group) + eps)`.
    GroupNorm,
    /// Dr. GRPO: `r - mean(group)`, no division by the standard deviation.
    GroupMean,
    /// RLOO: `r - mean(others in the group)`.
    LeaveOneOut,
    /// REINFORCE++: `(r - mean(step)) / (std(step) + eps)` over the whole step's samples.
    BatchNorm,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmConfig {
    pub name: Algorithm,
    /// The advantage estimator; the algorithm's own when unset.
    pub advantage: Option<AdvantageEstimator>,
    /// Added to the standard deviation for `group_norm` and `batch_norm`.
    pub std_eps: f64,
    /// Lower clip of the importance ratio: `1 - clip_low` (GSPO: 3e-4 when unset, else 0.2).
    pub clip_low: Option<f32>,
    /// Upper clip of the importance ratio: `1 + clip_high` (DAPO's clip-higher raises it;
    /// GSPO: 4e-4 when unset, else 0.2).
    pub clip_high: Option<f32>,
    /// Weight of the KL penalty to the frozen reference model (0 turns it off and never
    /// loads the reference): k3 in the loss, or k1 in the reward for `reinforce_pp`.
    pub kl_coef: f32,
    /// DPO's inverse temperature.
    pub beta: f32,
    /// DPO: the record fields holding the preferred and the dispreferred completion; SFT:
    /// `completion_key` holds the target.
    pub chosen_key: String,
    pub rejected_key: String,
    pub completion_key: String,
    /// DAPO's dynamic sampling: groups whose rewards are all equal (no learning signal) are
    /// replaced by groups of further prompts, in up to this many extra rounds (0: off).
    pub dynamic_sampling_rounds: u32,
    /// DAPO's overlong shaping: a completion longer than `max_new_tokens - overlong_buffer`
    /// loses up to `overlong_penalty`, linearly over the buffer (0: off).
    pub overlong_buffer: u32,
    pub overlong_penalty: f64,
    /// Optimizer updates over each step's samples (PPO epochs): from the second on the
    /// importance ratio (and PPO's value) clipping bites.
    pub epochs: u32,
    /// PPO: the discount and GAE's lambda over a completion's tokens.
    pub gamma: f32,
    pub lam: f32,
    /// PPO: the value prediction moves at most this far from the one before the update.
    pub value_clip: f32,
    /// PPO: weight of the value loss.
    pub value_coef: f32,
    /// PPO: the first this many steps train only the value head.
    pub critic_warmup_steps: u64,
    /// PPO: advantages are shifted and scaled to mean 0, standard deviation 1 over the step.
    pub whiten_advantages: bool,
    /// Rollout correction for the generator's logprobs differing from the trainer's:
    /// `none`, `tis` (truncated importance sampling) or `mis` (masked importance sampling).
    pub rollout_correction: CorrectionMode,
    /// TIS: the largest importance weight.
    pub rollout_correction_cap: f32,
    /// MIS: the importance weights kept, `[low, high]`.
    pub rollout_correction_band: [f32; 2],
    /// MIS: mask single tokens (`token`) or whole sequences by their geometric-mean weight
    /// (`sequence`).
    pub rollout_correction_level: CorrectionLevel,
}

impl Default for AlgorithmConfig {
    fn default() -> Self {
        Self {
            name: Algorithm::Grpo,
            advantage: None,
            std_eps: 1e-4,
            clip_low: None,
            clip_high: None,
            kl_coef: 0.0,
            beta: 0.1,
            chosen_key: "chosen".into(),
            rejected_key: "rejected".into(),
            completion_key: "answer".into(),
            dynamic_sampling_rounds: 0,
            overlong_buffer: 0,
            overlong_penalty: 1.0,
            epochs: 1,
            gamma: 1.0,
            lam: 0.95,
            value_clip: 0.2,
            value_coef: 0.5,
            critic_warmup_steps: 0,
            whiten_advantages: true,
            rollout_correction: CorrectionMode::None,
            rollout_correction_cap: 2.0,
            rollout_correction_band: [0.5, 2.0],
            rollout_correction_level: CorrectionLevel::Token,
        }
    }
}

impl AlgorithmConfig {
    pub fn estimator(&self) -> AdvantageEstimator {
        self.advantage
            .unwrap_or_else(|| self.name.default_estimator())
    }

    /// The importance-ratio clip range `(low, high)`.
    pub fn clip(&self) -> (f32, f32) {
        let (low, high) = match self.name {
            Algorithm::Gspo => (3e-4, 4e-4),
            _ => (0.2, 0.2),
        };
        (self.clip_low.unwrap_or(low), self.clip_high.unwrap_or(high))
    }

    /// The rollout correction the objective applies.
    pub fn correction(&self) -> RolloutCorrection {
        RolloutCorrection {
            mode: self.rollout_correction,
            cap: self.rollout_correction_cap,
            band: self.rollout_correction_band,
            level: self.rollout_correction_level,
        }
    }
}
