//! The `rollout` binary on good and bad input: config errors with locations and suggestions,
//! plugin failures with their traceback, and a short run with the torch-free toy policy.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

mod common;

use common::{repo, rollout, stderr, stdout};

/// A config for the toy policy; `rewards` is spliced in as TOML.
fn toy_config(dir: &Path, rewards: &str, extra: &str) -> PathBuf {
    let repo = repo();
    let text = format!(
        r#"[run]
name = "toy"
output_dir = "{out}"
steps = 3

[python]
paths = ["{fixtures}"]

[policy]
plugin = "toy_plugins:ToyPolicy"

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{prompts}" }}

[rollout]
prompts_per_step = 2
group_size = 3
max_new_tokens = 4

[train]
learning_rate = 0.001
{rewards}
{extra}
"#,
        out = dir.join("out").display(),
        fixtures = repo.join("tests/fixtures").display(),
        prompts = repo.join("tests/fixtures/prompts.jsonl").display(),
    );
    let path = dir.join("toy.toml");
    std::fs::write(&path, text).unwrap();
    path
}

const DIGIT_REWARD: &str = "[[rewards]]\nplugin = \"toy_plugins:DigitSum\"\n";

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn version_prints() {
    let out = rollout(&["--version"], &repo());
    assert!(out.status.success());
    assert!(stdout(&out).starts_with("rollout "));
}

#[test]
fn malformed_toml_names_line_and_column() {
    let tmp = tempfile::tempdir().unwrap();
    let path = write(tmp.path(), "bad.toml", "[run]\nname = \"x\"\nsteps = = 3\n");
    let out = rollout(&["check", path.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("bad.toml:3:"), "{err}");
    assert_eq!(
        err.trim().lines().count(),
        1,
        "one-line reason expected: {err}"
    );
}

#[test]
fn unknown_key_suggests_the_right_one() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path(), DIGIT_REWARD, "");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("group_size = 3", "group_sise = 3");
    std::fs::write(&config, text).unwrap();
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("toy.toml:18:1"), "{err}");
    assert!(err.contains("unknown field `group_sise`"), "{err}");
    assert!(err.contains("did you mean `group_size`?"), "{err}");
}

#[test]
fn unknown_table_and_wrong_type_are_located() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path(), DIGIT_REWARD, "[trainer]\nsteps = 1\n");
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("did you mean `train`?"),
        "{}",
        stderr(&out)
    );

    let config = toy_config(tmp.path(), DIGIT_REWARD, "");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("group_size = 3", "group_size = \"three\"");
    std::fs::write(&config, text).unwrap();
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("toy.toml:18:"), "{}", stderr(&out));
}

#[test]
fn impossible_values_are_located() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path(), DIGIT_REWARD, "");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("group_size = 3", "group_size = 1");
    std::fs::write(&config, text).unwrap();
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("toy.toml:18:1: `rollout.group_size`: must be at least 2"),
        "{err}"
    );
}

#[test]
fn impossible_algorithm_settings_are_located() {
    let cases = [
        (
            "name = \"ppo\"\nlam = 1.5",
            "`algorithm.lam`: must be in [0, 1]",
        ),
        ("epochs = 0", "`algorithm.epochs`: must be >= 1"),
        (
            "name = \"sft\"\nepochs = 2",
            "`algorithm.epochs`: applies to the policy-gradient",
        ),
        (
            "name = \"dpo\"\ndynamic_sampling_rounds = 1",
            "`algorithm.dynamic_sampling_rounds`: refills single-turn groups",
        ),
    ];
    for (keys, expected) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let config = toy_config(tmp.path(), DIGIT_REWARD, &format!("[algorithm]\n{keys}\n"));
        let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
        assert_eq!(out.status.code(), Some(2), "{keys}");
        let err = stderr(&out);
        assert!(
            err.contains(expected) && err.contains("toy.toml:"),
            "{keys}: {err}"
        );
    }
}

