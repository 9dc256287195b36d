//! A scheduling decision as the arrays the model runner consumes (`EngineStep`), the runner's
//! answer (`EngineStepOutput`) and the per-sample random numbers.

use super::EngineError;
use super::config::Speculation;
use super::sequence::{SeqId, SeqSlab, Sequence};

/// The splitmix64 finaliser: a bijective, well-mixing `u64` hash.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random number in `[0, 1)` of a sample with `seed` for its generated token `index`
/// and `purpose` (0: accept a draft, 1: draw the target's token, 2: draw the draft model's
/// proposal). It depends on nothing else, so a sample's randomness is the same whatever
/// batch it runs in and however often it is preempted.
pub fn uniform(seed: u64, index: u64, purpose: u64) -> f64 {
    let x = splitmix64(splitmix64(splitmix64(seed) ^ index) ^ purpose);
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Random numbers per row position: `uniforms[r, j, purpose]`.
const PURPOSES: usize = 3;

/// One scheduled sequence of a plan.
#[derive(Debug, Clone)]
pub(super) struct Scheduled {
    pub seq: SeqId,
    /// Tokens computed before the step; the first query token is at this position.
    pub start: usize,
    /// Query tokens, drafts included.
    pub num_query: usize,
    /// The last `num_drafts` query tokens are drafts.
    pub num_drafts: usize,
    /// Where its n-gram drafts start in [`StepPlan::drafts`].
    pub drafts_at: usize,
    /// Rows reading this sequence: `first_row..first_row + num_rows`.
    pub first_row: usize,
    pub num_rows: usize,
}

/// One forward pass and what to sample from it: exactly the arrays of `EngineStep`, 2-D and
/// 3-D ones flattened row-major, plus the engine's bookkeeping. Arrays may be moved out (e.g.
/// into NumPy) before [`super::Scheduler::apply`]; it only reads the bookkeeping.
#[derive(Debug, Clone, Default)]
pub struct StepPlan {
    /// `[T]` query token ids; -1 where the draft model fills in a draft.
    pub input_ids: Vec<i64>,
    /// `[T]` position of each query token.
    pub positions: Vec<i64>,
    /// `[T]` cache slot receiving each query token's key and value.
    pub slot_mapping: Vec<i64>,
    /// `[S + 1]` offsets of each sequence's query tokens.
    pub query_start: Vec<i64>,
    /// `[S, L]` slots of each sequence's context in position order, padded with 0.
    pub context_slots: Vec<i64>,
    /// `L`, the width of `context_slots`.
    pub context_width: usize,
    /// `[S]` context length of each sequence, this step's tokens included.
    pub context_lens: Vec<i64>,
    /// `[R]` sequence each output row samples from.
    pub sample_seq: Vec<i64>,
    /// `[R]` drafts each row verifies.
    pub draft_lens: Vec<i64>,
    /// `[R]` sampling temperature; 0 is greedy.
    pub temperature: Vec<f32>,
    /// `[R]` nucleus mass.
    pub top_p: Vec<f32>,
    /// `[R]` top-k; 0 disables.
    pub top_k: Vec<i64>,
    /// `[R, K + 1, 3]` random numbers in `[0, 1)`, see [`uniform`].
    pub uniforms: Vec<f64>,
    /// `K`, the most drafts of any row.
    pub max_drafts: usize,
    /// `[C]` slots copied to `copy_to` before the forward pass.
    pub copy_from: Vec<i64>,
    /// `[C]` destinations of the copies.
    pub copy_to: Vec<i64>,
    /// The drafts (input id -1) are proposed by the policy's draft model.
    pub draft_with_model: bool,
    pub(super) step: u64,
    pub(super) seqs: Vec<Scheduled>,
    /// Per row: the sample of the row's sequence it draws.
    pub(super) row_samples: Vec<usize>,
    /// Per row: index of its sequence in `seqs`.
    pub(super) row_seqs: Vec<usize>,
    /// N-gram drafts of all sequences, for checking accepted ones.
    pub(super) drafts: Vec<u32>,
}

impl StepPlan {
    /// `T`, query tokens of the step.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.num_query).sum()
    }

    /// `S`, sequences of the step.
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// `R`, output rows.
    pub fn num_rows(&self) -> usize {
        self.row_seqs.len()
    }

    /// The step number, counting from 1.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Fills the arrays from the scheduling decision.
    pub(super) fn build(&mut self, slab: &SeqSlab, block_size: usize, speculation: Speculation) {
        self.max_drafts = self.seqs.iter().map(|s| s.num_drafts).max().unwrap_or(0);
        self.context_width = self
            .seqs
            .iter()
            .map(|s| s.start + s.num_query)
            .max()
            .unwrap_or(0);
        self.draft_with_model = matches!(speculation, Speculation::DraftModel { .. });
        self.reserve_arrays();
        self.query_start.push(0);
        // Taken out while the arrays grow, so that each sequence's part can borrow the plan.
        let seqs = std::mem::take(&mut self.seqs);
        for (s, sched) in seqs.iter().enumerate() {
            let Some(seq) = slab.get(sched.seq) else {
                // Every scheduled sequence is live while its plan is built.
                debug_assert!(false, "scheduled sequence {:?} is gone", sched.seq);
                continue;
            };
            self.push_queries(s, sched, seq, block_size);
            self.push_rows(s, sched, seq);
        }
        self.seqs = seqs;
    }

    fn reserve_arrays(&mut self) {
        let (num_tokens, num_rows, num_seqs) =
            (self.num_tokens(), self.num_rows(), self.seqs.len());
        self.input_ids.reserve(num_tokens);
        self.positions.reserve(num_tokens);
        self.slot_mapping.reserve(num_tokens);
        self.query_start.reserve(num_seqs + 1);
        self.context_slots.reserve(num_seqs * self.context_width);
        self.context_lens.reserve(num_seqs);
        self.sample_seq.reserve(num_rows);
        self.draft_lens.reserve(num_rows);
        self.temperature.reserve(num_rows);
        self.top_p.reserve(num_rows);
        self.top_k.reserve(num_rows);
        self.uniforms
            .reserve(num_rows * (self.max_drafts + 1) * PURPOSES);
    }

    /// Sequence `s`'s query tokens (known tokens, then its drafts or placeholders for the
    /// draft model's), their cache slots, and its whole context's slots as row `s`.
    fn push_queries(&mut self, s: usize, sched: &Scheduled, seq: &Sequence, block_size: usize) {
        let end = sched.start + sched.num_query;
        let fed = end - sched.num_drafts;
        for pos in sched.start..end {
            let token = if pos < fed {
                i64::from(seq.tokens[pos])
            } else if self.draft_with_model {
                -1
            } else {
                i64::from(self.drafts[sched.drafts_at + pos - fed])
            };
            self.input_ids.push(token);
            self.positions.push(pos as i64);
            self.slot_mapping.push(seq.slot(pos, block_size) as i64);
        }
        self.query_start.push(self.input_ids.len() as i64);
        self.context_lens.push(end as i64);
        for (b, &block) in seq.blocks.iter().enumerate().take(end.div_ceil(block_size)) {
            let base = block as usize * block_size;
            let take = (end - b * block_size).min(block_size);
            self.context_slots
                .extend((base..base + take).map(|slot| slot as i64));
        }
        self.context_slots.resize((s + 1) * self.context_width, 0);
    }

    /// Sequence `s`'s output rows: their sampling parameters and random numbers, which
    /// depend only on the sample's seed and position.
    fn push_rows(&mut self, s: usize, sched: &Scheduled, seq: &Sequence) {
        let params = &seq.request.params;
        let generated = seq.generated() as u64;
        for r in sched.first_row..sched.first_row + sched.num_rows {
            let seed = seq.request.seeds[self.row_samples[r]];
            self.sample_seq.push(s as i64);
            self.draft_lens.push(sched.num_drafts as i64);
            self.temperature.push(params.temperature);
            self.top_p.push(params.top_p);
            self.top_k.push(i64::from(params.top_k));
            for j in 0..=self.max_drafts as u64 {
                for purpose in 0..PURPOSES as u64 {
                    self.uniforms.push(uniform(seed, generated + j, purpose));
                }
            }
        }
    }
}

