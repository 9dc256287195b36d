//! Generation overlapping training in one process (`rollout run` with
//! `cluster.max_staleness` above 0): a second copy of the policy generates on an interpreter
//! thread of its own while the first trains, and each trained version reaches it in memory,
//! in the buckets a trainer serves to generation workers, its tensors then viewing them.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use rollout_core::cluster::buckets::Serving;
use rollout_core::cluster::weights::VersionBuffer;
use rollout_core::config::LoadedConfig;
use rollout_core::roles::{
    Generator, Learner, Publication, RoleError, RoleFuture, SaveWritten, Tokenizer,
};
use rollout_net::messages::{
    GenerateRequest, GenerateResponse, TrainRequest, TrainResponse, ValuesRequest, ValuesResponse,
    WeightsReport,
};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::{PolicyHost, boxed, traced};
use crate::HostError;
use crate::interpreter::{PythonError, PythonWorker};

/// How long a published version may take to be whole (it is filled on the training thread).
const SEAL_WAIT: Duration = Duration::from_secs(600);

/// The trained policy and its generation copy: the learner of the run is the first, its
/// generator and tokenizer the second.
pub struct OverlappedPolicy {
    learner: PolicyHost,
    generator: PolicyHost,
    versions: Mutex<Versions>,
    turns: Turns,
}

/// The weight versions between the two copies.
#[derive(Default)]
struct Versions {
    /// Published by the learner, not yet imported by the generator.
    pending: Option<Arc<VersionBuffer>>,
    /// The version the generator's tensors view.
    served: Option<Arc<VersionBuffer>>,
    /// Bucket allocations of a version nothing views any more, for the next export.
    spare: Vec<Vec<u8>>,
}

impl OverlappedPolicy {
    /// Loads the config's policy twice: the learner on `worker`, the generation copy on a
    /// second thread of the same interpreter.
    pub async fn load(worker: Arc<PythonWorker>, loaded: &LoadedConfig) -> Result<Self, HostError> {
        let generation_worker = Arc::new(worker.sibling("python-generate")?);
        let learner = PolicyHost::load_learner(worker.clone(), loaded)
            .instrument(tracing::info_span!("policy.load"))
            .await?;
        let generator = PolicyHost::load(generation_worker.clone(), loaded)
            .instrument(tracing::info_span!("policy.load", copy = "generation"))
            .await?;
        if loaded.config.policy.torch_threads().is_none() {
            share_torch_threads(&worker, &generation_worker).await?;
        }
        tracing::info!(
            "generation overlaps training: a generation copy of the policy samples up to {} \
             steps ahead on an interpreter thread of its own",
            loaded.config.cluster.max_staleness
        );
        Ok(Self {
            learner,
            generator,
            versions: Mutex::new(Versions::default()),
            turns: Turns::default(),
        })
    }

    /// The trained copy.
    pub fn learner(&self) -> &PolicyHost {
        &self.learner
    }

    fn versions(&self) -> MutexGuard<'_, Versions> {
        self.versions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Makes `buffer` the generator's weights; the version it viewed before gives its
    /// allocations to the next export when nothing else holds them.
    async fn import(&self, buffer: Arc<VersionBuffer>) -> Result<(), RoleError> {
        self.generator.import_version(&buffer).await?;
        self.generator.serve_version(buffer.version);
        let mut versions = self.versions();
        if let Some(retired) = versions.served.replace(buffer) {
            if let Ok(retired) = Arc::try_unwrap(retired) {
                versions.spare = retired.into_allocations();
            }
        }
        Ok(())
    }
}

