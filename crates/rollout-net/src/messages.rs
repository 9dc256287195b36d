//! The messages exchanged between Rollout's roles: the controller, generation, reward scoring
//! and training. In a single process they are passed as values; across processes they travel
//! as the JSON header of a [`crate::frame::Frame`], with bulk tensors in its binary payload.

use serde::{Deserialize, Serialize};

mod kind;
pub use kind::{Message, MessageKind};

use crate::tensor::{TensorError, TensorMeta, TensorTable};

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence or stop token was generated (and is included in the completion).
    Stop,
    /// `max_new_tokens` was reached.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// How to sample; logprobs are those of the temperature-scaled distribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub max_new_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    /// Token ids that end a completion in addition to the model's end-of-sequence ids.
    pub stop_token_ids: Vec<u32>,
    /// Texts that end a completion once its decoded text contains one (the tokens up to and
    /// including the one that completed it are kept).
    #[serde(default)]
    pub stop_strings: Vec<String>,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    pub seed: u64,
}

impl SamplingParams {
    /// Sampling from the model's own distribution: temperature 1, no top-p or top-k cut, no
    /// stop but end-of-sequence.
    pub fn plain(max_new_tokens: u32, seed: u64) -> Self {
        Self {
            max_new_tokens,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            seed,
        }
    }
}

/// One prompt to complete `n` times.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptRequest {
    pub prompt_ids: Vec<u32>,
    pub n: u32,
    /// Per-sample token budgets (`n` of them); empty means `sampling.max_new_tokens` for all.
    #[serde(default)]
    pub max_new_tokens: Vec<u32>,
    /// The group's sampling seed; without one it is derived from `sampling.seed` and the
    /// prompt's position in the request. Set, samples do not depend on how a step's prompts
    /// are split between generation workers.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Which prompt group of which step this is, for the controller's ledger.
    #[serde(default)]
    pub group: Option<GroupRef>,
}

/// A prompt group's identity in a run: its step and its index among the step's groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GroupRef {
    pub step: u64,
    pub index: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub prompts: Vec<PromptRequest>,
    pub sampling: SamplingParams,
}

impl GenerateRequest {
    /// The most tokens any sample of the request may generate.
    pub fn longest_budget(&self) -> u32 {
        self.prompts
            .iter()
            .flat_map(|prompt| {
                if prompt.max_new_tokens.is_empty() {
                    vec![self.sampling.max_new_tokens]
                } else {
                    prompt.max_new_tokens.clone()
                }
            })
            .max()
            .unwrap_or(self.sampling.max_new_tokens)
    }
}

/// One generated completion, tagged with the weight version that produced it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
    pub weight_version: u64,
}

/// `groups[i]` holds the `n` completions of `prompts[i]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateResponse {
    pub groups: Vec<Vec<Completion>>,
    /// The generator's own measurements (engine throughput, KV utilisation, speculation).
    #[serde(default)]
    pub metrics: std::collections::BTreeMap<String, f64>,
    /// `producers[i]` names the generation worker that generated `groups[i]`, filled in by
    /// the controller's pool (empty in one process). Never on the wire: a worker cannot
    /// name another as the author of its completions.
    #[serde(skip)]
    pub producers: Vec<String>,
}

/// A finished sample as reward functions see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreSample {
    pub prompt: String,
    pub completion: String,
    /// The data record the prompt came from (answers and other metadata).
    pub record: serde_json::Value,
    pub finish_reason: FinishReason,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreRequest {
    pub samples: Vec<ScoreSample>,
}

/// The weighted total per sample, and each reward's raw scores by name. A sample listed in
/// `failed` could not be scored (its total and scores are 0 and mean nothing).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreResponse {
    pub totals: Vec<f64>,
    pub components: Vec<RewardComponent>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<ScoreFailure>,
}

/// A sample that a sandboxed reward could not score, or whose episode's sandboxed
/// environment failed (then `environment` names the hook and no reward scored it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreFailure {
    /// The sample's index in the request (in the step, for an environment failure).
    pub index: usize,
    pub reason: FailureReason,
    /// One line: the exception, the timeout, the signal.
    pub message: String,
    /// The reward that failed, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<String>,
    /// The environment hook that failed (`reset`, `step`) when the episode failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    /// The Python traceback, when the reward raised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceback: Option<String>,
}

