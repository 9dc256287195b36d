//! The steps of a run, by kind: what differs between an RL run of one policy, an SFT or DPO
//! run and a multi-agent run is how the next step is made; [`StepDone`] is what each hands
//! back to the controller's one loop.

use std::collections::BTreeMap;
use std::time::Instant;

use serde_json::Value;
use tracing::Instrument;

use super::offline::OfflineData;
use super::pipeline::{Pipeline, StepSamples};
use super::requeue::{RequeueQueue, Requeued};
use super::{Controller, DataCursor, DataPosition, Kind, RunError, Sampler, Team, team};
use crate::metrics::StepMetrics;
use crate::roles::StepGroups;
use crate::seeds::mix;

/// A step trained: its metrics line, where the data cursor stands after it and the records
/// requeued for later steps, the samples to log and its span (`--trace`).
pub(super) struct StepDone {
    pub metrics: StepMetrics,
    pub position: DataPosition,
    pub requeued: Vec<Requeued>,
    pub samples: Vec<Value>,
    pub span: tracing::Span,
}

/// The state a run's steps carry from one to the next.
pub(super) enum Steps<'a> {
    Rl(Box<RlSteps<'a>>),
    Offline(OfflineSteps<'a>),
    Team(&'a Team<'a>, DataCursor),
}

/// RL steps: later steps are sampled while earlier ones train, within `max_staleness`.
pub(super) struct RlSteps<'a> {
    sampler: Sampler<'a>,
    cursor: DataCursor,
    /// Dropped groups' records, drawn again before the cursor's.
    requeue: RequeueQueue,
    pipeline: Pipeline<'a>,
    /// Where the data cursor stood after each started step's prompts were drawn.
    positions: BTreeMap<u64, DataPosition>,
    next_step: u64,
    last_step_end: Instant,
}

/// SFT or DPO steps on the data's own completions.
pub(super) struct OfflineSteps<'a> {
    sampler: Sampler<'a>,
    data: OfflineData,
    cursor: DataCursor,
}

impl RlSteps<'_> {
    /// Requeues the records of the groups `step` dropped (to be drawn from step `ready_at`
    /// on), settles what `step` drew, and counts both in `metrics`. Returns what the
    /// checkpoint of `step` saves.
    fn settle_requeue(
        &mut self,
        step: u64,
        groups: &StepGroups,
        ready_at: u64,
        metrics: &mut StepMetrics,
    ) -> Vec<Requeued> {
        let requeued = self.requeue.requeue_dropped(step, groups, ready_at);
        self.requeue.settled(step);
        let measured = [
            ("groups_requeued", requeued),
            ("groups_redrawn", groups.redrawn.len()),
            ("requeue_waiting", self.requeue.waiting()),
        ];
        for (name, count) in measured {
            metrics.measured.insert(name.to_owned(), count as f64);
        }
        self.requeue.saved(step)
    }
}

impl Steps<'_> {
    /// Waits for what the steps left running (weight loads of RL steps).
    pub async fn finish(self) -> Result<(), RunError> {
        match self {
            Steps::Rl(mut rl) => Ok(rl.pipeline.finish_loading().await?),
            Steps::Offline(_) | Steps::Team(..) => Ok(()),
        }
    }
}

