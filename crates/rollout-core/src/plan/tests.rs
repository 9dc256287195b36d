//! The planner on whole configs: exact bytes of weights, gradients and optimizer state, and
//! what LoRA, quantization, the KL reference, PPO's value head and the launch roles change.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use super::estimate::{ADAMW_8BIT_BYTES, INT8_BYTES, NF4_BYTES};
use super::*;

/// The bench's small Llama: hidden 512, 8 layers, MLP 1376, 56 tokens: 25,362,944 parameters.
const SMALL: &str = r#"{"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1376,
    "vocab_size": 56, "max_position_embeddings": 128, "tie_word_embeddings": false}"#;
const PARAMS: u64 = 25_362_944;
const LAYER_LINEAR: u64 = 8 * (4 * 512 * 512 + 3 * 512 * 1376);

struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("model")).unwrap();
        std::fs::write(dir.path().join("model/config.json"), SMALL).unwrap();
        Setup { dir }
    }

    fn model(&self) -> PathBuf {
        self.dir.path().join("model")
    }

    /// A config with `options` spliced into the policy's table and `extra` appended.
    fn load(&self, options: &str, extra: &str) -> LoadedConfig {
        self.load_with(options, extra, &[])
    }

    /// The same with `--set` overrides.
    fn load_with(&self, options: &str, extra: &str, overrides: &[String]) -> LoadedConfig {
        let text = format!(
            "[policy]\nplugin = \"python_plugins.hf_policy:HFCausalLM\"\n\
             options = {{ model_path = \"{}\"{options} }}\n\
             [data]\nplugin = \"d:D\"\n[[rewards]]\nplugin = \"r:R\"\n\
             [rollout]\nprompts_per_step = 8\ngroup_size = 8\nmax_new_tokens = 32\n\
             [run]\nplan_prompt_tokens = 6\n{extra}",
            self.model().display()
        );
        crate::config::load_text(Path::new("plan.toml"), text, overrides).unwrap()
    }

    fn plan(&self, options: &str, extra: &str) -> Plan {
        plan(&self.load(options, extra), Mode::Run, None).unwrap()
    }
}

fn part(plan: &Plan, role: usize, name: &str) -> u64 {
    plan.roles[role]
        .devices
        .iter()
        .flat_map(|d| &d.components)
        .filter(|c| c.name == name)
        .map(|c| c.bytes)
        .sum()
}

fn has(plan: &Plan, name: &str) -> bool {
    plan.roles[0]
        .devices
        .iter()
        .flat_map(|d| &d.components)
        .any(|c| c.name == name)
}

#[test]
fn full_fp32_training_is_16_bytes_per_parameter_plus_the_rest() {
    let setup = Setup::new();
    let plan = setup.plan("", "");
    assert_eq!(plan.model.parameters, PARAMS);
    assert_eq!(plan.model.trainable_parameters, PARAMS);
    assert_eq!(part(&plan, 0, "weights"), 4 * PARAMS);
    assert_eq!(part(&plan, 0, "gradients"), 4 * PARAMS);
    assert_eq!(part(&plan, 0, "optimizer state"), 8 * PARAMS);
    assert!(!has(&plan, "reference model"));
    let device = &plan.roles[0].devices[0];
    assert_eq!(device.device, "cpu");
    assert_eq!(device.peak_phase, "train");
    assert_eq!(plan.devices.len(), 1);
}

#[test]
fn bfloat16_halves_weights_gradients_and_moments() {
    let setup = Setup::new();
    let plan = setup.plan(", dtype = \"bfloat16\"", "");
    assert_eq!(part(&plan, 0, "weights"), 2 * PARAMS);
    assert_eq!(part(&plan, 0, "gradients"), 2 * PARAMS);
    assert_eq!(part(&plan, 0, "optimizer state"), 4 * PARAMS);
}

#[test]
fn kl_loads_a_reference_copy_unless_lora() {
    let setup = Setup::new();
    let kl = "[algorithm]\nkl_coef = 0.04\n";
    let plan = setup.plan("", kl);
    assert_eq!(part(&plan, 0, "reference model"), 4 * PARAMS);
    assert!(has(&plan, "reference forward"));
    let quantized = setup.plan(", reference_quantization = \"int8\"", kl);
    let expected = LAYER_LINEAR as f64 * INT8_BYTES + ((PARAMS - LAYER_LINEAR) * 4) as f64;
    assert_eq!(part(&quantized, 0, "reference model"), expected as u64);
    let lora = setup.plan(", lora_rank = 8", kl);
    assert_eq!(part(&lora, 0, "reference model"), 0);
}

