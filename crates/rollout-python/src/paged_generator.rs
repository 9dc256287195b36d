//! Generation through Rollout's sampling engine: the Rust scheduler plans every step (which
//! sequences run, what they feed, where their KV lives) and the policy's model runner executes
//! it on the Python worker.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use rollout_core::config::{EngineSection, SpeculationMethod};
use rollout_core::roles::RoleError;
use rollout_core::scheduler::{
    EngineConfig, EngineStats, Request, SampleParams, Scheduler, Speculation,
};
use rollout_core::seeds::mix;
use rollout_net::messages::{Completion, FinishReason, GenerateRequest, GenerateResponse};
use tracing::Instrument;

use crate::contract::KvLayout;
use crate::interpreter::PythonWorker;
use crate::plugins::PolicyPlugin;

/// The engine of a run: one scheduler and its cache, reused by every generation request.
///
/// The cache is sized on demand: the first request allocates what it can use (its prompts
/// and budgets) and a later, larger one grows it, never past the memory budget.
pub struct PagedGenerator {
    state: tokio::sync::Mutex<EngineState>,
    layout: KvLayout,
    /// The scheduler's settings; `num_blocks` is chosen per allocation.
    config: EngineConfig,
    /// Blocks the memory budget allows at most.
    max_blocks: usize,
}

struct EngineState {
    scheduler: Option<Scheduler>,
    /// The weights the prefix cache was computed with; cached KV is stale after an update.
    weight_version: Option<u64>,
}

/// Accumulates one request's engine measurements.
#[derive(Default)]
struct CallMeasurements {
    steps: u64,
    forward_seconds: f64,
    stop_string_seconds: f64,
}

impl PagedGenerator {
    /// Reads the policy's cache geometry and the memory budget. `None` when the policy
    /// cannot run in the engine.
    pub async fn start(
        worker: &PythonWorker,
        policy: Arc<PolicyPlugin>,
        section: &EngineSection,
    ) -> Result<Option<Self>, RoleError> {
        let Some(layout) = worker.run(move |py| policy.kv_layout(py)).await?? else {
            return Ok(None);
        };
        let budget = if section.kv_cache_bytes > 0 {
            section.kv_cache_bytes
        } else {
            (layout.available_bytes as f64 * section.kv_cache_fraction) as u64
        };
        let max_blocks = (budget / layout.bytes_per_slot().max(1)) as usize / section.block_size;
        let speculation = match section.speculation.method {
            SpeculationMethod::Off => Speculation::Off,
            SpeculationMethod::Ngram => Speculation::Ngram {
                num_tokens: section.speculation.num_tokens,
                max_ngram: section.speculation.max_ngram,
                min_ngram: section.speculation.min_ngram,
            },
            SpeculationMethod::DraftModel => Speculation::DraftModel {
                num_tokens: section.speculation.num_tokens,
            },
        };
        let config = EngineConfig {
            block_size: section.block_size,
            num_blocks: max_blocks,
            max_batch_tokens: section.max_batch_tokens.max(section.max_running),
            max_running: section.max_running,
            prefix_caching: section.prefix_caching,
            speculation,
        };
        config.validate().map_err(|err| {
            RoleError::Protocol(format!(
                "{err} (a KV-cache budget of {budget} bytes holds {max_blocks} blocks of {} tokens)",
                section.block_size
            ))
        })?;
        Ok(Some(PagedGenerator {
            state: tokio::sync::Mutex::new(EngineState {
                scheduler: None,
                weight_version: None,
            }),
            layout,
            config,
            max_blocks,
        }))
    }

    /// Blocks `request` can occupy at once: every prompt with its longest completion, and
    /// each further sample's own completion plus a copied partial block.
    fn blocks_wanted(&self, request: &GenerateRequest) -> usize {
        let block_size = self.config.block_size;
        let drafts = match self.config.speculation {
            Speculation::Off => 0,
            Speculation::Ngram { num_tokens, .. } | Speculation::DraftModel { num_tokens } => {
                num_tokens
            }
        };
        request
            .prompts
            .iter()
            .map(|prompt| {
                let longest = prompt
                    .max_new_tokens
                    .iter()
                    .copied()
                    .max()
                    .unwrap_or(request.sampling.max_new_tokens)
                    as usize
                    + drafts;
                let samples = prompt.n.max(1) as usize;
                (prompt.prompt_ids.len() + longest).div_ceil(block_size)
                    + (samples - 1) * (longest.div_ceil(block_size) + 1)
            })
            .sum()
    }

