//! The contract classes built from the core's types, and the core's types from the classes
//! plugins return.

use pyo3::prelude::*;
use rollout_core::config::TrainConfig;
use rollout_core::roles;
use rollout_core::scheduler::{StepOutput, StepPlan};
use rollout_net::messages::{
    self, GenerateRequest, KlPenalty, MicroBatch, PromptRequest, RolloutCorrection, ScoreSample,
};
use rollout_net::{Dtype, TensorBytes};

use super::classes::*;
use super::{Array, Json, Tuple, to_python};

impl SamplingParams {
    /// The parameters of `request` for `Policy.generate`, whose `max_new_tokens` is the
    /// longest budget of any sample (shorter ones are truncated afterwards).
    pub fn of(request: &GenerateRequest) -> Self {
        let sampling = &request.sampling;
        SamplingParams {
            max_new_tokens: request.longest_budget(),
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            top_k: sampling.top_k,
            stop_token_ids: Tuple(sampling.stop_token_ids.clone()),
            seed: sampling.seed,
        }
    }
}

impl From<&TrainConfig> for Sharding {
    fn from(train: &TrainConfig) -> Self {
        let fsdp = &train.fsdp;
        Sharding {
            mode: train.sharding.as_str().to_owned(),
            param_dtype: fsdp
                .param_dtype
                .map(|d| d.as_str().to_owned())
                .unwrap_or_default(),
            reduce_dtype: fsdp.reduce_dtype.as_str().to_owned(),
            reshard_after_forward: fsdp.reshard_after_forward,
            offload: fsdp.offload,
        }
    }
}

impl From<&PromptRequest> for GenerationRequest {
    fn from(prompt: &PromptRequest) -> Self {
        GenerationRequest {
            prompt_ids: Array::vector(prompt.prompt_ids.iter().map(|&t| i64::from(t)).collect()),
            n: prompt.n,
        }
    }
}

impl From<&MicroBatch> for TrainBatch {
    fn from(batch: &MicroBatch) -> Self {
        let (rows, width) = (batch.rows, batch.width);
        let matrix = |values: &[f32]| Array::matrix(values.to_vec(), rows, width);
        let ppo = |values: &[f32]| (!batch.returns.is_empty()).then(|| matrix(values));
        TrainBatch {
            input_ids: Array::matrix(
                batch.input_ids.iter().map(|&t| i64::from(t)).collect(),
                rows,
                width,
            ),
            attention_mask: Array::matrix(
                batch.attention_mask.iter().map(|&m| i64::from(m)).collect(),
                rows,
                width,
            ),
            loss_mask: matrix(&batch.loss_mask),
            advantages: matrix(&batch.advantages),
            old_logprobs: matrix(&batch.old_logprobs),
            loss_scale: batch.loss_scale,
            objective: Objective::from(&batch.objective),
            returns: ppo(&batch.returns),
            old_values: ppo(&batch.old_values),
            row_staleness: (!batch.row_staleness.is_empty()).then(|| {
                Array::vector(batch.row_staleness.iter().map(|&s| i64::from(s)).collect())
            }),
            first_logprobs: None,
        }
    }
}

/// The SDK objectives' `rollout_correction*` fields.
struct Correction {
    mode: String,
    cap: f32,
    band: Tuple<f32>,
    level: String,
}

impl From<RolloutCorrection> for Correction {
    fn from(correction: RolloutCorrection) -> Self {
        Correction {
            mode: correction.mode.as_str().to_owned(),
            cap: correction.cap,
            band: Tuple(correction.band.to_vec()),
            level: correction.level.as_str().to_owned(),
        }
    }
}

impl From<&messages::Objective> for Objective {
    fn from(objective: &messages::Objective) -> Self {
        match *objective {
            messages::Objective::Grpo {
                clip_low,
                clip_high,
                kl_coef,
                temperature,
                kl_penalty,
                correction,
            } => {
                let correction = Correction::from(correction);
                Objective::Grpo(GrpoObjective {
                    clip_low,
                    clip_high,
                    kl_coef,
                    temperature,
                    kl_penalty: match kl_penalty {
                        KlPenalty::Loss => "loss",
                        KlPenalty::Reward => "reward",
                    }
                    .to_owned(),
                    rollout_correction: correction.mode,
                    rollout_correction_cap: correction.cap,
                    rollout_correction_band: correction.band,
                    rollout_correction_level: correction.level,
                })
            }
            messages::Objective::Gspo {
                clip_low,
                clip_high,
                kl_coef,
                temperature,
                correction,
            } => {
                let correction = Correction::from(correction);
                Objective::Gspo(GspoObjective {
                    clip_low,
                    clip_high,
                    kl_coef,
                    temperature,
                    rollout_correction: correction.mode,
                    rollout_correction_cap: correction.cap,
                    rollout_correction_band: correction.band,
                    rollout_correction_level: correction.level,
                })
            }
            messages::Objective::Ppo {
                clip_low,
                clip_high,
                kl_coef,
                temperature,
                value_clip,
                value_coef,
                train_policy,
                correction,
            } => {
                let correction = Correction::from(correction);
                Objective::Ppo(PpoObjective {
                    clip_low,
                    clip_high,
                    kl_coef,
                    temperature,
                    value_clip,
                    value_coef,
                    train_policy,
                    rollout_correction: correction.mode,
                    rollout_correction_cap: correction.cap,
                    rollout_correction_band: correction.band,
                    rollout_correction_level: correction.level,
                })
            }
            messages::Objective::Dpo { beta } => Objective::Dpo(DpoObjective { beta }),
            messages::Objective::Sft => Objective::Sft(SftObjective {}),
        }
    }
}