#[test]
fn lora_trains_only_the_adapters() {
    let setup = Setup::new();
    let plan = setup.plan(", lora_rank = 16", "");
    // q, k, v, o of 512 x 512 each: 16 x (512 + 512) per module, 4 modules, 8 layers.
    let adapters = 8 * 4 * 16 * (512 + 512);
    assert_eq!(plan.model.trainable_parameters, adapters);
    assert_eq!(part(&plan, 0, "weights"), 4 * PARAMS + 4 * adapters);
    assert_eq!(part(&plan, 0, "gradients"), 4 * adapters);
    assert_eq!(part(&plan, 0, "optimizer state"), 8 * adapters);
    let full = setup.plan("", "");
    assert!(part(&plan, 0, "activations") < part(&full, 0, "activations"));
    let mlp = setup.plan(
        ", lora_rank = 16, lora_target_modules = [\"gate_proj\", \"down_proj\"]",
        "",
    );
    assert_eq!(mlp.model.trainable_parameters, 8 * 16 * 2 * (512 + 1376));
}

#[test]
fn quantized_base_stores_layer_weights_in_fewer_bits() {
    let setup = Setup::new();
    let rest = ((PARAMS - LAYER_LINEAR) * 4) as f64;
    let adapters = 4 * 8 * 4 * 16 * 1024;
    for (name, per_weight) in [("int8", INT8_BYTES), ("nf4", NF4_BYTES)] {
        let plan = setup.plan(&format!(", lora_rank = 16, quantization = \"{name}\""), "");
        let expected = (LAYER_LINEAR as f64 * per_weight + rest) as u64 + adapters;
        assert_eq!(part(&plan, 0, "weights"), expected, "{name}");
    }
}

#[test]
fn eight_bit_adam_and_offloading() {
    let setup = Setup::new();
    let plan = setup.plan(", optimizer = \"adamw_8bit\"", "");
    assert_eq!(
        part(&plan, 0, "optimizer state"),
        (PARAMS as f64 * ADAMW_8BIT_BYTES) as u64
    );
    // On CUDA the offloaded state (and host copies of weights and gradients) is host memory.
    let cuda = setup.plan(", device = \"cuda:1\", offload_optimizer = true", "");
    let role = &cuda.roles[0];
    let host = role.devices.iter().find(|d| d.device == "cpu").unwrap();
    let state = host
        .components
        .iter()
        .find(|c| c.name == "optimizer state (offloaded)")
        .unwrap();
    assert_eq!(state.bytes, 8 * PARAMS + 8 * PARAMS);
    let device = role.devices.iter().find(|d| d.device == "cuda:1").unwrap();
    assert!(
        device
            .components
            .iter()
            .all(|c| !c.name.starts_with("optimizer"))
    );
    // No memory limit: the device cannot be checked here, and says so.
    let check = cuda.devices.iter().find(|d| d.device == "cuda:1").unwrap();
    assert_eq!(check.fits, None);
    assert!(
        cuda.notes
            .iter()
            .any(|n| n.contains("cuda:1 cannot be checked"))
    );
}

#[test]
fn ppo_value_head_is_float32_with_its_own_adamw() {
    let shape = ModelShape::parse(Path::new("config.json"), SMALL).unwrap();
    let setup = Setup::new();
    let loaded = setup.load(", dtype = \"bfloat16\", optimizer = \"adamw_8bit\"", "");
    let options = PolicyOptions::read(&loaded, false).unwrap();
    let grpo = PolicyMemory::new(&shape, &options, false);
    let ppo = PolicyMemory::new(&shape, &options, true);
    assert!(grpo.value_head(100).is_none());
    // Linear(512, 512) and Linear(512, 1), with biases.
    let head = 512 * 512 + 512 + 512 + 1;
    assert_eq!(ppo.value_head, head);
    let [weights, activations] = ppo.value_head(100).unwrap();
    assert_eq!(weights.bytes, 16 * head);
    assert_eq!(activations.bytes, 100 * 3 * 512 * 4);
    // The model's own parts do not change.
    assert_eq!(ppo.weights(), grpo.weights());
    assert_eq!(ppo.gradients(), grpo.gradients());
    assert_eq!(ppo.optimizer(), grpo.optimizer());
    assert_eq!(ppo.snapshot_bytes() - grpo.snapshot_bytes(), 12 * head);
}

