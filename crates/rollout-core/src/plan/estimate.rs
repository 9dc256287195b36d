//! The memory of each part of a role, by formula, and the phases of a step it is alive in.
//!
//! Every constant here is documented in docs/memory.md with how it was obtained; the CPU
//! ones were measured with `bench/memory` (`bench/results/memory.json`).

use super::model::{ModelShape, ParameterCounts};
use super::options::{Device, Dtype, Lora, Optimizer, PolicyOptions, Quantization};
use super::workload::Workload;

const MIB: u64 = 1 << 20;

/// Resident memory of a `rollout` process with Python, torch, transformers and the HF policy
/// imported, before the model's weights: 730 MiB on the 2-core x86-64 machines of
/// `bench/memory` (torch 2.11 CUDA wheel, transformers 5.17, Triton held back on a host
/// without a GPU driver). `rollout check` on the 1M-parameter model peaks at 637 and 731 MiB
/// on two such hosts (the libraries' resident pages differ); a training run touches about 25
/// MiB more of torch's libraries. Set between the two, nearer the higher.
pub const RUNTIME_BYTES: u64 = 730 * MIB;
/// Host memory a process adds once it initialises CUDA (driver, context, kernel images, and
/// the 50 MiB of Triton, loaded where there is a GPU); an estimate from typical torch CUDA
/// processes, not measured here (no GPU).
pub const CUDA_HOST_RUNTIME_BYTES: u64 = 1024 * MIB;
/// Device memory of a CUDA context, cuBLAS workspaces and the caching allocator's slack;
/// an estimate, not measured here.
pub const CUDA_CONTEXT_BYTES: u64 = 768 * MIB;
/// The controller of `rollout launch`: Python with data, reward and callback plugins that
/// need no model library; configs/distributed.toml's peaks at 53 MiB (torch is seeded when
/// something imports it, not imported to be seeded).
pub const CONTROLLER_RUNTIME_BYTES: u64 = 64 * MIB;
/// What importing torch and transformers adds to a process that holds no policy (a
/// controller or sandbox process loading a reward model or a tokenizer): a Python process
/// with NumPy peaks at 25 MiB, with torch and transformers' model classes at 645 MiB.
pub const MODEL_LIBRARIES_BYTES: u64 = 620 * MIB;
/// A sandbox process scoring rewards (`python -m rollout_sdk.sandbox`), before its plugins.
pub const SANDBOX_RUNTIME_BYTES: u64 = 100 * MIB;

/// Activation elements kept for the backward pass per token and decoder layer, as a multiple
/// of the hidden size and of the MLP's intermediate size: the inputs of the two norms, q, k,
/// v and their rotated copies, the attention output, the residual sums (about 11 x hidden)
/// and gate, up, the activation and its product (4 x intermediate). Fitted in bench/memory.
pub const ACTIVATION_HIDDEN: f64 = 11.0;
pub const ACTIVATION_INTERMEDIATE: f64 = 4.0;
/// Elements a frozen linear layer does not keep (its input, needed only for its weight's
/// gradient) when the base is frozen under LoRA: the MLP's input and its down projection's.
pub const FROZEN_SAVINGS_HIDDEN: f64 = 1.0;
pub const FROZEN_SAVINGS_INTERMEDIATE: f64 = 1.0;
/// What importing PEFT and bitsandbytes adds (LoRA, quantization, 8-bit AdamW): 52 MiB
/// measured over a process with torch and transformers' Llama imported.
pub const PEFT_BITSANDBYTES_BYTES: u64 = 52 * MIB;

/// Transient elements per token of a forward pass without gradients (generation, the
/// reference model): one layer's widest intermediates at a time.
pub const INFERENCE_HIDDEN: f64 = 4.0;
pub const INFERENCE_INTERMEDIATE: f64 = 2.0;
/// Bytes per quantized weight: int8 (LLM.int8: a byte and a float32 scale per row, counted
/// per weight for rows of 1024) and nf4 with double quantization (half a byte, an 8-bit
/// scale per 64 weights and a float32 per 256 scales).
pub const INT8_BYTES: f64 = 1.0 + 4.0 / 1024.0;
pub const NF4_BYTES: f64 = 0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0);
/// Bytes per parameter of bitsandbytes' 8-bit AdamW: two 8-bit moments and a float32 scale
/// per block of 256 for each.
pub const ADAMW_8BIT_BYTES: f64 = 2.0 + 8.0 / 256.0;
/// LoRA adapters are float32 whatever the base's dtype (PEFT's `autocast_adapter_dtype`).
pub const ADAPTER_DTYPE_BYTES: u64 = 4;
/// PPO's value head is float32 whatever the policy's dtype: a weight, its gradient and two
/// AdamW moments per parameter.
pub const VALUE_HEAD_BYTES_PER_PARAMETER: f64 = 16.0;
/// Float32 elements per token and hidden unit the value head's pass keeps: its input (the
/// last hidden state, detached and made contiguous), the first layer's output and its tanh.
pub const VALUE_ACTIVATION_HIDDEN: f64 = 3.0;

