//! Scenario tests: outputs equal the sequential reference under every scheduling feature.

use super::fake::{
    EOS, FakeRunner, ModelFn, Outcome, Rng, assert_matches_reference, drive, request,
};
use crate::scheduler::{
    EngineConfig, EngineError, FinishReason, Request, SampleParams, Scheduler, Speculation,
    StepOutput,
};

const HASHED: ModelFn = ModelFn { local_percent: 0 };
const REPETITIVE: ModelFn = ModelFn { local_percent: 85 };

fn config(
    block_size: usize,
    num_blocks: usize,
    max_batch_tokens: usize,
    max_running: usize,
) -> EngineConfig {
    EngineConfig {
        block_size,
        num_blocks,
        max_batch_tokens,
        max_running,
        prefix_caching: false,
        speculation: Speculation::Off,
    }
}

fn run(config: &EngineConfig, model: ModelFn, requests: &[Request]) -> (Outcome, Scheduler) {
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    for r in requests {
        scheduler.add(r.clone()).unwrap();
    }
    let mut runner = FakeRunner::new(config, model);
    let outcome = drive(&mut scheduler, &mut runner, |_, _| Vec::new());
    (outcome, scheduler)
}

fn mixed_workload(seed: u64, count: usize, n: usize, temperature: f32) -> Vec<Request> {
    let mut rng = Rng(seed);
    (0..count)
        .map(|_| {
            let len = rng.range(1, 70) as usize;
            request(&mut rng, len, n, 40, temperature, 0)
        })
        .collect()
}

#[test]
fn greedy_continuous_batching_matches_the_reference() {
    let requests = mixed_workload(1, 24, 1, 0.0);
    // 24-token batches: long prompts are chunked across steps.
    let config = config(4, 400, 24, 8);
    let (outcome, scheduler) = run(&config, HASHED, &requests);
    assert_matches_reference(HASHED, &requests, &outcome.finished);
    let stats = scheduler.stats();
    assert_eq!(stats.preemptions, 0);
    let prompt_tokens: u64 = requests.iter().map(|r| r.prompt.len() as u64).sum();
    assert_eq!(stats.prompt_tokens_computed, prompt_tokens);
    assert!(outcome.max_seqs > 1, "sequences are batched");
    // Mixed lengths, both finish reasons.
    let reasons: Vec<_> = outcome.finished.iter().map(|f| f.finish_reason).collect();
    assert!(reasons.contains(&FinishReason::Stop) && reasons.contains(&FinishReason::Length));
    assert!(stats.kv_occupancy_peak > 0.0 && stats.kv_occupancy_peak <= 1.0);
    assert!(stats.kv_occupancy_mean > 0.0 && stats.kv_occupancy_mean <= stats.kv_occupancy_peak);
    assert!(
        stats.kv_utilisation_mean >= stats.kv_occupancy_mean && stats.kv_utilisation_mean <= 1.0
    );
    assert!(stats.blocks_peak > 0 && stats.blocks_peak <= 400);
}

#[test]
fn chunked_prefill_does_not_stall_decodes() {
    let mut rng = Rng(5);
    let mut short = request(&mut rng, 3, 1, 30, 0.0, 0);
    short.stop_token_ids.clear();
    short.max_new_tokens = vec![30];
    let long = request(&mut rng, 100, 1, 5, 0.0, 0);
    let config = config(4, 200, 8, 4);
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    scheduler.add(short.clone()).unwrap();
    let mut runner = FakeRunner::new(&config, HASHED);
    let mut finished = Vec::new();
    let mut chunks = 0;
    while let Some(plan) = scheduler.plan() {
        if plan.step() == 3 {
            // Added mid-flight: it starts at the next plan.
            scheduler.add(long.clone()).unwrap();
        }
        // While the long prompt is prefilled in chunks, the short sequence decodes every step.
        if plan.seqs.len() == 2 {
            assert_eq!(plan.seqs[0].num_query, 1, "the decode goes first");
            assert!(plan.seqs[1].num_query <= 7);
            chunks += usize::from(plan.seqs[1].num_rows == 0);
        }
        let out = runner.run(&plan);
        finished.extend(scheduler.apply(&plan, &out).unwrap());
    }
    assert!(
        chunks >= 14,
        "the 100-token prompt took {chunks} chunks next to the decode"
    );
    finished.sort_by_key(|f| f.request);
    assert_matches_reference(HASHED, &[short, long], &finished);
}

