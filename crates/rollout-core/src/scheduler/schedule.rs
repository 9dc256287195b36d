//! Continuous batching: every [`Scheduler::plan`] decides afresh which sequences run and
//! which tokens each one feeds.
//!
//! Order of a step, under `max_batch_tokens` query tokens and `max_running` sequences:
//!
//! 1. running sequences that decode get their last token (plus drafts when speculating), in
//!    admission order; one that needs a block when none is available preempts the most
//!    recently admitted running sequences (their blocks are freed and they return to the
//!    front of the waiting queue, to be recomputed), itself last;
//! 2. running sequences still prefilling get the next chunk of their prompt;
//! 3. waiting sequences are admitted first-come first-served while their blocks (minus
//!    prefix-cache hits) plus one fit in the free and evictable blocks; all their blocks are
//!    allocated at admission and their first chunk is scheduled.

use std::collections::VecDeque;
use std::sync::Arc;

use super::EngineError;
use super::blocks::BlockPool;
use super::config::{EngineConfig, Request, Speculation};
use super::ngram::NgramIndex;
use super::plan::{Scheduled, StepPlan};
use super::sequence::{RequestId, RequestInfo, SeqId, SeqSlab, Sequence};
use super::stats::EngineStats;

/// The engine's scheduler and KV-cache bookkeeping. Drive it with `plan` then `apply`, once
/// each per forward pass, until `plan` returns `None`.
#[derive(Debug)]
pub struct Scheduler {
    pub(super) config: EngineConfig,
    pub(super) pool: BlockPool,
    pub(super) seqs: SeqSlab,
    /// Not running, in admission order (preempted sequences at the front).
    pub(super) waiting: VecDeque<SeqId>,
    /// Running, in the order they started running.
    pub(super) running: Vec<SeqId>,
    next_request: u64,
    step: u64,
    /// The step whose plan awaits `apply`.
    pub(super) in_flight: Option<u64>,
    pub(super) stats: EngineStats,
    occupancy_sum: f64,
    utilisation_sum: f64,
}

impl Scheduler {
    /// A scheduler with an empty cache. Zero sizes are raised to 1 and inconsistent n-gram
    /// bounds ordered; use [`Scheduler::try_new`] to reject them instead.
    pub fn new(config: EngineConfig) -> Self {
        let config = config.sanitized();
        Scheduler {
            pool: BlockPool::new(config.num_blocks, config.block_size),
            seqs: SeqSlab::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_request: 0,
            step: 0,
            in_flight: None,
            stats: EngineStats {
                blocks_total: config.num_blocks,
                ..EngineStats::default()
            },
            occupancy_sum: 0.0,
            utilisation_sum: 0.0,
            config,
        }
    }

    /// A scheduler for a configuration that [`EngineConfig::validate`] accepts.
    pub fn try_new(config: EngineConfig) -> Result<Self, EngineError> {
        config.validate()?;
        Ok(Scheduler::new(config))
    }

    /// The configuration in effect.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request; its `n` samples share one prefill of the prompt. Rejects invalid
    /// requests and sequences that could not fit even in an otherwise empty cache.
    pub fn add(&mut self, request: Request) -> Result<RequestId, EngineError> {
        request.validate()?;
        let (block_size, num_blocks) = (self.config.block_size, self.config.num_blocks);
        let prompt_len = request.prompt.len();
        // Admission keeps one block spare, so a sequence must fit in all blocks but one.
        let needed = self.config.blocks_for(prompt_len);
        if needed + 1 > num_blocks {
            return Err(EngineError::PromptTooLong {
                prompt_len,
                needed,
                block_size,
                num_blocks,
            });
        }
        let max_new_tokens = request.max_new_tokens.iter().copied().max().unwrap_or(1);
        // The last generated token is never fed, so it needs no slot.
        let needed = self
            .config
            .blocks_for(prompt_len + max_new_tokens as usize - 1);
        if needed + 1 > num_blocks {
            return Err(EngineError::SequenceTooLong {
                prompt_len,
                max_new_tokens,
                needed,
                block_size,
                num_blocks,
            });
        }
        let id = RequestId(self.next_request);
        self.next_request += 1;
        self.stats.prompt_tokens_requested += prompt_len as u64;
        let info = Arc::new(RequestInfo::new(id, &request));
        let seq = self.seqs.insert(|seq| Sequence {
            id: seq,
            request: info,
            samples: (0..request.n).collect(),
            tokens: request.prompt,
            logprobs: Vec::new(),
            computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            registered: 0,
            running: false,
            ngram: NgramIndex::default(),
        });
        self.waiting.push_back(seq);
        Ok(id)
    }

