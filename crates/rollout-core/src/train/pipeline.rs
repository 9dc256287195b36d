//! Asynchronous RL with bounded staleness: the steps whose samples are being generated
//! while the controller trains, and the weight versions being loaded by the generators.
//!
//! Admission control keeps every trained sample within `max_staleness` policy versions of
//! the weights it is trained into: step `k` is sampled only once the update of step
//! `k - 1 - max_staleness` has been trained and its weights sent to the generators, which
//! serve requests in the order they receive them. Nothing sampled is ever thrown away.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;

use futures_util::StreamExt;
use futures_util::stream::{FuturesOrdered, FuturesUnordered};
use rollout_net::messages::WeightsReport;

use super::RunError;
use super::sampler::Collected;
use crate::roles::RoleError;

/// A step's prompts (record indices) and what sampling them produced.
pub(super) struct StepSamples {
    pub step: u64,
    /// The data epoch the step's prompts were drawn in.
    pub epoch: u64,
    pub records: Vec<usize>,
    /// For the step's first groups: the group whose requeued record each carries.
    pub redrawn: Vec<rollout_net::messages::GroupRef>,
    pub collected: Result<Collected, RunError>,
    /// The step's span (`--trace`): from the start of its sampling to the end of its update.
    pub span: tracing::Span,
}

type Sampling<'s> = Pin<Box<dyn Future<Output = StepSamples> + Send + 's>>;
type Loading<'s> = Pin<Box<dyn Future<Output = Result<Vec<WeightsReport>, RoleError>> + Send + 's>>;

#[derive(Default)]
pub(super) struct Pipeline<'s> {
    sampling: FuturesOrdered<Sampling<'s>>,
    sampled: VecDeque<StepSamples>,
    loading: FuturesUnordered<Loading<'s>>,
    /// What the generators reported serving after the newest load.
    pub served: Vec<WeightsReport>,
    failed: Option<RoleError>,
}

impl<'s> Pipeline<'s> {
    pub fn start(&mut self, sampling: impl Future<Output = StepSamples> + Send + 's) {
        self.sampling.push_back(Box::pin(sampling));
    }

    pub fn load(
        &mut self,
        loading: impl Future<Output = Result<Vec<WeightsReport>, RoleError>> + Send + 's,
    ) {
        self.loading.push(Box::pin(loading));
    }

    /// Runs `work` while sampling and weight loading go on.
    pub async fn while_running<T>(
        &mut self,
        work: impl Future<Output = T>,
    ) -> Result<T, RoleError> {
        let mut work = std::pin::pin!(work);
        loop {
            if let Some(err) = self.failed.take() {
                return Err(err);
            }
            tokio::select! {
                output = &mut work => return Ok(output),
                Some(samples) = self.sampling.next(), if !self.sampling.is_empty() => {
                    self.sampled.push_back(samples);
                }
                Some(loaded) = self.loading.next(), if !self.loading.is_empty() => {
                    self.loaded(loaded);
                }
            }
        }
    }

    fn loaded(&mut self, loaded: Result<Vec<WeightsReport>, RoleError>) {
        match loaded {
            Ok(reports) => self.served = reports,
            Err(err) => {
                self.failed.get_or_insert(err);
            }
        }
    }

    /// The oldest step's samples, once sampled.
    pub async fn next_samples(&mut self) -> Result<Option<StepSamples>, RoleError> {
        if let Some(samples) = self.sampled.pop_front() {
            return Ok(Some(samples));
        }
        if self.sampling.is_empty() {
            return Ok(None);
        }
        loop {
            if let Some(err) = self.failed.take() {
                return Err(err);
            }
            tokio::select! {
                samples = self.sampling.next() => return Ok(samples),
                Some(loaded) = self.loading.next(), if !self.loading.is_empty() => {
                    self.loaded(loaded);
                }
            }
        }
    }

    /// Waits for every weight load sent so far, while sampling goes on.
    pub async fn finish_loading(&mut self) -> Result<(), RoleError> {
        while !self.loading.is_empty() {
            tokio::select! {
                Some(loaded) = self.loading.next() => self.loaded(loaded),
                Some(samples) = self.sampling.next(), if !self.sampling.is_empty() => {
                    self.sampled.push_back(samples);
                }
            }
        }
        match self.failed.take() {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }
}
