//! The processes of a run and what each holds: `rollout run` is one process with the policy,
//! the trainer and the reference; `rollout launch` a controller, generation workers and
//! trainer ranks; reward models run where the rewards are scored.

use super::estimate::{
    CONTROLLER_RUNTIME_BYTES, CUDA_CONTEXT_BYTES, CUDA_HOST_RUNTIME_BYTES, Component,
    PEFT_BITSANDBYTES_BYTES, Phases, RUNTIME_BYTES, component, count, frozen_weights_bytes,
    kv_cache,
};
use super::inputs::{Inputs, Role};
use super::options::{Device, Quantization};
use super::plugin_processes::{controller_model_libraries, place_sandboxes, plain_runtime};
use super::workload::Workload;
use crate::config::{FsdpConfig, Sharding};

/// `rollout run`: every role in one process (plus the sandbox processes, if any).
pub fn in_process(inputs: &Inputs<'_>) -> Vec<Role> {
    let mut components = runtime(inputs.policy.options.device, process_runtime(inputs));
    let overlapped = inputs.config.overlaps_generation_in_process();
    components.extend(policy_in_process(inputs, overlapped));
    let mut roles = vec![Role {
        name: "run".into(),
        components,
    }];
    place_sandboxes(inputs, &mut roles);
    roles
}

/// A policy's weights, generation and training in the run's process. `overlapped`:
/// generation runs on a copy of the policy during training (`cluster.max_staleness` > 0),
/// so its memory adds to training's.
fn policy_in_process(inputs: &Inputs<'_>, overlapped: bool) -> Vec<Component> {
    let workload = Workload::of(inputs.config, inputs.policy.shape, inputs.samples, 1);
    let mut components = vec![inputs.policy.weights()];
    if inputs.samples {
        let mut sampling = generation(inputs, &workload);
        if overlapped {
            sampling.extend(generation_copy(inputs));
            for part in &mut sampling {
                part.phases = Phases::ALL;
            }
        }
        components.extend(sampling);
    }
    components.extend(training(inputs, &workload, 1, true));
    components
}

/// The generation copy of an overlapped run and the weight versions handed to it: the one
/// it serves and the next, exported as float32 buckets.
fn generation_copy(inputs: &Inputs<'_>) -> [Component; 2] {
    let copy = Component {
        name: "generation copy",
        ..inputs.policy.weights()
    };
    let versions = component(
        "weight versions",
        Device::Cpu,
        (2 * inputs.policy.trainable * 4) as f64,
        Phases::ALL,
        "float32 buckets: the version the generation copy serves and the next".into(),
    );
    [copy, versions]
}

/// Another agent of a multi-agent run: its own policy in the run's process.
pub fn agent_in_process(name: &str, inputs: &Inputs<'_>) -> Role {
    Role {
        name: format!("agent {name}"),
        components: policy_in_process(inputs, false),
    }
}

/// `rollout launch`: the controller, `[cluster] workers` generation workers and
/// `[cluster] trainers` trainer ranks.
pub fn launch(inputs: &Inputs<'_>) -> Vec<Role> {
    let cluster = &inputs.config.cluster;
    let device = inputs.policy.options.device;
    let mut controller = vec![plain_runtime(
        CONTROLLER_RUNTIME_BYTES,
        "Python and the data, reward and callback plugins",
    )];
    controller.extend(controller_model_libraries(inputs));
    let mut roles = vec![Role {
        name: "controller".into(),
        components: controller,
    }];
    if inputs.samples {
        let workers = u64::from(cluster.workers.max(1));
        let workload = Workload::of(inputs.config, inputs.policy.shape, true, workers);
        for index in 0..workers {
            let mut components = runtime(device, process_runtime(inputs));
            components.push(inputs.policy.weights());
            components.extend(generation(inputs, &workload));
            components.push(component(
                "weight sync buffers",
                Device::Cpu,
                (2 * cluster.weight_bucket_bytes) as f64,
                Phases::CHECKPOINT,
                "a received bucket and the one being relayed".into(),
            ));
            roles.push(Role {
                name: format!("worker {index}"),
                components,
            });
        }
    }
    let ranks = u64::from(cluster.trainers.max(1));
    let workload = Workload::of(inputs.config, inputs.policy.shape, inputs.samples, ranks);
    for rank in 0..ranks {
        let mut components = runtime(device, process_runtime(inputs));
        if inputs.config.train.sharding == Sharding::Fsdp {
            components.extend(sharded_trainer_rank(inputs, &workload, ranks, rank == 0));
            roles.push(Role {
                name: format!("trainer {rank}"),
                components,
            });
            continue;
        }
        components.push(inputs.policy.weights());
        components.extend(training(inputs, &workload, ranks, rank == 0));
        if inputs.samples && rank == 0 {
            components.push(component(
                "weight export",
                Device::Cpu,
                (inputs.policy.trainable * 4) as f64,
                Phases::CHECKPOINT,
                "float32 copies of the trained weights for the workers".into(),
            ));
        }
        roles.push(Role {
            name: format!("trainer {rank}"),
            components,
        });
    }
    place_sandboxes(inputs, &mut roles);
    roles
}

