//! `rollout plan` and the memory check of `rollout run`: a peak per role, JSON that parses,
//! a run that cannot fit refused (by `rollout plan` with exit status 1, by `rollout run`
//! before Python loads), config errors located, and every shipped config planned.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

mod common;

use common::{repo, rollout, stderr, stdout};

/// The quickstart's model shape (hidden 256, 4 layers): only its config.json is needed.
const MODEL: &str = r#"{"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 1024,
    "vocab_size": 56, "max_position_embeddings": 128, "tie_word_embeddings": false}"#;

/// A config for the HF policy over a model directory holding only `config.json`;
/// `options` is spliced into the policy's options and `extra` appended.
fn config(dir: &Path, options: &str, extra: &str) -> PathBuf {
    std::fs::create_dir_all(dir.join("model")).unwrap();
    std::fs::write(dir.join("model/config.json"), MODEL).unwrap();
    let text = format!(
        r#"[run]
output_dir = "{out}"
steps = 2

[policy]
plugin = "python_plugins.hf_policy:HFCausalLM"
options = {{ model_path = "{model}"{options} }}

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{prompts}" }}

[[rewards]]
plugin = "python_plugins.rewards:ExactMatch"

[rollout]
prompts_per_step = 4
group_size = 4
max_new_tokens = 8
{extra}"#,
        out = dir.join("out").display(),
        model = dir.join("model").display(),
        prompts = repo().join("tests/fixtures/prompts.jsonl").display(),
    );
    let path = dir.join("plan.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn plan_prints_a_peak_per_role() {
    let tmp = tempfile::tempdir().unwrap();
    let path = config(tmp.path(), "", "");
    let out = rollout(&["plan", path.to_str().unwrap()], tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("run on cpu: peak "), "{text}");
    assert!(text.contains("optimizer state"), "{text}");
    assert!(text.contains("cpu: predicted peak"), "{text}");

    let out = rollout(
        &[
            "plan",
            path.to_str().unwrap(),
            "--launch",
            "--set",
            "cluster.workers=2",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for role in [
        "controller on cpu",
        "worker 0 on cpu",
        "worker 1 on cpu",
        "trainer 0 on cpu",
    ] {
        assert!(text.contains(role), "{role}: {text}");
    }
}

#[test]
fn plan_json_parses() {
    let tmp = tempfile::tempdir().unwrap();
    let path = config(tmp.path(), "", "[algorithm]\nkl_coef = 0.1\n");
    let out = rollout(&["plan", path.to_str().unwrap(), "--json"], tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["model"]["parameters"], 4_225_280);
    let device = &plan["roles"][0]["devices"][0];
    assert_eq!(device["device"], "cpu");
    assert!(device["peak_bytes"].as_u64().unwrap() > 690 << 20);
    let names = component_names(device);
    assert!(names.contains(&"reference model"), "{names:?}");
    assert_eq!(plan["devices"][0]["fits"], true);
}

fn component_names(device: &serde_json::Value) -> Vec<&str> {
    device["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect()
}

#[test]
fn plan_json_has_each_role_with_its_peak_and_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let path = config(tmp.path(), "", "");
    let out = rollout(
        &[
            "plan",
            path.to_str().unwrap(),
            "--json",
            "--launch",
            "--set",
            "cluster.workers=2",
            "--set",
            "cluster.trainers=2",
        ],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["command"], "launch");
    let roles = plan["roles"].as_array().unwrap();
    let names: Vec<&str> = roles.iter().map(|r| r["role"].as_str().unwrap()).collect();
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
    let mut total = 0;
    for role in roles {
        let devices = role["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 1, "{role}");
        let device = &devices[0];
        let peak = device["peak_bytes"].as_u64().unwrap();
        // The peak is the largest sum over one phase: at least every part alive always, and
        // at most all parts together.
        let parts = device["components"].as_array().unwrap();
        let bytes = |always: bool| -> u64 {
            parts
                .iter()
                .filter(|p| !always || p["phases"].as_array().unwrap().len() == 4)
                .map(|p| p["bytes"].as_u64().unwrap())
                .sum()
        };
        assert!(bytes(true) <= peak && peak <= bytes(false), "{role}");
        assert!(
            ["load", "generate", "train", "checkpoint"]
                .contains(&device["peak_phase"].as_str().unwrap())
        );
        total += peak;
    }
    // Workers generate and hold no optimizer; trainer ranks do.
    assert!(component_names(&roles[1]["devices"][0]).contains(&"KV cache"));
    assert!(!component_names(&roles[1]["devices"][0]).contains(&"optimizer state"));
    assert!(component_names(&roles[3]["devices"][0]).contains(&"optimizer state"));
    // The machine's check adds up every local process.
    assert_eq!(plan["devices"][0]["predicted_peak_bytes"], total);
}

#[test]
fn plan_exits_1_when_the_run_will_not_fit() {
    let tmp = tempfile::tempdir().unwrap();
    let path = config(tmp.path(), "", "");
    let path = path.to_str().unwrap();
    for args in [
        vec!["plan", path, "--memory-limit", "0.1"],
        vec!["plan", path, "--set", "run.memory_limit_gb=0.1"],
    ] {
        let out = rollout(&args, tmp.path());
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
        // The plan is still printed, with the verdict, and the error says what to do.
        let text = stdout(&out);
        assert!(text.contains("run on cpu: peak "), "{text}");
        assert!(
            text.contains("of 95.4 MiB memory limit: DOES NOT FIT"),
            "{text}"
        );
        let err = stderr(&out);
        assert!(
            err.contains("the run will not fit in memory: cpu: predicted peak"),
            "{err}"
        );
        assert!(err.contains("95.4 MiB available (memory limit)"), "{err}");
        assert!(err.contains("--no-plan-check"), "{err}");
    }

    let out = rollout(
        &["plan", path, "--json", "--memory-limit", "0.1"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let plan: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["devices"][0]["fits"], false);
    assert_eq!(plan["devices"][0]["available_bytes"], 100_000_000);

    // A limit the run fits in.
    let out = rollout(&["plan", path, "--memory-limit", "1000"], tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains(": fits"), "{}", stdout(&out));
}

#[test]
fn run_that_cannot_fit_is_refused_before_python_loads() {
    let tmp = tempfile::tempdir().unwrap();
    // A venv that does not exist: starting Python would fail with another error.
    let extra = "[python]\nvenv = \"/nonexistent-venv\"\n";
    let path = config(tmp.path(), "", extra);
    let path = path.to_str().unwrap();
    let out = rollout(&["run", path, "--memory-limit", "0.1"], tmp.path());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("will not fit in memory"), "{err}");
    assert!(err.contains("cpu: predicted peak"), "{err}");
    assert!(err.contains("95.4 MiB available (memory limit)"), "{err}");
    assert!(!err.contains("nonexistent-venv"), "{err}");
    assert!(!tmp.path().join("out").exists());

    // The same from the config, and `rollout launch` too.
    let limited = rollout(
        &["run", path, "--set", "run.memory_limit_gb=0.1"],
        tmp.path(),
    );
    assert!(
        stderr(&limited).contains("will not fit in memory"),
        "{}",
        stderr(&limited)
    );
    let launch = rollout(&["launch", path, "--memory-limit", "0.1"], tmp.path());
    assert!(
        stderr(&launch).contains("will not fit in memory"),
        "{}",
        stderr(&launch)
    );

    // The escape hatches: the run goes on to start Python (and fails on the venv).
    for args in [
        vec!["run", path, "--memory-limit", "0.1", "--no-plan-check"],
        vec![
            "run",
            path,
            "--memory-limit",
            "0.1",
            "--set",
            "run.plan_check=false",
        ],
    ] {
        let out = rollout(&args, tmp.path());
        let err = stderr(&out);
        assert!(!err.contains("will not fit"), "{err}");
        assert!(err.contains("nonexistent-venv"), "{err}");
    }
}

#[test]
fn plan_config_errors_are_located() {
    let tmp = tempfile::tempdir().unwrap();
    let path = config(tmp.path(), ", dtype = \"float64\"", "");
    let out = rollout(&["plan", path.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("plan.toml:7:"), "{err}");
    assert!(
        err.contains("`policy.options.dtype`: must be one of"),
        "{err}"
    );

    let path = config(tmp.path(), "", "");
    let out = rollout(
        &[
            "plan",
            path.to_str().unwrap(),
            "--set",
            "run.plan_chek=false",
        ],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("did you mean `plan_check`?"),
        "{}",
        stderr(&out)
    );

    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("steps = 2", "steps = 2\nmemory_limit_gb = -1");
    std::fs::write(&path, text).unwrap();
    let out = rollout(&["plan", path.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("plan.toml:4:1: `run.memory_limit_gb`"),
        "{err}"
    );
}

#[test]
fn plan_names_a_missing_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let path = config(tmp.path(), "", "");
    let out = rollout(
        &[
            "plan",
            path.to_str().unwrap(),
            "--set",
            "policy.options.model_path=no/such/model",
        ],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("--set policy.options.model_path"), "{err}");
    assert!(err.contains("no/such/model/config.json"), "{err}");
}

/// The quickstart's chat model (`rollout init-quickstart`): its character vocabulary and
/// role-marker tokens.
const CHAT_MODEL: &str = r#"{"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 512,
    "vocab_size": 68, "max_position_embeddings": 256, "tie_word_embeddings": false}"#;

/// The demo reward model of `python -m python_plugins.reward_models create-demo`.
const REWARD_MODEL: &str = r#"{"architectures": ["LlamaForSequenceClassification"],
    "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
    "vocab_size": 56, "max_position_embeddings": 512, "tie_word_embeddings": false,
    "id2label": {"0": "has_7"}}"#;

/// The components of the controller in `rollout plan CONFIG --launch`.
fn launch_controller_parts(config: &Path, dir: &Path) -> Vec<String> {
    let out = rollout(
        &["plan", config.to_str().unwrap(), "--json", "--launch"],
        dir,
    );
    let plan: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(plan["roles"][0]["role"], "controller");
    component_names(&plan["roles"][0]["devices"][0])
        .into_iter()
        .map(String::from)
        .collect()
}

/// Every config in configs/ plans (exit 0, a peak per process), from a directory where the
/// models their setup steps create (`rollout init-quickstart`, the demo reward model) are
/// present as their `config.json`: the planner reads nothing else.
#[test]
fn plan_covers_every_shipped_config() {
    let repo = repo();
    let tmp = tempfile::tempdir().unwrap();
    for (dir, text) in [
        ("artifacts/quickstart/model", MODEL),
        ("artifacts/quickstart/chat_model", CHAT_MODEL),
        ("artifacts/reward_model", REWARD_MODEL),
    ] {
        std::fs::create_dir_all(tmp.path().join(dir)).unwrap();
        std::fs::write(tmp.path().join(dir).join("config.json"), text).unwrap();
    }
    let mut planned = Vec::new();
    for entry in std::fs::read_dir(repo.join("configs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let out = rollout(&["plan", path.to_str().unwrap()], tmp.path());
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let text = stdout(&out);
        assert!(text.contains("cpu: predicted peak"), "{name}: {text}");
        let out = rollout(&["plan", path.to_str().unwrap(), "--json"], tmp.path());
        let plan: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        for role in plan["roles"].as_array().unwrap() {
            let peak = role["devices"][0]["peak_bytes"].as_u64().unwrap();
            assert!(peak >= 64 << 20, "{name}: {role}");
        }
        let parts = component_names(&plan["roles"][0]["devices"][0]);
        match name.as_str() {
            "rlhf_reward_model" => assert!(parts.contains(&"reward model"), "{parts:?}"),
            // A launch's controller loads torch and transformers only for a plugin that needs
            // them: the tool-use config's chat template does, the distributed config's do not.
            "tool_use" | "distributed" => {
                let controller = launch_controller_parts(&path, tmp.path());
                let libraries = controller
                    .iter()
                    .any(|part| part == "torch and transformers");
                assert_eq!(libraries, name == "tool_use", "{name}: {controller:?}");
            }
            "ppo" => assert!(parts.contains(&"value head"), "{parts:?}"),
            "lora" | "qlora" => assert!(plan["model"]["lora_rank"] == 32, "{name}"),
            _ => {}
        }
        planned.push(name);
    }
    planned.sort();
    for name in [
        "dpo",
        "dr_grpo",
        "gspo",
        "lora",
        "ppo",
        "qlora",
        "quickstart",
        "reinforce_pp",
        "rlhf_reward_model",
        "rloo",
        "sft",
    ] {
        assert!(planned.iter().any(|p| p == name), "{name}: {planned:?}");
    }
}
