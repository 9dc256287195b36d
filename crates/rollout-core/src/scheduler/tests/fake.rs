//! A fake model runner that reads and writes a fake KV cache exactly through a plan's slots,
//! and a reference that generates each sample alone with the same model function.
//!
//! The "model" maps a context (the `(token, position)` pairs read from the cache, in order)
//! to a small distribution over the vocabulary: a hash of the whole context picks it, and with
//! probability `local_percent` the most likely token follows a fixed rule of the last token
//! instead (repetitive text that n-gram drafting can predict). Any bookkeeping error
//! (wrong slot, wrong order, a missing copy-on-write, a stale cached block) changes the hash
//! and therefore the outputs.

use crate::scheduler::{
    EngineConfig, FinishReason, Finished, Request, SampleParams, Scheduler, StepOutput, StepPlan,
    uniform,
};

/// Vocabulary size.
pub const VOCAB: u32 = 48;
/// A token id the tests use as end-of-sequence.
pub const EOS: u32 = 0;

/// Probabilities of the fake distribution's candidates, most likely first.
const PROBS: [f32; 4] = [0.55, 0.25, 0.12, 0.08];

fn mix(h: u64, x: u64) -> u64 {
    let mut z = (h ^ x).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The repetitive part of the model: the next token after `last` (short cycles over 1..=11).
fn local_rule(last: u32) -> u32 {
    (last * 5 + 3) % 11 + 1
}

/// The model function, incrementally over a context.
#[derive(Debug, Clone, Copy)]
pub struct ModelFn {
    pub local_percent: u64,
}

/// Rolling state over a context.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ctx {
    hash: u64,
    last: Option<u32>,
}

impl Ctx {
    /// Extends the context by one cache entry (`None`: a slot never written).
    pub fn push(&mut self, entry: Option<(u32, u32)>) {
        let code = match entry {
            Some((token, pos)) => (u64::from(token) << 32) | u64::from(pos),
            None => u64::MAX,
        };
        self.hash = mix(self.hash, code);
        self.last = entry.map(|(t, _)| t);
    }
}

impl ModelFn {
    /// The most likely next token after `ctx`.
    pub fn greedy(&self, ctx: &Ctx) -> u32 {
        let local = ctx.last.map(local_rule);
        match local {
            Some(token) if mix(ctx.hash, 1) % 100 < self.local_percent => token,
            _ => (mix(ctx.hash, 2) % u64::from(VOCAB)) as u32,
        }
    }

    /// The token drawn with uniform `u` (greedy when `temperature == 0`) and its logprob.
    pub fn sample(&self, ctx: &Ctx, temperature: f32, u: f64) -> (u32, f32) {
        let top = self.greedy(ctx);
        if temperature == 0.0 {
            return (top, PROBS[0].ln());
        }
        let mut acc = 0.0f64;
        for (i, &p) in PROBS.iter().enumerate() {
            acc += f64::from(p);
            if u < acc || i + 1 == PROBS.len() {
                return ((top + 11 * i as u32) % VOCAB, p.ln());
            }
        }
        unreachable!()
    }

    /// A draft model: the local rule, deliberately wrong now and then.
    pub fn draft(&self, last: u32, pos: i64) -> u32 {
        let token = local_rule(last);
        if pos % 7 == 3 {
            (token + 1) % VOCAB
        } else {
            token
        }
    }
}

/// The fake runner: a KV cache of `(token, position)` per slot.
pub struct FakeRunner {
    pub model: ModelFn,
    pub store: Vec<Option<(u32, u32)>>,
}

impl FakeRunner {
    pub fn new(config: &EngineConfig, model: ModelFn) -> Self {
        FakeRunner {
            model,
            store: vec![None; config.num_blocks * config.block_size],
        }
    }