/// Parts of a step; each component is alive in some of them and a device's peak is the
/// largest sum over one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases(u8);

impl Phases {
    pub const LOAD: Phases = Phases(1);
    pub const GENERATE: Phases = Phases(2);
    pub const TRAIN: Phases = Phases(4);
    pub const CHECKPOINT: Phases = Phases(8);
    pub const ALL: Phases = Phases(15);
    /// Allocated on first use, then kept: everything but loading.
    pub const AFTER_LOAD: Phases = Phases(14);
    pub const NAMES: [(Phases, &'static str); 4] = [
        (Phases::LOAD, "load"),
        (Phases::GENERATE, "generate"),
        (Phases::TRAIN, "train"),
        (Phases::CHECKPOINT, "checkpoint"),
    ];

    pub fn with(self, other: Phases) -> Phases {
        Phases(self.0 | other.0)
    }

    pub fn contains(self, other: Phases) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn names(self) -> Vec<&'static str> {
        Self::NAMES
            .iter()
            .filter(|(phase, _)| self.contains(*phase))
            .map(|(_, name)| *name)
            .collect()
    }
}

/// One part of a role's memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Component {
    pub name: &'static str,
    pub device: Device,
    pub bytes: u64,
    pub detail: String,
    pub phases: Phases,
}

pub fn component(
    name: &'static str,
    device: Device,
    bytes: f64,
    phases: Phases,
    detail: String,
) -> Component {
    Component {
        name,
        device,
        bytes: bytes.max(0.0) as u64,
        detail,
        phases,
    }
}

/// Everything about the policy's weights that memory follows.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyMemory<'a> {
    pub shape: &'a ModelShape,
    pub options: &'a PolicyOptions,
    pub params: ParameterCounts,
    /// Trainable parameters of the model: every weight, or the LoRA adapters.
    pub trainable: u64,
    /// Bytes per trainable parameter (and its gradient and AdamW moment).
    pub trainable_bytes: u64,
    /// Parameters of PPO's value head (0 without one); float32 with their own AdamW.
    pub value_head: u64,
}

impl<'a> PolicyMemory<'a> {
    /// `value_head`: the run trains PPO's critic on the policy (`[algorithm] name = "ppo"`).
    pub fn new(shape: &'a ModelShape, options: &'a PolicyOptions, value_head: bool) -> Self {
        let params = shape.parameters();
        let value_head = if value_head {
            value_head_parameters(shape.hidden_size)
        } else {
            0
        };
        let (trainable, trainable_bytes) = match &options.lora {
            Some(lora) => (lora_parameters(shape, lora), ADAPTER_DTYPE_BYTES),
            None => (params.total(), options.dtype.bytes()),
        };
        PolicyMemory {
            shape,
            options,
            params,
            trainable,
            trainable_bytes,
            value_head,
        }
    }

    pub fn dtype_bytes(&self) -> u64 {
        self.options.dtype.bytes()
    }

    /// Bytes of the weights held on the device: the base (its linear layers quantized if
    /// asked) and the adapters.
    pub fn weights(&self) -> Component {
        let base =
            frozen_weights_bytes(&self.params, self.options.dtype, self.options.quantization);
        let adapters = match &self.options.lora {
            Some(_) => self.trainable * ADAPTER_DTYPE_BYTES,
            None => 0,
        };
        let mut detail = format!(
            "{} parameters in {}",
            count(self.params.total()),
            dtype_name(self.options.dtype)
        );
        if self.options.quantization != Quantization::None {
            detail.push_str(&format!(
                ", layer weights {}",
                quantization_name(self.options.quantization)
            ));
        }
        if let Some(lora) = &self.options.lora {
            detail.push_str(&format!(
                " + LoRA rank {} adapters: {} float32",
                lora.rank,
                count(self.trainable)
            ));
        }
        component(
            "weights",
            self.options.device,
            base + adapters as f64,
            Phases::ALL,
            detail,
        )
    }

    /// PPO's value head: its float32 weights, gradients and AdamW moments (created at the
    /// first value pass), and what its training pass keeps per token. `None` without one.
    pub fn value_head(&self, tokens: u64) -> Option<[Component; 2]> {
        if self.value_head == 0 {
            return None;
        }
        let h = self.shape.hidden_size as f64;
        let t = tokens as f64;
        Some([
            component(
                "value head",
                self.options.device,
                self.value_head as f64 * VALUE_HEAD_BYTES_PER_PARAMETER,
                Phases::AFTER_LOAD,
                format!(
                    "{} float32 parameters with gradients and their own AdamW",
                    count(self.value_head)
                ),
            ),
            component(
                "value activations",
                self.options.device,
                t * VALUE_ACTIVATION_HIDDEN * h * 4.0,
                Phases::TRAIN,
                format!("{tokens} tokens: the detached float32 hidden state, h and tanh(h)"),
            ),
        ])
    }

