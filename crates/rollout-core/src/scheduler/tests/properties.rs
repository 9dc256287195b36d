//! Property tests over random workloads, cache sizes and scheduler settings: outputs equal
//! the sequential reference, the cache budget holds at every step (checked by `drive`), and
//! every block is free or cached once everything finished.

use proptest::prelude::*;

use super::fake::{FakeRunner, ModelFn, Rng, drive, reference, request};
use crate::scheduler::{EngineConfig, FinishReason, Request, Scheduler, Speculation};

fn speculation() -> impl Strategy<Value = Speculation> {
    prop_oneof![
        Just(Speculation::Off),
        (1usize..5, 1usize..4, 0usize..3).prop_map(|(num_tokens, min_ngram, extra)| {
            Speculation::Ngram {
                num_tokens,
                max_ngram: min_ngram + extra,
                min_ngram,
            }
        }),
        (1usize..4).prop_map(|num_tokens| Speculation::DraftModel { num_tokens }),
    ]
}

fn config() -> impl Strategy<Value = EngineConfig> {
    (
        1usize..7,
        3usize..60,
        1usize..40,
        1usize..10,
        any::<bool>(),
        speculation(),
    )
        .prop_map(
            |(
                block_size,
                num_blocks,
                max_batch_tokens,
                max_running,
                prefix_caching,
                speculation,
            )| {
                EngineConfig {
                    block_size,
                    num_blocks,
                    max_batch_tokens,
                    max_running,
                    prefix_caching,
                    speculation,
                }
            },
        )
}

/// A request spec: (arrival step, shared-prefix base, prompt length, n, max new tokens,
/// sampled, period of a repetitive prompt).
type Spec = (u64, usize, usize, usize, u32, bool, usize);

fn spec() -> impl Strategy<Value = Spec> {
    (
        0u64..8,
        0usize..3,
        1usize..40,
        1usize..5,
        1u32..24,
        any::<bool>(),
        0usize..4,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_match_the_reference_within_budget(
        config in config(),
        specs in proptest::collection::vec(spec(), 1..10),
        repetitive in any::<bool>(),
        stop_at in proptest::option::of(0u64..30),
        seed in any::<u64>(),
    ) {
        let model = ModelFn { local_percent: if repetitive { 85 } else { 0 } };
        let mut rng = Rng(seed);
        // Prompts start with one of three shared prefixes, so prefix caching gets hits.
        let bases: Vec<Vec<u32>> =
            (0..3).map(|_| request(&mut rng, 12, 1, 1, 0.0, 0).prompt).collect();
        let mut arrivals: Vec<(u64, Request)> = specs
            .iter()
            .map(|&(at, base, len, n, max_new, sampled, period)| {
                let mut r = request(&mut rng, len, n, max_new, if sampled { 1.0 } else { 0.0 }, period);
                let shared = bases[base][..len.min(12) / 2].to_vec();
                r.prompt.splice(0..0, shared);
                (at, r)
            })
            .collect();
        arrivals.sort_by_key(|a| a.0);

        let mut scheduler = Scheduler::try_new(config.clone()).unwrap();
        let mut runner = FakeRunner::new(&config, model);
        let mut accepted: Vec<(u64, Request)> = Vec::new();
        let mut next = 0;
        let mut stopped = Vec::new();
        let outcome = drive(&mut scheduler, &mut runner, |s, step| {
            let mut done = Vec::new();
            // The caller stops one sequence early (as a stop string would).
            if stop_at == Some(step) {
                if let Some((seq, _)) = s.running_tails(4).first().cloned() {
                    let f = s.finish_early(seq, FinishReason::Stop);
                    stopped.extend(f.iter().map(|f| (f.request.0, f.sample)));
                    done.extend(f);
                }
            }
            while next < arrivals.len() && (arrivals[next].0 <= step || s.is_idle()) {
                // Requests that never fit are rejected by `add`.
                let r = arrivals[next].1.clone();
                next += 1;
                match s.add(r.clone()) {
                    Ok(id) => accepted.push((id.0, r)),
                    Err(e) => {
                        let blocks = config.blocks_for(r.prompt.len() + *r.max_new_tokens.iter().max().unwrap() as usize - 1);
                        assert!(blocks + 1 > config.num_blocks, "{e}");
                    }
                }
            }
            done
        });
        prop_assert_eq!(next, arrivals.len());

        let expected: usize = accepted.iter().map(|(_, r)| r.n).sum();
        prop_assert_eq!(outcome.finished.len(), expected);
        for f in &outcome.finished {
            let (_, r) = accepted.iter().find(|(id, _)| *id == f.request.0).unwrap();
            let (tokens, reason) = reference(model, r, f.sample);
            if stopped.contains(&(f.request.0, f.sample)) {
                prop_assert!(tokens.starts_with(&f.tokens));
            } else {
                prop_assert_eq!(&f.tokens, &tokens);
                prop_assert_eq!(f.finish_reason, reason);
            }
        }
        let stats = scheduler.stats();
        prop_assert!(stats.blocks_peak <= config.num_blocks);
        prop_assert!(stats.kv_occupancy_peak <= 1.0);
        prop_assert!(stats.steps == 0 || (stats.kv_utilisation_mean > 0.0 && stats.kv_utilisation_mean <= 1.0));
        prop_assert!(stats.accepted_tokens <= stats.drafted_tokens);
    }
}
