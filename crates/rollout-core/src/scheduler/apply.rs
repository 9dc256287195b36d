//! Turning a model outcome into sequence state (emitted tokens, rolled-back drafts, forked
//! groups) and finishing samples.

use super::blocks::BlockPool;
use super::config::EngineConfig;
use super::ngram::NgramIndex;
use super::plan::{StepOutput, StepPlan};
use super::schedule::{Scheduler, release, release_all};
use super::sequence::{SeqId, Sequence};
use super::{EngineError, FinishReason, Finished};

impl Scheduler {
    /// Applies the runner's outcome of `plan`, which must be the plan in flight. The outcome
    /// is validated first (shapes, `1 <= counts <= draft_lens + 1`, token ids, accepted
    /// n-gram drafts emitted as drafted); an invalid one changes nothing. Returns the samples
    /// that finished in this step.
    pub fn apply(
        &mut self,
        plan: &StepPlan,
        outcome: &StepOutput,
    ) -> Result<Vec<Finished>, EngineError> {
        if self.in_flight != Some(plan.step) {
            return Err(EngineError::PlanMismatch {
                got: plan.step,
                expected: self.in_flight,
            });
        }
        outcome.validate(plan)?;
        self.in_flight = None;
        let k1 = plan.max_drafts + 1;
        let mut finished = Vec::new();
        let mut members = Vec::new();
        for sched in &plan.seqs {
            // Sequences finished early while the plan was in flight are gone.
            let Some(seq) = self.seqs.get_mut(sched.seq) else {
                continue;
            };
            seq.computed = sched.start + sched.num_query - sched.num_drafts;
            if sched.num_rows == 0 {
                Self::register_blocks(&mut self.pool, &self.config, seq);
                continue;
            }
            // The group's prompt is prefilled: the first sample keeps this sequence, each
            // other one gets a fork sharing its blocks.
            debug_assert_eq!(seq.samples.len(), sched.num_rows);
            seq.samples.truncate(1);
            members.clear();
            members.push((sched.seq, sched.first_row));
            for row in sched.first_row + 1..sched.first_row + sched.num_rows {
                if let Some(child) = self.fork(sched.seq, plan.row_samples[row]) {
                    members.push((child, row));
                }
            }
            for &(id, row) in &members {
                let emitted = row * k1..row * k1 + outcome.counts[row] as usize;
                self.emit(
                    id,
                    sched.num_drafts,
                    &outcome.tokens[emitted.clone()],
                    &outcome.logprobs[emitted],
                    &mut finished,
                );
            }
        }
        if !finished.is_empty() {
            let seqs = &self.seqs;
            self.running.retain(|&id| seqs.get(id).is_some());
        }
        Ok(finished)
    }

    /// Offers the full computed blocks of `seq` to the prefix cache.
    fn register_blocks(pool: &mut BlockPool, config: &EngineConfig, seq: &mut Sequence) {
        if !config.prefix_caching {
            return;
        }
        let full = (seq.computed / config.block_size).min(seq.blocks.len());
        seq.hash_blocks(full, config.block_size);
        for b in seq.registered..full {
            pool.register(seq.blocks[b], seq.hashes[b]);
        }
        seq.registered = seq.registered.max(full);
    }

    /// Ends the live sequence `id` (removed from neither queue: the caller does that),
    /// caching its computed blocks and freeing them; one `Finished` per sample it stands for.
    fn finish(&mut self, id: SeqId, reason: FinishReason, out: &mut Vec<Finished>) {
        let Some(mut seq) = self.seqs.remove(id) else {
            return;
        };
        Self::register_blocks(&mut self.pool, &self.config, &mut seq);
        release_all(&mut self.pool, &mut seq.blocks);
        let mut tokens = seq.tokens.split_off(seq.request.prompt_len);
        let samples = seq.samples.len();
        for (k, &sample) in seq.samples.iter().enumerate() {
            let (tokens, logprobs) = if k + 1 == samples {
                (
                    std::mem::take(&mut tokens),
                    std::mem::take(&mut seq.logprobs),
                )
            } else {
                (tokens.clone(), seq.logprobs.clone())
            };
            out.push(Finished {
                request: seq.request.id,
                sample,
                tokens,
                logprobs,
                finish_reason: reason,
            });
        }
    }

