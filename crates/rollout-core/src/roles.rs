//! The interfaces between the controller and the parts that do the work.
//!
//! The controller (data, advantages, batching, checkpoints) talks to generation, scoring,
//! training, environments and observers only through these traits, with the message types of
//! `rollout_net`. The crate `rollout-python` implements them in one process on the embedded
//! interpreter; [`crate::cluster`] implements them across processes and machines. Nothing
//! here knows about Python: a role's failure is a [`RoleError`], whoever reports it.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use rollout_net::messages::{
    GenerateRequest, GenerateResponse, GroupRef, ScoreRequest, ScoreResponse, TrainRequest,
    TrainResponse, ValuesRequest, ValuesResponse, WeightsReport,
};

use crate::metrics::StepMetrics;

pub type RoleFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, RoleError>> + Send + 'a>>;

/// Finishes when the files of a checkpoint taken by [`Learner::save_in_background`] are
/// written.
pub type SaveWritten = RoleFuture<'static, ()>;

/// A weight version a learner has published: `announced` is enough to start pulling it;
/// `sealed` is the same report with the version's checksum, which the learner may still be
/// computing while generators pull (every rank's checksum, checked to agree).
pub struct Publication {
    pub announced: WeightsReport,
    pub sealed: RoleFuture<'static, WeightsReport>,
}

impl Publication {
    /// A version whose checksum was known when it was announced.
    pub fn sealed(report: WeightsReport) -> Self {
        Self {
            announced: report.clone(),
            sealed: Box::pin(async move { Ok(report) }),
        }
    }
}

/// Why a role could not do what it was asked: the same for a role in this process and one
/// on another machine.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RoleError {
    /// User code failed: the message names the plugin, its config location and the hook, and
    /// carries the traceback.
    #[error("{0}")]
    Plugin(String),
    /// The runtime hosting the plugins failed (e.g. the interpreter could not start).
    #[error("{0}")]
    Runtime(String),
    /// The process serving the role died or its connection was lost.
    #[error("lost {role}: {reason}")]
    WorkerLost { role: String, reason: String },
    /// The role did not answer in time.
    #[error("{role} did not answer within {seconds:.0} s")]
    TimedOut { role: String, seconds: f64 },
    /// The role answered something that breaks the contract.
    #[error("{0}")]
    Protocol(String),
}

pub trait Generator: Send + Sync {
    /// Samples completions with the weights the generator currently holds.
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse>;
    /// Makes the published version the one served from the next generation request on (a
    /// request already running finishes with the version it started with): generators may
    /// pull it as soon as it is announced, but serve it only once it matches the sealed
    /// checksum. Returns what each generation worker then serves. In-process, the generator
    /// shares the learner's weights and there is nothing to copy.
    fn load_weights(&self, weights: Publication) -> RoleFuture<'_, Vec<WeightsReport>>;
    /// The update of `step` has been applied, with the samples of exactly `groups.trained`:
    /// whatever the generator tracks about the step's groups is settled. Returns the
    /// generator's metrics since the last call.
    fn step_trained(
        &self,
        _step: u64,
        _groups: &StepGroups,
    ) -> RoleFuture<'_, BTreeMap<String, f64>> {
        Box::pin(async { Ok(BTreeMap::new()) })
    }
    /// The learner restarted from the checkpoint of `step`; later updates are undone.
    fn resumed_from(&self, _step: u64) -> RoleFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    /// The learner is about to step on devices the generator shares (colocated): free what
    /// generation holds there until [`Generator::restore_memory`]. Nothing by default.
    fn release_memory(&self) -> RoleFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    /// Takes back what [`Generator::release_memory`] freed, before the next generation.
    fn restore_memory(&self) -> RoleFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
    /// The trainer left samples these generation workers produced out of an update (their
    /// data was invalid, or their loss not finite): send them away as for a malformed answer.
    /// Nothing by default (in one process there is no worker to send away).
    fn send_away(&self, _workers: Vec<String>, _reason: String) -> RoleFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }
}

/// What became of one step's prompt groups: those whose samples went into its update, and
/// those generated for it that did not (replaced by another group of the step, or dropped).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepGroups {
    /// The groups whose samples went into the update, by index, each with its record.
    pub trained: Vec<GroupRecord>,
    pub replaced: Vec<ReplacedGroup>,
    pub dropped: Vec<DroppedGroup>,
    /// Groups whose record came back from the data queue, and the group it was dropped from.
    pub redrawn: Vec<(u32, GroupRef)>,
    /// Generation was leased per episode turn (multi-turn), not per group.
    pub per_turn: bool,
}

/// A prompt group of a step and the index of its data record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupRecord {
    pub group: u32,
    pub record: u64,
}

/// A group generated but not trained: group `by` of the same step took its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplacedGroup {
    pub group: u32,
    pub by: u32,
    pub reason: ReplaceReason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplaceReason {
    /// Generated past `cluster.max_staleness`: generated again on current weights.
    Stale,
    /// No reward spread (dynamic sampling): a reserve prompt's group took its place.
    Flat,
}

/// A group left out of its step's update, and whether its record went back to the data
/// queue for a later step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DroppedGroup {
    pub group: u32,
    pub record: u64,
    pub reason: DropReason,
    pub requeued: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Still past `cluster.max_staleness` after the last round of regeneration.
    Stale,
    /// No answer after `cluster.max_attempts` leases.
    Attempts,
}

impl ReplaceReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplaceReason::Stale => "stale",
            ReplaceReason::Flat => "flat",
        }
    }
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::Stale => "stale",
            DropReason::Attempts => "attempts",
        }
    }
}

