#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use super::grid::{Axis, check_axes, check_unique, expand, parse_axis};
use super::manifest::{self, Manifest, ManifestRun};
use super::status::RunStatus;
use super::summary::{self, Row};
use super::{Options, Plan, SweepError};

fn axis(key: &str, values: &[&str]) -> Axis {
    Axis {
        key: key.into(),
        values: values.iter().map(|v| (*v).to_owned()).collect(),
    }
}

#[test]
fn values_split_at_top_level_commas_only() {
    let parsed = parse_axis("rollout.stop=[\"a,b\", \"c\"],[\"d\"], 'x,y'").unwrap();
    assert_eq!(parsed.key, "rollout.stop");
    assert_eq!(parsed.values, ["[\"a,b\", \"c\"]", "[\"d\"]", "'x,y'"]);
    assert!(matches!(
        parse_axis("train.learning_rate"),
        Err(SweepError::Grid { .. })
    ));
    assert!(matches!(parse_axis("a..b=1"), Err(SweepError::Grid { .. })));
    assert!(matches!(parse_axis("a=1,,2"), Err(SweepError::Grid { .. })));
    assert!(matches!(parse_axis("a=1,1"), Err(SweepError::Grid { .. })));
    assert!(matches!(parse_axis("a=[1,2"), Err(SweepError::Grid { .. })));
    assert!(matches!(
        parse_axis("run.output_dir=x,y"),
        Err(SweepError::Grid { .. })
    ));
}

#[test]
fn expansion_is_the_product_first_axis_slowest_seeds_innermost() {
    let axes = [
        axis("train.learning_rate", &["1e-5", "3e-5"]),
        axis("rollout.group_size", &["4", "8"]),
    ];
    let points = expand(&axes, Some(2));
    let names: Vec<&str> = points.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "learning_rate=1e-5,group_size=4,seed=0",
            "learning_rate=1e-5,group_size=4,seed=1",
            "learning_rate=1e-5,group_size=8,seed=0",
            "learning_rate=1e-5,group_size=8,seed=1",
            "learning_rate=3e-5,group_size=4,seed=0",
            "learning_rate=3e-5,group_size=4,seed=1",
            "learning_rate=3e-5,group_size=8,seed=0",
            "learning_rate=3e-5,group_size=8,seed=1",
        ]
    );
    assert_eq!(
        points[5].assignments(),
        [
            "train.learning_rate=3e-5",
            "rollout.group_size=4",
            "run.seed=1"
        ]
    );
    assert_eq!(points[5].dir_name, points[5].name);
    check_unique(&points).unwrap();
}

#[test]
fn names_without_seeds_quote_free_and_disambiguated() {
    let axes = [
        axis("algorithm.name", &["grpo", "\"rloo\""]),
        axis("sft.steps", &["0"]),
        axis("run.steps", &["5"]),
    ];
    let points = expand(&axes, None);
    assert_eq!(points.len(), 2);
    assert_eq!(points[0].name, "name=grpo,sft.steps=0,run.steps=5");
    assert_eq!(points[1].name, "name=rloo,sft.steps=0,run.steps=5");
    assert_eq!(points[1].assignments()[0], "algorithm.name=\"rloo\"");
    assert!(points.iter().all(|p| p.seed.is_none()));
    // No grid at all: one run per seed, or a single run.
    assert_eq!(expand(&[], Some(3)).len(), 3);
    assert_eq!(expand(&[], None)[0].name, "run");
    // A path value is cleaned into one directory name.
    let points = expand(&[axis("policy.options.model_path", &["/m/a b"])], None);
    assert_eq!(points[0].name, "model_path=/m/a b");
    assert_eq!(points[0].dir_name, "model_path=_m_a_b");
}

#[test]
fn axes_conflicts_are_refused() {
    let twice = [axis("run.steps", &["1"]), axis("run.steps", &["2"])];
    assert!(matches!(
        check_axes(&twice, None),
        Err(SweepError::Grid { .. })
    ));
    let seed = [axis("run.seed", &["1", "2"])];
    assert!(check_axes(&seed, None).is_ok());
    assert!(matches!(
        check_axes(&seed, Some(2)),
        Err(SweepError::Grid { .. })
    ));
    assert!(matches!(
        check_axes(&[], Some(0)),
        Err(SweepError::Grid { .. })
    ));
    let clash = expand(&[axis("data.options.path", &["a/b", "a_b"])], None);
    assert!(matches!(check_unique(&clash), Err(SweepError::Grid { .. })));
}

fn manifest(grid: Vec<Axis>, config: &[u8]) -> Manifest {
    Manifest::new(
        Path::new("c.toml"),
        config,
        grid,
        Some(2),
        vec!["run.steps=2".into()],
        vec![ManifestRun {
            name: "a".into(),
            dir: "a".into(),
        }],
    )
}