#[test]
fn groups_prefill_once_and_copy_on_write() {
    let mut rng = Rng(2);
    // Prompt lengths not multiples of the block size: the last prompt block is shared by the
    // samples and must be copied before they write their own tokens into it.
    let mut requests: Vec<Request> = [13, 30, 7]
        .iter()
        .map(|&len| request(&mut rng, len, 6, 25, 0.0, 0))
        .collect();
    requests.push(request(&mut rng, 9, 5, 25, 1.0, 0));
    requests.push(request(&mut rng, 16, 4, 25, 0.7, 0));
    let config = config(4, 300, 64, 32);
    let (outcome, scheduler) = run(&config, HASHED, &requests);
    assert_matches_reference(HASHED, &requests, &outcome.finished);
    let stats = scheduler.stats();
    assert_eq!(stats.preemptions, 0);
    let prompt_tokens: u64 = requests.iter().map(|r| r.prompt.len() as u64).sum();
    assert_eq!(stats.prompt_tokens_requested, prompt_tokens);
    assert_eq!(
        stats.prompt_tokens_computed, prompt_tokens,
        "once per group, not once per sample"
    );
    assert!(outcome.copy_steps > 0, "copy-on-write happened");
    // Sampled completions of one prompt differ (their seeds do).
    let sampled: Vec<_> = outcome
        .finished
        .iter()
        .filter(|f| f.request.0 == 3)
        .collect();
    assert!(sampled.windows(2).any(|w| w[0].tokens != w[1].tokens));
}

#[test]
fn tiny_caches_preempt_and_recompute_exactly() {
    for (temperature, n) in [(0.0, 1), (0.0, 3), (1.0, 2)] {
        let requests = mixed_workload(3, 12, n, temperature);
        // 15 blocks of 4 tokens: room for about two sequences at a time.
        let config = config(4, 30, 32, 8);
        let (outcome, scheduler) = run(&config, HASHED, &requests);
        assert_matches_reference(HASHED, &requests, &outcome.finished);
        assert!(
            scheduler.stats().preemptions > 0,
            "the cache is small enough to preempt"
        );
        assert!(scheduler.stats().recomputed_tokens > 0);
    }
}

#[test]
fn seeded_sampling_does_not_depend_on_batch_or_preemption() {
    let requests = mixed_workload(4, 10, 2, 1.0);
    let roomy = config(4, 400, 64, 16);
    let tiny = config(4, 30, 16, 8);
    let alone = config(8, 400, 8, 1);
    let mut runs = Vec::new();
    for config in [&roomy, &tiny, &alone] {
        let (outcome, scheduler) = run(config, HASHED, &requests);
        assert_matches_reference(HASHED, &requests, &outcome.finished);
        runs.push((outcome.finished, scheduler.stats().preemptions));
    }
    assert!(runs[1].1 > 0);
    // Other requests mixed in, in another order.
    let mut rng = Rng(99);
    let mut scheduler = Scheduler::try_new(roomy.clone()).unwrap();
    let mut runner = FakeRunner::new(&roomy, HASHED);
    let mut ids = Vec::new();
    for (i, r) in requests.iter().enumerate().rev() {
        scheduler.add(request(&mut rng, 20, 1, 10, 1.0, 0)).unwrap();
        ids.push((scheduler.add(r.clone()).unwrap(), i));
    }
    let outcome = drive(&mut scheduler, &mut runner, |_, _| Vec::new());
    for (id, i) in ids {
        let got: Vec<_> = outcome
            .finished
            .iter()
            .filter(|f| f.request == id)
            .collect();
        let want: Vec<_> = runs[0]
            .0
            .iter()
            .filter(|f| f.request.0 == i as u64)
            .collect();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert_eq!(
                (g.sample, &g.tokens, &g.logprobs),
                (w.sample, &w.tokens, &w.logprobs)
            );
        }
    }
}

