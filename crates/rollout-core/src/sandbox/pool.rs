//! The pool: `processes` workers score a request's samples concurrently, one sample per
//! call; failed samples are collected, broken workers replaced, and the failure fractions
//! checked against the limits.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use rollout_net::messages::{
    FailureReason, RewardComponent, ScoreFailure, ScoreRequest, ScoreResponse, ScoreSample,
};

use super::SandboxError;
use super::limits::{FailureCounts, FailureLedger, check_limits, describe, reason_counts};
use super::protocol::{Request, RewardSpec};
use super::worker::{Launch, Outcome, SampleFailure, SandboxWorker};
use crate::config::SandboxConfig;

/// What a pool needs: how to start a worker, the rewards it loads and the limits.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    pub launch: Launch,
    pub rewards: Vec<RewardSpec>,
    /// Metric name and weight of each reward, in `rewards` order.
    pub names: Vec<String>,
    pub weights: Vec<f64>,
    pub config: SandboxConfig,
    /// The run's failure counts, shared with the environment pool.
    pub ledger: Arc<FailureLedger>,
}

struct PoolState {
    /// A slot is empty after its worker was killed; it is refilled when next needed.
    slots: Vec<Option<SandboxWorker>>,
}

pub struct SandboxPool {
    spec: PoolSpec,
    init: String,
    state: tokio::sync::Mutex<PoolState>,
}

impl SandboxPool {
    /// Starts every worker; a reward that fails to load fails here.
    pub async fn start(spec: PoolSpec) -> Result<Self, SandboxError> {
        let init = serde_json::to_string(&Request::Init {
            rewards: &spec.rewards,
            environment: None,
            seed: None,
            memory_mb: spec.config.memory_mb,
            cpu_seconds: spec.config.cpu_seconds,
        })
        .map_err(|err| SandboxError::Protocol(err.to_string()))?;
        let pool = SandboxPool {
            state: tokio::sync::Mutex::new(PoolState { slots: Vec::new() }),
            spec,
            init,
        };
        let started = join_all((0..pool.spec.config.processes.max(1)).map(|_| pool.spawn())).await;
        let slots = started
            .into_iter()
            .map(|worker| worker.map(Some))
            .collect::<Result<Vec<_>, _>>()?;
        pool.state.lock().await.slots = slots;
        tracing::info!(
            "reward sandbox: {} worker processes ({})",
            pool.spec.config.processes.max(1),
            pool.spec.launch.program.display()
        );
        Ok(pool)
    }

    /// The rewards' metric names.
    pub fn names(&self) -> &[String] {
        &self.spec.names
    }

    async fn spawn(&self) -> Result<SandboxWorker, SandboxError> {
        let timeout = Duration::from_secs_f64(self.spec.config.start_timeout_seconds);
        SandboxWorker::start(&self.spec.launch, &self.init, timeout).await
    }

    /// Scores every sample with every reward. Failed samples are listed in `failed` with
    /// total 0; the call fails only when failures pass the configured fractions.
    pub async fn score(&self, request: &ScoreRequest) -> Result<ScoreResponse, SandboxError> {
        let mut state = self.state.lock().await;
        let outcomes = self.run_lanes(&mut state.slots, &request.samples).await?;
        let response = self.combine(outcomes);
        let counts = FailureCounts {
            total: request.samples.len() as u64,
            failed: response.failed.len() as u64,
        };
        drop(state);
        let run = self.spec.ledger.add_scored(counts);
        if !response.failed.is_empty() {
            tracing::warn!(
                "rewards failed on {} of {} samples ({}); first: {}",
                counts.failed,
                counts.total,
                reason_counts(&response.failed),
                describe(&response.failed[0])
            );
        }
        check_limits(&self.spec.config, Some(counts), Some(run), &response.failed)?;
        Ok(response)
    }

    /// Each worker takes the next unscored sample until none is left.
    async fn run_lanes(
        &self,
        slots: &mut [Option<SandboxWorker>],
        samples: &[ScoreSample],
    ) -> Result<Vec<Outcome>, SandboxError> {
        let next = AtomicUsize::new(0);
        let lanes = join_all(slots.iter_mut().map(|slot| self.lane(slot, samples, &next))).await;
        let mut outcomes: Vec<Option<Outcome>> = vec![None; samples.len()];
        for lane in lanes {
            for (index, outcome) in lane? {
                outcomes[index] = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .map(|outcome| {
                outcome.ok_or_else(|| SandboxError::Protocol("a sample was left unscored".into()))
            })
            .collect()
    }

    async fn lane(
        &self,
        slot: &mut Option<SandboxWorker>,
        samples: &[ScoreSample],
        next: &AtomicUsize,
    ) -> Result<Vec<(usize, Outcome)>, SandboxError> {
        let timeout = Duration::from_secs_f64(self.spec.config.timeout_seconds);
        let mut done = Vec::new();
        loop {
            let index = next.fetch_add(1, Ordering::Relaxed);
            let Some(sample) = samples.get(index) else {
                return Ok(done);
            };
            let worker = match slot {
                Some(worker) => worker,
                None => slot.insert(self.spawn().await?),
            };
            let outcome = worker.score(sample, timeout).await;
            if matches!(outcome, Outcome::Failed { replace: true, .. }) {
                if let Some(worker) = slot.take() {
                    worker.kill().await;
                }
            }
            done.push((index, outcome));
        }
    }

    /// Weighted totals and per-reward scores; failed samples score 0 everywhere.
    fn combine(&self, outcomes: Vec<Outcome>) -> ScoreResponse {
        let rewards = self.spec.names.len();
        let mut totals = vec![0.0; outcomes.len()];
        let mut scores = vec![vec![0.0; outcomes.len()]; rewards];
        let mut failed = Vec::new();
        for (index, outcome) in outcomes.into_iter().enumerate() {
            match self.validated(outcome) {
                Ok(sample_scores) => {
                    for (reward, score) in sample_scores.into_iter().enumerate() {
                        scores[reward][index] = score;
                        totals[index] += self.spec.weights[reward] * score;
                    }
                }
                Err(failure) => failed.push(ScoreFailure {
                    index,
                    reason: failure.reason,
                    message: failure.message,
                    reward: failure.reward.and_then(|r| self.spec.names.get(r).cloned()),
                    environment: None,
                    traceback: failure.traceback,
                }),
            }
        }
        let components = scores
            .into_iter()
            .zip(self.spec.names.iter().zip(&self.spec.weights))
            .map(|(scores, (name, &weight))| RewardComponent {
                name: name.clone(),
                weight,
                scores,
            })
            .collect();
        ScoreResponse {
            totals,
            components,
            failed,
        }
    }

    fn validated(&self, outcome: Outcome) -> Result<Vec<f64>, SampleFailure> {
        match outcome {
            Outcome::Failed { failure, .. } => Err(failure),
            Outcome::Scored(scores) if scores.len() != self.spec.names.len() => {
                Err(SampleFailure {
                    reason: FailureReason::Invalid,
                    message: format!(
                        "the worker returned {} scores for {} rewards",
                        scores.len(),
                        self.spec.names.len()
                    ),
                    reward: None,
                    traceback: None,
                })
            }
            Outcome::Scored(scores) => match scores.iter().position(|s| !s.is_finite()) {
                Some(reward) => Err(SampleFailure {
                    reason: FailureReason::Invalid,
                    message: format!("returned {}; rewards must be finite", scores[reward]),
                    reward: Some(reward),
                    traceback: None,
                }),
                None => Ok(scores),
            },
        }
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