impl Generator for OverlappedPolicy {
    /// Runs after every load asked for before it, and before every one asked for after.
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let turn = self.turns.take();
        boxed(async move {
            let _turn = turn.wait().await;
            self.generator.generate(request).await
        })
    }

    /// Hands the version over once it is whole, between two generation requests.
    fn load_weights(&self, weights: Publication) -> RoleFuture<'_, Vec<WeightsReport>> {
        let turn = self.turns.take();
        let pending = self.versions().pending.take();
        boxed(async move {
            let sealed = weights.sealed.await?;
            let buffer = pending.filter(|buffer| buffer.version == sealed.version);
            let buffer = buffer.ok_or_else(|| {
                RoleError::Protocol(format!(
                    "weight version {} was published without its buffer",
                    sealed.version
                ))
            })?;
            let _turn = turn.wait().await;
            self.import(buffer).await?;
            Ok(vec![WeightsReport {
                holder: "generation thread".into(),
                ..sealed
            }])
        })
    }
}

impl Learner for OverlappedPolicy {
    fn train(&self, request: TrainRequest) -> RoleFuture<'_, TrainResponse> {
        self.learner.train(request)
    }

    fn values(&self, request: ValuesRequest) -> RoleFuture<'_, ValuesResponse> {
        self.learner.values(request)
    }

    fn save(&self, directory: PathBuf) -> RoleFuture<'_, ()> {
        self.learner.save(directory)
    }

    fn save_in_background(&self, directory: PathBuf) -> RoleFuture<'_, SaveWritten> {
        self.learner.save_in_background(directory)
    }

    fn restore(&self, directory: PathBuf, weight_version: u64) -> RoleFuture<'_, ()> {
        self.learner.restore(directory, weight_version)
    }

    /// Exports the weights into buckets the generator will view, announcing the version
    /// while the training thread still fills them.
    fn publish_weights(&self, bucket_bytes: u64) -> RoleFuture<'_, Publication> {
        traced(|| tracing::info_span!("policy.publish"), async move {
            let spare = std::mem::take(&mut self.versions().spare);
            let exported = self
                .learner
                .export_weights(bucket_bytes, Some(Serving::Copied(spare)))
                .await?;
            let buffer = exported.buffer.ok_or_else(|| {
                RoleError::Protocol("a version exported to serve came without its buffer".into())
            })?;
            let announced = WeightsReport {
                version: exported.version,
                checksum: exported.checksum.unwrap_or_default(),
                bytes: exported.bytes,
                source: String::new(),
                holder: "local".into(),
            };
            self.versions().pending = Some(buffer.clone());
            let report = announced.clone();
            let sealed = async move { buffer.sealed_report(report, SEAL_WAIT).await };
            Ok(Publication {
                announced,
                sealed: Box::pin(sealed),
            })
        })
    }

    fn needs_weight_sync(&self) -> bool {
        true
    }
}

impl Tokenizer for OverlappedPolicy {
    // On the generation thread, so sampling never waits for a training step.
    fn encode(&self, texts: Vec<String>, continuation: bool) -> RoleFuture<'_, Vec<Vec<u32>>> {
        self.generator.encode(texts, continuation)
    }

    fn decode(&self, sequences: Vec<Vec<u32>>) -> RoleFuture<'_, Vec<String>> {
        self.generator.decode(sequences)
    }

    fn eos_token_ids(&self) -> RoleFuture<'_, Vec<u32>> {
        self.generator.eos_token_ids()
    }
}

/// How many torch threads each copy runs when the policy leaves the count to torch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ThreadSplit {
    learner: usize,
    generator: usize,
}

impl ThreadSplit {
    /// torch's `threads` (one per core by default) shared by the copies, the learner taking
    /// the odd one; each runs at least one.
    fn of(threads: usize) -> Self {
        Self {
            learner: threads.div_ceil(2).max(1),
            generator: (threads / 2).max(1),
        }
    }
}