#[test]
fn powersgd_without_its_warm_up_is_located() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = "[cluster]\ngradient_compression = \"powersgd\"\npowersgd_warmup_updates = 1\n";
    let config = toy_config(tmp.path(), DIGIT_REWARD, cluster);
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("`cluster.powersgd_warmup_updates`: must be at least 2"),
        "{err}"
    );
    let line = std::fs::read_to_string(&config)
        .unwrap()
        .lines()
        .position(|line| line.starts_with("powersgd_warmup_updates"))
        .unwrap()
        + 1;
    assert!(err.contains(&format!("toy.toml:{line}:1:")), "{err}");
}

#[test]
fn min_trainers_outside_one_to_trainers_is_located() {
    let tmp = tempfile::tempdir().unwrap();
    for fewest in [0, 3] {
        let cluster = format!("[cluster]\ntrainers = 2\nmin_trainers = {fewest}\n");
        let config = toy_config(tmp.path(), DIGIT_REWARD, &cluster);
        let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
        assert_eq!(out.status.code(), Some(2), "{fewest}");
        let err = stderr(&out);
        let line = std::fs::read_to_string(&config)
            .unwrap()
            .lines()
            .position(|line| line.starts_with("min_trainers"))
            .unwrap()
            + 1;
        let expected = format!(
            "toy.toml:{line}:1: `cluster.min_trainers`: must be between 1 and cluster.trainers"
        );
        assert!(err.contains(&expected), "{err}");
    }
}

#[test]
fn a_bad_metrics_address_is_located() {
    let tmp = tempfile::tempdir().unwrap();
    for listen in ["localhost:9400", "127.0.0.1", "127.0.0.1:99999"] {
        let metrics = format!("[metrics]\nlisten = \"{listen}\"\n");
        let config = toy_config(tmp.path(), DIGIT_REWARD, &metrics);
        let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
        assert_eq!(out.status.code(), Some(2), "{listen}");
        let err = stderr(&out);
        let line = std::fs::read_to_string(&config)
            .unwrap()
            .lines()
            .position(|line| line.starts_with("listen = "))
            .unwrap()
            + 1;
        assert!(
            err.contains(&format!(
                "toy.toml:{line}:1: `metrics.listen`: must be an address"
            )),
            "{listen}: {err}"
        );
    }
    // And through --set, the same check.
    let config = toy_config(tmp.path(), DIGIT_REWARD, "");
    let args = [
        "check",
        config.to_str().unwrap(),
        "--set",
        "metrics.listen=nowhere",
    ];
    let out = rollout(&args, tmp.path());
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("--set metrics.listen") && err.contains("must be an address"),
        "{err}"
    );
}