impl<'py> IntoPyObject<'py> for Objective {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        match self {
            Objective::Grpo(objective) => to_python(py, objective),
            Objective::Gspo(objective) => to_python(py, objective),
            Objective::Ppo(objective) => to_python(py, objective),
            Objective::Dpo(objective) => to_python(py, objective),
            Objective::Sft(objective) => to_python(py, objective),
        }
    }
}

impl From<&ScoreSample> for Sample {
    fn from(sample: &ScoreSample) -> Self {
        Sample {
            prompt: sample.prompt.clone(),
            completion: sample.completion.clone(),
            record: Json(sample.record.clone()),
            finish_reason: sample.finish_reason.as_str().to_owned(),
        }
    }
}

impl From<&roles::RunStarted> for RunInfo {
    fn from(start: &roles::RunStarted) -> Self {
        RunInfo {
            name: start.name.clone(),
            // The SDK promises a `str` (a path would arrive as a `pathlib.Path`).
            output_dir: start.output_dir.to_string_lossy().into_owned(),
            total_steps: start.total_steps,
            start_step: start.start_step,
            config: Json(start.config.clone()),
        }
    }
}

impl KvLayout {
    /// Cache bytes of one token across all layers (keys and values).
    pub fn bytes_per_slot(&self) -> u64 {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes
    }
}

impl EngineStep {
    /// The plan's arrays, moved out (no copy); its bookkeeping stays for
    /// `Scheduler::apply`.
    pub fn take(plan: &mut StepPlan) -> Self {
        let (seqs, rows, k1) = (plan.num_seqs(), plan.num_rows(), plan.max_drafts + 1);
        let vector = |values: &mut Vec<i64>| Array::vector(std::mem::take(values));
        EngineStep {
            input_ids: vector(&mut plan.input_ids),
            positions: vector(&mut plan.positions),
            slot_mapping: vector(&mut plan.slot_mapping),
            query_start: vector(&mut plan.query_start),
            context_slots: Array::matrix(
                std::mem::take(&mut plan.context_slots),
                seqs,
                plan.context_width,
            ),
            context_lens: vector(&mut plan.context_lens),
            sample_seq: vector(&mut plan.sample_seq),
            draft_lens: vector(&mut plan.draft_lens),
            temperature: Array::vector(std::mem::take(&mut plan.temperature)),
            top_p: Array::vector(std::mem::take(&mut plan.top_p)),
            top_k: vector(&mut plan.top_k),
            uniforms: Array {
                data: std::mem::take(&mut plan.uniforms),
                shape: [rows, k1, 3],
            },
            copy_from: vector(&mut plan.copy_from),
            copy_to: vector(&mut plan.copy_to),
            draft_with_model: plan.draft_with_model,
        }
    }
}

impl From<EngineStepOutput> for StepOutput {
    fn from(output: EngineStepOutput) -> Self {
        StepOutput {
            tokens: output.tokens.data,
            logprobs: output.logprobs.data,
            counts: output.counts.data,
        }
    }
}

impl From<StepResult> for roles::StepResult {
    fn from(result: StepResult) -> Self {
        roles::StepResult {
            observation: result.observation,
            reward: result.reward,
            done: result.done,
        }
    }
}

impl From<AgentTurn> for roles::AgentTurn {
    fn from(turn: AgentTurn) -> Self {
        roles::AgentTurn {
            agent: turn.agent,
            prompt: turn.prompt,
        }
    }
}

impl HostTensor {
    /// The tensor named `name`, its dtype and byte count checked.
    pub fn into_tensor(self, name: String) -> Result<TensorBytes, String> {
        let Some(dtype) = Dtype::from_safetensors_name(&self.dtype) else {
            return Err(format!("`{name}`: unknown dtype `{}`", self.dtype));
        };
        TensorBytes::new(name, dtype, self.shape, self.data.0).map_err(|err| err.to_string())
    }
}