#[test]
fn the_algorithm_decides_sampling_and_the_reference() {
    let setup = Setup::new();
    let grpo = setup.plan("", "");
    assert_eq!(grpo.algorithm, "grpo");
    assert!(has(&grpo, "KV cache"));
    // DPO samples nothing and always compares with the reference; SFT neither.
    let dpo = setup.plan("", "[algorithm]\nname = \"dpo\"\n");
    assert_eq!(dpo.algorithm, "dpo");
    assert!(!has(&dpo, "KV cache"));
    assert_eq!(part(&dpo, 0, "reference model"), 4 * PARAMS);
    let sft = setup.plan("", "[algorithm]\nname = \"sft\"\n");
    assert_eq!(sft.algorithm, "sft");
    assert!(!has(&sft, "KV cache") && !has(&sft, "reference model"));
    let reinforce = setup.plan("", "[algorithm]\nname = \"reinforce_pp\"\n");
    assert_eq!(reinforce.algorithm, "reinforce_pp");
    assert!(!has(&reinforce, "value head"));
}

#[test]
fn ppo_adds_the_value_head_and_shares_no_prompts() {
    let setup = Setup::new();
    let head = 512 * 512 + 512 + 512 + 1;
    let grpo = setup.plan("", "");
    let ppo = setup.plan("", "[algorithm]\nname = \"ppo\"\n");
    assert_eq!(ppo.algorithm, "ppo");
    assert_eq!(ppo.model.trainable_parameters, PARAMS + head);
    assert_eq!(part(&ppo, 0, "value head"), 16 * head);
    assert_eq!(part(&ppo, 0, "gradients"), part(&grpo, 0, "gradients"));
    // 64 rows of 38 tokens, 3 float32 hidden-sized elements each.
    assert_eq!(part(&ppo, 0, "value activations"), 64 * 38 * 3 * 512 * 4);
    assert!(!has(&grpo, "value head") && !has(&grpo, "value activations"));
    // Prompts of 6 tokens before 32 are not worth sharing, so GRPO pads as PPO does; with
    // prompts of 64 GRPO's pass runs each prompt once, and PPO's (which needs every
    // position's hidden state) does not.
    let long = ["run.plan_prompt_tokens=64".to_string()];
    let grpo = plan(&setup.load_with("", "", &long), Mode::Run, None).unwrap();
    let ppo = setup.load_with("", "[algorithm]\nname = \"ppo\"\n", &long);
    let ppo = plan(&ppo, Mode::Run, None).unwrap();
    assert_eq!(
        part(&grpo, 0, "activations") * 64 * 96,
        part(&ppo, 0, "activations") * (8 * 64 + 64 * 32)
    );
}

#[test]
fn gradient_checkpointing_keeps_layer_inputs_only() {
    let setup = Setup::new();
    let full = part(&setup.plan("", ""), 0, "activations");
    let checkpointed = part(
        &setup.plan(", gradient_checkpointing = true", ""),
        0,
        "activations",
    );
    assert!(checkpointed * 4 < full, "{checkpointed} vs {full}");
    // Smaller micro-batches, smaller activations.
    let small = part(
        &setup.plan("", "[train]\nmicro_batch_tokens = 512\n"),
        0,
        "activations",
    );
    assert!(small * 4 < full);
}

#[test]
fn only_a_background_checkpoint_during_the_run_is_copied_on_the_host() {
    let setup = Setup::new();
    let copy = |extra: &str| part(&setup.plan("", extra), 0, "checkpoint copy");
    let state = 4 * PARAMS + 8 * PARAMS;
    assert!(copy("[checkpoint]\nevery = 10\n") >= state);
    // At the end only, or in the foreground: written from the tensors as they are.
    assert_eq!(copy(""), 0);
    assert_eq!(copy("[checkpoint]\nevery = 10\nbackground = false\n"), 0);
    assert_eq!(copy("[checkpoint]\nevery = 100\n"), 0);
}