#[test]
fn missing_config_file_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let out = rollout(&["run", "nope.toml"], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("cannot read config nope.toml"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn overrides_apply_and_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path(), DIGIT_REWARD, "");
    let path = config.to_str().unwrap();
    let out = rollout(
        &["check", path, "--set", "rollout.group_sise=4"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("did you mean `group_size`?"),
        "{}",
        stderr(&out)
    );

    let out = rollout(
        &["check", path, "--set", "rollout.group_size=1"],
        tmp.path(),
    );
    assert!(
        stderr(&out).contains("--set rollout.group_size"),
        "{}",
        stderr(&out)
    );

    let out = rollout(
        &["check", path, "--set", "rollout.prompts_per_step=5"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("5 prompts x 3 completions"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn check_reports_every_plugin() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path(), DIGIT_REWARD, "");
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("config OK"), "{text}");
    assert!(text.contains("6 records"), "{text}");
    assert!(text.contains("digit_sum x 1"), "{text}");
}

#[test]
fn plugin_that_fails_to_import_names_plugin_hook_and_traceback() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(
        tmp.path(),
        "[[rewards]]\nplugin = \"broken_import:Thing\"\n",
        "",
    );
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    let first = err.lines().next().unwrap_or_default();
    assert!(first.contains("plugin `broken_import:Thing`"), "{err}");
    assert!(first.contains("toy.toml:"), "{err}");
    assert!(
        first.contains("failed in `load`: RuntimeError: this module cannot be imported on purpose"),
        "{err}"
    );
    assert!(err.contains("Traceback (most recent call last)"), "{err}");
    assert!(err.contains("broken_import.py"), "{err}");
}

#[test]
fn missing_module_and_wrong_class_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(
        tmp.path(),
        "[[rewards]]\nplugin = \"no_such_module:Reward\"\n",
        "",
    );
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert!(
        stderr(&out).contains("ModuleNotFoundError"),
        "{}",
        stderr(&out)
    );

    let config = toy_config(
        tmp.path(),
        "[[rewards]]\nplugin = \"toy_plugins:NotAPlugin\"\n",
        "",
    );
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert!(
        stderr(&out).contains("is not a subclass of rollout_sdk.Reward"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_policy_whose_vocabulary_is_unknown_or_exceeded_is_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path(), DIGIT_REWARD, "");
    let text = std::fs::read_to_string(&config).unwrap();
    let cases = [
        (
            "UnsizedToyPolicy",
            "the policy's vocabulary size is unknown",
        ),
        (
            "OverflowingToyPolicy",
            "failed in `encode`: token id 16 is outside the policy's vocabulary of 11",
        ),
    ];
    for (policy, reason) in cases {
        let spec = format!("toy_plugins:{policy}");
        std::fs::write(&config, text.replace("toy_plugins:ToyPolicy", &spec)).unwrap();
        let out = rollout(&["run", config.to_str().unwrap()], tmp.path());
        assert!(!out.status.success(), "{policy} ran");
        assert!(stderr(&out).contains(reason), "{policy}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    }
}

#[test]
fn plugin_option_errors_point_into_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let reward =
        "[[rewards]]\nplugin = \"toy_plugins:StrictReward\"\n[rewards.options]\nthreshhold = 0.3\n";
    let config = toy_config(tmp.path(), reward, "");
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("toy.toml:26:1"), "{err}");
    assert!(err.contains("did you mean `threshold`?"), "{err}");
    assert!(err.contains("toy_plugins:StrictReward"), "{err}");

    let reward =
        "[[rewards]]\nplugin = \"toy_plugins:StrictReward\"\noptions = { threshold = \"high\" }\n";
    let config = toy_config(tmp.path(), reward, "");
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("expected a number"),
        "{}",
        stderr(&out)
    );
}