fn repetitive_workload(seed: u64, n: usize, temperature: f32) -> Vec<Request> {
    let mut rng = Rng(seed);
    (0..8)
        .map(|i| {
            let len = rng.range(10, 60) as usize;
            let mut r = request(&mut rng, len, n, 60, temperature, 3 + i % 4);
            r.stop_token_ids.clear();
            r
        })
        .collect()
}

#[test]
fn ngram_speculation_is_exact_and_accepts_drafts() {
    let ngram = Speculation::Ngram {
        num_tokens: 4,
        max_ngram: 3,
        min_ngram: 2,
    };
    for (temperature, n, num_blocks) in [(0.0, 1, 400), (0.0, 3, 400), (0.8, 2, 400), (0.0, 2, 40)]
    {
        let requests = repetitive_workload(6, n, temperature);
        let config = EngineConfig {
            speculation: ngram,
            ..config(4, num_blocks, 48, 8)
        };
        let (outcome, scheduler) = run(&config, REPETITIVE, &requests);
        assert_matches_reference(REPETITIVE, &requests, &outcome.finished);
        let stats = scheduler.stats();
        assert!(
            stats.accepted_tokens > 0,
            "some drafts are accepted: {stats:?}"
        );
        assert!(
            stats.accepted_tokens < stats.drafted_tokens,
            "some are rejected: {stats:?}"
        );
        // Accepted drafts save steps: fewer query rows than generated tokens.
        assert!(stats.generated_tokens > stats.steps);
    }
}

#[test]
fn draft_model_speculation_is_exact() {
    let requests = repetitive_workload(7, 2, 0.0);
    let speculation = Speculation::DraftModel { num_tokens: 3 };
    let config = EngineConfig {
        speculation,
        ..config(4, 60, 40, 8)
    };
    let (outcome, scheduler) = run(&config, REPETITIVE, &requests);
    assert_matches_reference(REPETITIVE, &requests, &outcome.finished);
    let stats = scheduler.stats();
    assert!(stats.accepted_tokens > 0, "{stats:?}");
    assert!(stats.accepted_tokens < stats.drafted_tokens, "{stats:?}");
}

#[test]
fn draft_model_plans_leave_drafts_to_the_policy() {
    let config = EngineConfig {
        speculation: Speculation::DraftModel { num_tokens: 3 },
        ..config(4, 60, 40, 8)
    };
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    let mut r = request(&mut Rng(1), 5, 1, 10, 0.0, 0);
    r.stop_token_ids.clear();
    scheduler.add(r).unwrap();
    let mut runner = FakeRunner::new(&config, HASHED);
    let plan = scheduler.plan().unwrap();
    assert!(plan.draft_with_model && plan.max_drafts == 0);
    let out = runner.run(&plan);
    scheduler.apply(&plan, &out).unwrap();
    let plan = scheduler.plan().unwrap();
    assert_eq!(plan.draft_lens, vec![3]);
    assert_eq!(plan.input_ids[1..], [-1, -1, -1]);
    assert_eq!(plan.positions, vec![5, 6, 7, 8]);
    assert_eq!(plan.uniforms.len(), 4 * 3);
}