#[test]
fn generation_overlapping_training_adds_its_copy_and_generates_while_training() {
    let setup = Setup::new();
    let synchronous = setup.plan("", "");
    let overlapped = setup.plan("", "[cluster]\nmax_staleness = 1\n");
    assert!(!has(&synchronous, "generation copy"));
    assert_eq!(part(&overlapped, 0, "generation copy"), 4 * PARAMS);
    assert_eq!(part(&overlapped, 0, "weight versions"), 2 * 4 * PARAMS);
    // Training no longer frees the phase generation held: the peak holds both at once.
    let peak = |plan: &Plan| plan.roles[0].devices[0].peak_bytes;
    let added = 4 * PARAMS + 2 * 4 * PARAMS;
    assert!(peak(&overlapped) >= peak(&synchronous) + added);
    let forward_phases = |plan: &Plan| {
        plan.roles[0].devices[0]
            .components
            .iter()
            .find(|c| c.name == "generation forward")
            .map(|c| c.phases.clone())
            .unwrap()
    };
    assert!(!forward_phases(&synchronous).contains(&"train"));
    assert!(forward_phases(&overlapped).contains(&"train"));
    // Without sampling (SFT) there is nothing to overlap.
    let sft = setup.plan(
        "",
        "[cluster]\nmax_staleness = 1\n[algorithm]\nname = \"sft\"\n",
    );
    assert!(!has(&sft, "generation copy"));
}

#[test]
fn launch_plans_controller_workers_and_ranks() {
    let setup = Setup::new();
    let loaded = setup.load(
        "",
        "[cluster]\nworkers = 2\ntrainers = 2\n[checkpoint]\nevery = 10\n",
    );
    let plan = plan(
        &loaded,
        Mode::Launch {
            external_roles: false,
        },
        None,
    )
    .unwrap();
    let names: Vec<&str> = plan.roles.iter().map(|r| r.role.as_str()).collect();
    assert_eq!(
        names,
        [
            "controller",
            "worker 0",
            "worker 1",
            "trainer 0",
            "trainer 1"
        ]
    );
    // Workers hold no optimizer; ranks train half the rows each; rank 0 keeps the checkpoint.
    assert_eq!(part(&plan, 1, "optimizer state"), 0);
    assert!(part(&plan, 1, "KV cache") > 0);
    assert_eq!(part(&plan, 3, "optimizer state"), 8 * PARAMS);
    assert!(part(&plan, 3, "checkpoint copy") > 0);
    assert_eq!(part(&plan, 4, "checkpoint copy"), 0);
    assert_eq!(part(&plan, 3, "gradient all-reduce"), 4 * PARAMS);
    let total: u64 = plan
        .roles
        .iter()
        .flat_map(|r| &r.devices)
        .map(|d| d.peak_bytes)
        .sum();
    assert_eq!(plan.devices[0].predicted_peak_bytes, total);
    let external = plan_external(&loaded);
    assert!(external.devices[0].predicted_peak_bytes < total);
}