    /// Runs one plan the way the Python runner does, checking the plan's internal consistency.
    pub fn run(&mut self, plan: &StepPlan) -> StepOutput {
        let t = plan.input_ids.len();
        let s = plan.context_lens.len();
        let r = plan.sample_seq.len();
        let k1 = plan.max_drafts + 1;
        let width = plan.context_width;
        assert_eq!((plan.positions.len(), plan.slot_mapping.len()), (t, t));
        assert_eq!(plan.query_start.len(), s + 1);
        assert_eq!(plan.query_start[s] as usize, t);
        assert_eq!(plan.context_slots.len(), s * width);
        for v in [&plan.draft_lens, &plan.top_k] {
            assert_eq!(v.len(), r);
        }
        assert_eq!((plan.temperature.len(), plan.top_p.len()), (r, r));
        assert_eq!(plan.uniforms.len(), r * k1 * 3);
        assert_eq!(plan.copy_from.len(), plan.copy_to.len());
        let mut written = std::collections::HashSet::new();
        for &slot in plan.slot_mapping.iter().chain(&plan.copy_to) {
            assert!(
                written.insert(slot),
                "slot {slot} written twice in one step"
            );
        }

        // Copy-on-write, before the forward pass.
        let copied: Vec<_> = plan
            .copy_from
            .iter()
            .map(|&f| self.store[f as usize])
            .collect();
        for (&to, entry) in plan.copy_to.iter().zip(copied) {
            self.store[to as usize] = entry;
        }
        let mut input_ids = plan.input_ids.clone();
        let fed = input_ids
            .iter()
            .zip(&plan.slot_mapping)
            .zip(&plan.positions);
        for ((&token, &slot), &pos) in fed {
            if token >= 0 {
                self.store[slot as usize] = Some((token as u32, pos as u32));
            }
        }
        // The draft model fills its drafts in, in order, reading the tokens before each.
        if plan.draft_with_model {
            for seq in 0..s {
                let len = plan.context_lens[seq] as usize;
                let (q0, q1) = (
                    plan.query_start[seq] as usize,
                    plan.query_start[seq + 1] as usize,
                );
                for i in (q0..q1).filter(|&i| plan.input_ids[i] < 0) {
                    let at = len - (q1 - i);
                    let read = |j: usize| self.store[plan.context_slots[seq * width + j] as usize];
                    let last = read(at - 1).map_or(0, |e| e.0);
                    let token = self.model.draft(last, plan.positions[i]);
                    input_ids[i] = i64::from(token);
                    self.store[plan.slot_mapping[i] as usize] =
                        Some((token, plan.positions[i] as u32));
                }
            }
        }

        // Attention: each sequence reads its context through `context_slots`.
        let mut prefix: Vec<Vec<Ctx>> = Vec::with_capacity(s);
        for seq in 0..s {
            let len = plan.context_lens[seq] as usize;
            assert!(len <= width);
            let (q0, q1) = (
                plan.query_start[seq] as usize,
                plan.query_start[seq + 1] as usize,
            );
            assert!(q1 > q0 && q1 - q0 <= len);
            for i in q0..q1 {
                // A query token's own slot is where the context reads its position.
                let at = len - (q1 - i);
                assert_eq!(plan.context_slots[seq * width + at], plan.slot_mapping[i]);
            }
            let mut ctx = Ctx::default();
            let mut states = Vec::with_capacity(len);
            for j in 0..len {
                ctx.push(self.store[plan.context_slots[seq * width + j] as usize]);
                states.push(ctx);
            }
            prefix.push(states);
        }

        let mut out = StepOutput {
            tokens: vec![0; r * k1],
            logprobs: vec![0.0; r * k1],
            counts: vec![0; r],
        };
        for row in 0..r {
            let seq = plan.sample_seq[row] as usize;
            let k = plan.draft_lens[row] as usize;
            let len = plan.context_lens[seq] as usize;
            let q1 = plan.query_start[seq + 1] as usize;
            let mut count = 0;
            for j in 0..=k {
                let qi = q1 - (k + 1) + j;
                let ctx = &prefix[seq][len - (q1 - qi)];
                let u = plan.uniforms[(row * k1 + j) * 3 + 1];
                let (token, logprob) = self.model.sample(ctx, plan.temperature[row], u);
                out.tokens[row * k1 + j] = i64::from(token);
                out.logprobs[row * k1 + j] = logprob;
                count += 1;
                if j < k && input_ids[qi + 1] != i64::from(token) {
                    break;
                }
            }
            out.counts[row] = count;
        }
        out
    }
}

/// One sample generated alone, token by token, with the model function.
pub fn reference(model: ModelFn, request: &Request, sample: usize) -> (Vec<u32>, FinishReason) {
    let mut ctx = Ctx::default();
    let mut pos = 0u32;
    for &token in &request.prompt {
        ctx.push(Some((token, pos)));
        pos += 1;
    }
    let mut tokens = Vec::new();
    for g in 0..request.max_new_tokens[sample] as u64 {
        let u = uniform(request.seeds[sample], g, 1);
        let (token, _) = model.sample(&ctx, request.params.temperature, u);
        tokens.push(token);
        if request.stop_token_ids.contains(&token) {
            return (tokens, FinishReason::Stop);
        }
        ctx.push(Some((token, pos)));
        pos += 1;
    }
    (tokens, FinishReason::Length)
}

