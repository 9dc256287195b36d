//! The `rollout` binary with an environment and `[sandbox]`: the sandbox keys are checked and
//! located, an environment that fails to load in the sandbox points at its option, and
//! `environments = false` keeps the environment in the embedded interpreter (where a raise
//! ends the run) while the default isolates it (where it costs the episode).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

mod common;

use common::{repo, rollout, stderr};

/// A toy-policy run whose `[environment]` table is `environment`, then `[sandbox]` with
/// `sandbox` (line 24 is the first of `environment`, line 29 the first of `sandbox`).
fn config(dir: &Path, environment: &str, sandbox: &str) -> PathBuf {
    let repo = repo();
    let text = format!(
        r#"[run]
name = "toy"
output_dir = "{out}"
steps = 2

[python]
paths = ["{fixtures}"]

[policy]
plugin = "toy_plugins:ToyPolicy"

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{prompts}" }}

[rollout]
prompts_per_step = 2
group_size = 2
max_new_tokens = 3

[train]
learning_rate = 0.001
[environment]
{environment}
max_turns = 2

[sandbox]
{sandbox}
"#,
        out = dir.join("out").display(),
        fixtures = repo.join("tests/fixtures").display(),
        prompts = repo.join("tests/fixtures/prompts.jsonl").display(),
    );
    let path = dir.join("toy.toml");
    std::fs::write(&path, text).unwrap();
    path
}

const HOSTILE: &str = "plugin = \"sandbox_environments:Hostile\"\noptions = { refuse = \"*\" }";

#[test]
fn sandbox_keys_are_checked_where_they_are_written() {
    let tmp = tempfile::tempdir().unwrap();
    for (sandbox, expected) in [
        ("processes = 1\nenvironments = \"yes\"", "toy.toml:30:"),
        (
            "processes = 1\nmax_failed_fraction_per_step = 1.5",
            "toy.toml:30:1: `sandbox.max_failed_fraction_per_step`: must be in [0, 1]",
        ),
        ("enviroments = true", "did you mean `environments`?"),
    ] {
        let config = config(tmp.path(), HOSTILE, sandbox);
        let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains(expected), "{}", stderr(&out));
    }
}

#[test]
fn an_environment_with_a_bad_option_in_the_sandbox_points_at_its_line() {
    let tmp = tempfile::tempdir().unwrap();
    let environment =
        "plugin = \"python_plugins.environments:GuessNumber\"\noptions = { low = \"one\" }";
    let config = config(tmp.path(), environment, "processes = 1");
    let out = rollout(&["check", config.to_str().unwrap()], tmp.path());
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("toy.toml:25:13: `environment.options.low`"),
        "{err}"
    );
    assert!(
        err.contains("(plugin `python_plugins.environments:GuessNumber`)"),
        "{err}"
    );
}

#[test]
fn an_environment_that_raises_ends_the_run_only_outside_the_sandbox() {
    let tmp = tempfile::tempdir().unwrap();
    let limits = "max_failed_fraction = 1.0\nmax_failed_fraction_per_step = 1.0";
    let inside = config(tmp.path(), HOSTILE, &format!("processes = 1\n{limits}"));
    let out = rollout(&["run", inside.to_str().unwrap()], tmp.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let metrics = std::fs::read_to_string(tmp.path().join("out/metrics.jsonl")).unwrap();
    for line in metrics.lines() {
        let line: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(line["environment_failed_raised"], 4, "{line}");
        assert_eq!(line["trained_rows"], 0, "{line}");
    }

    let outside = config(
        tmp.path(),
        HOSTILE,
        &format!("processes = 1\nenvironments = false\n{limits}"),
    );
    let out = rollout(
        &["run", outside.to_str().unwrap(), "--overwrite"],
        tmp.path(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("plugin `sandbox_environments:Hostile`"),
        "{err}"
    );
    assert!(err.contains("failed in `reset`"), "{err}");
    assert!(err.contains("environment refused record"), "{err}");
}