/// Why a sample could not be scored (or its episode could not be played).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureReason {
    /// The reward (or environment) raised an exception.
    Raised,
    /// The call ran past its wall-clock timeout or its CPU-time limit.
    Timeout,
    /// The process scoring it died (a segfault, a protocol violation).
    Crashed,
    /// MemoryError, or the process was killed for memory.
    Memory,
    /// The reward returned something other than one finite float (or the environment
    /// something other than a prompt or a `StepResult`).
    Invalid,
    /// Environments only: the sandbox process holding the episode's state was restarted
    /// after another episode's call failed in it, so the episode could not go on.
    Restarted,
}

impl FailureReason {
    pub const ALL: [FailureReason; 6] = [
        FailureReason::Raised,
        FailureReason::Timeout,
        FailureReason::Crashed,
        FailureReason::Memory,
        FailureReason::Invalid,
        FailureReason::Restarted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Raised => "raised",
            FailureReason::Timeout => "timeout",
            FailureReason::Crashed => "crashed",
            FailureReason::Memory => "memory",
            FailureReason::Invalid => "invalid",
            FailureReason::Restarted => "restarted",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardComponent {
    pub name: String,
    pub weight: f64,
    pub scores: Vec<f64>,
}

/// The objective a training micro-batch is optimised for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case")]
pub enum Objective {
    /// Clipped token-level importance ratio (GRPO, Dr. GRPO, RLOO, REINFORCE++).
    Grpo {
        clip_low: f32,
        clip_high: f32,
        kl_coef: f32,
        temperature: f32,
        #[serde(default)]
        kl_penalty: KlPenalty,
        #[serde(default)]
        correction: RolloutCorrection,
    },
    /// GSPO: the clipped ratio is the sequence's (geometric mean over its tokens).
    Gspo {
        clip_low: f32,
        clip_high: f32,
        kl_coef: f32,
        temperature: f32,
        #[serde(default)]
        correction: RolloutCorrection,
    },
    /// PPO: the clipped token ratio on the batch's per-token (GAE) advantages plus the
    /// clipped value loss of the policy's value head against `returns`, relative to
    /// `old_values`. With `train_policy` false (critic warm-up) only the value head learns.
    Ppo {
        clip_low: f32,
        clip_high: f32,
        kl_coef: f32,
        temperature: f32,
        value_clip: f32,
        value_coef: f32,
        train_policy: bool,
        #[serde(default)]
        correction: RolloutCorrection,
    },
    /// DPO over pairs of rows: row `2i` is pair `i`'s chosen sequence, row `2i + 1` its
    /// rejected one; `loss_scale` is `1 / pairs in the update`.
    Dpo {
        beta: f32,
    },
    Sft,
}

/// Where the KL to the reference enters a policy-gradient objective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlPenalty {
    /// `kl_coef` times the k3 estimator, added to the loss.
    #[default]
    Loss,
    /// `kl_coef` times the k1 estimator, subtracted from each token's reward (summed over the
    /// tokens from there to the end, as REINFORCE++ does).
    Reward,
}

/// How a policy-gradient objective corrects for the generator's logprobs differing from the
/// trainer's (docs/algorithms.md, "Rollout correction"). With a correction on, the clipped
/// ratio is taken against the trainer's own logprobs at its first evaluation of the batch
/// (decoupled PPO) and each token's policy-gradient loss is weighted by `exp(trainer at first
/// evaluation - generator)`: truncated at `cap` (TIS) or masked outside `band` (MIS).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RolloutCorrection {
    pub mode: CorrectionMode,
    /// TIS: the largest weight.
    pub cap: f32,
    /// MIS: the weights kept, `[low, high]`.
    pub band: [f32; 2],
    /// MIS: whether a token or its whole sequence (its geometric-mean weight) is masked.
    pub level: CorrectionLevel,
}

impl Default for RolloutCorrection {
    fn default() -> Self {
        RolloutCorrection {
            mode: CorrectionMode::None,
            cap: 2.0,
            band: [0.5, 2.0],
            level: CorrectionLevel::Token,
        }
    }
}

/// The rollout correction's kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CorrectionMode {
    /// None: the ratio is taken against the generator's logprobs, as without correction.
    #[default]
    None,
    /// Truncated importance sampling.
    Tis,
    /// Masked importance sampling.
    Mis,
}

impl CorrectionMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CorrectionMode::None => "none",
            CorrectionMode::Tis => "tis",
            CorrectionMode::Mis => "mis",
        }
    }
}