    /// Gradients of the trainable parameters (alive from the backward pass to the update).
    pub fn gradients(&self) -> Component {
        component(
            "gradients",
            self.options.device,
            (self.trainable * self.trainable_bytes) as f64,
            Phases::TRAIN,
            format!(
                "{} trainable x {} bytes",
                count(self.trainable),
                self.trainable_bytes
            ),
        )
    }

    /// The optimizer's moments, on the device or (offloaded) on the host with a host copy of
    /// the trained weights and their gradients.
    pub fn optimizer(&self) -> Vec<Component> {
        let (per_param, name) = match self.options.optimizer {
            Optimizer::Adamw => ((2 * self.trainable_bytes) as f64, "AdamW"),
            Optimizer::Adamw8bit => (ADAMW_8BIT_BYTES, "8-bit AdamW"),
        };
        let bytes = self.trainable as f64 * per_param;
        let detail = format!("{name}: {per_param:.2} bytes x {}", count(self.trainable));
        let offloaded = self.options.offload_optimizer && self.options.device != Device::Cpu;
        if !offloaded {
            return vec![component(
                "optimizer state",
                self.options.device,
                bytes,
                Phases::AFTER_LOAD,
                detail,
            )];
        }
        let copies = (2 * self.trainable * self.trainable_bytes) as f64;
        vec![component(
            "optimizer state (offloaded)",
            Device::Cpu,
            bytes + copies,
            Phases::AFTER_LOAD,
            format!("{detail}, plus host copies of the trained weights and gradients"),
        )]
    }

    /// Activations kept for the backward pass of a micro-batch of `tokens` positions, and
    /// the logits and their float32 log-softmax.
    pub fn activations(&self, tokens: u64) -> Vec<Component> {
        let h = self.shape.hidden_size as f64;
        let i = self.shape.intermediate_size as f64;
        let layers = self.shape.num_layers as f64;
        let b = self.dtype_bytes() as f64;
        let frozen = self.options.lora.is_some();
        let mut per_layer = ACTIVATION_HIDDEN * h + ACTIVATION_INTERMEDIATE * i;
        if frozen {
            per_layer -= FROZEN_SAVINGS_HIDDEN * h + FROZEN_SAVINGS_INTERMEDIATE * i;
        }
        let (elements, how) = if self.options.gradient_checkpointing {
            (
                layers * h + per_layer,
                "layer inputs + one layer recomputed",
            )
        } else {
            (layers * per_layer, "every layer")
        };
        let t = tokens as f64;
        vec![
            component(
                "activations",
                self.options.device,
                t * elements * b,
                Phases::TRAIN,
                format!("largest micro-batch: {tokens} tokens, {how}"),
            ),
            component(
                "logits",
                self.options.device,
                t * self.shape.vocab_size as f64 * logits_bytes(self.options.dtype),
                Phases::TRAIN,
                format!("{tokens} tokens x {} vocabulary", self.shape.vocab_size),
            ),
        ]
    }

    /// Whether the policy imports PEFT and bitsandbytes.
    pub fn imports_peft(&self) -> bool {
        self.options.lora.is_some()
            || self.options.quantization != Quantization::None
            || self.options.reference_quantization != Quantization::None
            || self.options.optimizer == Optimizer::Adamw8bit
    }

    /// The transient of a forward pass without gradients over `tokens` positions.
    pub fn inference(
        &self,
        name: &'static str,
        tokens: u64,
        logit_rows: u64,
        phases: Phases,
    ) -> Component {
        let h = self.shape.hidden_size as f64;
        let i = self.shape.intermediate_size as f64;
        let b = self.dtype_bytes() as f64;
        let bytes = tokens as f64 * (INFERENCE_HIDDEN * h + INFERENCE_INTERMEDIATE * i) * b
            + logit_rows as f64 * self.shape.vocab_size as f64 * logits_bytes(self.options.dtype);
        component(
            name,
            self.options.device,
            bytes,
            phases,
            format!("{tokens} tokens in one forward pass"),
        )
    }

