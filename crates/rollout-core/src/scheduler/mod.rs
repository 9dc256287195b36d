//! The pure-Rust core of Rollout's sampling engine.
//!
//! The engine owns scheduling and the KV cache; the policy's model runner only runs the
//! forward pass and samples (the contract is `rollout_sdk/engine.py`). Every step:
//!
//! 1. [`Scheduler::plan`] decides which sequences run and which tokens each one feeds
//!    (continuous batching with chunked prefill, admission control, preemption by recompute,
//!    group prefix sharing with copy-on-write, prefix caching and speculative drafts) and
//!    returns a [`StepPlan`] holding exactly the arrays of `EngineStep`;
//! 2. the runner executes it and returns the arrays of `EngineStepOutput` as a
//!    [`StepOutput`];
//! 3. [`Scheduler::apply`] validates the outcome, appends the emitted tokens, rolls back
//!    rejected drafts, forks groups after their shared prefill and returns the samples that
//!    finished.
//!
//! The cache is `num_blocks * block_size` token slots; slot `block * block_size + offset` holds
//! token `offset` of `block`. Randomness is per sample and per generated token
//! ([`uniform`]), so outputs do not depend on batch composition or preemption.

mod apply;
mod blocks;
mod config;
mod ngram;
mod plan;
mod schedule;
mod sequence;
mod stats;

#[cfg(test)]
mod tests;

pub use config::{EngineConfig, Request, SampleParams, Speculation};
pub use plan::{StepOutput, StepPlan, uniform};
pub use rollout_net::messages::FinishReason;
pub use schedule::Scheduler;
pub use sequence::{RequestId, SeqId};
pub use stats::EngineStats;

/// A sample that finished: its generated tokens (the stop token included when it ended on
/// one) and their log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    /// The request the sample belongs to.
    pub request: RequestId,
    /// Index of the sample within its request (`0..n`).
    pub sample: usize,
    /// Generated tokens, prompt excluded.
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token under the temperature-scaled distribution.
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
}

/// What the engine rejects: invalid configurations and requests, and model outcomes that do
/// not match their plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// A configuration value is out of range.
    #[error("invalid engine configuration: {0}")]
    InvalidConfig(String),
    /// The request has no prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The request asks for no samples.
    #[error("a request needs at least one sample (n = 0)")]
    NoSamples,
    /// A per-sample list does not have `n` entries.
    #[error("`{field}` has {got} entries but the request has n = {n} samples")]
    PerSampleLength {
        /// The offending field.
        field: &'static str,
        /// Its length.
        got: usize,
        /// The number of samples.
        n: usize,
    },
    /// A sample may not generate anything.
    #[error("max_new_tokens of sample {sample} is 0; every sample generates at least one token")]
    ZeroMaxNewTokens {
        /// The offending sample.
        sample: usize,
    },
    /// A sampling parameter is out of range.
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(String),
    /// The prompt alone needs more KV blocks than the whole cache holds.
    #[error(
        "the prompt of {prompt_len} tokens needs {needed} KV blocks of {block_size} tokens, plus \
         one free block, but the whole cache has {num_blocks}: shorten the prompt or give the \
         cache more memory"
    )]
    PromptTooLong {
        /// Prompt tokens.
        prompt_len: usize,
        /// Blocks the prompt occupies.
        needed: usize,
        /// Tokens per block.
        block_size: usize,
        /// Blocks in the cache.
        num_blocks: usize,
    },
    /// Prompt plus the longest completion cannot be held by the whole cache.
    #[error(
        "a sequence of {prompt_len} prompt tokens and up to {max_new_tokens} new tokens needs \
         {needed} KV blocks of {block_size} tokens, plus one free block, but the whole cache \
         has {num_blocks}: lower max_new_tokens or give the cache more memory"
    )]
    SequenceTooLong {
        /// Prompt tokens.
        prompt_len: usize,
        /// The largest `max_new_tokens` of the request.
        max_new_tokens: u32,
        /// Blocks the longest sequence occupies.
        needed: usize,
        /// Tokens per block.
        block_size: usize,
        /// Blocks in the cache.
        num_blocks: usize,
    },
    /// `apply` got a plan that is not the one in flight.
    #[error(
        "step plan {got} is not the plan in flight ({expected:?}); apply each plan once, in order"
    )]
    PlanMismatch {
        /// The plan's step number.
        got: u64,
        /// The step in flight, if any.
        expected: Option<u64>,
    },
    /// An outcome array has the wrong length.
    #[error("outcome `{field}` has {got} elements, expected {expected}")]
    OutcomeShape {
        /// The array.
        field: &'static str,
        /// Its required length.
        expected: usize,
        /// Its length.
        got: usize,
    },
    /// `counts[row]` is outside `1..=draft_lens[row] + 1`.
    #[error("outcome row {row} emits {count} tokens; it must emit 1 to {max}")]
    OutcomeCount {
        /// The row.
        row: usize,
        /// Its count.
        count: i64,
        /// Drafts of the row plus one.
        max: usize,
    },
    /// An emitted token id is not a valid token id.
    #[error("outcome row {row} emits token id {token}, which is not a valid token id")]
    OutcomeToken {
        /// The row.
        row: usize,
        /// The token id.
        token: i64,
    },
    /// An emitted log-probability is NaN or positive.
    #[error("outcome row {row} has log-probability {logprob}, which is not <= 0")]
    OutcomeLogprob {
        /// The row.
        row: usize,
        /// The value.
        logprob: f32,
    },
    /// The outcome claims a draft was accepted but emits a different token at its place.
    #[error(
        "outcome row {row} accepts draft {position} but emits {got} instead of the draft {expected}"
    )]
    DraftMismatch {
        /// The row.
        row: usize,
        /// Index of the draft in the row.
        position: usize,
        /// The drafted token.
        expected: u32,
        /// The emitted token.
        got: i64,
    },
    /// A KV block was released more often than it was retained (a bookkeeping bug).
    #[error("KV block {0} was released more often than it was retained")]
    DoubleFree(u32),
}
