//! Generation through Rollout's sampling engine: the Rust scheduler plans every step (which
//! sequences run, what they feed, where their KV lives) and the policy's model runner executes
//! it on the Python worker.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use rollout_core::config::{EngineSection, SpeculationMethod};
use rollout_core::roles::RoleError;
use rollout_core::scheduler::{
    EngineConfig, EngineStats, Finished, Request, RequestId, SampleParams, Scheduler, Speculation,
    StepPlan,
};
use rollout_core::seeds::mix;
use rollout_net::messages::{
    Completion, FinishReason, GenerateRequest, GenerateResponse, PromptRequest, SamplingParams,
};
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
        let scheduler = self
            .prepare_scheduler(&mut guard, worker, policy, &request, weight_version)
            .await?;
        let before = scheduler.stats();
        let pending = self.submit(scheduler, &request, eos_token_ids)?;
        let mut run = EngineRun {
            worker,
            policy,
            scheduler,
            sampling: &request.sampling,
            weight_version,
            pending,
            measured: CallMeasurements::default(),
        };
        let started = Instant::now();
        run.step_until_idle().await?;
        let seconds = started.elapsed().as_secs_f64();
        let groups = run.pending.into_groups()?;
        let metrics = call_metrics(&before, &run.scheduler.stats(), &run.measured, seconds);
        Ok(GenerateResponse {
            groups,
            metrics,
            producers: Vec::new(),
        })
    }

    /// The scheduler, ready for a request with the weights of `weight_version`: large enough
    /// for `request`, holding no other request's sequences, and without prefixes cached
    /// under other weights.
    async fn prepare_scheduler<'s>(
        &self,
        state: &'s mut EngineState,
        worker: &PythonWorker,
        policy: &Arc<PolicyPlugin>,
        request: &GenerateRequest,
        weight_version: u64,
    ) -> Result<&'s mut Scheduler, RoleError> {
        let stale = state.weight_version != Some(weight_version);
        state.weight_version = Some(weight_version);
        let scheduler = self.ensure_capacity(state, worker, policy, request).await?;
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
        Ok(scheduler)
    }

    /// Adds every prompt of `request` to `scheduler`, in order: the groups to fill.
    fn submit(
        &self,
        scheduler: &mut Scheduler,
        request: &GenerateRequest,
        eos_token_ids: &[u32],
    ) -> Result<PendingGroups, RoleError> {
        let sampling = &request.sampling;
        let mut stop_token_ids = sampling.stop_token_ids.clone();
        if !sampling.ignore_eos {
            stop_token_ids.extend_from_slice(eos_token_ids);
        }
        let mut pending = PendingGroups::with_capacity(request.prompts.len());
        for (index, prompt) in request.prompts.iter().enumerate() {
            let scheduled = self.scheduler_request(index, prompt, sampling, &stop_token_ids)?;
            let id = scheduler
                .add(scheduled)
                .map_err(|err| RoleError::Protocol(format!("prompt {index}: {err}")))?;
            pending.add_group(id, prompt.n as usize);
        }
        Ok(pending)
    }

    /// The scheduler's request for prompt `index`; refused when its longest sample could
    /// outgrow the model's positions.
    fn scheduler_request(
        &self,
        index: usize,
        prompt: &PromptRequest,
        sampling: &SamplingParams,
        stop_token_ids: &[u32],
    ) -> Result<Request, RoleError> {
        let n = prompt.n as usize;
        let budgets = if prompt.max_new_tokens.is_empty() {
            vec![sampling.max_new_tokens; n]
        } else {
            prompt.max_new_tokens.clone()
        };
        let longest =
            prompt.prompt_ids.len() as u64 + u64::from(budgets.iter().copied().max().unwrap_or(0));
        if longest > self.layout.max_positions {
            return Err(RoleError::Protocol(format!(
                "prompt {index} has {} tokens and may generate {} more, past the model's {} positions",
                prompt.prompt_ids.len(),
                longest - prompt.prompt_ids.len() as u64,
                self.layout.max_positions
            )));
        }
        let group_seed = prompt
            .seed
            .unwrap_or_else(|| mix(sampling.seed, index as u64));
        Ok(Request {
            prompt: prompt.prompt_ids.clone(),
            n,
            max_new_tokens: budgets,
            params: SampleParams {
                temperature: sampling.temperature,
                top_p: sampling.top_p,
                top_k: sampling.top_k,
            },
            stop_token_ids: stop_token_ids.to_vec(),
            seeds: (0..n as u64)
                .map(|sample| mix(group_seed, sample))
                .collect(),
        })
    }
}

/// One request's prompt groups, filled sample by sample as the engine finishes them.
struct PendingGroups {
    /// The group (prompt index) of each scheduler request.
    prompt_of: HashMap<RequestId, usize>,
    groups: Vec<Vec<Option<Completion>>>,
}

impl PendingGroups {
    fn with_capacity(prompts: usize) -> Self {
        PendingGroups {
            prompt_of: HashMap::new(),
            groups: Vec::with_capacity(prompts),
        }
    }

    /// The next group: `samples` completions of the scheduler's `request`.
    fn add_group(&mut self, request: RequestId, samples: usize) {
        self.prompt_of.insert(request, self.groups.len());
        self.groups.push(vec![None; samples]);
    }

    /// Files each finished sample as a completion of its group.
    fn record(&mut self, finished: Vec<Finished>, weight_version: u64) -> Result<(), RoleError> {
        for done in finished {
            let Some(&index) = self.prompt_of.get(&done.request) else {
                return Err(RoleError::Protocol(
                    "the engine finished an unknown request".into(),
                ));
            };
            if let Some(slot) = self.groups[index].get_mut(done.sample) {
                *slot = Some(Completion {
                    token_ids: done.tokens,
                    logprobs: done.logprobs,
                    finish_reason: done.finish_reason,
                    weight_version,
                });
            }
        }
        Ok(())
    }