#[test]
fn a_directory_of_another_sweep_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sweep");
    let first = manifest(vec![axis("train.learning_rate", &["1", "2"])], b"x");
    assert!(!manifest::create_or_check(&dir, &first).unwrap());
    assert!(
        manifest::create_or_check(&dir, &first).unwrap(),
        "the same sweep continues"
    );
    let other_grid = manifest(vec![axis("train.learning_rate", &["1", "3"])], b"x");
    let err = manifest::create_or_check(&dir, &other_grid).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, SweepError::ManifestMismatch { .. }));
    assert!(message.contains("the grid"), "{message}");
    assert!(message.contains("train.learning_rate=1,3"), "{message}");
    let other_config = manifest(vec![axis("train.learning_rate", &["1", "2"])], b"y");
    let message = manifest::create_or_check(&dir, &other_config)
        .unwrap_err()
        .to_string();
    assert!(message.contains("the config"), "{message}");
    assert!(!message.contains("the grid"), "{message}");
    // A non-empty directory that is no sweep's is not taken over.
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir_all(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), "mine").unwrap();
    let err = manifest::create_or_check(&foreign, &first).unwrap_err();
    assert!(matches!(err, SweepError::NotASweep { .. }));
}

#[test]
fn a_lock_of_a_dead_sweep_does_not_block() {
    let tmp = tempfile::tempdir().unwrap();
    manifest::Lock {
        sweep: u32::MAX - 1,
        runs: vec![("runs/x".into(), u32::MAX - 2)],
    }
    .write(tmp.path())
    .unwrap();
    manifest::Lock::check_none_alive(tmp.path()).unwrap();
    // This test process is alive and its command line names this test binary.
    let me = std::env::args().next().unwrap();
    manifest::Lock {
        sweep: u32::MAX - 1,
        runs: vec![(me, std::process::id())],
    }
    .write(tmp.path())
    .unwrap();
    let err = manifest::Lock::check_none_alive(tmp.path()).unwrap_err();
    assert!(matches!(err, SweepError::StillRunning { .. }));
}

fn write_run(dir: &Path, rewards: &[f64], summary: Option<&str>) {
    std::fs::create_dir_all(dir).unwrap();
    let lines: Vec<String> = rewards
        .iter()
        .enumerate()
        .map(|(i, r)| {
            format!(
                "{{\"step\": {}, \"epoch\": 0, \"weight_version\": {}, \"reward_mean\": {r}, \"completions\": 8, \"generated_tokens\": 40, \"step_seconds\": 2.0, \"elapsed_seconds\": {}}}",
                i + 1,
                i + 1,
                2 * (i + 1)
            )
        })
        .collect();
    std::fs::write(dir.join("metrics.jsonl"), lines.join("\n") + "\n").unwrap();
    if let Some(summary) = summary {
        std::fs::write(dir.join("summary.json"), summary).unwrap();
    }
}