impl<'a> Controller<'a> {
    /// The run's steps from where it stands. An RL run first finishes its supervised warm
    /// start (`[sft]`, checkpointed) and brings the generators to the current weights.
    pub(super) async fn steps(&mut self, resumed: bool) -> Result<Steps<'a>, RunError> {
        let cursor = DataCursor::new(
            self.records.len(),
            mix(self.config.run.seed, 1),
            self.config.data.shuffle,
            self.state.data,
        );
        let sampler = match &self.kind {
            Kind::Team(team) => return Ok(Steps::Team(team, cursor)),
            Kind::Policy(sampler) => sampler.clone(),
        };
        if !self.config.algorithm.name.samples() {
            let data = self.offline_data(&sampler).await?;
            return Ok(Steps::Offline(OfflineSteps {
                sampler,
                data,
                cursor,
            }));
        }
        if let Some(sft) = &self.config.sft {
            if self.state.sft_step < sft.steps {
                self.supervised_warm_start(&sampler, sft, resumed).await?;
                // A run of SFT alone is checkpointed at its end, like any other.
                if self.config.run.steps > 0 && !self.stopping() {
                    self.checkpoint().await?;
                }
            }
        }
        self.sync_generators_now(&sampler).await?;
        Ok(Steps::Rl(Box::new(RlSteps {
            requeue: RequeueQueue::new(&self.state.requeued, self.records.len()),
            sampler,
            cursor,
            pipeline: Pipeline::default(),
            positions: BTreeMap::new(),
            next_step: self.state.step + 1,
            last_step_end: Instant::now(),
        })))
    }

    /// Makes the run's next step; `None` when there is none left to make.
    pub(super) async fn next_step(
        &mut self,
        steps: &mut Steps<'a>,
    ) -> Result<Option<StepDone>, RunError> {
        match steps {
            Steps::Rl(rl) => self.next_rl_step(rl).await,
            Steps::Offline(offline) => {
                let step = self.state.step + 1;
                let span = tracing::info_span!("step", step);
                let (metrics, position) = self
                    .offline_step(&offline.sampler, &offline.data, &mut offline.cursor, step)
                    .instrument(span.clone())
                    .await?;
                Ok(Some(StepDone {
                    metrics,
                    position,
                    requeued: Vec::new(),
                    samples: Vec::new(),
                    span,
                }))
            }
            Steps::Team(team, cursor) => {
                let step = self.state.step + 1;
                let picked = cursor.take(self.config.rollout.prompts_per_step);
                let position = cursor.position();
                let span = tracing::info_span!(parent: None, "step", step);
                let records: Vec<Value> = picked
                    .iter()
                    .map(|&i| self.records[i].fields.clone())
                    .collect();
                let (metrics, samples) = team::step(
                    self.config,
                    team,
                    step,
                    position.epoch,
                    &records,
                    self.state.weight_version,
                )
                .instrument(span.clone())
                .await?;
                Ok(Some(StepDone {
                    metrics,
                    position,
                    requeued: Vec::new(),
                    samples,
                    span,
                }))
            }
        }
    }

    /// Starts sampling every step the staleness bound admits, then trains the oldest.
    async fn next_rl_step(&mut self, rl: &mut RlSteps<'a>) -> Result<Option<StepDone>, RunError> {
        while rl.next_step <= self.config.run.steps
            && rl.next_step <= self.state.step + 1 + self.max_staleness()
        {
            self.start_sampling(rl);
        }
        let Some(sampled) = rl.pipeline.next_samples().await? else {
            return Ok(None);
        };
        let step = sampled.step;
        let span = sampled.span.clone();
        let (mut metrics, samples, groups) = self
            .rl_step(&rl.sampler, sampled, &mut rl.pipeline, rl.last_step_end)
            .instrument(span.clone())
            .await?;
        rl.last_step_end = Instant::now();
        let pool = rl
            .sampler
            .roles
            .generator
            .step_trained(step, &groups)
            .instrument(span.clone())
            .await?;
        metrics.measured.extend(pool);
        // The first step to draw after this update's.
        let ready_at = step + 1 + self.max_staleness();
        let requeued = rl.settle_requeue(step, &groups, ready_at, &mut metrics);
        Ok(Some(StepDone {
            metrics,
            position: rl.positions.remove(&step).unwrap_or(self.state.data),
            requeued,
            samples,
            span,
        }))
    }

    /// Draws the records of step `rl.next_step` and starts sampling them.
    fn start_sampling(&self, rl: &mut RlSteps<'a>) {
        let step = rl.next_step;
        let drawn = self.prompts_drawn_per_step();
        // Dropped groups' records first, then fresh ones.
        let requeued = rl
            .requeue
            .draw(step, self.config.rollout.prompts_per_step.min(drawn));
        let mut records: Vec<usize> = requeued.iter().map(|entry| entry.record).collect();
        records.extend(rl.cursor.take(drawn - records.len()));
        let redrawn = requeued.iter().map(|entry| entry.from).collect();
        let position = rl.cursor.position();
        rl.positions.insert(step, position);
        let seed = mix(self.config.run.seed, 1000 + step);
        let sampler = rl.sampler.clone();
        // A step's span runs from the start of its sampling (with staleness, while earlier
        // steps train) to the end of its update.
        let span = tracing::info_span!(parent: None, "step", step);
        let sampling = tracing::info_span!(parent: &span, "sample", step);
        rl.pipeline.start(async move {
            let collected = sampler
                .collect(step, &records, seed)
                .instrument(sampling)
                .await;
            let records = collected.as_ref().map_or(records, |c| c.records.clone());
            StepSamples {
                step,
                epoch: position.epoch,
                records,
                redrawn,
                collected,
                span,
            }
        });
        rl.next_step += 1;
    }

    /// Records drawn for each step: its prompts and, with dynamic sampling, a reserve of
    /// `prompts_per_step` per refill round, drawn whether used or not so that the data
    /// order never depends on rewards (a resumed run draws exactly the same).
    fn prompts_drawn_per_step(&self) -> usize {
        let rounds = self.config.algorithm.dynamic_sampling_rounds as usize;
        self.config.rollout.prompts_per_step * (1 + rounds)
    }
}