/// The baseline of a process holding the policy.
fn process_runtime(inputs: &Inputs<'_>) -> u64 {
    if inputs.policy.imports_peft() {
        RUNTIME_BYTES + PEFT_BITSANDBYTES_BYTES
    } else {
        RUNTIME_BYTES
    }
}

/// The process baseline, and on CUDA the driver's host memory and the device's context.
fn runtime(device: Device, host_bytes: u64) -> Vec<Component> {
    let mut parts = vec![component(
        "runtime",
        Device::Cpu,
        host_bytes as f64,
        Phases::ALL,
        "Python, torch, transformers and the plugins, before any weight".into(),
    )];
    if let Device::Cuda(_) = device {
        parts.push(component(
            "CUDA runtime (host)",
            Device::Cpu,
            CUDA_HOST_RUNTIME_BYTES as f64,
            Phases::ALL,
            "driver and kernel images (estimate)".into(),
        ));
        parts.push(component(
            "CUDA context",
            device,
            CUDA_CONTEXT_BYTES as f64,
            Phases::ALL,
            "context, cuBLAS workspace, allocator slack (estimate)".into(),
        ));
    }
    parts
}

/// The sampling engine's KV cache, its forward passes and the draft model.
fn generation(inputs: &Inputs<'_>, workload: &Workload) -> Vec<Component> {
    let config = inputs.config;
    let policy = &inputs.policy;
    let mut parts = Vec::new();
    if let Some(draft) = &inputs.draft {
        let bytes = frozen_weights_bytes(
            &draft.parameters(),
            policy.options.dtype,
            Quantization::None,
        );
        parts.push(component(
            "draft model",
            policy.options.device,
            bytes,
            Phases::ALL,
            format!("{} parameters", count(draft.parameters().total())),
        ));
    }
    parts.push(kv_cache(
        policy.shape,
        inputs.draft.as_ref(),
        policy.options,
        workload,
        config,
        inputs.device_free,
    ));
    let tokens = (config.engine.max_batch_tokens as u64)
        .min(workload.rows() * workload.sequence_tokens())
        .max(1);
    let rows = workload.rows().min(config.engine.max_running as u64);
    parts.push(policy.inference("generation forward", tokens, rows, Phases::GENERATE));
    parts
}

/// Gradients, optimizer, activations, the reference and checkpoint copies of one trainer
/// (of `ranks`); `first` holds the checkpoint copy.
fn training(inputs: &Inputs<'_>, workload: &Workload, ranks: u64, first: bool) -> Vec<Component> {
    let policy = &inputs.policy;
    let options = policy.options;
    let tokens = train_tokens(inputs, workload, ranks, true);
    let mut parts = vec![policy.gradients()];
    parts.extend(policy.optimizer());
    parts.extend(policy.activations(tokens));
    parts.extend(policy.value_head(tokens).into_iter().flatten());
    if ranks > 1 {
        parts.push(component(
            "gradient all-reduce",
            options.device,
            (policy.trainable * 4) as f64,
            Phases::TRAIN,
            "flattened float32 gradient buckets".into(),
        ));
    }
    parts.extend(reference(inputs, tokens));
    if first {
        parts.push(snapshot(inputs));
    }
    parts
}

/// Token positions of a rank's largest training micro-batch. `may_share`: whether the
/// policy may run each distinct prompt once (sharded ranks never do).
fn train_tokens(inputs: &Inputs<'_>, workload: &Workload, ranks: u64, may_share: bool) -> u64 {
    let config = inputs.config;
    let policy = &inputs.policy;
    let options = policy.options;
    let micro = config.train.micro_batch_tokens as u64;
    // The value head needs every position's hidden state: PPO's passes share no prompts.
    let share = may_share
        && options.share_prompt_prefix
        && !options.gradient_checkpointing
        && policy.value_head == 0;
    let mut tokens = if inputs.samples {
        workload.train_tokens(micro, share)
    } else {
        let pairs = if inputs.pairs { 2 } else { 1 };
        workload.supervised_tokens(workload.prompts * pairs, micro)
    };
    if let Some(sft) = &config.sft {
        let rows = (sft.batch_size as u64).div_ceil(ranks);
        tokens = tokens.max(workload.supervised_tokens(rows, micro));
    }
    tokens
}