/// The runner's answer to a [`StepPlan`]: the arrays of `EngineStepOutput`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    /// `[R, K + 1]`: row `r` emits `tokens[r, :counts[r]]` (accepted drafts, then one
    /// sampled token).
    pub tokens: Vec<i64>,
    /// `[R, K + 1]` log-probabilities of the emitted tokens.
    pub logprobs: Vec<f32>,
    /// `[R]`, `1 <= counts[r] <= draft_lens[r] + 1`.
    pub counts: Vec<i64>,
}

impl StepOutput {
    /// Checks shapes, counts, token ids and log-probabilities, and that accepted n-gram
    /// drafts are emitted as drafted.
    pub(super) fn validate(&self, plan: &StepPlan) -> Result<(), EngineError> {
        let rows = plan.num_rows();
        let k1 = plan.max_drafts + 1;
        let shape = |field, expected: usize, got: usize| {
            if expected == got {
                Ok(())
            } else {
                Err(EngineError::OutcomeShape {
                    field,
                    expected,
                    got,
                })
            }
        };
        shape("tokens", rows * k1, self.tokens.len())?;
        shape("logprobs", rows * k1, self.logprobs.len())?;
        shape("counts", rows, self.counts.len())?;
        for (row, &count) in self.counts.iter().enumerate() {
            let sched = &plan.seqs[plan.row_seqs[row]];
            let max = sched.num_drafts + 1;
            if count < 1 || count as u64 > max as u64 {
                return Err(EngineError::OutcomeCount { row, count, max });
            }
            let count = count as usize;
            let emitted = &self.tokens[row * k1..row * k1 + count];
            for (position, &token) in emitted.iter().enumerate() {
                if u32::try_from(token).is_err() {
                    return Err(EngineError::OutcomeToken { row, token });
                }
                if position + 1 < count && !plan.draft_with_model {
                    let expected = plan.drafts[sched.drafts_at + position];
                    if i64::from(expected) != token {
                        return Err(EngineError::DraftMismatch {
                            row,
                            position,
                            expected,
                            got: token,
                        });
                    }
                }
            }
            for &logprob in &self.logprobs[row * k1..row * k1 + count] {
                if logprob.is_nan() || logprob > 0.0 {
                    return Err(EngineError::OutcomeLogprob { row, logprob });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniforms_are_in_range_and_depend_on_every_input() {
        let u = uniform(7, 3, 1);
        assert!((0.0..1.0).contains(&u));
        assert_eq!(u, uniform(7, 3, 1));
        assert_ne!(u, uniform(8, 3, 1));
        assert_ne!(u, uniform(7, 4, 1));
        assert_ne!(u, uniform(7, 3, 2));
        let mean = (0..10_000).map(|i| uniform(1, i, 0)).sum::<f64>() / 10_000.0;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }
}
