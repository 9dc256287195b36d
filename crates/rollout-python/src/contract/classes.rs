//! Every SDK dataclass that crosses the boundary, as Rust sees it. Each struct has the fields
//! of its dataclass, in the same order; `IntoPyObject` ones are built by Rust, `FromPyObject`
//! ones are returned by plugins.

use std::collections::BTreeMap;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::{Array, ClassSpec, FieldKind, FieldSpec, Json, SdkClass, Tuple, Unused, read_field};

/// Defines the contract's structs, each converted field by field, in both directions as the
/// keyword `to_python` or `from_python` says; makes each an [`SdkClass`] and lists them all in
/// [`classes`], so none escapes the conformance test.
macro_rules! sdk_classes {
    ($(
        $(#[$meta:meta])*
        $direction:ident struct $name:ident {
            $( $(#[$field_meta:meta])* pub $field:ident : $ty:ty ),* $(,)?
        }
    )*) => {
        $(
            $(#[$meta])*
            pub struct $name {
                $( $(#[$field_meta])* pub $field: $ty ),*
            }

            impl SdkClass for $name {
                const CLASS: &'static str = stringify!($name);
            }

            sdk_classes!(@$direction $name { $($field: $ty),* });
        )*

        /// Every contract class with its fields as Rust declares them.
        pub fn classes() -> Vec<ClassSpec> {
            vec![$(
                ClassSpec {
                    class: stringify!($name),
                    fields: vec![$(
                        FieldSpec {
                            name: stringify!($field),
                            optional: <$ty as FieldKind>::OPTIONAL,
                        }
                    ),*],
                }
            ),*]
        }
    };
    (@to_python $name:ident { $($field:ident: $ty:ty),* }) => {
        impl<'py> IntoPyObject<'py> for $name {
            type Target = PyDict;
            type Output = Bound<'py, PyDict>;
            type Error = PyErr;

            #[allow(unused_variables)]
            fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
                let fields = PyDict::new(py);
                $( fields.set_item(stringify!($field), self.$field)?; )*
                Ok(fields)
            }
        }
    };
    (@from_python $name:ident { $($field:ident: $ty:ty),* }) => {
        impl<'py> FromPyObject<'_, 'py> for $name {
            type Error = PyErr;

            fn extract(object: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
                Ok($name {
                    $( $field: read_field(&object, stringify!($name), stringify!($field))? ),*
                })
            }
        }
    };
}

sdk_classes! {
    /// How to sample one `Policy.generate` call (`rollout_sdk.types`).
    #[derive(Debug)]
    to_python struct SamplingParams {
        pub max_new_tokens: u32,
        pub temperature: f32,
        pub top_p: f32,
        pub top_k: u32,
        pub stop_token_ids: Tuple<u32>,
        pub seed: u64,
    }

    /// One prompt to complete `n` times.
    #[derive(Debug)]
    to_python struct GenerationRequest {
        pub prompt_ids: Array<i64, 1>,
        pub n: u32,
    }

    /// One completion returned by `Policy.generate`.
    #[derive(Debug)]
    from_python struct Generation {
        pub token_ids: Array<i64, 1>,
        pub logprobs: Array<f32, 1>,
        pub finish_reason: String,
    }

    /// One training micro-batch (`Policy.train_step`, `Policy.values`); `[rows, width]`
    /// arrays.
    #[derive(Debug)]
    to_python struct TrainBatch {
        pub input_ids: Array<i64, 2>,
        pub attention_mask: Array<i64, 2>,
        pub loss_mask: Array<f32, 2>,
        pub advantages: Array<f32, 2>,
        pub old_logprobs: Array<f32, 2>,
        pub loss_scale: f32,
        pub objective: Objective,
        pub returns: Option<Array<f32, 2>>,
        pub old_values: Option<Array<f32, 2>>,
        pub row_staleness: Option<Array<i64, 1>>,
        pub first_logprobs: Option<Array<f32, 2>>,
    }

    #[derive(Debug)]
    to_python struct GrpoObjective {
        pub clip_low: f32,
        pub clip_high: f32,
        pub kl_coef: f32,
        pub temperature: f32,
        pub kl_penalty: String,
        pub rollout_correction: String,
        pub rollout_correction_cap: f32,
        pub rollout_correction_band: Tuple<f32>,
        pub rollout_correction_level: String,
    }

    #[derive(Debug)]
    to_python struct GspoObjective {
        pub clip_low: f32,
        pub clip_high: f32,
        pub kl_coef: f32,
        pub temperature: f32,
        pub rollout_correction: String,
        pub rollout_correction_cap: f32,
        pub rollout_correction_band: Tuple<f32>,
        pub rollout_correction_level: String,
    }

    #[derive(Debug)]
    to_python struct PpoObjective {
        pub clip_low: f32,
        pub clip_high: f32,
        pub kl_coef: f32,
        pub temperature: f32,
        pub value_clip: f32,
        pub value_coef: f32,
        pub train_policy: bool,
        pub rollout_correction: String,
        pub rollout_correction_cap: f32,
        pub rollout_correction_band: Tuple<f32>,
        pub rollout_correction_level: String,
    }

    #[derive(Debug)]
    to_python struct DpoObjective {
        pub beta: f32,
    }

    /// No fields: built with no arguments.
    #[derive(Debug)]
    to_python struct SftObjective {}

    /// A finished completion, as reward functions see it.
    #[derive(Debug)]
    to_python struct Sample {
        pub prompt: String,
        pub completion: String,
        pub record: Json,
        pub finish_reason: String,
    }

    /// How trainer ranks hold the policy (`Policy.shard`; `[train] sharding`, `[train.fsdp]`).
    #[derive(Debug)]
    to_python struct Sharding {
        pub mode: String,
        pub param_dtype: String,
        pub reduce_dtype: String,
        pub reshard_after_forward: bool,
        pub offload: bool,
    }

    /// What callbacks' `on_run_start` receives.
    #[derive(Debug)]
    to_python struct RunInfo {
        pub name: String,
        pub output_dir: String,
        pub total_steps: u64,
        pub start_step: u64,
        pub config: Json,
    }

    /// The cache geometry a policy that runs in the sampling engine reports.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    from_python struct KvLayout {
        pub num_layers: u64,
        pub num_kv_heads: u64,
        pub head_dim: u64,
        pub dtype_bytes: u64,
        pub max_positions: u64,
        pub available_bytes: u64,
    }

    /// One forward pass of the sampling engine (`rollout_sdk.engine`).
    #[derive(Debug)]
    to_python struct EngineStep {
        pub input_ids: Array<i64, 1>,
        pub positions: Array<i64, 1>,
        pub slot_mapping: Array<i64, 1>,
        pub query_start: Array<i64, 1>,
        pub context_slots: Array<i64, 2>,
        pub context_lens: Array<i64, 1>,
        pub sample_seq: Array<i64, 1>,
        pub draft_lens: Array<i64, 1>,
        pub temperature: Array<f32, 1>,
        pub top_p: Array<f32, 1>,
        pub top_k: Array<i64, 1>,
        pub uniforms: Array<f64, 3>,
        pub copy_from: Array<i64, 1>,
        pub copy_to: Array<i64, 1>,
        pub draft_with_model: bool,
    }

    /// The policy's answer to an [`EngineStep`].
    #[derive(Debug)]
    from_python struct EngineStepOutput {
        pub tokens: Array<i64, 2>,
        pub logprobs: Array<f32, 2>,
        pub counts: Array<i64, 1>,
        pub forward_seconds: f64,
    }

    /// A reward's verdict that one sample could not be scored (`rollout_sdk.reward`).
    #[derive(Debug)]
    from_python struct SampleFailure {
        pub reason: String,
        pub message: String,
    }

    /// An environment's answer to one policy turn.
    #[derive(Debug)]
    from_python struct StepResult {
        pub observation: String,
        pub reward: f64,
        pub done: bool,
        pub info: Unused,
    }

    /// Whose turn it is in a multi-agent episode, and the prompt that agent sees.
    #[derive(Debug)]
    from_python struct AgentTurn {
        pub agent: String,
        pub prompt: String,
    }

    /// A multi-agent environment's answer to one turn.
    #[derive(Debug)]
    from_python struct JointStepResult {
        pub rewards: BTreeMap<String, f64>,
        pub next_turn: Option<AgentTurn>,
        pub info: Unused,
    }

    /// One tensor of a policy's snapshot (`rollout_sdk.snapshot`).
    #[derive(Debug)]
    from_python struct HostTensor {
        pub dtype: String,
        pub shape: Vec<u64>,
        pub data: Buffer,
    }

    /// A safetensors file of a snapshot.
    #[derive(Debug)]
    from_python struct TensorFile {
        pub tensors: Mapping<HostTensor>,
        pub metadata: BTreeMap<String, String>,
    }
}

impl FieldKind for AgentTurn {}
impl FieldKind for Objective {}
impl FieldKind for Buffer {}
impl<V> FieldKind for Mapping<V> {}

/// The objective of a [`TrainBatch`]: one of the SDK's objective classes.
#[derive(Debug)]
pub enum Objective {
    Grpo(GrpoObjective),
    Gspo(GspoObjective),
    Ppo(PpoObjective),
    Dpo(DpoObjective),
    Sft(SftObjective),
}

/// The bytes of any contiguous buffer (`bytes`, a `uint8` array, a `memoryview`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buffer(pub Vec<u8>);

/// A Python mapping's items, in its order.
#[derive(Debug)]
pub struct Mapping<V>(pub Vec<(String, V)>);