/// Gives each copy its share of torch's threads (thread counts are per interpreter thread),
/// where the policy imported torch, and logs the counts torch then reports. Two copies each
/// running one thread per core slow each other down: on 2 cores a step of the 1M-parameter
/// benchmark model took 0.042-0.048 s that way against 0.033-0.036 s split.
async fn share_torch_threads(
    learner: &PythonWorker,
    generator: &PythonWorker,
) -> Result<(), HostError> {
    let Some(threads) = learner.run(torch_thread_count).await?? else {
        return Ok(());
    };
    let split = ThreadSplit::of(threads);
    let training = learner
        .run(move |py| set_torch_threads(py, split.learner))
        .await??;
    let generating = generator
        .run(move |py| set_torch_threads(py, split.generator))
        .await??;
    tracing::info!(
        "the two copies share torch's {threads} threads: {training} training, {generating} \
         generating (the policy's `torch_threads` sets each copy's count instead)"
    );
    Ok(())
}

/// torch's thread count on the calling interpreter thread; `None` when torch was never
/// imported.
fn torch_thread_count(py: Python<'_>) -> Result<Option<usize>, PythonError> {
    let raised = |err: PyErr| PythonError::from_py(py, &err);
    let modules = py
        .import("sys")
        .and_then(|sys| sys.getattr("modules"))
        .and_then(|modules| Ok(modules.cast_into::<PyDict>()?))
        .map_err(raised)?;
    let Some(torch) = modules.get_item("torch").map_err(raised)? else {
        return Ok(None);
    };
    torch
        .call_method0("get_num_threads")
        .and_then(|threads| threads.extract())
        .map(Some)
        .map_err(raised)
}

/// Sets torch's thread count on the calling interpreter thread; the count torch then reports.
fn set_torch_threads(py: Python<'_>, threads: usize) -> Result<usize, PythonError> {
    py.import("torch")
        .and_then(|torch| {
            torch.call_method1("set_num_threads", (threads,))?;
            torch.call_method0("get_num_threads")?.extract()
        })
        .map_err(|err| PythonError::from_py(py, &err))
}

/// The generator's calls, run one at a time in the order they were made (not the order
/// their futures are first polled in), as a generation worker serves its requests: each call
/// takes its turn when it is made and waits for the turn before it to end.
#[derive(Default)]
struct Turns {
    last: Mutex<Option<oneshot::Receiver<()>>>,
}

impl Turns {
    fn take(&self) -> Turn {
        let (done, next) = oneshot::channel();
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Turn {
            previous: last.replace(next),
            done,
        }
    }
}

/// A place in [`Turns`]; the next call may run once it is dropped.
struct Turn {
    previous: Option<oneshot::Receiver<()>>,
    done: oneshot::Sender<()>,
}

impl Turn {
    /// Waits for the call before this one to end (or be abandoned); hold what it returns
    /// while the call runs.
    async fn wait(self) -> oneshot::Sender<()> {
        if let Some(previous) = self.previous {
            let _ = previous.await;
        }
        self.done
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_turn_waits_for_the_call_taken_before_it_to_end() {
        let turns = Turns::default();
        let first = turns.take();
        let second = turns.take();
        // Polled before the first call has even started, the second still waits for it.
        let mut second = Box::pin(second.wait());
        let waiting = Duration::from_millis(50);
        assert!(tokio::time::timeout(waiting, &mut second).await.is_err());
        let running = first.wait().await;
        assert!(tokio::time::timeout(waiting, &mut second).await.is_err());
        drop(running);
        let ran = tokio::time::timeout(Duration::from_secs(5), second).await;
        assert!(ran.is_ok());
    }

    #[test]
    fn the_copies_share_the_threads_the_learner_taking_the_odd_one() {
        let split = |threads| {
            let ThreadSplit { learner, generator } = ThreadSplit::of(threads);
            (learner, generator)
        };
        assert_eq!(split(2), (1, 1));
        assert_eq!(split(3), (2, 1));
        assert_eq!(split(16), (8, 8));
        assert_eq!(split(1), (1, 1));
        assert_eq!(split(0), (1, 1));
    }

    #[tokio::test]
    async fn an_abandoned_turn_lets_the_next_one_run() {
        let turns = Turns::default();
        let first = turns.take();
        let second = turns.take();
        drop(first);
        let waited = tokio::time::timeout(Duration::from_secs(5), second.wait()).await;
        assert!(waited.is_ok());
    }
}
