//! What the engine is configured with, and what a caller asks of it.

use super::EngineError;

/// Sizes and policies of one engine instance.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Cache capacity in blocks, from the memory budget (computed by the caller).
    pub num_blocks: usize,
    /// Query tokens per forward pass at most (decodes, drafts and prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences running at once at most.
    pub max_running: usize,
    /// Reuse cached full blocks across requests (multi-turn contexts, repeated prompts).
    pub prefix_caching: bool,
    /// Speculative decoding.
    pub speculation: Speculation,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 1024,
            max_batch_tokens: 2048,
            max_running: 256,
            prefix_caching: true,
            speculation: Speculation::Off,
        }
    }
}

impl EngineConfig {
    /// Checks that every size is positive and the speculation settings are consistent.
    pub fn validate(&self) -> Result<(), EngineError> {
        let positive = [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_batch_tokens", self.max_batch_tokens),
            ("max_running", self.max_running),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(EngineError::InvalidConfig(format!(
                    "{name} must be at least 1"
                )));
            }
        }
        if self.num_blocks.saturating_mul(self.block_size) > i64::MAX as usize / 2 {
            return Err(EngineError::InvalidConfig(
                "the cache has too many slots".into(),
            ));
        }
        match self.speculation {
            Speculation::Off => Ok(()),
            Speculation::Ngram {
                num_tokens,
                max_ngram,
                min_ngram,
            } => {
                if num_tokens == 0 || min_ngram == 0 || max_ngram < min_ngram {
                    Err(EngineError::InvalidConfig(format!(
                        "n-gram speculation needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram \
                         (got num_tokens = {num_tokens}, min_ngram = {min_ngram}, max_ngram = \
                         {max_ngram})"
                    )))
                } else {
                    Ok(())
                }
            }
            Speculation::DraftModel { num_tokens } => {
                if num_tokens == 0 {
                    Err(EngineError::InvalidConfig(
                        "draft-model speculation needs num_tokens >= 1".into(),
                    ))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Degenerate sizes raised to 1 and inconsistent n-gram bounds ordered, so that any
    /// configuration can run.
    pub(super) fn sanitized(mut self) -> Self {
        self.block_size = self.block_size.max(1);
        self.num_blocks = self.num_blocks.max(1);
        self.max_batch_tokens = self.max_batch_tokens.max(1);
        self.max_running = self.max_running.max(1);
        self.speculation = match self.speculation {
            Speculation::Ngram {
                num_tokens,
                max_ngram,
                min_ngram,
            } => {
                let min_ngram = min_ngram.max(1);
                Speculation::Ngram {
                    num_tokens,
                    max_ngram: max_ngram.max(min_ngram),
                    min_ngram,
                }
            }
            other => other,
        };
        self
    }

    /// Blocks needed to hold `tokens` tokens.
    pub(super) fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// Speculative decoding: extra query tokens per decoding sequence, verified in the same pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speculation {
    /// One token per decoding sequence and step.
    Off,
    /// Prompt-lookup drafting: the tokens that followed the most recent earlier occurrence of
    /// the sequence's last `m` tokens, `m` from `max_ngram` down to `min_ngram`.
    Ngram {
        /// Drafts per step at most.
        num_tokens: usize,
        /// Longest suffix matched.
        max_ngram: usize,
        /// Shortest suffix matched.
        min_ngram: usize,
    },
    /// The policy's draft model proposes `num_tokens` tokens; the plan reserves their places
    /// (input id -1) and sets `draft_with_model`.
    DraftModel {
        /// Drafts per step at most.
        num_tokens: usize,
    },
}

impl Speculation {
    /// Drafts per decoding sequence and step at most.
    pub(super) fn num_tokens(&self) -> usize {
        match *self {
            Speculation::Off => 0,
            Speculation::Ngram { num_tokens, .. } | Speculation::DraftModel { num_tokens } => {
                num_tokens
            }
        }
    }
}

/// How a request's samples are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub top_k: u32,
}

impl Default for SampleParams {
    fn default() -> Self {
        SampleParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
        }
    }
}

/// One prompt and `n` samples of it; the prompt is prefilled once for all of them.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Samples of the prompt.
    pub n: usize,
    /// Per sample (`n` entries): tokens generated at most.
    pub max_new_tokens: Vec<u32>,
    /// Shared by the samples.
    pub params: SampleParams,
    /// Tokens that end a sample (the caller includes the end-of-sequence ids); the stop token
    /// is part of the completion.
    pub stop_token_ids: Vec<u32>,
    /// Per sample (`n` entries): the seed its random numbers derive from.
    pub seeds: Vec<u64>,
}

impl Request {
    /// Checks everything that does not depend on the cache size.
    pub(super) fn validate(&self) -> Result<(), EngineError> {
        if self.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if self.n == 0 {
            return Err(EngineError::NoSamples);
        }
        if self.max_new_tokens.len() != self.n {
            return Err(EngineError::PerSampleLength {
                field: "max_new_tokens",
                got: self.max_new_tokens.len(),
                n: self.n,
            });
        }
        if self.seeds.len() != self.n {
            return Err(EngineError::PerSampleLength {
                field: "seeds",
                got: self.seeds.len(),
                n: self.n,
            });
        }
        if let Some(sample) = self.max_new_tokens.iter().position(|&m| m == 0) {
            return Err(EngineError::ZeroMaxNewTokens { sample });
        }
        let p = &self.params;
        if !(p.temperature.is_finite() && p.temperature >= 0.0) {
            return Err(EngineError::InvalidParams(format!(
                "temperature must be finite and >= 0, got {}",
                p.temperature
            )));
        }
        if !(p.top_p > 0.0 && p.top_p <= 1.0) {
            return Err(EngineError::InvalidParams(format!(
                "top_p must be in (0, 1], got {}",
                p.top_p
            )));
        }
        Ok(())
    }
}