fn run_fails_with(reward_class: &str, expected: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let reward = format!("[[rewards]]\nplugin = \"toy_plugins:{reward_class}\"\n");
    let config = toy_config(tmp.path(), &reward, "");
    let out = rollout(&["run", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains(&format!("plugin `toy_plugins:{reward_class}`")),
        "{err}"
    );
    assert!(err.contains("failed in `score`"), "{err}");
    assert!(err.contains(expected), "{err}");
    // Nothing half-written is left as a checkpoint.
    let checkpoints = tmp.path().join("out/checkpoints");
    assert!(!checkpoints.exists() || std::fs::read_dir(&checkpoints).unwrap().count() == 0);
}

#[test]
fn check_samples_and_scores_one_group_to_catch_broken_rewards() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(
        tmp.path(),
        "[[rewards]]\nplugin = \"toy_plugins:WrongCountReward\"\n",
        "",
    );
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("returned 2 scores for 3 samples"),
        "{}",
        stderr(&out)
    );
    assert!(
        !tmp.path().join("out").exists(),
        "check must not create the run's output"
    );

    let config = toy_config(tmp.path(), DIGIT_REWARD, "");
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert!(
        stdout(&out).contains("sampled      3 completions of the first prompt"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn reward_that_raises_fails_the_run_with_traceback() {
    run_fails_with("RaisingReward", "ValueError: reward exploded on purpose");
    run_fails_with("RaisingReward", "Traceback (most recent call last)");
    run_fails_with("RaisingReward", "in score\n    raise ValueError");
}

/// The sandboxed counterpart: in worker processes the same reward costs its samples (logged
/// with the traceback, counted in the metrics, not trained on) and the run completes.
#[test]
fn sandboxed_reward_that_raises_costs_its_samples_not_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let reward = "[[rewards]]\nplugin = \"toy_plugins:RaisingReward\"\n";
    let sandbox = "[sandbox]\nprocesses = 2\nmax_failed_fraction = 1.0\n\
                   max_failed_fraction_per_step = 1.0\n";
    let config = toy_config(tmp.path(), reward, sandbox);
    let args = [
        "run",
        config.to_str().unwrap(),
        "--set",
        "run.log_samples=100",
    ];
    let out = rollout(&args, tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let lines = metric_lines(tmp.path());
    assert_eq!(lines.len(), 3);
    for line in &lines {
        assert_eq!(line["reward_failed"], 6, "{line}");
        assert_eq!(line["reward_failed_raised"], 6, "{line}");
        assert_eq!(line["reward_failed_timeout"], 0, "{line}");
        assert_eq!(line["trained_rows"], 0, "{line}");
    }
    let samples = std::fs::read_to_string(tmp.path().join("out/samples.jsonl")).unwrap();
    assert_eq!(samples.lines().count(), 18);
    for sample in samples.lines() {
        let sample: serde_json::Value = serde_json::from_str(sample).unwrap();
        assert_eq!(sample["failed"]["reason"], "raised", "{sample}");
        assert_eq!(sample["reward"], serde_json::Value::Null, "{sample}");
        let traceback = sample["failed"]["traceback"].as_str().unwrap();
        assert!(
            traceback.contains("reward exploded on purpose"),
            "{traceback}"
        );
    }
}

#[test]
fn sandboxed_reward_with_a_bad_option_points_at_its_line() {
    let tmp = tempfile::tempdir().unwrap();
    let reward = "[[rewards]]\nplugin = \"python_plugins.rewards:Format\"\n\
                  options = { pattern = \"x\", require_stop = \"yes\" }\n";
    let config = toy_config(tmp.path(), reward, "[sandbox]\nprocesses = 1\n");
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("toy.toml:25:28: `rewards[0].options.require_stop`"),
        "{err}"
    );
    assert!(
        err.contains("expected true or false, got 'yes' (plugin `python_plugins.rewards:Format`)"),
        "{err}"
    );
}

#[test]
fn reward_with_wrong_count_is_rejected() {
    run_fails_with("WrongCountReward", "returned 5 scores for 6 samples");
}

#[test]
fn reward_returning_nan_is_rejected() {
    run_fails_with(
        "NanReward",
        "returned NaN for sample 0; rewards must be finite",
    );
}

fn metric_lines(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("out/metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

#[test]
fn toy_run_writes_metrics_checkpoints_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let config = toy_config(tmp.path(), DIGIT_REWARD, "[checkpoint]\nevery = 2\n");
    let path = config.to_str().unwrap();
    let out = rollout(&["run", path], tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let lines = metric_lines(tmp.path());
    assert_eq!(lines.len(), 3);
    for key in [
        "step",
        "reward_mean",
        "loss",
        "completions",
        "generated_tokens",
        "step_seconds",
        "samples_per_second",
        "weight_version",
    ] {
        assert!(
            lines.iter().all(|l| l.get(key).is_some()),
            "missing {key}: {lines:?}"
        );
    }
    assert_eq!(lines[2]["completions"], 6);
    assert_eq!(lines[2]["weight_version"], 3);
    assert!(stdout(&out).contains("done: 3 steps"), "{}", stdout(&out));

    // Starting again over the same output refuses to clobber it.
    let again = rollout(&["run", path], tmp.path());
    assert_eq!(again.status.code(), Some(1));
    assert!(stderr(&again).contains("--resume"), "{}", stderr(&again));

    // Resume with more steps continues from step 3 and reproduces nothing twice.
    let out = rollout(
        &["run", path, "--resume", "--set", "run.steps=5"],
        tmp.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let resumed = metric_lines(tmp.path());
    let steps: Vec<u64> = resumed
        .iter()
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5]);
    assert_eq!(resumed[4]["weight_version"], 5);
}

#[test]
fn resumed_run_matches_an_uninterrupted_one() {
    let straight = tempfile::tempdir().unwrap();
    let config = toy_config(straight.path(), DIGIT_REWARD, "[checkpoint]\nevery = 2\n");
    let out = rollout(
        &["run", config.to_str().unwrap(), "--set", "run.steps=4"],
        straight.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));

    let split = tempfile::tempdir().unwrap();
    let config = toy_config(split.path(), DIGIT_REWARD, "[checkpoint]\nevery = 2\n");
    let path = config.to_str().unwrap();
    let out = rollout(&["run", path, "--set", "run.steps=2"], split.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let out = rollout(
        &["run", path, "--resume", "--set", "run.steps=4"],
        split.path(),
    );
    assert!(out.status.success(), "{}", stderr(&out));

    let strip = |lines: Vec<serde_json::Value>| -> Vec<(f64, f64, u64)> {
        lines
            .iter()
            .map(|l| {
                (
                    l["reward_mean"].as_f64().unwrap(),
                    l["loss"].as_f64().unwrap(),
                    l["generated_tokens"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(
        strip(metric_lines(straight.path())),
        strip(metric_lines(split.path()))
    );
}

#[test]
fn what_a_multi_agent_run_cannot_combine_with_is_located() {
    let tmp = tempfile::tempdir().unwrap();
    let environment = "[environment]\nplugin = \"python_plugins.multi_agent:ProposerSolver\"\n";
    let cases = [
        (
            "",
            "[agents.Solver]\n",
            "[agents.Solver]",
            "agent name `Solver`",
        ),
        (
            DIGIT_REWARD,
            "[agents.solver]\n",
            "[[rewards]]",
            "come from its environment",
        ),
        (
            "",
            "[agents.solver]\nlearning_rate = -1.0\n",
            "learning_rate = -1.0",
            "must be a finite number > 0",
        ),
        (
            "",
            "[agents.solver]\n[algorithm]\nname = \"ppo\"\n",
            "name = \"ppo\"",
            "critic-free policy-gradient",
        ),
    ];
    for (rewards, agents, located_at, message) in cases {
        let config = toy_config(tmp.path(), rewards, &format!("{environment}{agents}"));
        let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
        assert_eq!(out.status.code(), Some(2), "{agents}");
        let err = stderr(&out);
        let line = std::fs::read_to_string(&config)
            .unwrap()
            .lines()
            .position(|line| line.starts_with(located_at))
            .unwrap()
            + 1;
        assert!(
            err.contains(&format!("toy.toml:{line}:")),
            "{agents}: {err}"
        );
        assert!(err.contains(message), "{agents}: {err}");
    }
    // Agents need an environment to take turns in.
    let config = toy_config(tmp.path(), "", "[agents.solver]\n");
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("agents take turns in an environment"));
}

#[test]
fn rollout_correction_settings_are_checked_where_they_are_set() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (
            "[algorithm]\nrollout_correction = \"tis\"\nrollout_correction_cap = 0.5\n",
            "rollout_correction_cap = 0.5",
            "must be a finite number >= 1",
        ),
        (
            "[algorithm]\nrollout_correction = \"mis\"\nrollout_correction_band = [1.5, 2.0]\n",
            "rollout_correction_band",
            "0 <= low <= 1 <= high",
        ),
        (
            "[algorithm]\nname = \"sft\"\nrollout_correction = \"tis\"\n",
            "rollout_correction = \"tis\"",
            "policy-gradient algorithm",
        ),
        (
            "[algorithm]\nrollout_correction = \"importance\"\n",
            "rollout_correction = \"importance\"",
            "unknown variant",
        ),
    ];
    for (algorithm, located_at, message) in cases {
        let config = toy_config(tmp.path(), DIGIT_REWARD, algorithm);
        let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
        assert_eq!(out.status.code(), Some(2), "{algorithm}");
        let err = stderr(&out);
        let line = std::fs::read_to_string(&config)
            .unwrap()
            .lines()
            .position(|line| line.starts_with(located_at))
            .unwrap()
            + 1;
        assert!(
            err.contains(&format!("toy.toml:{line}:")),
            "{algorithm}: {err}"
        );
        assert!(err.contains(message), "{algorithm}: {err}");
    }
    let fine =
        "[algorithm]\nrollout_correction = \"mis\"\nrollout_correction_level = \"sequence\"\n";
    let config = toy_config(tmp.path(), DIGIT_REWARD, fine);
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
}