/// Deterministic pseudo-random numbers for building workloads.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = mix(self.0, 0x1234_5678);
        self.0
    }

    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

/// A request with `n` samples, a random prompt of `prompt_len` tokens (repetitive when
/// `period > 0`), per-sample max lengths in `1..=max_new` and seeds.
pub fn request(
    rng: &mut Rng,
    prompt_len: usize,
    n: usize,
    max_new: u32,
    temperature: f32,
    period: usize,
) -> Request {
    let prompt = if period > 0 {
        let motif: Vec<u32> = (0..period)
            .map(|_| rng.range(1, u64::from(VOCAB)) as u32)
            .collect();
        (0..prompt_len).map(|i| motif[i % period]).collect()
    } else {
        (0..prompt_len)
            .map(|_| rng.range(1, u64::from(VOCAB)) as u32)
            .collect()
    };
    Request {
        prompt,
        n,
        max_new_tokens: (0..n)
            .map(|_| rng.range(1, u64::from(max_new) + 1) as u32)
            .collect(),
        params: SampleParams {
            temperature,
            top_p: 1.0,
            top_k: 0,
        },
        stop_token_ids: vec![EOS],
        seeds: (0..n).map(|_| rng.next()).collect(),
    }
}

/// What a run produced and observed.
pub struct Outcome {
    /// Finished samples, sorted by (request, sample).
    pub finished: Vec<Finished>,
    /// Plans that copied slots (copy-on-write).
    pub copy_steps: usize,
    /// Most sequences in one plan.
    pub max_seqs: usize,
}

/// Runs the scheduler to completion against the fake runner, checking the bookkeeping after
/// every plan and apply; `hook` runs before every plan (to add requests, stop sequences...).
pub fn drive(
    scheduler: &mut Scheduler,
    runner: &mut FakeRunner,
    mut hook: impl FnMut(&mut Scheduler, u64) -> Vec<Finished>,
) -> Outcome {
    let config = scheduler.config().clone();
    let mut out = Outcome {
        finished: Vec::new(),
        copy_steps: 0,
        max_seqs: 0,
    };
    for step in 0.. {
        assert!(step < 100_000, "no progress");
        out.finished.extend(hook(scheduler, step));
        let Some(plan) = scheduler.plan() else {
            break;
        };
        scheduler.check_invariants().unwrap();
        assert!(plan.input_ids.len() <= config.max_batch_tokens);
        assert!(scheduler.num_running() <= config.max_running);
        assert!(scheduler.stats().blocks_used <= config.num_blocks);
        out.copy_steps += usize::from(!plan.copy_from.is_empty());
        out.max_seqs = out.max_seqs.max(plan.num_seqs());
        let result = runner.run(&plan);
        out.finished
            .extend(scheduler.apply(&plan, &result).unwrap());
        scheduler.check_invariants().unwrap();
    }
    assert!(scheduler.is_idle());
    // Everything finished: every block is free or cached.
    let stats = scheduler.stats();
    assert_eq!(stats.blocks_used, 0);
    scheduler.check_invariants().unwrap();
    out.finished.sort_by_key(|f| (f.request, f.sample));
    out
}

/// Checks that every sample of `requests` (added in order, ids 0..) finished exactly as the
/// reference generates it alone.
pub fn assert_matches_reference(model: ModelFn, requests: &[Request], finished: &[Finished]) {
    let expected: usize = requests.iter().map(|r| r.n).sum();
    assert_eq!(finished.len(), expected, "every sample finishes once");
    let mut it = finished.iter();
    for (id, request) in requests.iter().enumerate() {
        for sample in 0..request.n {
            let got = it.next().unwrap();
            assert_eq!((got.request.0, got.sample), (id as u64, sample));
            let (tokens, reason) = reference(model, request, sample);
            assert_eq!(got.tokens, tokens, "request {id} sample {sample}");
            assert_eq!(got.finish_reason, reason, "request {id} sample {sample}");
            assert_eq!(got.logprobs.len(), got.tokens.len());
        }
    }
}