/// The controller imports torch and transformers only where a plugin it hosts needs them:
/// reward models it scores with, or a `tokenizer` option; a sandbox process holding a reward
/// model imports them too.
#[test]
fn the_controller_counts_model_libraries_only_where_its_plugins_load_them() {
    let setup = Setup::new();
    let launch = |extra: &str| {
        let text = format!("[cluster]\nworkers = 1\n{extra}");
        plan(
            &setup.load("", &text),
            Mode::Launch {
                external_roles: false,
            },
            None,
        )
        .unwrap()
    };
    let libraries = |plan: &Plan, role: usize| part(plan, role, "torch and transformers");
    let model = setup.model();
    let plain = launch("");
    assert_eq!(part(&plain, 0, "runtime"), 64 << 20);
    assert_eq!(libraries(&plain, 0), 0);
    // Workers and ranks hold the policy: their runtime already has the libraries.
    assert_eq!(libraries(&plain, 1), 0);

    let tokenizer = launch("[[callbacks]]\nplugin = \"c:C\"\noptions = { tokenizer = \"t\" }\n");
    assert_eq!(libraries(&tokenizer, 0), 620 << 20);
    // An environment's tokenizer loads in the controller unless its episodes play in the sandbox.
    let environment = "[environment]\nplugin = \"e:E\"\noptions = { tokenizer = \"t\" }\n";
    assert_eq!(libraries(&launch(environment), 0), 620 << 20);
    let sandbox = "[sandbox]\nprocesses = 1\nenvironments = true\n";
    assert_eq!(libraries(&launch(&format!("{environment}{sandbox}")), 0), 0);

    let reward_model = format!(
        "[[rewards]]\nplugin = \"python_plugins.reward_models:RewardModel\"\n\
         options = {{ model_path = \"{}\" }}\n",
        model.display()
    );
    let scored_here = launch(&reward_model);
    assert_eq!(libraries(&scored_here, 0), 620 << 20);
    assert!(part(&scored_here, 0, "reward model") > 0);

    let sandboxed = launch(&format!("{reward_model}[sandbox]\nprocesses = 1\n"));
    assert_eq!(libraries(&sandboxed, 0), 0);
    let sandbox = sandboxed.roles.len() - 1;
    assert_eq!(sandboxed.roles[sandbox].role, "sandbox 0");
    assert_eq!(libraries(&sandboxed, sandbox), 620 << 20);
    assert!(part(&sandboxed, sandbox, "reward model") > 0);
}

/// Each pool of the sandbox (rewards, the environment's episodes) is `processes` processes
/// of its own, with torch and transformers only where a plugin there loads them.
#[test]
fn every_sandbox_process_is_planned_with_what_its_plugins_load() {
    let setup = Setup::new();
    let roles = |extra: &str| -> Vec<(String, u64, u64)> {
        let plan = setup.plan("", extra);
        (0..plan.roles.len())
            .filter(|&role| plan.roles[role].role.contains("sandbox"))
            .map(|role| {
                let runtime = part(&plan, role, "runtime");
                (
                    plan.roles[role].role.clone(),
                    runtime,
                    part(&plan, role, "torch and transformers"),
                )
            })
            .collect()
    };
    let plain = 100 << 20;
    assert!(roles("").is_empty());
    // The config's reward is a plain plugin: two processes of Python alone.
    assert_eq!(
        roles("[sandbox]\nprocesses = 2\n"),
        vec![
            ("sandbox 0".into(), plain, 0),
            ("sandbox 1".into(), plain, 0)
        ]
    );
    let environment = "[environment]\nplugin = \"e:E\"\noptions = { tokenizer = \"t\" }\n";
    let both = roles(&format!(
        "{environment}[sandbox]\nprocesses = 2\nenvironments = true\n"
    ));
    let names: Vec<&str> = both.iter().map(|(name, _, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "sandbox 0",
            "sandbox 1",
            "environment sandbox 0",
            "environment sandbox 1"
        ]
    );
    // The environment's tokenizer loads transformers in each of its processes only.
    assert_eq!(both[0].2, 0);
    assert_eq!(both[2].2, 620 << 20);
    // Episodes played in the run's process add no sandbox process.
    let in_run = format!("{environment}[sandbox]\nprocesses = 2\nenvironments = false\n");
    assert_eq!(roles(&in_run).len(), 2);
}

fn plan_external(loaded: &LoadedConfig) -> Plan {
    plan(
        loaded,
        Mode::Launch {
            external_roles: true,
        },
        None,
    )
    .unwrap()
}

#[test]
fn a_tiny_limit_refuses_and_names_the_device() {
    let setup = Setup::new();
    let plan = setup.plan("", "");
    assert!(check(&plan).is_ok());
    let loaded = setup.load("", "");
    let refused = super::plan(&loaded, Mode::Run, Some(0.5)).unwrap();
    let err = check(&refused).unwrap_err().to_string();
    assert!(err.contains("cpu: predicted peak"), "{err}");
    assert!(err.contains("476.8 MiB available (memory limit)"), "{err}");
    assert!(err.contains("--no-plan-check"), "{err}");
    assert!(gate(&loaded, Mode::Run, Some(0.5), true).is_err());
    assert!(gate(&loaded, Mode::Run, Some(0.5), false).is_ok());
}