/// The memory of one FSDP2-sharded trainer rank (`[train] sharding = "fsdp"`): a `1/ranks`
/// shard of the weights, gradients and optimizer state (in host memory with
/// `[train.fsdp] offload`), the blocks gathered while they compute, and the activations,
/// reference and checkpoint copy as a replicated rank has them; `first` (rank 0) also holds
/// the whole weights it gathers for the generation workers.
fn sharded_trainer_rank(
    inputs: &Inputs<'_>,
    workload: &Workload,
    ranks: u64,
    first: bool,
) -> Vec<Component> {
    let policy = &inputs.policy;
    let fsdp = &inputs.config.train.fsdp;
    let device = policy.options.device;
    let state_device = if fsdp.offload { Device::Cpu } else { device };
    // This rank's share of a part of the state, where the state lives.
    let shard = |part: Component, name: &'static str| Component {
        name,
        device: state_device,
        bytes: part.bytes / ranks,
        detail: format!("1/{ranks} of {}", part.detail),
        ..part
    };
    let mut parts = vec![shard(policy.weights(), "weights")];
    parts.extend(loading(inputs, device));
    parts.push(gathered(inputs, fsdp, device));
    if device == Device::Cpu {
        parts.push(freed_blocks(inputs, fsdp));
    }
    parts.push(shard(policy.gradients(), "gradients"));
    parts.extend(accumulated_gradients(inputs, workload));
    let optimizer = policy.optimizer().into_iter();
    parts.extend(optimizer.map(|part| shard(part, "optimizer state")));
    let tokens = train_tokens(inputs, workload, ranks, false);
    parts.extend(policy.activations(tokens));
    parts.extend(policy.value_head(tokens).into_iter().flatten());
    for reference in reference(inputs, tokens) {
        let sharded = reference.name == "reference model";
        parts.push(Component {
            bytes: if sharded {
                reference.bytes / ranks
            } else {
                reference.bytes
            },
            ..reference
        });
    }
    let snapshot = snapshot(inputs);
    parts.push(Component {
        bytes: snapshot.bytes / ranks,
        detail: format!("this rank's 1/{ranks}: {}", snapshot.detail),
        ..snapshot
    });
    if first && inputs.samples {
        parts.push(component(
            "weight export",
            Device::Cpu,
            (policy.trainable * 4) as f64,
            Phases::CHECKPOINT,
            "the whole float32 weights gathered for the workers, one tensor at a time".into(),
        ));
    }
    parts
}

/// Each rank loads the whole model before sharding it. On the CPU the loaded tensors are
/// the pages of the safetensors file, mapped while `fully_shard` copies this rank's rows out
/// of them; on a GPU the whole model sits on the device while the file's pages are mapped
/// in host memory.
fn loading(inputs: &Inputs<'_>, device: Device) -> Vec<Component> {
    let whole = inputs.policy.weights().bytes as f64;
    let mut parts = vec![component(
        "whole weights (loading)",
        device,
        whole,
        Phases::LOAD,
        "the model as loaded, before it is sharded and freed".into(),
    )];
    if device != Device::Cpu {
        parts.push(component(
            "mapped weights file",
            Device::Cpu,
            whole,
            Phases::LOAD,
            "safetensors pages mapped while the weights are read".into(),
        ));
    }
    parts
}

/// Parameters FSDP2 holds unsharded while they compute: the root's (embeddings, final norm,
/// LM head: gathered for the whole forward and backward pass) and two decoder blocks (the one
/// computing and the one prefetched), in the dtype they compute in.
fn gathered(inputs: &Inputs<'_>, fsdp: &FsdpConfig, device: Device) -> Component {
    let params = &inputs.policy.params;
    let layers = inputs.policy.shape.num_layers.max(1);
    let root = params.embedding + params.final_norm + params.lm_head;
    let block = params.layers / layers;
    let unsharded = root + 2 * block.min(params.layers);
    let bytes = fsdp
        .param_dtype
        .map_or(inputs.policy.dtype_bytes(), |dtype| dtype.bytes());
    component(
        "gathered parameters",
        device,
        (unsharded * bytes) as f64,
        Phases::TRAIN,
        format!(
            "root (embeddings, norm, LM head) and two blocks: {} parameters x {bytes} bytes",
            count(unsharded)
        ),
    )
}

