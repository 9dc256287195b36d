//! A multi-agent run against the testkit's fakes (no Python): each agent trains on its own
//! turns and returns, checkpoints apart and resumes from its own directory.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use rollout_core::config::Config;
use rollout_core::roles::RoleError;
use rollout_core::train::{Agent, Controller, Roles, RunError, Start, Team, Trainees, verify};
use rollout_testkit::fakes::{FakeLearner, FakePolicy, RecordingObserver, Relay, config, records};

fn team_config(output: &Path, steps: u64) -> Config {
    let base = format!(
        r#"
        [run]
        steps = {steps}
        output_dir = "{}"
        [policy]
        plugin = "fake:Model"
        [data]
        plugin = "fake:Data"
        [environment]
        plugin = "fake:Relay"
        max_turns = 4
        [agents.first]
        [agents.second]
        learning_rate = 0.5
        [rollout]
        prompts_per_step = 2
        group_size = 2
        [checkpoint]
        every = 2
        "#,
        output.display()
    );
    config(&base, "")
}

/// Runs `config` with two fake agents; returns the steps completed.
async fn run(
    config: &Config,
    environment: &Relay,
    learners: [&FakeLearner; 2],
    start: Start,
) -> Result<u64, RunError> {
    let policies = learners.map(|learner| FakePolicy::sharing(learner.version.clone()));
    let agents = config
        .agent_specs()
        .into_iter()
        .zip(learners.iter().zip(&policies))
        .map(|(spec, (learner, policy))| Agent {
            name: spec.name.to_owned(),
            generator: policy,
            learner: *learner,
            tokenizer: policy,
            learning_rate: spec.learning_rate,
        })
        .collect();
    let team = Team {
        agents,
        environments: environment,
    };
    let observer = RecordingObserver::default();
    let roles = Roles {
        trainees: Trainees::Team(&team),
        observer: &observer,
    };
    let mut controller =
        Controller::new(config, roles, records(8), Arc::new(AtomicBool::new(false)));
    match tokio::time::timeout(Duration::from_secs(20), controller.run(start)).await {
        Ok(summary) => summary.map(|s| s.steps_completed),
        Err(_) => panic!("the run hung"),
    }
}

fn metrics(output: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(output.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_agent_trains_on_its_own_returns_and_checkpoints_apart() {
    let output = tempfile::tempdir().unwrap();
    let config = team_config(output.path(), 3);
    let (first, second, relay) = (
        FakeLearner::default(),
        FakeLearner::default(),
        Relay::default(),
    );
    assert_eq!(
        run(&config, &relay, [&first, &second], Start::Fresh)
            .await
            .unwrap(),
        3
    );

    for learner in [&first, &second] {
        let events = learner.events();
        assert_eq!(
            events,
            ["train 1", "train 2", "snapshot 2", "train 3", "save 3"],
            "one update per step, checkpointed at step 2 in the background and at the last, 3, in the foreground"
        );
    }
    for step in [2, 3] {
        let dir = output.path().join(format!("checkpoints/step-{step:08}"));
        assert_eq!(verify(&dir).unwrap().step, step);
        for agent in ["first", "second"] {
            let weights =
                std::fs::read_to_string(dir.join("policy").join(agent).join("weights.txt"));
            assert_eq!(weights.unwrap(), step.to_string(), "{agent} at step {step}");
        }
    }
    // 2 prompts x 2 episodes a step, ids alternating in parity: `first` gets 0 or 1 plus
    // 0.5, `second` always 1.
    let lines = metrics(output.path());
    assert_eq!(lines.len(), 3);
    for line in &lines {
        assert_eq!(line["first/reward_mean"], 1.0, "{line}");
        assert_eq!(line["second/reward_mean"], 1.0, "{line}");
        assert_eq!(line["first/turns"], 4.0);
        assert_eq!(line["second/turns"], 4.0);
        assert_eq!(line["episode_turns_mean"], 2.0);
        assert_eq!(line["truncated_episodes"], 0);
        assert_eq!(line["first/zero_std_groups"], 0.0);
        assert_eq!(line["second/zero_std_groups"], 2.0);
        assert_eq!(line["second/learning_rate"], 0.5);
        assert_eq!(line["reward_mean"], 1.0);
    }
    // Each agent trains on its own advantages: `first` on its 4 turns (+-1/sqrt 2 in each
    // group), `second` on none (no spread, no KL term: zero-advantage rows are skipped).
    for rows in first.trained_advantages() {
        let mut rows = rows.clone();
        rows.sort_by(f32::total_cmp);
        let half = std::f32::consts::FRAC_1_SQRT_2;
        let expected = [-half, -half, half, half];
        assert!(
            rows.iter().zip(expected).all(|(a, b)| (a - b).abs() < 1e-3),
            "{rows:?}"
        );
        assert_eq!(rows.len(), 4);
    }
    assert!(second.trained_advantages().iter().all(Vec::is_empty));
    assert_eq!(relay.finished().len(), 12, "every episode released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_restores_every_agent_from_its_own_directory() {
    let output = tempfile::tempdir().unwrap();
    let (first, second, relay) = (
        FakeLearner::default(),
        FakeLearner::default(),
        Relay::default(),
    );
    run(
        &team_config(output.path(), 2),
        &relay,
        [&first, &second],
        Start::Fresh,
    )
    .await
    .unwrap();
    let (first, second) = (FakeLearner::default(), FakeLearner::default());
    let config = team_config(output.path(), 3);
    assert_eq!(
        run(&config, &relay, [&first, &second], Start::Resume)
            .await
            .unwrap(),
        3
    );
    for learner in [&first, &second] {
        assert_eq!(learner.events()[..2], ["restore 2 as 2", "train 3"]);
    }
    let steps: Vec<_> = metrics(output.path())
        .iter()
        .map(|l| l["step"].clone())
        .collect();
    assert_eq!(steps, [1, 2, 3], "the resumed run continues the metrics");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_for_an_unknown_agent_fails_the_run_and_releases_the_episodes() {
    let output = tempfile::tempdir().unwrap();
    let (first, second) = (FakeLearner::default(), FakeLearner::default());
    let relay = Relay::with_stranger();
    let err = run(
        &team_config(output.path(), 2),
        &relay,
        [&first, &second],
        Start::Fresh,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, RunError::Role(RoleError::Protocol(m)) if m.contains("`third`")),
        "{err}"
    );
    assert_eq!(relay.finished().len(), 4);
    assert!(
        first.events().is_empty(),
        "nothing trained: {:?}",
        first.events()
    );
}