#[test]
fn prefix_cache_serves_the_next_turn() {
    let mut rng = Rng(8);
    let mut first = request(&mut rng, 37, 1, 30, 0.0, 0);
    first.stop_token_ids.clear();
    let config = EngineConfig {
        prefix_caching: true,
        ..config(4, 120, 32, 4)
    };
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    let mut runner = FakeRunner::new(&config, HASHED);
    scheduler.add(first.clone()).unwrap();
    let turn1 = drive(&mut scheduler, &mut runner, |_, _| Vec::new()).finished;
    assert_matches_reference(HASHED, std::slice::from_ref(&first), &turn1);
    assert_eq!(scheduler.stats().prefix_cache_hit_tokens, 0);

    // Next turn: the whole context, the completion and an observation.
    let mut second = first.clone();
    second.prompt.extend(&turn1[0].tokens);
    second.prompt.extend([5, 6, 7]);
    // Other traffic in between evicts some cached blocks but not all.
    let filler = request(&mut rng, 30, 1, 10, 0.0, 0);
    let mut scheduler_ids = Vec::new();
    scheduler_ids.push(scheduler.add(filler.clone()).unwrap());
    let computed_before = scheduler.stats().prompt_tokens_computed;
    let out = drive(&mut scheduler, &mut runner, |s, step| {
        if step == 3 {
            scheduler_ids.push(s.add(second.clone()).unwrap());
        }
        Vec::new()
    });
    let stats = scheduler.stats();
    assert!(stats.prefix_cache_hit_tokens > 0, "{stats:?}");
    assert_eq!(stats.prefix_cache_hit_tokens % 4, 0);
    assert_eq!(
        stats.prompt_tokens_computed - computed_before,
        (filler.prompt.len() + second.prompt.len()) as u64 - stats.prefix_cache_hit_tokens
    );
    // The context was 37 + 30 tokens; its last token was never fed, so 66 are cached.
    assert_eq!(stats.prefix_cache_hit_tokens, 64);
    assert_matches_reference(
        HASHED,
        &[first, filler, second.clone()],
        &[turn1, out.finished].concat(),
    );

    // After a weight update the cache is cleared: nothing is reused.
    scheduler.clear_prefix_cache();
    scheduler.add(second.clone()).unwrap();
    drive(&mut scheduler, &mut runner, |_, _| Vec::new());
    assert_eq!(scheduler.stats().prefix_cache_hit_tokens, 64);
}

#[test]
fn repeated_prompts_hit_the_cache_and_stay_exact() {
    // 24 tokens fill 6 blocks exactly: the last block is never taken from the cache, since
    // the last prompt token must be computed for its logits.
    for (len, max_hit) in [(26, 24), (24, 20)] {
        let mut rng = Rng(10);
        let base = request(&mut rng, len, 3, 20, 0.9, 0);
        let mut requests = Vec::new();
        for i in 0..6u64 {
            let mut r = base.clone();
            r.seeds = vec![i, i + 100, i + 200];
            requests.push(r);
        }
        let config = EngineConfig {
            prefix_caching: true,
            ..config(4, 60, 16, 6)
        };
        let (outcome, scheduler) = run(&config, HASHED, &requests);
        assert_matches_reference(HASHED, &requests, &outcome.finished);
        let stats = scheduler.stats();
        // Some requests start while the first one is still prefilling, with fewer hits.
        assert!(stats.prefix_cache_hit_tokens >= max_hit, "{stats:?}");
        assert!(
            stats.prompt_tokens_computed < stats.prompt_tokens_requested,
            "{stats:?}"
        );
    }
}