/// On the host, the block-sized buffers a sharded rank frees every step (gathered
/// parameters, unsharded gradients) that jemalloc keeps for reuse but cannot always reuse
/// for the next, differently sized one: two blocks of each, measured on 2 and 4 CPU ranks
/// (bench/sharding.py). Returning them at once instead made each step 1.8x slower.
fn freed_blocks(inputs: &Inputs<'_>, fsdp: &FsdpConfig) -> Component {
    let params = &inputs.policy.params;
    let block = params.layers / inputs.policy.shape.num_layers.max(1);
    let bytes = fsdp
        .param_dtype
        .map_or(inputs.policy.dtype_bytes(), |dtype| dtype.bytes());
    component(
        "freed blocks kept",
        Device::Cpu,
        (4 * block.min(params.layers) * bytes) as f64,
        Phases::TRAIN,
        format!(
            "two blocks' gathered parameters and unsharded gradients, freed and kept for \
             reuse: 4 x {} parameters x {bytes} bytes",
            count(block)
        ),
    )
}

/// Micro-batches after the first of an update accumulate unsharded gradients (they are
/// reduce-scattered only in the last one's backward pass): the whole trainable gradient, in
/// the policy's dtype. `None` when a rank gets one micro-batch per update.
fn accumulated_gradients(inputs: &Inputs<'_>, workload: &Workload) -> Option<Component> {
    let micro = (inputs.config.train.micro_batch_tokens as u64).max(1);
    // `workload` is already this rank's share of the step.
    let per_rank = (workload.rows() * workload.sequence_tokens()).div_ceil(micro);
    if per_rank <= 1 {
        return None;
    }
    let policy = &inputs.policy;
    Some(component(
        "accumulated gradients",
        policy.options.device,
        (policy.trainable * policy.trainable_bytes) as f64,
        Phases::TRAIN,
        format!("{per_rank} micro-batches per rank: unsharded until the last one's backward pass"),
    ))
}

fn reference(inputs: &Inputs<'_>, tokens: u64) -> Vec<Component> {
    let policy = &inputs.policy;
    let device = policy.options.device;
    let Some(reference) = &inputs.reference else {
        return Vec::new();
    };
    let mut parts = Vec::new();
    match reference {
        None => parts.push(component(
            "reference model",
            device,
            0.0,
            Phases::AFTER_LOAD,
            "the base with the LoRA adapters disabled: no copy".into(),
        )),
        Some(model) => {
            let params = model.shape.parameters();
            parts.push(component(
                "reference model",
                device,
                frozen_weights_bytes(&params, policy.options.dtype, model.quantization),
                Phases::AFTER_LOAD,
                format!(
                    "{} frozen parameters, loaded at the first update",
                    count(params.total())
                ),
            ));
        }
    }
    parts.push(policy.inference("reference forward", tokens, tokens, Phases::TRAIN));
    parts
}

/// The host copy of a checkpoint, taken at the step boundary; with background writes and
/// checkpoints during the run it is still being written while the next step trains. A
/// checkpoint written in the foreground (the run's last one always is) streams host tensors
/// to the file as they are: no copy on the host, one from a device.
fn snapshot(inputs: &Inputs<'_>) -> Component {
    let config = inputs.config;
    let checkpoint = &config.checkpoint;
    let mid_run = (checkpoint.every > 0 && checkpoint.every < config.run.steps)
        || (config.sft.is_some() && config.run.steps > 0);
    // A background write (about 0.3 s per 100 MB) overlaps the next step's generation.
    let overlaps = checkpoint.background && mid_run;
    let copies = match inputs.policy.options.device {
        Device::Cpu => u64::from(overlaps),
        // A host tensor from the device, then (in the background) the bytes the writer holds.
        Device::Cuda(_) => 1 + u64::from(overlaps),
    };
    component(
        "checkpoint copy",
        Device::Cpu,
        (copies * inputs.policy.snapshot_bytes()) as f64,
        if overlaps {
            Phases::CHECKPOINT.with(Phases::GENERATE)
        } else {
            Phases::CHECKPOINT
        },
        if overlaps {
            "saved weights and optimizer state, written in the background during generation".into()
        } else {
            "saved weights and optimizer state, held until written".into()
        },
    )
}