    /// Bytes a checkpoint copies to host memory: the saved weights (the adapters only under
    /// LoRA) and the optimizer's state.
    pub fn snapshot_bytes(&self) -> u64 {
        let weights = match &self.options.lora {
            Some(_) => self.trainable * ADAPTER_DTYPE_BYTES,
            None => self.params.total() * self.dtype_bytes(),
        };
        let optimizer = match self.options.optimizer {
            Optimizer::Adamw => 2 * self.trainable * self.trainable_bytes,
            Optimizer::Adamw8bit => (self.trainable as f64 * ADAMW_8BIT_BYTES) as u64,
        };
        // PPO's value head: float32 weights (4 bytes) and AdamW moments (8).
        let head = self.value_head * (4 + 8);
        weights + optimizer + head
    }
}

/// Bytes of a frozen copy of a model's weights, its decoder layers' linear weights quantized.
pub fn frozen_weights_bytes(
    params: &ParameterCounts,
    dtype: Dtype,
    quantization: Quantization,
) -> f64 {
    let b = dtype.bytes() as f64;
    let linear = params.layer_linear_weights as f64;
    let rest = params.total().saturating_sub(params.layer_linear_weights) as f64;
    let per_linear = match quantization {
        Quantization::None => b,
        Quantization::Int8 => INT8_BYTES,
        Quantization::Nf4 => NF4_BYTES,
    };
    linear * per_linear + rest * b
}

/// Bytes per logit and token: the logits, their float32 copy and log-softmax temporary,
/// and in the backward pass their float32 gradient (and one in the model's dtype).
pub fn logits_bytes(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::Float32 => 12.0,
        Dtype::Bfloat16 | Dtype::Float16 => 16.0,
    }
}

/// Parameters of PPO's value head on a model of `hidden` units, as
/// `python_plugins/value_head.py` builds it: `Linear(hidden, hidden)`, tanh, `Linear(hidden, 1)`,
/// with biases (keep in step with that file).
pub fn value_head_parameters(hidden: u64) -> u64 {
    hidden * hidden + hidden + hidden + 1
}

/// Parameters of LoRA adapters of `rank` on every decoder layer's `target_modules`:
/// `rank x (in + out)` per adapted linear layer. Names the model does not have add nothing
/// (the policy rejects them when it loads).
pub fn lora_parameters(shape: &ModelShape, lora: &Lora) -> u64 {
    let per_layer: u64 = shape
        .linears()
        .iter()
        .filter(|linear| lora.target_modules.iter().any(|t| t == linear.name))
        .map(|linear| lora.rank * (linear.in_features + linear.out_features))
        .sum();
    per_layer.saturating_mul(shape.num_layers)
}

/// The KV cache of the sampling engine for `workload`: the blocks a request wants with the
/// engine's headroom of a half, capped by the budget; on the CPU only the written blocks are
/// resident (the cache is `calloc`ed), on CUDA all of it.
pub fn kv_cache(
    shape: &ModelShape,
    draft: Option<&ModelShape>,
    options: &PolicyOptions,
    workload: &Workload,
    config: &crate::config::Config,
    device_free: Option<u64>,
) -> Component {
    let engine = &config.engine;
    let b = options.dtype.bytes();
    let per_slot =
        shape.kv_elements_per_token() * b + draft.map_or(0, |d| d.kv_elements_per_token() * b);
    let block = (engine.block_size as u64).max(1);
    let wanted = workload.kv_blocks_wanted(config);
    if !engine.enabled {
        // Hugging Face `generate`: a dynamic cache of every row, grown by concatenation.
        let bytes = 2 * workload.rows() * workload.sequence_tokens() * per_slot;
        return component(
            "KV cache",
            options.device,
            bytes as f64,
            Phases::GENERATE,
            format!(
                "HF generate: {} rows x {} tokens, twice while it grows",
                workload.rows(),
                workload.sequence_tokens()
            ),
        );
    }
    let budget = if engine.kv_cache_bytes > 0 {
        Some(engine.kv_cache_bytes)
    } else {
        device_free.map(|free| (free as f64 * engine.kv_cache_fraction) as u64)
    };
    let max_blocks = budget.map_or(u64::MAX, |bytes| bytes / per_slot.max(1) / block);
    let allocated = (wanted * 3 / 2).min(max_blocks).max(1);
    let resident = match options.device {
        Device::Cpu => wanted.min(allocated),
        Device::Cuda(_) => allocated,
    };
    component(
        "KV cache",
        options.device,
        (resident * block * per_slot) as f64,
        Phases::AFTER_LOAD,
        format!(
            "{resident} of {allocated} blocks of {block} tokens resident, {} bytes per token",
            per_slot
        ),
    )
}

pub fn count(n: u64) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}K", n as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.2}B", n as f64 / 1e9),
    }
}

pub fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Float32 => "float32",
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
    }
}

pub fn quantization_name(quantization: Quantization) -> &'static str {
    match quantization {
        Quantization::None => "none",
        Quantization::Int8 => "int8",
        Quantization::Nf4 => "nf4",
    }
}