    /// Decides the next forward pass; `None` when no work is left. Each plan must be given to
    /// [`Scheduler::apply`] before the next `plan` (a second call meanwhile returns `None`).
    pub fn plan(&mut self) -> Option<StepPlan> {
        if let Some(step) = self.in_flight {
            tracing::error!(step, "plan() called before the previous plan was applied");
            debug_assert!(false, "plan() called before step {step} was applied");
            return None;
        }
        if self.is_idle() {
            return None;
        }
        let mut plan = StepPlan {
            step: self.step + 1,
            ..StepPlan::default()
        };
        let mut budget = self.config.max_batch_tokens;
        while self.running.len() > self.config.max_running {
            if let Some(newest) = self.running.pop() {
                self.preempt(newest);
            }
        }
        self.schedule_decodes(&mut plan, &mut budget);
        self.schedule_prefills(&mut plan, &mut budget);
        self.admit(&mut plan, &mut budget);
        if plan.seqs.is_empty() {
            tracing::error!("the scheduler has work but scheduled nothing");
            debug_assert!(false, "the scheduler has work but scheduled nothing");
            return None;
        }
        plan.build(&self.seqs, self.config.block_size, self.config.speculation);

        self.step += 1;
        self.in_flight = Some(self.step);
        let stats = &mut self.stats;
        stats.steps = self.step;
        stats.query_tokens += plan.input_ids.len() as u64;
        stats.blocks_peak = stats.blocks_peak.max(self.pool.used());
        let total_slots = (self.config.num_blocks * self.config.block_size) as f64;
        // Planning already counted the slots this step's query tokens fill.
        let live = self.pool.live_slots() as f64;
        let occupancy = live / total_slots;
        self.occupancy_sum += occupancy;
        stats.kv_occupancy_peak = stats.kv_occupancy_peak.max(occupancy);
        let held_slots = (self.pool.used() * self.config.block_size) as f64;
        self.utilisation_sum += if held_slots > 0.0 {
            live / held_slots
        } else {
            1.0
        };
        Some(plan)
    }