pub trait Scorer: Send + Sync {
    fn score(&self, request: ScoreRequest) -> RoleFuture<'_, ScoreResponse>;
}

pub trait Learner: Send + Sync {
    /// Applies `request.epochs` optimizer updates and returns the new weight version.
    fn train(&self, request: TrainRequest) -> RoleFuture<'_, TrainResponse>;
    /// The value head's predictions for every token of the micro-batches (PPO).
    fn values(&self, request: ValuesRequest) -> RoleFuture<'_, ValuesResponse>;
    /// Writes the weights and optimizer state into `directory`.
    fn save(&self, directory: PathBuf) -> RoleFuture<'_, ()>;
    /// Copies what `save` would write and returns once the copy is taken, so training can
    /// go on; the files are written into `directory` in the background, until the returned
    /// [`SaveWritten`] finishes. Saves in the foreground unless the learner can do better.
    fn save_in_background(&self, directory: PathBuf) -> RoleFuture<'_, SaveWritten> {
        Box::pin(async move {
            self.save(directory).await?;
            Ok(Box::pin(async { Ok(()) }) as SaveWritten)
        })
    }
    /// Restores what `save` wrote; the weights become `weight_version`.
    fn restore(&self, directory: PathBuf, weight_version: u64) -> RoleFuture<'_, ()>;
    /// Exports the current weights as a version generators can load, in buckets of
    /// `bucket_bytes`; returns once it can be pulled, perhaps before its checksum is known.
    fn publish_weights(&self, bucket_bytes: u64) -> RoleFuture<'_, Publication>;
    /// Whether generators need `publish_weights` + `Generator::load_weights` after an update
    /// (not when they share the learner's weights in one process).
    fn needs_weight_sync(&self) -> bool;
}

pub trait Tokenizer: Send + Sync {
    /// Tokenises prompts, or (`continuation`) text that extends an existing context.
    fn encode(&self, texts: Vec<String>, continuation: bool) -> RoleFuture<'_, Vec<Vec<u32>>>;
    fn decode(&self, sequences: Vec<Vec<u32>>) -> RoleFuture<'_, Vec<String>>;
    fn eos_token_ids(&self) -> RoleFuture<'_, Vec<u32>>;
}

/// One prompt record after the data source's transforms: its prompt and every field (JSON).
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub prompt: String,
    pub fields: serde_json::Value,
}

/// One episode to start: its data record and the seed shared by its group.
#[derive(Debug, Clone)]
pub struct EpisodeStart {
    pub record: serde_json::Value,
    pub seed: u64,
}

/// The environment's answer to one turn.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    pub observation: String,
    pub reward: f64,
    pub done: bool,
}

/// Why one episode ended early: a call of its (sandboxed) environment raised, hung,
/// crashed, ran out of memory or answered nonsense, or the process holding its state was
/// restarted. Only that episode fails; the run goes on.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeFailure {
    /// The hook that failed: `reset` or `step`.
    pub hook: &'static str,
    pub reason: rollout_net::messages::FailureReason,
    /// One line: the exception, the timeout, the signal.
    pub message: String,
    pub traceback: Option<String>,
}

/// One episode's answer to a call: failed episodes are not called again (but are finished).
pub type EpisodeResult<T> = Result<T, EpisodeFailure>;

pub trait Environments: Send + Sync {
    /// Starts episodes and returns their first prompts; episode `i` has id `first_id + i`.
    fn start(
        &self,
        first_id: u64,
        episodes: Vec<EpisodeStart>,
    ) -> RoleFuture<'_, Vec<EpisodeResult<String>>>;
    /// One outcome per action, in order.
    fn step(&self, actions: Vec<(u64, String)>) -> RoleFuture<'_, Vec<EpisodeResult<StepResult>>>;
    /// Releases the episodes of `ids` (finished or failed). Fails the run when failed
    /// episodes pass the configured limits.
    fn finish(&self, ids: Vec<u64>) -> RoleFuture<'_, ()>;
}

/// Whose turn it is in a multi-agent episode, and the whole prompt that agent sees.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentTurn {
    pub agent: String,
    pub prompt: String,
}

/// A multi-agent environment's answer to one turn: rewards to any agents, and the next turn
/// (`None`: the episode is over).
#[derive(Debug, Clone, PartialEq)]
pub struct JointOutcome {
    pub rewards: BTreeMap<String, f64>,
    pub next: Option<AgentTurn>,
}

/// Episodes in which several agents take turns; a call that fails fails the run.
pub trait MultiAgentEnvironments: Send + Sync {
    /// Starts episodes and returns their first turns; episode `i` has id `first_id + i`.
    fn start(&self, first_id: u64, episodes: Vec<EpisodeStart>) -> RoleFuture<'_, Vec<AgentTurn>>;
    /// One outcome per action (the text of the turn last handed to that episode), in order.
    fn step(&self, actions: Vec<(u64, String)>) -> RoleFuture<'_, Vec<JointOutcome>>;
    /// Releases the episodes of `ids`.
    fn finish(&self, ids: Vec<u64>) -> RoleFuture<'_, ()>;
}

/// Run-level events for callbacks; observers cannot fail a run.
pub trait Observer: Send + Sync {
    fn run_started(&self, info: RunStarted) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
    fn step_ended(&self, metrics: StepMetrics) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
    fn checkpoint_written(
        &self,
        step: u64,
        path: PathBuf,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
    fn run_ended(
        &self,
        summary: serde_json::Value,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
}

#[derive(Debug, Clone)]
pub struct RunStarted {
    pub name: String,
    pub output_dir: PathBuf,
    pub total_steps: u64,
    pub start_step: u64,
    pub config: serde_json::Value,
}