#[test]
fn add_rejects_what_cannot_fit_or_is_malformed() {
    let mut scheduler = Scheduler::try_new(config(4, 10, 16, 4)).unwrap();
    let ok = Request {
        prompt: vec![1; 30],
        n: 2,
        max_new_tokens: vec![7, 3],
        params: SampleParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
        },
        stop_token_ids: vec![EOS],
        seeds: vec![1, 2],
    };
    scheduler.add(ok.clone()).unwrap();
    let long = Request {
        prompt: vec![1; 37],
        ..ok.clone()
    };
    let error = scheduler.add(long).unwrap_err();
    assert!(matches!(
        error,
        EngineError::PromptTooLong {
            prompt_len: 37,
            needed: 10,
            ..
        }
    ));
    assert!(error.to_string().contains("whole cache has 10"), "{error}");
    let error = scheduler
        .add(Request {
            max_new_tokens: vec![8, 1],
            ..ok.clone()
        })
        .unwrap_err();
    assert!(
        matches!(
            error,
            EngineError::SequenceTooLong {
                max_new_tokens: 8,
                ..
            }
        ),
        "{error}"
    );
    let cases = [
        (
            Request {
                prompt: vec![],
                ..ok.clone()
            },
            EngineError::EmptyPrompt,
        ),
        (
            Request {
                n: 0,
                max_new_tokens: vec![],
                seeds: vec![],
                ..ok.clone()
            },
            EngineError::NoSamples,
        ),
        (
            Request {
                seeds: vec![1],
                ..ok.clone()
            },
            EngineError::PerSampleLength {
                field: "seeds",
                got: 1,
                n: 2,
            },
        ),
        (
            Request {
                max_new_tokens: vec![1, 0],
                ..ok.clone()
            },
            EngineError::ZeroMaxNewTokens { sample: 1 },
        ),
    ];
    for (request, expected) in cases {
        assert_eq!(scheduler.add(request).unwrap_err(), expected);
    }
    let bad = Request {
        params: SampleParams {
            temperature: f32::NAN,
            ..ok.params
        },
        ..ok
    };
    assert!(matches!(
        scheduler.add(bad),
        Err(EngineError::InvalidParams(_))
    ));
    assert!(Scheduler::try_new(config(0, 10, 16, 4)).is_err());
    let bad_ngram = Speculation::Ngram {
        num_tokens: 2,
        max_ngram: 1,
        min_ngram: 2,
    };
    assert!(
        Scheduler::try_new(EngineConfig {
            speculation: bad_ngram,
            ..config(4, 10, 16, 4)
        })
        .is_err()
    );
}

#[test]
fn apply_rejects_malformed_outcomes_and_changes_nothing() {
    let ngram = Speculation::Ngram {
        num_tokens: 3,
        max_ngram: 2,
        min_ngram: 1,
    };
    let config = EngineConfig {
        speculation: ngram,
        ..config(4, 40, 32, 4)
    };
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    let mut runner = FakeRunner::new(&config, REPETITIVE);
    let mut r = request(&mut Rng(3), 12, 1, 30, 0.0, 2);
    r.stop_token_ids.clear();
    scheduler.add(r.clone()).unwrap();
    let mut finished = Vec::new();
    // Run until a plan carries drafts.
    let plan = loop {
        let plan = scheduler.plan().unwrap();
        if plan.max_drafts > 0 {
            break plan;
        }
        let out = runner.run(&plan);
        finished.extend(scheduler.apply(&plan, &out).unwrap());
    };
    let good = runner.run(&plan);
    let k1 = plan.max_drafts + 1;
    let mut short = good.clone();
    short.tokens.pop();
    let mut zero = good.clone();
    zero.counts[0] = 0;
    let mut too_many = good.clone();
    too_many.counts[0] = k1 as i64 + 1;
    let mut negative = good.clone();
    negative.tokens[0] = -5;
    let mut nan = good.clone();
    nan.logprobs[0] = f32::NAN;
    let mut wrong_draft = good.clone();
    wrong_draft.counts[0] = 2;
    wrong_draft.tokens[0] = (i64::from(plan.input_ids[1] as u32) + 1) % 48;
    let rejected = [
        (short, "OutcomeShape"),
        (
            StepOutput {
                counts: vec![],
                ..good.clone()
            },
            "OutcomeShape",
        ),
        (zero, "OutcomeCount"),
        (too_many, "OutcomeCount"),
        (negative, "OutcomeToken"),
        (nan, "OutcomeLogprob"),
        (wrong_draft, "DraftMismatch"),
    ];
    for (outcome, kind) in rejected {
        let error = scheduler.apply(&plan, &outcome).unwrap_err();
        assert!(
            format!("{error:?}").starts_with(kind),
            "{error:?} is not {kind}"
        );
    }
    // A plan that is not in flight.
    let mut stale = plan.clone();
    stale.step += 1;
    assert!(matches!(
        scheduler.apply(&stale, &good),
        Err(EngineError::PlanMismatch { .. })
    ));
    // Nothing changed: the good outcome still applies, once.
    finished.extend(scheduler.apply(&plan, &good).unwrap());
    assert!(matches!(
        scheduler.apply(&plan, &good),
        Err(EngineError::PlanMismatch { .. })
    ));
    finished.extend(drive(&mut scheduler, &mut runner, |_, _| Vec::new()).finished);
    assert_matches_reference(REPETITIVE, &[r], &finished);
}