    /// Pass 1: the last token (plus drafts) of every decoding running sequence.
    fn schedule_decodes(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let block_size = self.config.block_size;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            let Some(len) = self
                .seqs
                .get(id)
                .filter(|s| s.is_decoding())
                .map(|s| s.tokens.len())
            else {
                i += 1;
                continue;
            };
            if !self.reserve_slot(i, len - 1, plan) {
                // Preempted itself: it was the newest, so the loop is over.
                continue;
            }
            let drafts_at = plan.drafts.len();
            let num_drafts = self.reserve_drafts(i, *budget - 1, plan);
            self.schedule(plan, id, 1 + num_drafts, num_drafts, drafts_at);
            *budget -= 1 + num_drafts;
            debug_assert!(
                self.seqs
                    .get(id)
                    .is_some_and(|s| s.blocks.len() * block_size >= len)
            );
            i += 1;
        }
    }

    /// Pass 2: the next prompt chunk of every running sequence still prefilling.
    fn schedule_prefills(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        for i in 0..self.running.len() {
            if *budget == 0 {
                break;
            }
            let id = self.running[i];
            let Some(seq) = self.seqs.get(id).filter(|s| !s.is_decoding()) else {
                continue;
            };
            let chunk = (seq.tokens.len() - seq.computed).min(*budget);
            self.schedule(plan, id, chunk, 0, plan.drafts.len());
            *budget -= chunk;
        }
    }

    /// Pass 3: admits waiting sequences in order while they fit.
    fn admit(&mut self, plan: &mut StepPlan, budget: &mut usize) {
        let block_size = self.config.block_size;
        while *budget > 0 {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(seq) = self.seqs.get_mut(id) else {
                self.waiting.pop_front();
                continue;
            };
            let running = self.running.len();
            if running > 0 && running + seq.samples.len() > self.config.max_running {
                break;
            }
            let len = seq.tokens.len();
            // Cached full blocks of the prefix; the last token is always computed.
            let (mut hits, mut evictable_hits) = (0, 0);
            if self.config.prefix_caching {
                let max_hits = (len - 1) / block_size;
                seq.hash_blocks(max_hits, block_size);
                while hits < max_hits {
                    let Some(block) = self.pool.lookup(seq.hashes[hits]) else {
                        break;
                    };
                    evictable_hits += usize::from(self.pool.is_evictable(block));
                    hits += 1;
                }
            }
            let needed = self.config.blocks_for(len) - hits;
            if needed + 1 > self.pool.available() - evictable_hits {
                break;
            }
            self.waiting.pop_front();
            for i in 0..hits {
                if let Some(block) = self.pool.lookup(seq.hashes[i]) {
                    self.pool.retain(block);
                    seq.blocks.push(block);
                }
            }
            for _ in 0..needed {
                if let Some(block) = self.pool.allocate() {
                    seq.blocks.push(block);
                }
            }
            debug_assert_eq!(seq.blocks.len(), self.config.blocks_for(len));
            seq.computed = hits * block_size;
            seq.registered = hits;
            seq.running = true;
            self.stats.prefix_cache_hit_tokens += seq.computed as u64;
            let chunk = (len - seq.computed).min(*budget);
            self.running.push(id);
            self.schedule(plan, id, chunk, 0, plan.drafts.len());
            *budget -= chunk;
        }
    }

    /// Makes the block of position `pos` of `running[i]` exist and be private, copying a
    /// shared block's written slots (copy-on-write). Preempts newer running sequences when no
    /// block is available; returns false if it had to preempt `running[i]` itself.
    fn reserve_slot(&mut self, i: usize, pos: usize, plan: &mut StepPlan) -> bool {
        let block_size = self.config.block_size;
        let id = self.running[i];
        let index = pos / block_size;
        let shared = match self.seqs.get(id) {
            Some(seq) if index < seq.blocks.len() => {
                let block = seq.blocks[index];
                if self.pool.refcount(block) <= 1 {
                    return true;
                }
                Some(block)
            }
            Some(_) => None,
            None => return false,
        };
        let block = loop {
            if let Some(block) = self.pool.allocate() {
                break block;
            }
            if self.running.len() > i + 1 {
                if let Some(newest) = self.running.pop() {
                    self.preempt(newest);
                }
            } else {
                self.running.remove(i);
                self.preempt(id);
                return false;
            }
        };
        let Some(seq) = self.seqs.get_mut(id) else {
            return false;
        };
        match shared {
            None => seq.blocks.push(block),
            // Preemptions may have left this sequence the only holder: write in place.
            Some(src) if self.pool.refcount(src) <= 1 => release(&mut self.pool, block),
            Some(src) => {
                seq.blocks[index] = block;
                let written = pos % block_size;
                let (from, to) = (src as usize * block_size, block as usize * block_size);
                plan.copy_from
                    .extend((from..from + written).map(|s| s as i64));
                plan.copy_to.extend((to..to + written).map(|s| s as i64));
                self.pool.set_fill(block, written);
                release(&mut self.pool, src);
            }
        }
        true
    }

    /// Drafts for the decoding `running[i]` (at most `max` tokens, and never beyond its
    /// `max_new_tokens`), with blocks for their positions taken only from blocks that the
    /// later running sequences do not need for their own decode. N-gram drafts are appended
    /// to `plan.drafts`.
    fn reserve_drafts(&mut self, i: usize, max: usize, plan: &mut StepPlan) -> usize {
        let block_size = self.config.block_size;
        let later = self.running.len() - i - 1;
        let spare = self.pool.available().saturating_sub(later);
        // A group's leader feeding its last prompt token samples every member's first token;
        // drafts are per sample, so it gets none.
        let Some(seq) = self
            .seqs
            .get_mut(self.running[i])
            .filter(|s| s.samples.len() == 1)
        else {
            return 0;
        };
        let max_new = seq.request.max_new_tokens[seq.sample()] as usize;
        let remaining = max_new.saturating_sub(seq.generated());
        let max = max
            .min(self.config.speculation.num_tokens())
            .min(remaining.saturating_sub(1));
        if max == 0 {
            return 0;
        }
        let len = seq.tokens.len();
        let reachable = (seq.blocks.len() + spare) * block_size;
        let max = max.min(reachable.saturating_sub(len));
        let drafts_at = plan.drafts.len();
        let num_drafts = match self.config.speculation {
            Speculation::Off => 0,
            Speculation::DraftModel { .. } => max,
            Speculation::Ngram {
                max_ngram,
                min_ngram,
                ..
            } => {
                seq.ngram
                    .propose(&seq.tokens, min_ngram, max_ngram, max, &mut plan.drafts);
                plan.drafts.len() - drafts_at
            }
        };
        while seq.blocks.len() < self.config.blocks_for(len + num_drafts) {
            match self.pool.allocate() {
                Some(block) => seq.blocks.push(block),
                None => break,
            }
        }
        let num_drafts = num_drafts.min(seq.blocks.len() * block_size - len);
        plan.drafts.truncate(drafts_at + num_drafts);
        num_drafts
    }

    /// Adds `num_query` tokens of `id` (the last `num_drafts` of them drafts) to the plan,
    /// with one row per sample when they reach the end of its tokens.
    fn schedule(
        &mut self,
        plan: &mut StepPlan,
        id: SeqId,
        num_query: usize,
        num_drafts: usize,
        drafts_at: usize,
    ) {
        let block_size = self.config.block_size;
        let Some(seq) = self.seqs.get(id) else {
            return;
        };
        let start = seq.computed;
        let end = start + num_query;
        let fed = end - num_drafts;
        let num_rows = if fed == seq.tokens.len() {
            seq.samples.len()
        } else {
            0
        };
        let index = plan.seqs.len();
        plan.seqs.push(Scheduled {
            seq: id,
            start,
            num_query,
            num_drafts,
            drafts_at,
            first_row: plan.row_seqs.len(),
            num_rows,
        });
        if num_rows > 0 {
            plan.row_samples.extend_from_slice(&seq.samples);
            plan.row_seqs.extend(std::iter::repeat_n(index, num_rows));
        }
        // Keys and values of positions start..end are written by the forward pass.
        for b in start / block_size..end.div_ceil(block_size) {
            let block = seq.blocks[b];
            let written = (end - b * block_size).min(block_size);
            if written > self.pool.fill(block) {
                self.pool.set_fill(block, written);
            }
        }
        let prompt_len = seq.request.prompt_len;
        // Generated tokens other than the last one are only fed again after a preemption.
        let last = seq.tokens.len() - 1;
        self.stats.prompt_tokens_computed += overlap(start..fed, 0..prompt_len) as u64;
        self.stats.recomputed_tokens += overlap(start..fed, prompt_len..last) as u64;
    }

    /// Frees the blocks of the running `id` and queues it first to be recomputed; its tokens
    /// (generated ones included) become the prompt of its recomputation.
    fn preempt(&mut self, id: SeqId) {
        let Some(seq) = self.seqs.get_mut(id) else {
            return;
        };
        release_all(&mut self.pool, &mut seq.blocks);
        seq.computed = 0;
        seq.registered = 0;
        seq.running = false;
        self.waiting.push_front(id);
        self.stats.preemptions += 1;
    }

    /// The last `len` generated tokens (fewer if it has fewer) of every unfinished sequence
    /// that has generated at least one, for the caller's stop-string checks.
    pub fn running_tails(&self, len: usize) -> Vec<(SeqId, Vec<u32>)> {
        self.running
            .iter()
            .chain(&self.waiting)
            .filter_map(|&id| self.seqs.get(id))
            .filter(|seq| seq.generated() > 0)
            .map(|seq| {
                let from = seq.tokens.len() - seq.generated().min(len);
                (seq.id, seq.tokens[from..].to_vec())
            })
            .collect()
    }

    /// The request and sample a live sequence stands for.
    pub fn sample_of(&self, seq: SeqId) -> Option<(RequestId, usize)> {
        self.seqs.get(seq).map(|s| (s.request.id, s.sample()))
    }

    /// Forgets every cached prefix; call it when the weights change (cached keys and values
    /// are stale then), preferably while idle.
    pub fn clear_prefix_cache(&mut self) {
        self.pool.clear_cache();
    }

    /// Counters and cache occupancy.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            blocks_used: self.pool.used(),
            blocks_cached: self.pool.num_evictable(),
            kv_occupancy_mean: if self.step == 0 {
                0.0
            } else {
                self.occupancy_sum / self.step as f64
            },
            kv_utilisation_mean: if self.step == 0 {
                0.0
            } else {
                self.utilisation_sum / self.step as f64
            },
            ..self.stats.clone()
        }
    }

    /// Sequences running now.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting to (re)start.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// No sequence is running or waiting.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }
}

/// Length of the intersection of two ranges.
fn overlap(a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> usize {
    a.end.min(b.end).saturating_sub(a.start.max(b.start))
}

/// Releases one block; a double free is a bookkeeping bug, reported and otherwise ignored.
pub(super) fn release(pool: &mut BlockPool, block: u32) {
    if let Err(error) = pool.release(block) {
        tracing::error!(%error, "KV block bookkeeping");
        debug_assert!(false, "{error}");
    }
}

/// Releases a block table, last block first so that a prefix's tail is evicted before its
/// head.
pub(super) fn release_all(pool: &mut BlockPool, blocks: &mut Vec<u32>) {
    while let Some(block) = blocks.pop() {
        release(pool, block);
    }
}
