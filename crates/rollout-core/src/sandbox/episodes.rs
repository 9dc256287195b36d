//! Environments in the sandbox: episodes played in a pool of worker processes.
//!
//! An episode is stateful, so each one is pinned, when it starts, to one process (round
//! robin over the pool in start order, so the same episodes land alike run after run) and
//! every call of it goes there. A process serves one call at a time; the pool's processes
//! work in parallel. Each call (`reset`, `step`) has `timeout_seconds` of wall clock.
//!
//! A call that raises or answers nonsense fails its episode and the process goes on. One
//! that hangs, crashes or runs out of memory fails its episode and the process is killed;
//! the other episodes whose state it held are lost with it and fail at their next call
//! (`restarted`; they are not played again: an environment need not be replayable). A
//! fresh process takes the slot when the next episode starts.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use rollout_net::messages::{FailureReason, ScoreFailure};

use super::SandboxError;
use super::limits::{FailureCounts, FailureLedger, check_limits, describe, reason_counts};
use super::protocol::{Answer, EnvironmentSpec, Request};
use super::worker::{CallFailure, Launch, SandboxWorker, unexpected};
use crate::config::SandboxConfig;
use crate::roles::{EpisodeFailure, EpisodeResult, EpisodeStart, StepResult};

/// What an environment pool needs: how to start a worker, the environment it hosts, the
/// seed of its global generators, the limits and the run's failure counts.
#[derive(Debug, Clone)]
pub struct EnvironmentPoolSpec {
    pub launch: Launch,
    pub environment: EnvironmentSpec,
    pub seed: u64,
    pub config: SandboxConfig,
    pub ledger: Arc<FailureLedger>,
}

struct Slot {
    /// `None` after the worker was killed, until the next episode starts here.
    worker: Option<SandboxWorker>,
    /// Bumped whenever the worker is killed: episodes pinned to an earlier incarnation
    /// lost their state.
    incarnation: u64,
    /// Why the worker was last killed, for the episodes that lost their state.
    killed_because: String,
}

/// Where a live episode's state is, and how it failed if it did.
struct Pin {
    slot: usize,
    incarnation: u64,
    failure: Option<EpisodeFailure>,
}

/// A call's result, with where it ran.
struct Done<T> {
    index: usize,
    episode: u64,
    /// The slot's incarnation after the call (a new episode's pin).
    incarnation: u64,
    result: EpisodeResult<T>,
}

/// One call of one episode; `pinned` is `None` for a `reset` (pinned by the call).
struct Call {
    episode: u64,
    hook: &'static str,
    pinned: Option<u64>,
}

pub struct EnvironmentPool {
    spec: EnvironmentPoolSpec,
    init: String,
    slots: Vec<tokio::sync::Mutex<Slot>>,
    episodes: Mutex<HashMap<u64, Pin>>,
}