#[test]
fn finish_early_stops_a_sample_and_frees_its_blocks() {
    let mut rng = Rng(12);
    let mut r = request(&mut rng, 10, 3, 40, 1.0, 0);
    r.stop_token_ids.clear();
    r.max_new_tokens = vec![40; 3];
    let config = config(4, 80, 32, 8);
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    let id = scheduler.add(r.clone()).unwrap();
    let mut runner = FakeRunner::new(&config, HASHED);
    let mut stopped = None;
    let outcome = drive(&mut scheduler, &mut runner, |s, _| {
        // The caller's stop-string check: stop sample 1 once it has 5 tokens.
        for (seq, tail) in s.running_tails(3) {
            assert!(tail.len() <= 3);
            if stopped.is_none() && s.sample_of(seq) == Some((id, 1)) && tail.len() == 3 {
                let generated = s.seqs.get(seq).unwrap().generated();
                if generated < 5 {
                    continue;
                }
                let done = s.finish_early(seq, FinishReason::Stop);
                assert_eq!(done.len(), 1);
                assert!(
                    s.finish_early(seq, FinishReason::Stop).is_empty(),
                    "stale ids do nothing"
                );
                assert_eq!(done[0].tokens[2..], tail);
                stopped = Some(done[0].tokens.clone());
                return done;
            }
        }
        Vec::new()
    });
    let stopped = stopped.unwrap();
    let finished = &outcome.finished;
    assert_eq!(finished.len(), 3);
    assert_eq!(finished[1].tokens, stopped);
    assert_eq!(finished[1].finish_reason, FinishReason::Stop);
    assert_eq!(stopped, super::fake::reference(HASHED, &r, 1).0[..5]);
    for sample in [0, 2] {
        assert_eq!(
            finished[sample].tokens,
            super::fake::reference(HASHED, &r, sample).0
        );
    }
}

#[test]
fn finish_early_ends_a_whole_group_before_it_forks() {
    let config = config(4, 80, 8, 8);
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    let mut r = request(&mut Rng(1), 30, 4, 10, 1.0, 0);
    r.stop_token_ids.clear();
    let id = scheduler.add(r).unwrap();
    let mut runner = FakeRunner::new(&config, HASHED);
    let plan = scheduler.plan().unwrap();
    let out = runner.run(&plan);
    assert!(scheduler.apply(&plan, &out).unwrap().is_empty());
    let leader = scheduler.running[0];
    assert!(
        scheduler.running_tails(4).is_empty(),
        "nothing generated yet"
    );
    // Stopped while a plan is in flight: the plan's rows for it are ignored.
    let plan = scheduler.plan().unwrap();
    let done = scheduler.finish_early(leader, FinishReason::Length);
    assert_eq!(
        done.iter()
            .map(|f| (f.request, f.sample))
            .collect::<Vec<_>>(),
        (0..4).map(|i| (id, i)).collect::<Vec<_>>()
    );
    assert!(done.iter().all(|f| f.tokens.is_empty()));
    let out = runner.run(&plan);
    assert!(scheduler.apply(&plan, &out).unwrap().is_empty());
    assert!(scheduler.is_idle() && scheduler.plan().is_none());
    assert_eq!(scheduler.stats().blocks_used, 0);
    scheduler.check_invariants().unwrap();
}