/// What MIS masks: a token, or its whole sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CorrectionLevel {
    #[default]
    Token,
    Sequence,
}

impl CorrectionLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            CorrectionLevel::Token => "token",
            CorrectionLevel::Sequence => "sequence",
        }
    }
}

/// One right-padded training micro-batch; every `[rows, width]` array is row-major.
///
/// Position `t` of each per-token array describes token `input_ids[t]` as predicted from the
/// tokens before it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MicroBatch {
    pub rows: usize,
    pub width: usize,
    pub input_ids: Vec<u32>,
    pub attention_mask: Vec<u8>,
    pub loss_mask: Vec<f32>,
    pub advantages: Vec<f32>,
    pub old_logprobs: Vec<f32>,
    /// Multiplies the summed token loss: `1 / masked tokens in the whole update`.
    pub loss_scale: f32,
    pub objective: Objective,
    /// PPO only (else empty): the value targets and the value head's predictions before the
    /// update, per token like `advantages`.
    #[serde(default)]
    pub returns: Vec<f32>,
    #[serde(default)]
    pub old_values: Vec<f32>,
    /// Per row: weight versions between the trainer's before this update and the one that
    /// generated the row (0: generated with the very weights being trained; empty: every row
    /// is). Splits the mismatch metrics from staleness.
    #[serde(default)]
    pub row_staleness: Vec<u32>,
}

impl MicroBatch {
    /// Tokens the loss is computed on.
    pub fn loss_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m > 0.0).count()
    }

    /// Padded size, the cost the token budget bounds (saturating: `rows` and `width` come
    /// from the peer).
    pub fn padded_tokens(&self) -> usize {
        self.rows.saturating_mul(self.width)
    }
}

/// One optimizer update: gradients accumulated over `micro_batches`, then applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainRequest {
    pub micro_batches: Vec<MicroBatch>,
    pub learning_rate: f64,
    /// Passes over `micro_batches`, each ending in an optimizer update (PPO epochs); the
    /// weight version advances once for the whole request.
    #[serde(default = "one_epoch")]
    pub epochs: u32,
}

fn one_epoch() -> u32 {
    1
}

/// The value head's prediction for every token of `micro_batches` (no update): trainer
/// ranks answer for the micro-batches they are sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValuesRequest {
    pub micro_batches: Vec<MicroBatch>,
}

/// `values[i]` is micro-batch `i`'s `[rows, width]` row-major predictions; position `t` is
/// the value of the state before token `t`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValuesResponse {
    pub values: Vec<Vec<f32>>,
}

/// Token-weighted means of the micro-batch metrics plus the update's own (grad norm, lr).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainResponse {
    pub metrics: std::collections::BTreeMap<String, f64>,
    /// The weight version after this update.
    pub weight_version: u64,
    /// Rows the trainer left out of the update, by their place in the request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub excluded: Vec<ExcludedRow>,
}

/// Why a trainer left a row out of an update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Exclusion {
    /// A token id outside the policy's vocabulary, or a behaviour logprob no sampler gives
    /// (not finite, or outside the peer check's range).
    Invalid,
    /// Its loss was not finite.
    NonFinite,
}

/// Row `row` of micro-batch `micro_batch` of a [`TrainRequest`], left out of the update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ExcludedRow {
    pub micro_batch: u32,
    pub row: u32,
    pub reason: Exclusion,
}

/// The first message on a connection, sent by each side: who is speaking.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The sender's role, e.g. `"controller"`, `"generator"`, `"scorer"` or `"trainer"`.
    pub role: String,
    /// A name unique among the run's processes, for logs.
    pub name: String,
    /// The sending build's version (its `CARGO_PKG_VERSION`); peers must match.
    pub version: String,
    /// Requests the sender accepts before its peer must wait for answers.
    #[serde(default)]
    pub credits: u32,
    /// Role facts: a trainer's rank and world size, the address a process serves weights on.
    #[serde(default)]
    pub info: serde_json::Value,
}

/// A liveness probe; the receiver answers with a heartbeat carrying the same `seq`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub seq: u64,
}

/// Sent instead of a response when a request failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMessage {
    pub message: String,
}

/// New policy weights: `tensors` lays out the frame's payload, whose XXH3-128 digest is
/// `checksum` (see [`crate::tensor::checksum`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsUpdate {
    /// The weight version these tensors are.
    pub version: u64,
    pub checksum: String,
    pub tensors: TensorTable,
}