    /// The groups, once every sample of every group is complete.
    fn into_groups(self) -> Result<Vec<Vec<Completion>>, RoleError> {
        self.groups
            .into_iter()
            .map(|group| group.into_iter().collect::<Option<Vec<_>>>())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                RoleError::Protocol("the engine went idle with samples unfinished".into())
            })
    }
}

/// One request on the engine: the scheduler's steps run on the policy's model runner until
/// every sample is finished.
struct EngineRun<'a> {
    worker: &'a PythonWorker,
    policy: &'a Arc<PolicyPlugin>,
    scheduler: &'a mut Scheduler,
    sampling: &'a SamplingParams,
    /// The weights every completion is generated with.
    weight_version: u64,
    pending: PendingGroups,
    measured: CallMeasurements,
}

impl EngineRun<'_> {
    /// Steps the engine until the scheduler has nothing left to plan.
    async fn step_until_idle(&mut self) -> Result<(), RoleError> {
        let stop_tail = self
            .sampling
            .stop_strings
            .iter()
            .map(|s| s.chars().count())
            .max()
            .unwrap_or(0)
            + 4;
        while let Some(plan) = self.scheduler.plan() {
            let mut finished = self.step(plan).await?;
            if !self.sampling.stop_strings.is_empty() {
                finished.extend(self.finish_at_stop_strings(stop_tail).await?);
            }
            self.pending.record(finished, self.weight_version)?;
        }
        Ok(())
    }

    /// Runs `plan` on the model runner and applies its output: the samples it finished.
    async fn step(&mut self, plan: StepPlan) -> Result<Vec<Finished>, RoleError> {
        let runner = self.policy.clone();
        let span = tracing::info_span!(
            "engine.step",
            seqs = plan.num_seqs(),
            tokens = plan.num_tokens()
        );
        let (plan, result) = self
            .worker
            .run(move |py| {
                let mut plan = plan;
                let result = runner.engine_step(py, &mut plan);
                (plan, result)
            })
            .instrument(span)
            .await?;
        let (outcome, forward_seconds) = result?;
        self.measured.steps += 1;
        self.measured.forward_seconds += forward_seconds;
        self.scheduler
            .apply(&plan, &outcome)
            .map_err(|err| RoleError::Protocol(format!("the model runner's step output: {err}")))
    }

    /// Ends the sequences whose last `stop_tail` tokens decode to a text containing a stop
    /// string: the samples that finished.
    async fn finish_at_stop_strings(
        &mut self,
        stop_tail: usize,
    ) -> Result<Vec<Finished>, RoleError> {
        let checking = Instant::now();
        let mut finished = Vec::new();
        let tails = self.scheduler.running_tails(stop_tail);
        if !tails.is_empty() {
            let decoder = self.policy.clone();
            let sequences: Vec<Vec<u32>> = tails.iter().map(|(_, tail)| tail.clone()).collect();
            let texts = self
                .worker
                .run(move |py| {
                    let slices: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
                    decoder.decode(py, &slices)
                })
                .await??;
            for ((seq, _), text) in tails.iter().zip(texts) {
                if self
                    .sampling
                    .stop_strings
                    .iter()
                    .any(|stop| text.contains(stop.as_str()))
                {
                    finished.extend(self.scheduler.finish_early(*seq, FinishReason::Stop));
                }
            }
        }
        self.measured.stop_string_seconds += checking.elapsed().as_secs_f64();
        Ok(finished)
    }
}

/// The engine's measurements for one request, from the scheduler's counters before and after.
fn call_metrics(
    before: &EngineStats,
    after: &EngineStats,
    measured: &CallMeasurements,
    seconds: f64,
) -> BTreeMap<String, f64> {
    let mut metrics = BTreeMap::new();
    let mut put = |name: &str, value: f64| {
        metrics.insert(format!("engine/{name}"), value);
    };
    put_timings(&mut put, measured, seconds);
    put_scheduler_counts(&mut put, before, after);
    metrics
}

/// Where the request's time went: its steps, the forward passes, everything else.
fn put_timings(put: &mut impl FnMut(&str, f64), measured: &CallMeasurements, seconds: f64) {
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
    if measured.stop_string_seconds > 0.0 {
        put("stop_string_seconds", measured.stop_string_seconds);
    }
}

/// What the scheduler counted during the request: the KV cache's use, tokens and drafts.
fn put_scheduler_counts(
    put: &mut impl FnMut(&str, f64),
    before: &EngineStats,
    after: &EngineStats,
) {
    let steps = after.steps.saturating_sub(before.steps).max(1) as f64;
    let call_mean = |after_mean: f64, before_mean: f64| {
        (after_mean * after.steps as f64 - before_mean * before.steps as f64) / steps
    };
    let delta = |a: u64, b: u64| a.saturating_sub(b) as f64;
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
    put(
        "batch_tokens_mean",
        delta(after.query_tokens, before.query_tokens) / steps,
    );
    put(
        "generated_tokens",
        delta(after.generated_tokens, before.generated_tokens),
    );
    let drafted = delta(after.drafted_tokens, before.drafted_tokens);
    if drafted > 0.0 {
        let accepted = delta(after.accepted_tokens, before.accepted_tokens);
        put("drafted_tokens", drafted);
        put("accepted_tokens", accepted);
        put("acceptance_rate", accepted / drafted);
    }
}