fn fixed(prompt: Vec<u32>, max_new: u32) -> Request {
    Request {
        prompt,
        n: 1,
        max_new_tokens: vec![max_new],
        params: SampleParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
        },
        stop_token_ids: vec![],
        seeds: vec![0],
    }
}

#[test]
fn preemption_takes_the_most_recently_admitted_sequence() {
    // A's prompt fills 1.5 blocks, B's and C's one each: after two decode steps A needs a
    // third block while B and C have taken the last free ones.
    let config = config(4, 6, 64, 4);
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    let ids: Vec<_> = [vec![1; 6], vec![2; 4], vec![3; 4]]
        .into_iter()
        .map(|p| scheduler.add(fixed(p, 12)).unwrap())
        .collect();
    let mut runner = FakeRunner::new(&config, HASHED);
    let mut first_victim = None;
    drive(&mut scheduler, &mut runner, |s, _| {
        if first_victim.is_none() && s.stats().preemptions > 0 {
            let waiting = s.waiting.front().copied().unwrap();
            first_victim = s.sample_of(waiting).map(|(r, _)| r);
        }
        Vec::new()
    });
    assert_eq!(first_victim, Some(ids[2]));
}

#[test]
fn a_cached_prefix_is_evicted_from_its_tail() {
    let config = EngineConfig {
        prefix_caching: true,
        ..config(4, 6, 64, 4)
    };
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    let mut runner = FakeRunner::new(&config, HASHED);
    let a: Vec<u32> = (1..=13).collect();
    // A caches its 3 full blocks; B needs one of them back; A again still finds its head.
    for (prompt, hits) in [(a.clone(), 0), ((20..36).collect(), 0), (a, 8)] {
        let before = scheduler.stats().prefix_cache_hit_tokens;
        scheduler.add(fixed(prompt, 1)).unwrap();
        drive(&mut scheduler, &mut runner, |_, _| Vec::new());
        assert_eq!(scheduler.stats().prefix_cache_hit_tokens - before, hits);
    }
}

#[test]
fn the_scheduler_can_move_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Scheduler>();
    assert_send_sync::<crate::scheduler::StepPlan>();
}

#[test]
fn a_group_leader_feeding_its_last_prompt_token_gets_no_drafts() {
    // Chunks of 2 leave the 7th prompt token alone, fed like a decode; its rows sample every
    // member's first token, so no drafts may ride along (found by the property test).
    let speculation = Speculation::DraftModel { num_tokens: 1 };
    let config = EngineConfig {
        speculation,
        ..config(1, 25, 2, 1)
    };
    let mut r = request(&mut Rng(3), 7, 2, 5, 1.0, 2);
    r.max_new_tokens = vec![4, 5];
    let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
    scheduler.add(r.clone()).unwrap();
    let mut runner = FakeRunner::new(&config, REPETITIVE);
    let mut finished = Vec::new();
    while let Some(plan) = scheduler.plan() {
        scheduler.check_invariants().unwrap();
        for s in plan.seqs.iter().filter(|s| s.num_rows > 1) {
            assert_eq!(s.num_drafts, 0);
        }
        let out = runner.run(&plan);
        finished.extend(scheduler.apply(&plan, &out).unwrap());
        scheduler.check_invariants().unwrap();
    }
    finished.sort_by_key(|f| f.sample);
    assert_matches_reference(REPETITIVE, &[r], &finished);
}