    /// The scheduler, (re)allocating the cache when `request` wants more than it has.
    async fn ensure_capacity<'s>(
        &self,
        state: &'s mut EngineState,
        worker: &PythonWorker,
        policy: &Arc<PolicyPlugin>,
        request: &GenerateRequest,
    ) -> Result<&'s mut Scheduler, RoleError> {
        let wanted = self.blocks_wanted(request).min(self.max_blocks).max(1);
        let current = state
            .scheduler
            .as_ref()
            .map_or(0, |s| s.config().num_blocks);
        if wanted > current {
            // Headroom, so growing contexts (later turns of episodes) do not reallocate each time.
            let num_blocks = (wanted * 3 / 2).max(current * 2).min(self.max_blocks);
            let scheduler = Scheduler::try_new(EngineConfig {
                num_blocks,
                ..self.config.clone()
            })
            .map_err(|err| RoleError::Protocol(err.to_string()))?;
            let num_slots = num_blocks * self.config.block_size;
            let allocator = policy.clone();
            worker
                .run(move |py| allocator.allocate_kv(py, num_slots))
                .instrument(tracing::info_span!("engine.allocate_kv", num_blocks))
                .await??;
            tracing::info!(
                "sampling engine: KV cache of {num_blocks} blocks of {} tokens ({:.1} MiB; the budget allows {})",
                self.config.block_size,
                (num_slots as u64 * self.layout.bytes_per_slot()) as f64 / (1 << 20) as f64,
                self.max_blocks
            );
            state.scheduler = Some(scheduler);
        }
        state
            .scheduler
            .as_mut()
            .ok_or_else(|| RoleError::Protocol("the KV cache could not be allocated".into()))
    }

    /// The KV cache's contents are gone (the policy released and reallocated it): nothing
    /// cached may be reused by the next request.
    pub async fn forget_cached_prefixes(&self) {
        self.state.lock().await.weight_version = None;
    }

    /// Completes every prompt of `request` with the weights of `weight_version`.
    pub async fn generate(
        &self,
        worker: &PythonWorker,
        policy: &Arc<PolicyPlugin>,
        request: GenerateRequest,
        eos_token_ids: &[u32],
        weight_version: u64,
    ) -> Result<GenerateResponse, RoleError> {
        let mut guard = self.state.lock().await;
        let state = &mut *guard;
        let stale = state.weight_version != Some(weight_version);
        state.weight_version = Some(weight_version);
        let scheduler = self
            .ensure_capacity(state, worker, policy, &request)
            .await?;
        if !scheduler.is_idle() {
            // A request that failed or was dropped midway left its sequences behind: they
            // hold blocks and would finish as nobody's. The cache stays; its prefixes do not.
            tracing::warn!(
                running = scheduler.num_running(),
                waiting = scheduler.num_waiting(),
                "the sampling engine held sequences of an unfinished request: dropped"
            );
            *scheduler = Scheduler::new(scheduler.config().clone());
        }
        if stale {
            scheduler.clear_prefix_cache();
        }
        let before = scheduler.stats();
        let sampling = &request.sampling;
        let mut stop_token_ids = sampling.stop_token_ids.clone();
        if !sampling.ignore_eos {
            stop_token_ids.extend_from_slice(eos_token_ids);
        }
        let mut prompt_of = HashMap::new();
        let mut groups: Vec<Vec<Option<Completion>>> = Vec::with_capacity(request.prompts.len());
        for (index, prompt) in request.prompts.iter().enumerate() {
            let n = prompt.n as usize;
            let budgets = if prompt.max_new_tokens.is_empty() {
                vec![sampling.max_new_tokens; n]
            } else {
                prompt.max_new_tokens.clone()
            };
            let longest = prompt.prompt_ids.len() as u64
                + u64::from(budgets.iter().copied().max().unwrap_or(0));
            if longest > self.layout.max_positions {
                return Err(RoleError::Protocol(format!(
                    "prompt {index} has {} tokens and may generate {} more, past the model's {} positions",
                    prompt.prompt_ids.len(),
                    longest - prompt.prompt_ids.len() as u64,
                    self.layout.max_positions
                )));
            }
            let id = scheduler
                .add(Request {
                    prompt: prompt.prompt_ids.clone(),
                    n,
                    max_new_tokens: budgets,
                    params: SampleParams {
                        temperature: sampling.temperature,
                        top_p: sampling.top_p,
                        top_k: sampling.top_k,
                    },
                    stop_token_ids: stop_token_ids.clone(),
                    seeds: {
                        let group_seed = prompt
                            .seed
                            .unwrap_or_else(|| mix(sampling.seed, index as u64));
                        (0..n as u64)
                            .map(|sample| mix(group_seed, sample))
                            .collect()
                    },
                })
                .map_err(|err| RoleError::Protocol(format!("prompt {index}: {err}")))?;
            prompt_of.insert(id, index);
            groups.push(vec![None; n]);
        }

        let started = Instant::now();
        let mut measured = CallMeasurements::default();
        let stop_tail = sampling
            .stop_strings
            .iter()
            .map(|s| s.chars().count())
            .max()
            .unwrap_or(0)
            + 4;
        while let Some(plan) = scheduler.plan() {
            let runner = policy.clone();
            let span = tracing::info_span!(
                "engine.step",
                seqs = plan.num_seqs(),
                tokens = plan.num_tokens()
            );
            let (plan, result) = worker
                .run(move |py| {
                    let mut plan = plan;
                    let result = runner.engine_step(py, &mut plan);
                    (plan, result)
                })
                .instrument(span)
                .await?;
            let (outcome, forward_seconds) = result?;
            measured.steps += 1;
            measured.forward_seconds += forward_seconds;
            let mut finished = scheduler.apply(&plan, &outcome).map_err(|err| {
                RoleError::Protocol(format!("the model runner's step output: {err}"))
            })?;
            if !sampling.stop_strings.is_empty() {
                let checking = Instant::now();
                let tails = scheduler.running_tails(stop_tail);
                if !tails.is_empty() {
                    let decoder = policy.clone();
                    let sequences: Vec<Vec<u32>> =
                        tails.iter().map(|(_, tail)| tail.clone()).collect();
                    let texts = worker
                        .run(move |py| {
                            let slices: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
                            decoder.decode(py, &slices)
                        })
                        .await??;
                    for ((seq, _), text) in tails.iter().zip(texts) {
                        if sampling
                            .stop_strings
                            .iter()
                            .any(|stop| text.contains(stop.as_str()))
                        {
                            finished.extend(scheduler.finish_early(*seq, FinishReason::Stop));
                        }
                    }
                }
                measured.stop_string_seconds += checking.elapsed().as_secs_f64();
            }
            for done in finished {
                let Some(&index) = prompt_of.get(&done.request) else {
                    return Err(RoleError::Protocol(
                        "the engine finished an unknown request".into(),
                    ));
                };
                if let Some(slot) = groups[index].get_mut(done.sample) {
                    *slot = Some(Completion {
                        token_ids: done.tokens,
                        logprobs: done.logprobs,
                        finish_reason: done.finish_reason,
                        weight_version,
                    });
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let groups = groups
            .into_iter()
            .map(|group| group.into_iter().collect::<Option<Vec<_>>>())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                RoleError::Protocol("the engine went idle with samples unfinished".into())
            })?;
        let metrics = call_metrics(&before, &scheduler.stats(), &measured, seconds);
        Ok(GenerateResponse { groups, metrics })
    }
}