impl WeightsUpdate {
    /// Checks `payload` against `checksum` and the tensor table, then returns each tensor's
    /// bytes.
    pub fn tensor_bytes<'a>(
        &'a self,
        payload: &'a [u8],
    ) -> Result<Vec<(&'a TensorMeta, &'a [u8])>, TensorError> {
        let found = crate::tensor::checksum(payload);
        if found != self.checksum {
            return Err(TensorError::ChecksumMismatch {
                expected: self.checksum.clone(),
                found,
            });
        }
        self.tensors.tensor_bytes(payload)
    }
}

/// The controller's answer to a role's `Hello`: the run's resolved config (TOML) and what
/// this process is to do in it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    pub config_toml: String,
    /// Role-specific: e.g. a worker's index among the generation workers.
    #[serde(default)]
    pub assignment: serde_json::Value,
}

/// Tokenizer work for a generation worker (the controller holds no model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TokenizerRequest {
    Encode {
        texts: Vec<String>,
        continuation: bool,
    },
    Decode {
        sequences: Vec<Vec<u32>>,
    },
    EosTokenIds,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum TokenizerResponse {
    Ids { ids: Vec<Vec<u32>> },
    Texts { texts: Vec<String> },
}

/// Save the trainer state into `directory`, or restore it from there as `weight_version`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum CheckpointRequest {
    Save {
        directory: String,
    },
    /// Copy the state now (answered then) and write it into `directory` in the background.
    SaveInBackground {
        directory: String,
    },
    /// Answered once the background write into `directory` finished.
    Written {
        directory: String,
    },
    Restore {
        directory: String,
        weight_version: u64,
    },
}

/// A request finished with nothing to return.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {}

/// A role's answer to [`Welcome`]: its policy is loaded, and takes token ids below
/// `vocabulary`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Loaded {
    pub vocabulary: u64,
}

/// Asks the trainers to snapshot their current weights for generation workers to pull.
/// Answered with a [`WeightsReport`]; a rank that serves the version may first announce it,
/// unsealed (`more` set), as soon as it can be pulled, and answer the sealed report once
/// its checksum is known.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishWeights {
    /// Bytes per bucket of the snapshot.
    pub bucket_bytes: u64,
}

/// A weight version: its checksum (XXH3-128 over every tensor's name and bytes in order), size, and
/// where it can be pulled from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightsReport {
    pub version: u64,
    /// Empty while the version is announced but not yet sealed: its publisher is still
    /// checksumming buckets that can already be pulled (see [`SealWeights`]).
    pub checksum: String,
    pub bytes: u64,
    /// `host:port` of a weight server holding this version (empty: none, e.g. in-process).
    #[serde(default)]
    pub source: String,
    /// Who reports it (a worker or trainer name).
    #[serde(default)]
    pub holder: String,
}

impl WeightsReport {
    /// Whether the version's checksum is known.
    pub fn is_sealed(&self) -> bool {
        !self.checksum.is_empty()
    }
}

/// Controller -> generation worker: pull `weights` from `weights.source`, verify every bucket
/// and the whole version's checksum, and serve it from the next generation request on.
/// Unsealed `weights` are pulled at once, but served only once a [`SealWeights`] for the
/// version brings the checksum they must match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncWeights {
    pub weights: WeightsReport,
}

/// Controller -> generation worker, answered with [`Done`]: the sealed report (checksum
/// included) of a version an earlier [`SyncWeights`] announced unsealed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealWeights {
    pub weights: WeightsReport,
}

/// Asks a weight server for every bucket of `version`, streamed as they become available.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullWeights {
    pub version: u64,
}

/// One bucket of a weight version; `checksum` is the XXH3-128 digest of the frame's payload
/// ([`crate::tensor::checksum`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsBucket {
    pub version: u64,
    pub index: u32,
    pub count: u32,
    pub checksum: String,
    pub tensors: TensorTable,
}

/// The controller ends the run: the role exits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shutdown {
    pub reason: String,
}

/// Controller -> colocated generation worker, answered with [`Done`]: free the device
/// memory generation holds (KV cache, weights moved to the host) while the trainers step
/// (`Release`), or take it back before generating (`Restore`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GeneratorMemory {
    Release,
    Restore,
}
