//! The token counts a step works on, as the controller, the engine and the trainer will see
//! them: sequences per step, their length, the largest micro-batch, the KV blocks wanted.

use super::model::ModelShape;
use crate::config::{Config, SpeculationMethod};

/// Prompt tokens assumed when `[run] plan_prompt_tokens` is 0: as many as the completion
/// budget (prompts are not read by the planner).
pub const DEFAULT_PROMPT_TOKENS_PER_COMPLETION_TOKEN: u64 = 1;

/// The share prompts must save of a micro-batch's token positions for the HF policy to run
/// each distinct prompt once (`share_prompt_prefix`; `python_plugins/shared_prefix.py`).
const SHARED_PREFIX_MIN_SAVING: f64 = 0.2;

/// One step's shape for one role.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Workload {
    /// Prompts this role generates for per step (all of them in `rollout run`).
    pub prompts: u64,
    pub group_size: u64,
    /// Tokens of a prompt (an estimate unless `plan_prompt_tokens` is set).
    pub prompt_tokens: u64,
    /// Tokens generated per sample and episode (every turn's budget).
    pub completion_tokens: u64,
    /// Whether the run samples at all (DPO and SFT train on the data's completions).
    pub samples: bool,
}

impl Workload {
    /// The run's step for a role that generates or trains `1 / share` of it.
    pub fn of(config: &Config, shape: &ModelShape, samples: bool, share: u64) -> Self {
        let rollout = &config.rollout;
        let turns = config
            .environment
            .as_ref()
            .map_or(1, |e| u64::from(e.max_turns.max(1)));
        let completion = u64::from(rollout.max_new_tokens).saturating_mul(turns);
        let prompt = match config.run.plan_prompt_tokens {
            0 => u64::from(rollout.max_new_tokens) * DEFAULT_PROMPT_TOKENS_PER_COMPLETION_TOKEN,
            tokens => tokens,
        };
        let prompt = prompt.min(shape.max_positions.saturating_sub(completion).max(1));
        Workload {
            prompts: (rollout.prompts_per_step as u64).div_ceil(share.max(1)),
            group_size: rollout.group_size as u64,
            prompt_tokens: prompt,
            completion_tokens: completion.min(shape.max_positions),
            samples,
        }
    }

    pub fn sequence_tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }

    pub fn rows(&self) -> u64 {
        self.prompts.saturating_mul(self.group_size)
    }

    /// Token positions the largest micro-batch computes: rows x length under the padded
    /// budget (a longer sequence gets a micro-batch of its own), fewer when each distinct
    /// prompt runs once.
    pub fn train_tokens(&self, micro_batch_tokens: u64, share_prefix: bool) -> u64 {
        let length = self.sequence_tokens().max(1);
        let rows = (micro_batch_tokens / length).clamp(1, self.rows().max(1));
        let padded = rows * length;
        if !share_prefix || self.group_size < 2 {
            return padded;
        }
        let shared =
            rows.div_ceil(self.group_size) * self.prompt_tokens + rows * self.completion_tokens;
        if (shared as f64) <= padded as f64 * (1.0 - SHARED_PREFIX_MIN_SAVING) {
            shared
        } else {
            padded
        }
    }

    /// Tokens of the largest supervised micro-batch (`[sft]`, or SFT/DPO as the algorithm):
    /// `rows` sequences of a prompt and a completion of `max_new_tokens`.
    pub fn supervised_tokens(&self, rows: u64, micro_batch_tokens: u64) -> u64 {
        let length = self.sequence_tokens().max(1);
        (micro_batch_tokens / length).clamp(1, rows.max(1)) * length
    }

    /// KV-cache blocks one generation request wants, as `PagedGenerator::blocks_wanted`
    /// counts them: each prompt with its longest completion, and each further sample's own
    /// completion plus a copied partial block.
    pub fn kv_blocks_wanted(&self, config: &Config) -> u64 {
        let engine = &config.engine;
        let block = (engine.block_size as u64).max(1);
        let drafts = match engine.speculation.method {
            SpeculationMethod::Off => 0,
            _ => engine.speculation.num_tokens as u64,
        };
        let longest = self.completion_tokens + drafts;
        let per_prompt = (self.prompt_tokens + longest).div_ceil(block)
            + self.group_size.saturating_sub(1) * (longest.div_ceil(block) + 1);
        self.prompts.saturating_mul(per_prompt)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn workload(prompts: u64, group: u64, prompt: u64, completion: u64) -> Workload {
        Workload {
            prompts,
            group_size: group,
            prompt_tokens: prompt,
            completion_tokens: completion,
            samples: true,
        }
    }

    #[test]
    fn micro_batch_is_capped_by_the_budget_and_the_step() {
        let step = workload(8, 8, 6, 32);
        // 64 rows of 38 tokens fit a budget of 8192 in one micro-batch.
        assert_eq!(step.train_tokens(8192, false), 64 * 38);
        // 512 tokens take 13 rows.
        assert_eq!(step.train_tokens(512, false), 13 * 38);
        // A sequence longer than the budget gets a micro-batch of its own.
        assert_eq!(step.train_tokens(10, false), 38);
    }

    #[test]
    fn shared_prompts_only_when_they_save_a_fifth() {
        // Prompts of 6 tokens before 32: 2096 of 2432 positions, a 14% saving: not used.
        assert_eq!(workload(8, 8, 6, 32).train_tokens(8192, true), 64 * 38);
        // The quickstart's 6 + 6: each prompt once saves 44%.
        let quickstart = workload(32, 8, 6, 6);
        assert_eq!(quickstart.train_tokens(4096, true), 32 * 6 + 256 * 6);
    }

    #[test]
    fn kv_blocks_follow_the_engine() {
        let config: Config =
            toml::from_str("[policy]\nplugin = \"p:P\"\n[data]\nplugin = \"d:D\"\n").unwrap();
        // 38 tokens: 3 blocks of 16; 7 more samples of 32 tokens: 2 blocks + 1 copied each.
        assert_eq!(
            workload(8, 8, 6, 32).kv_blocks_wanted(&config),
            8 * (3 + 7 * 3)
        );
    }
}