/// The engine's measurements for one request, from the scheduler's counters before and after.
fn call_metrics(
    before: &EngineStats,
    after: &EngineStats,
    measured: &CallMeasurements,
    seconds: f64,
) -> BTreeMap<String, f64> {
    let steps = after.steps.saturating_sub(before.steps).max(1) as f64;
    let call_mean = |after_mean: f64, before_mean: f64| {
        (after_mean * after.steps as f64 - before_mean * before.steps as f64) / steps
    };
    let drafted = after.drafted_tokens.saturating_sub(before.drafted_tokens) as f64;
    let accepted = after.accepted_tokens.saturating_sub(before.accepted_tokens) as f64;
    let generated = after
        .generated_tokens
        .saturating_sub(before.generated_tokens) as f64;
    let query = after.query_tokens.saturating_sub(before.query_tokens) as f64;
    let delta = |a: u64, b: u64| a.saturating_sub(b) as f64;
    let mut metrics = BTreeMap::new();
    let mut put = |name: &str, value: f64| {
        metrics.insert(format!("engine/{name}"), value);
    };
    put("steps", measured.steps as f64);
    put("seconds", seconds);
    put("forward_seconds", measured.forward_seconds);
    put(
        "overhead_fraction",
        if seconds > 0.0 {
            (1.0 - measured.forward_seconds / seconds).max(0.0)
        } else {
            0.0
        },
    );
    put(
        "kv_utilisation_mean",
        call_mean(after.kv_utilisation_mean, before.kv_utilisation_mean),
    );
    put(
        "kv_occupancy_mean",
        call_mean(after.kv_occupancy_mean, before.kv_occupancy_mean),
    );
    put("kv_blocks", after.blocks_total as f64);
    put("preemptions", delta(after.preemptions, before.preemptions));
    put(
        "prefix_cache_hit_tokens",
        delta(
            after.prefix_cache_hit_tokens,
            before.prefix_cache_hit_tokens,
        ),
    );
    put(
        "prompt_tokens_requested",
        delta(
            after.prompt_tokens_requested,
            before.prompt_tokens_requested,
        ),
    );
    put(
        "prompt_tokens_computed",
        delta(after.prompt_tokens_computed, before.prompt_tokens_computed),
    );
    put("batch_tokens_mean", query / steps);
    put("generated_tokens", generated);
    if drafted > 0.0 {
        put("drafted_tokens", drafted);
        put("accepted_tokens", accepted);
        put("acceptance_rate", accepted / drafted);
    }
    if measured.stop_string_seconds > 0.0 {
        put("stop_string_seconds", measured.stop_string_seconds);
    }
    metrics
}
