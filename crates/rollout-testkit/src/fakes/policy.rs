//! A policy without a model: its tokenizer and its generator.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rollout_core::roles::{Generator, Publication, RoleFuture, Tokenizer};
use rollout_net::messages::{
    Completion, FinishReason, GenerateRequest, GenerateResponse, WeightsReport,
};

use super::lock;

/// One character per token id (`0` is end-of-sequence). Every completion is two tokens,
/// `'a' + sample` then `'b'`, each with logprob -0.5, tagged with the weight version it was
/// generated with: the learner's own (shared, as in one process) or the version last loaded
/// (held apart, as on a generation worker).
pub struct FakePolicy {
    weights: Weights,
    /// Per generated group: the step it belongs to and the weight version that generated it.
    generated: Mutex<Vec<(u64, u64)>>,
    /// Once: the step whose first generation request answers with weights this many
    /// versions older (a worker that rejoined on old weights).
    lag: Mutex<Option<(u64, u64)>>,
}

enum Weights {
    Shared(Arc<AtomicU64>),
    Held(AtomicU64),
}

impl FakePolicy {
    /// Generates with `version`, the learner's weights (`FakeLearner::version`).
    pub fn sharing(version: Arc<AtomicU64>) -> Self {
        FakePolicy {
            weights: Weights::Shared(version),
            generated: Mutex::default(),
            lag: Mutex::default(),
        }
    }

    /// Generates with the weights last loaded (version 0 before any).
    pub fn holding_weights() -> Self {
        FakePolicy {
            weights: Weights::Held(AtomicU64::new(0)),
            generated: Mutex::default(),
            lag: Mutex::default(),
        }
    }

    /// Answers the first generation request of `step` with weights `behind` versions
    /// older than it holds.
    pub fn lagging_once(self, step: u64, behind: u64) -> Self {
        *lock(&self.lag) = Some((step, behind));
        self
    }

    fn version(&self) -> u64 {
        match &self.weights {
            Weights::Shared(version) => version.load(Ordering::SeqCst),
            Weights::Held(version) => version.load(Ordering::SeqCst),
        }
    }

    /// `(step, weight version)` of every group generated, in order.
    pub fn generated(&self) -> Vec<(u64, u64)> {
        lock(&self.generated).clone()
    }
}

impl Tokenizer for FakePolicy {
    fn encode(&self, texts: Vec<String>, _: bool) -> RoleFuture<'_, Vec<Vec<u32>>> {
        let ids = texts
            .iter()
            .map(|text| text.chars().map(u32::from).collect())
            .collect();
        Box::pin(async move { Ok(ids) })
    }

    fn decode(&self, sequences: Vec<Vec<u32>>) -> RoleFuture<'_, Vec<String>> {
        let texts = sequences
            .iter()
            .map(|ids| ids.iter().filter_map(|&id| char::from_u32(id)).collect())
            .collect();
        Box::pin(async move { Ok(texts) })
    }

    fn eos_token_ids(&self) -> RoleFuture<'_, Vec<u32>> {
        Box::pin(async { Ok(vec![0]) })
    }
}

impl Generator for FakePolicy {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let mut version = self.version();
        let step = request
            .prompts
            .first()
            .and_then(|p| p.group)
            .map(|g| g.step);
        let mut lag = lock(&self.lag);
        if let Some((lagging, behind)) = *lag
            && step == Some(lagging)
        {
            version = version.saturating_sub(behind);
            *lag = None;
        }
        drop(lag);
        lock(&self.generated).extend(
            request
                .prompts
                .iter()
                .map(|prompt| (prompt.group.map_or(0, |g| g.step), version)),
        );
        let groups = request
            .prompts
            .iter()
            .map(|prompt| {
                (0..prompt.n)
                    .map(|sample| Completion {
                        token_ids: vec![u32::from('a') + sample, u32::from('b')],
                        logprobs: vec![-0.5, -0.5],
                        finish_reason: FinishReason::Stop,
                        weight_version: version,
                    })
                    .collect()
            })
            .collect();
        Box::pin(async move {
            Ok(GenerateResponse {
                groups,
                metrics: BTreeMap::from([("engine/steps".to_owned(), 2.0)]),
                producers: Vec::new(),
            })
        })
    }

    fn load_weights(&self, weights: Publication) -> RoleFuture<'_, Vec<WeightsReport>> {
        if let Weights::Held(version) = &self.weights {
            version.store(weights.announced.version, Ordering::SeqCst);
        }
        Box::pin(async move { Ok(vec![weights.sealed.await?]) })
    }
}