    /// Stops a sequence on the caller's behalf (e.g. a stop string matched) and returns what
    /// it generated, one entry per sample it stands for (several only for a group whose
    /// prompt is still being prefilled). Unknown or finished ids return nothing. If a plan is
    /// in flight, its rows for this sequence are ignored by `apply`.
    pub fn finish_early(&mut self, seq: SeqId, reason: FinishReason) -> Vec<Finished> {
        let mut out = Vec::new();
        let Some(running) = self.seqs.get(seq).map(|s| s.running) else {
            return out;
        };
        if running {
            if let Some(i) = self.running.iter().position(|&id| id == seq) {
                self.running.remove(i);
            }
        } else if let Some(i) = self.waiting.iter().position(|&id| id == seq) {
            self.waiting.remove(i);
        }
        self.finish(seq, reason, &mut out);
        out
    }

    /// A new running sequence for `sample` sharing every block of `parent`.
    fn fork(&mut self, parent: SeqId, sample: usize) -> Option<SeqId> {
        let p = self.seqs.get(parent)?;
        let (request, tokens, blocks) = (p.request.clone(), p.tokens.clone(), p.blocks.clone());
        let (computed, hashes, registered) = (p.computed, p.hashes.clone(), p.registered);
        for &block in &blocks {
            self.pool.retain(block);
        }
        let id = self.seqs.insert(|id| Sequence {
            id,
            request,
            samples: vec![sample],
            tokens,
            logprobs: Vec::new(),
            computed,
            blocks,
            hashes,
            registered,
            running: true,
            ngram: NgramIndex::default(),
        });
        self.running.push(id);
        Some(id)
    }

    /// Appends the row's emitted tokens (validated) to `id` up to its first stop token or its
    /// `max_new_tokens`, then either finishes it or rolls its cache back past the rejected
    /// drafts.
    fn emit(
        &mut self,
        id: SeqId,
        num_drafts: usize,
        tokens: &[i64],
        logprobs: &[f32],
        finished: &mut Vec<Finished>,
    ) {
        let Some(seq) = self.seqs.get_mut(id) else {
            return;
        };
        let accepted = tokens.len() - 1;
        self.stats.drafted_tokens += num_drafts as u64;
        self.stats.accepted_tokens += accepted as u64;
        let max_new = seq.request.max_new_tokens[seq.sample()] as usize;
        let mut reason = None;
        for (&token, &logprob) in tokens.iter().zip(logprobs) {
            let token = token as u32;
            seq.tokens.push(token);
            seq.logprobs.push(logprob);
            self.stats.generated_tokens += 1;
            if seq.request.stop_token_ids.contains(&token) {
                reason = Some(FinishReason::Stop);
            } else if seq.generated() >= max_new {
                reason = Some(FinishReason::Length);
            }
            if reason.is_some() {
                break;
            }
        }
        // Accepted drafts were fed, so their keys and values are valid.
        seq.computed = (seq.computed + accepted).min(seq.tokens.len());
        if let Some(reason) = reason {
            self.finish(id, reason, finished);
            return;
        }
        if num_drafts > 0 {
            roll_back(self, id);
        }
        if let Some(seq) = self.seqs.get_mut(id) {
            Self::register_blocks(&mut self.pool, &self.config, seq);
        }
    }
}

/// Frees the blocks that only held rejected drafts and marks the rest of the last block
/// unwritten; the rejected keys and values are overwritten by later steps.
fn roll_back(scheduler: &mut Scheduler, id: SeqId) {
    let EngineConfig { block_size, .. } = scheduler.config;
    let Some(seq) = scheduler.seqs.get_mut(id) else {
        return;
    };
    let keep = seq.tokens.len().div_ceil(block_size);
    while seq.blocks.len() > keep {
        if let Some(block) = seq.blocks.pop() {
            release(&mut scheduler.pool, block);
        }
    }
    if let Some(&block) = seq.blocks.get(seq.computed / block_size) {
        scheduler.pool.set_fill(block, seq.computed % block_size);
    }
}