impl EnvironmentPool {
    /// Starts every worker; an environment that fails to load fails here.
    pub async fn start(spec: EnvironmentPoolSpec) -> Result<Self, SandboxError> {
        let init = serde_json::to_string(&Request::Init {
            rewards: &[],
            environment: Some(&spec.environment),
            seed: Some(spec.seed),
            memory_mb: spec.config.memory_mb,
            cpu_seconds: spec.config.cpu_seconds,
        })
        .map_err(|err| SandboxError::Protocol(err.to_string()))?;
        let processes = spec.config.processes.max(1);
        let timeout = Duration::from_secs_f64(spec.config.start_timeout_seconds);
        let started =
            join_all((0..processes).map(|_| SandboxWorker::start(&spec.launch, &init, timeout)))
                .await;
        let slots = started
            .into_iter()
            .map(|worker| {
                worker.map(|worker| {
                    tokio::sync::Mutex::new(Slot {
                        worker: Some(worker),
                        incarnation: 0,
                        killed_because: String::new(),
                    })
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        tracing::info!(
            "environment sandbox: {processes} worker processes ({})",
            spec.launch.program.display()
        );
        Ok(EnvironmentPool {
            spec,
            init,
            slots,
            episodes: Mutex::new(HashMap::new()),
        })
    }

    /// Starts episodes `first_id + i` and returns their first prompts (or failures).
    pub async fn start_episodes(
        &self,
        first_id: u64,
        starts: &[EpisodeStart],
    ) -> Result<Vec<EpisodeResult<String>>, SandboxError> {
        let mut lanes: Vec<Vec<usize>> = vec![Vec::new(); self.slots.len()];
        for index in 0..starts.len() {
            lanes[index % self.slots.len()].push(index);
        }
        let lanes = join_all(lanes.into_iter().enumerate().map(|(slot, indices)| {
            self.lane(slot, indices, |index| {
                let start = &starts[index];
                let episode = first_id.wrapping_add(index as u64);
                let call = Call {
                    episode,
                    hook: "reset",
                    pinned: None,
                };
                let request = move |id| Request::Reset {
                    id,
                    episode,
                    record: &start.record,
                    seed: start.seed,
                };
                (call, request, accept_prompt)
            })
        }))
        .await;
        self.gather(starts.len(), lanes)
    }

    /// Plays one turn of each `(episode, action)`, in order.
    pub async fn step(
        &self,
        actions: &[(u64, String)],
    ) -> Result<Vec<EpisodeResult<StepResult>>, SandboxError> {
        let mut lanes: Vec<Vec<usize>> = vec![Vec::new(); self.slots.len()];
        let mut pins = Vec::with_capacity(actions.len());
        {
            let live = self.table();
            for (index, (episode, _)) in actions.iter().enumerate() {
                let pin = live.get(episode).ok_or_else(|| {
                    SandboxError::Protocol(format!("episode {episode} is not running"))
                })?;
                lanes[pin.slot].push(index);
                pins.push(pin.incarnation);
            }
        }
        let lanes = join_all(lanes.into_iter().enumerate().map(|(slot, indices)| {
            self.lane(slot, indices, |index| {
                let (episode, action) = &actions[index];
                let episode = *episode;
                let call = Call {
                    episode,
                    hook: "step",
                    pinned: Some(pins[index]),
                };
                let request = move |id| Request::Step {
                    id,
                    episode,
                    action,
                };
                (call, request, accept_step)
            })
        }))
        .await;
        self.gather(actions.len(), lanes)
    }

    /// Releases `ids` (their instances are dropped in their processes), counts them and
    /// their failures in the run's ledger and holds the run's failed fraction to its limit.
    pub async fn finish(&self, ids: &[u64]) -> Result<(), SandboxError> {
        let mut failed = Vec::new();
        let mut by_slot: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.slots.len()];
        let mut total = 0;
        {
            let mut live = self.table();
            for (index, id) in ids.iter().enumerate() {
                let Some(pin) = live.remove(id) else { continue };
                total += 1;
                match pin.failure {
                    Some(failure) => failed.push(score_failure(index, failure)),
                    None => by_slot[pin.slot].push((*id, pin.incarnation)),
                }
            }
        }
        join_all(
            by_slot
                .into_iter()
                .enumerate()
                .filter(|(_, episodes)| !episodes.is_empty())
                .map(|(slot, episodes)| self.release(slot, episodes)),
        )
        .await;
        let counts = FailureCounts {
            total,
            failed: failed.len() as u64,
        };
        if let Some(first) = failed.first() {
            tracing::warn!(
                "environments failed on {} of {} episodes ({}); first: {}",
                counts.failed,
                counts.total,
                reason_counts(&failed),
                describe(first)
            );
        }
        let run = self.spec.ledger.add_episodes(counts);
        check_limits(&self.spec.config, None, Some(run), &failed)
    }

    /// Runs the calls `make` builds for `indices`, in order, on `slot`'s worker.
    async fn lane<'r, T, R, A>(
        &self,
        slot: usize,
        indices: Vec<usize>,
        make: impl Fn(usize) -> (Call, R, A),
    ) -> Result<Vec<Done<T>>, SandboxError>
    where
        R: FnOnce(u64) -> Request<'r>,
        A: FnOnce(Answer) -> Result<T, Answer>,
    {
        let mut done = Vec::with_capacity(indices.len());
        if indices.is_empty() {
            return Ok(done);
        }
        let mut state = self.slots[slot].lock().await;
        for index in indices {
            let (call, request, accept) = make(index);
            let episode = call.episode;
            let result = self.call_in(&mut state, call, request, accept).await?;
            // A new episode is pinned to the worker that ran its `reset` (a failed one
            // is never called again).
            done.push(Done {
                index,
                episode,
                incarnation: state.incarnation,
                result,
            });
        }
        Ok(done)
    }

    /// One call on a slot's worker. A `reset` starts the worker if the slot has none; a
    /// call of an episode whose worker was killed since it started fails as `restarted`.
    async fn call_in<'r, T>(
        &self,
        slot: &mut Slot,
        call: Call,
        request: impl FnOnce(u64) -> Request<'r>,
        accept: impl FnOnce(Answer) -> Result<T, Answer>,
    ) -> Result<EpisodeResult<T>, SandboxError> {
        let hook = call.hook;
        if let Some(pinned) = call.pinned {
            if pinned != slot.incarnation || slot.worker.is_none() {
                return Ok(Err(restarted(hook, &slot.killed_because)));
            }
        }
        let worker = match &mut slot.worker {
            Some(worker) => worker,
            None => {
                let timeout = Duration::from_secs_f64(self.spec.config.start_timeout_seconds);
                tracing::info!("environment sandbox: starting a fresh worker process");
                slot.worker
                    .insert(SandboxWorker::start(&self.spec.launch, &self.init, timeout).await?)
            }
        };
        let timeout = Duration::from_secs_f64(self.spec.config.timeout_seconds);
        let answer = worker.call(request, timeout).await;
        let failure = match answer.map(accept) {
            Ok(Ok(value)) => return Ok(Ok(value)),
            Ok(Err(other)) => unexpected(&other),
            Err(failure) => failure,
        };
        let CallFailure { failure, replace } = failure;
        if replace {
            if let Some(worker) = slot.worker.take() {
                worker.kill().await;
            }
            slot.incarnation += 1;
            slot.killed_because = format!(
                "episode {}'s `{hook}` failed in it ({}: {})",
                call.episode,
                failure.reason.as_str(),
                failure.message
            );
        }
        Ok(Err(EpisodeFailure {
            hook,
            reason: failure.reason,
            message: failure.message,
            traceback: failure.traceback,
        }))
    }

    /// Puts the lanes' results back in call order and records the episodes' pins and
    /// failures.
    fn gather<T>(
        &self,
        count: usize,
        lanes: Vec<Result<Vec<Done<T>>, SandboxError>>,
    ) -> Result<Vec<EpisodeResult<T>>, SandboxError> {
        let mut results: Vec<Option<EpisodeResult<T>>> = (0..count).map(|_| None).collect();
        let mut live = self.table();
        for (slot, lane) in lanes.into_iter().enumerate() {
            for Done {
                index,
                episode,
                incarnation,
                result,
            } in lane?
            {
                let pin = live.entry(episode).or_insert(Pin {
                    slot,
                    incarnation,
                    failure: None,
                });
                if let Err(failure) = &result {
                    pin.failure = Some(failure.clone());
                }
                results[index] = Some(result);
            }
        }
        results
            .into_iter()
            .map(|result| {
                result.ok_or_else(|| SandboxError::Protocol("an episode was left out".into()))
            })
            .collect()
    }

    /// Drops finished episodes' instances in their worker (if it still holds them).
    async fn release(&self, slot: usize, episodes: Vec<(u64, u64)>) {
        let mut state = self.slots[slot].lock().await;
        let ids: Vec<u64> = episodes
            .iter()
            .filter(|(_, incarnation)| *incarnation == state.incarnation)
            .map(|(id, _)| *id)
            .collect();
        let Some(worker) = state.worker.as_mut().filter(|_| !ids.is_empty()) else {
            return;
        };
        let timeout = Duration::from_secs_f64(self.spec.config.timeout_seconds);
        let answer = worker
            .call(|id| Request::Finish { id, episodes: &ids }, timeout)
            .await;
        if let Err(CallFailure { failure, replace }) = answer {
            tracing::warn!(
                "environment sandbox: releasing finished episodes failed: {}",
                failure.message
            );
            if replace {
                if let Some(worker) = state.worker.take() {
                    worker.kill().await;
                }
                state.incarnation += 1;
                state.killed_because = format!("releasing episodes failed: {}", failure.message);
            }
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Pin>> {
        // The table is only ever read and written whole-entry; a poisoned lock is still valid.
        self.episodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn accept_prompt(answer: Answer) -> Result<String, Answer> {
    match answer {
        Answer::Started { prompt, .. } => Ok(prompt),
        other => Err(other),
    }
}

fn accept_step(answer: Answer) -> Result<StepResult, Answer> {
    match answer {
        Answer::Stepped {
            observation,
            reward,
            done,
            ..
        } if reward.is_finite() => Ok(StepResult {
            observation,
            reward,
            done,
        }),
        other => Err(other),
    }
}

fn restarted(hook: &'static str, because: &str) -> EpisodeFailure {
    EpisodeFailure {
        hook,
        reason: FailureReason::Restarted,
        message: format!(
            "the sandbox process holding this episode was restarted: {because}; \
             the episode's state was lost with it"
        ),
        traceback: None,
    }
}

/// An episode failure as its sample's `failed` entry (`index`: the sample's in the step).
pub fn score_failure(index: usize, failure: EpisodeFailure) -> ScoreFailure {
    ScoreFailure {
        index,
        reason: failure.reason,
        message: failure.message,
        reward: None,
        environment: Some(failure.hook.to_owned()),
        traceback: failure.traceback,
    }
}

#[cfg(test)]
#[path = "episodes_tests.rs"]
mod tests;