#[test]
fn unplannable_runs_are_clear_errors() {
    let setup = Setup::new();
    let missing = setup.dir.path().join("nowhere");
    let text = format!(
        "[policy]\nplugin = \"m:P\"\noptions = {{ model_path = \"{}\" }}\n\
         [data]\nplugin = \"d:D\"\n[[rewards]]\nplugin = \"r:R\"\n",
        missing.display()
    );
    let loaded = crate::config::load_text(Path::new("plan.toml"), text, &[]).unwrap();
    let err = plan(&loaded, Mode::Run, None).unwrap_err().to_string();
    assert!(err.starts_with("plan.toml:3:"), "{err}");
    assert!(err.contains("nowhere/config.json"), "{err}");
    // ... but a run goes ahead: loading will report it.
    assert!(gate(&loaded, Mode::Run, None, true).is_ok());

    let toy =
        "[policy]\nplugin = \"toy:Toy\"\n[data]\nplugin = \"d:D\"\n[[rewards]]\nplugin = \"r:R\"\n";
    let loaded = crate::config::load_text(Path::new("toy.toml"), toy.into(), &[]).unwrap();
    let err = plan(&loaded, Mode::Run, None).unwrap_err();
    assert!(matches!(err, PlanError::UnknownPolicy { .. }), "{err}");

    let bad = setup.load(", dtype = \"float64\"", "");
    let err = plan(&bad, Mode::Run, None).unwrap_err();
    assert!(matches!(err, PlanError::Config(_)));
    assert!(err.to_string().starts_with("plan.toml:3:"), "{err}");
    assert!(err.to_string().contains("policy.options.dtype"), "{err}");
}

#[test]
fn peft_and_bitsandbytes_add_to_the_runtime_of_a_lora_policy() {
    let setup = Setup::new();
    let full = setup.plan("", "");
    let lora = setup.plan(", lora_rank = 16", "");
    assert_eq!(
        part(&lora, 0, "runtime") - part(&full, 0, "runtime"),
        52 << 20
    );
}

#[test]
fn every_agent_of_a_multi_agent_run_holds_its_own_policy() {
    let setup = Setup::new();
    let single = setup.plan("", "");
    let text = format!(
        "[policy]\nplugin = \"python_plugins.hf_policy:HFCausalLM\"\n\
         options = {{ model_path = \"{}\" }}\n[agents.proposer]\n[agents.solver]\n\
         [data]\nplugin = \"d:D\"\n[environment]\nplugin = \"e:E\"\n\
         [rollout]\nprompts_per_step = 8\ngroup_size = 8\nmax_new_tokens = 32\n\
         [run]\nplan_prompt_tokens = 6\n",
        setup.model().display()
    );
    let loaded = crate::config::load_text(Path::new("agents.toml"), text, &[]).unwrap();
    let agents = plan(&loaded, Mode::Run, None).unwrap();
    let roles: Vec<&str> = agents.roles.iter().map(|r| r.role.as_str()).collect();
    assert_eq!(roles, ["run", "agent solver"]);
    for name in ["weights", "gradients", "optimizer state", "KV cache"] {
        assert_eq!(part(&agents, 1, name), part(&single, 0, name), "{name}");
        assert_eq!(part(&agents, 0, name), part(&single, 0, name), "{name}");
    }
    // One interpreter for both agents.
    assert_eq!(part(&agents, 1, "runtime"), 0);
    let peak = |plan: &Plan| plan.devices[0].predicted_peak_bytes;
    let solver = agents.roles[1].devices[0].peak_bytes;
    assert_eq!(peak(&agents), peak(&single) + solver);
}

fn launch_plan(setup: &Setup, extra: &str) -> Plan {
    let loaded = setup.load("", extra);
    let mode = Mode::Launch {
        external_roles: false,
    };
    plan(&loaded, mode, None).unwrap()
}

fn on_device(plan: &Plan, role: usize, device: &str, name: &str) -> u64 {
    plan.roles[role]
        .devices
        .iter()
        .filter(|d| d.device == device)
        .flat_map(|d| &d.components)
        .filter(|c| c.name == name)
        .map(|c| c.bytes)
        .sum()
}