#[test]
fn statuses_come_from_the_runs_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    assert_eq!(RunStatus::of(&dir.join("none")), RunStatus::Pending);
    write_run(&dir.join("killed"), &[0.1], None);
    assert_eq!(RunStatus::of(&dir.join("killed")), RunStatus::Incomplete);
    let interrupted = r#"{"interrupted": true, "steps_completed": 1, "steps_planned": 3}"#;
    write_run(&dir.join("stopped"), &[0.1], Some(interrupted));
    assert_eq!(RunStatus::of(&dir.join("stopped")), RunStatus::Interrupted);
    let done =
        r#"{"interrupted": false, "steps_completed": 3, "steps_planned": 3, "wall_seconds": 9.5}"#;
    write_run(&dir.join("done"), &[0.1, 0.2, 0.3], Some(done));
    assert_eq!(RunStatus::of(&dir.join("done")), RunStatus::Finished);
    // A summary cut off mid-write is not a finished run.
    write_run(&dir.join("torn"), &[0.1], Some(r#"{"interrupted": fal"#));
    assert_eq!(RunStatus::of(&dir.join("torn")), RunStatus::Incomplete);
    assert!(RunStatus::Incomplete.resumes() && RunStatus::Interrupted.resumes());
    assert!(!RunStatus::Pending.resumes() && !RunStatus::Finished.resumes());
}

#[test]
fn the_summary_reads_fake_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let axes = [axis("train.learning_rate", &["1e-5", "2e-5", "3e-5"])];
    let points = expand(&axes, None);
    let dirs: Vec<PathBuf> = points
        .iter()
        .map(|p| tmp.path().join(&p.dir_name))
        .collect();
    // 12 steps: the final reward is the mean of the last 10 (0.3 ... 1.2), the best 1.2.
    let rewards: Vec<f64> = (1..=12).map(|i| f64::from(i) / 10.0).collect();
    let done = r#"{"interrupted": false, "steps_completed": 12, "steps_planned": 12, "wall_seconds": 30.0}"#;
    write_run(&dirs[0], &rewards, Some(done));
    write_run(&dirs[1], &[0.5, 0.25], None);
    let rows: Vec<Row> = vec![
        Row::read(&points[0], &dirs[0], 12, None),
        Row::read(&points[1], &dirs[1], 12, Some("failed (exit 1)")),
        Row::read(&points[2], &dirs[2], 12, None),
    ];
    assert_eq!(rows[0].status, "finished");
    assert!((rows[0].final_reward.unwrap() - 0.75).abs() < 1e-9);
    assert_eq!(rows[0].best_reward, Some(1.2));
    assert_eq!(rows[0].best_reward_step, Some(12.0));
    assert_eq!(rows[0].samples_per_second, Some(4.0));
    assert_eq!(rows[0].tokens_per_second, Some(20.0));
    assert_eq!(rows[0].wall_seconds, Some(30.0));
    assert_eq!(rows[1].status, "failed (exit 1)");
    assert_eq!(rows[1].final_reward, Some(0.375));
    assert_eq!(rows[1].wall_seconds, Some(4.0), "the last elapsed_seconds");
    assert_eq!(rows[2].status, "pending");
    assert_eq!(rows[2].steps_logged, 0);

    let keys = vec!["train.learning_rate".to_owned()];
    let table = summary::write(tmp.path(), &keys, false, &rows).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 5);
    assert!(lines[0].starts_with("| run | train.learning_rate | status | steps |"));
    assert_eq!(
        lines[2],
        "| learning_rate=1e-5 | 1e-5 | finished | 12/12 | 0.7500 | 1.2000 (step 12) | 4.0 | 20.0 | 30.0 |"
    );
    assert!(lines[4].starts_with("| learning_rate=3e-5 | 3e-5 | pending | 0/12 |  |"));
    let csv = std::fs::read_to_string(tmp.path().join("summary.csv")).unwrap();
    let csv_lines: Vec<&str> = csv.lines().collect();
    assert!(csv_lines[0].starts_with("run,train.learning_rate,status,steps_logged"));
    assert!(csv_lines[2].starts_with("learning_rate=2e-5,2e-5,failed (exit 1),2,12,0.375,0.5,1,"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(json[0]["values"]["train.learning_rate"], "1e-5");
    assert!((json[0]["final_reward"].as_f64().unwrap() - 0.75).abs() < 1e-9);
    assert_eq!(
        std::fs::read_to_string(tmp.path().join("summary.md")).unwrap(),
        table
    );
}

fn write_config(dir: &Path) -> PathBuf {
    let path = dir.join("c.toml");
    let text = "[run]\nsteps = 3\n[policy]\nplugin = \"toy:Toy\"\n[data]\nplugin = \"d:D\"\n\
                [[rewards]]\nplugin = \"r:R\"\n[train]\nlearning_rate = 1e-5\n";
    std::fs::write(&path, text).unwrap();
    path
}

fn options(config: &Path, grid: &[&str]) -> Options {
    Options {
        config: config.to_path_buf(),
        grid: grid.iter().map(|g| (*g).to_owned()).collect(),
        seeds: Some(2),
        overrides: vec!["run.steps=4".into()],
        output: Some(config.with_file_name("sweep")),
        parallel: 1,
        launch: false,
    }
}

#[test]
fn every_run_is_validated_and_named_up_front() {
    let tmp = tempfile::tempdir().unwrap();
    let config = write_config(tmp.path());
    let plan = Plan::new(&options(&config, &["train.learning_rate=1e-5,2e-5"])).unwrap();
    assert_eq!(plan.runs.len(), 4);
    let run = &plan.runs[3];
    assert_eq!(run.point.name, "learning_rate=2e-5,seed=1");
    assert_eq!(run.steps, 4);
    assert_eq!(
        run.dir,
        tmp.path().join("sweep").join("learning_rate=2e-5,seed=1")
    );
    assert_eq!(run.overrides[0], "run.steps=4");
    assert!(run.overrides.contains(&"run.seed=1".to_owned()));
    assert!(
        run.overrides
            .contains(&"run.name=\"learning_rate=2e-5,seed=1\"".to_owned())
    );

    // A misspelt key: the same error as `--set`, named by its --grid, before anything runs.
    let err = Plan::new(&options(&config, &["train.lerning_rate=1e-5"])).unwrap_err();
    assert!(matches!(err, SweepError::GridValue { .. }) && err.is_config());
    let message = chain(&err);
    assert!(
        message.starts_with("--grid train.lerning_rate=1e-5: --set "),
        "{message}"
    );
    assert!(
        message.contains("did you mean `learning_rate`?"),
        "{message}"
    );
    // A value of the wrong type.
    let message = chain(&Plan::new(&options(&config, &["run.steps=3,many"])).unwrap_err());
    assert!(message.contains("run.steps=many"), "{message}");
    // The sweep names the runs and their directories itself.
    let mut reserved = options(&config, &[]);
    reserved.overrides.push("run.name=x".into());
    let err = Plan::new(&reserved).unwrap_err();
    assert!(matches!(err, SweepError::Config(_)) && err.is_config());
    assert!(
        !tmp.path().join("sweep").exists(),
        "nothing is created by planning"
    );
}

/// The error and its sources, as `rollout` prints them.
fn chain(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    message
}