#[test]
fn sharded_ranks_hold_a_share_of_the_state_and_the_gathered_blocks() {
    let setup = Setup::new();
    let cluster = "[cluster]\nworkers = 1\ntrainers = 4\n[checkpoint]\nevery = 10\n";
    let replicated = launch_plan(&setup, cluster);
    let sharded = launch_plan(&setup, &format!("[train]\nsharding = \"fsdp\"\n{cluster}"));
    for name in ["weights", "gradients", "optimizer state"] {
        assert_eq!(
            part(&sharded, 2, name),
            part(&replicated, 2, name) / 4,
            "{name}"
        );
    }
    // The root (embeddings, norm, LM head) and two of the 8 blocks, in float32.
    let block = (PARAMS - 2 * 56 * 512 - 512) / 8;
    assert_eq!(
        part(&sharded, 2, "gathered parameters"),
        4 * (2 * 56 * 512 + 512 + 2 * block)
    );
    // On the host, the allocator keeps two freed blocks of parameters and of gradients.
    assert_eq!(part(&sharded, 2, "freed blocks kept"), 4 * 4 * block);
    assert_eq!(part(&replicated, 2, "freed blocks kept"), 0);
    assert_eq!(part(&sharded, 2, "gradient all-reduce"), 0);
    // Loading holds the whole model once more: on the CPU, as its file's mapped pages.
    assert_eq!(part(&sharded, 2, "whole weights (loading)"), 4 * PARAMS);
    assert_eq!(part(&sharded, 2, "mapped weights file"), 0);
    // Every rank copies its share of a checkpoint; only rank 0 gathers the weights to serve.
    assert!(part(&sharded, 5, "checkpoint copy") > 0);
    assert_eq!(part(&sharded, 2, "weight export"), 4 * PARAMS);
    assert_eq!(part(&sharded, 3, "weight export"), 0);
    assert!(sharded.roles[2].devices[0].peak_bytes < replicated.roles[2].devices[0].peak_bytes);
}

#[test]
fn offloaded_shards_move_to_the_host_and_compute_dtypes_size_the_gathers() {
    let setup = Setup::new();
    let extra = "[train]\nsharding = \"fsdp\"\n[train.fsdp]\noffload = true\n\
                 param_dtype = \"bfloat16\"\n[cluster]\nworkers = 1\ntrainers = 2\n";
    let loaded = setup.load(", device = \"cuda:0\"", extra);
    let mode = Mode::Launch {
        external_roles: false,
    };
    let plan = plan(&loaded, mode, Some(80.0)).unwrap();
    assert_eq!(
        on_device(&plan, 2, "cpu", "optimizer state"),
        8 * PARAMS / 2
    );
    assert_eq!(on_device(&plan, 2, "cuda:0", "optimizer state"), 0);
    assert_eq!(on_device(&plan, 2, "cpu", "weights"), 4 * PARAMS / 2);
    // On a GPU the model loads onto the device while its file is mapped in host memory.
    assert!(on_device(&plan, 2, "cuda:0", "whole weights (loading)") > 0);
    assert!(on_device(&plan, 2, "cpu", "mapped weights file") > 0);
    let gathered = on_device(&plan, 2, "cuda:0", "gathered parameters");
    let block = (PARAMS - 2 * 56 * 512 - 512) / 8;
    assert_eq!(gathered, 2 * (2 * 56 * 512 + 512 + 2 * block));
    // Device memory is not jemalloc's to keep.
    assert_eq!(on_device(&plan, 2, "cpu", "freed blocks kept"), 0);
}

#[test]
fn several_micro_batches_per_rank_keep_unsharded_gradients() {
    let setup = Setup::new();
    let extra = "[train]\nsharding = \"fsdp\"\nmicro_batch_tokens = 64\n\
                 [cluster]\nworkers = 1\ntrainers = 2\n";
    let plan = launch_plan(&setup, extra);
    assert_eq!(part(&plan, 2, "accumulated gradients"), 4 * PARAMS);
    let one_each = launch_plan(
        &setup,
        "[train]\nsharding = \"fsdp\"\nmicro_batch_tokens = 100000\n[cluster]\nworkers = 1\ntrainers = 2\n",
    );
    assert_eq!(part(&one_each, 2, "accumulated gradients"), 0);
}
