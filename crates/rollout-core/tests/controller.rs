//! The controller against the testkit's fake roles (no Python, no model): what it asks of
//! them, in which order, with which numbers, and what it leaves on disk.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use rollout_core::cluster::ledger::{Ledger, audit};
use rollout_core::cluster::pool::MIN_LOGPROB;
use rollout_core::cluster::pool::{PoolSettings, RemoteWorkers};
use rollout_core::config::Config;
use rollout_core::metrics::StepMetrics;
use rollout_core::roles::{Environments, Generator, Tokenizer};
use rollout_core::train::{
    Controller, PolicyRoles, Roles, RunError, Start, Summary, Trainees, verify,
};
use rollout_net::ClusterKey;
use rollout_net::messages::Objective;
use rollout_testkit::fakes::worker::{Behaviour, Malformation, fake_worker};
use rollout_testkit::fakes::{
    FakeEnvironment, FakeLearner, FakePolicy, FakeRewards, RecordingObserver, Score, config,
    records,
};

/// A run's fakes: a learner, a policy sharing its weights (unless given one that holds its
/// own), rewards, maybe an environment, and an observer.
struct Fakes {
    learner: FakeLearner,
    policy: FakePolicy,
    rewards: FakeRewards,
    environment: Option<FakeEnvironment>,
    observer: RecordingObserver,
}

impl Fakes {
    fn new(learner: FakeLearner) -> Self {
        let policy = FakePolicy::sharing(learner.version.clone());
        Fakes {
            learner,
            policy,
            rewards: FakeRewards::first_letter(),
            environment: None,
            observer: RecordingObserver::default(),
        }
    }

    async fn run(&self, config: &Config, start: Start) -> Result<Summary, RunError> {
        self.run_with(config, start, &self.policy, &self.policy)
            .await
    }

    async fn run_with(
        &self,
        config: &Config,
        start: Start,
        generator: &dyn Generator,
        tokenizer: &dyn Tokenizer,
    ) -> Result<Summary, RunError> {
        let roles = Roles {
            trainees: Trainees::Policy(PolicyRoles {
                generator,
                learner: &self.learner,
                tokenizer,
                scorer: &self.rewards,
                environments: self.environment.as_ref().map(|e| e as &dyn Environments),
            }),
            observer: &self.observer,
        };
        let interrupted = Arc::new(AtomicBool::new(false));
        let mut controller = Controller::new(config, roles, records(8), interrupted);
        let run = tokio::time::timeout(Duration::from_secs(20), controller.run(start)).await;
        let result = run.unwrap_or_else(|_| panic!("the run hung: {:?}", self.learner.events()));
        controller.finish(result.as_ref().ok()).await;
        result
    }
}

/// The base run: `steps` RL steps of 2 prompts x 2 completions, every sample logged,
/// checkpoints every `every` steps; `extra` adds or overrides sections.
fn run_config(output: &Path, steps: u64, every: u64, extra: &str) -> Config {
    let base = format!(
        r#"
        [run]
        steps = {steps}
        output_dir = "{}"
        log_samples = 100
        [policy]
        plugin = "fake:Policy"
        [data]
        plugin = "fake:Data"
        [rollout]
        prompts_per_step = 2
        group_size = 2
        [checkpoint]
        every = {every}
        "#,
        output.display()
    );
    config(&base, extra)
}

fn metrics(output: &Path) -> Vec<StepMetrics> {
    std::fs::read_to_string(output.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| StepMetrics::from_line(line).unwrap())
        .collect()
}

fn samples(output: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(output.join("samples.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// What a step learned from, without wall times.
fn learning_signal(metrics: &StepMetrics) -> serde_json::Value {
    let mut line = metrics.to_line();
    if let Some(fields) = line.as_object_mut() {
        fields.retain(|name, _| !name.ends_with("seconds") && !name.ends_with("per_second"));
    }
    line
}

fn checkpoint(output: &Path, step: u64) -> (u64, String) {
    let dir = output.join("checkpoints").join(format!("step-{step:08}"));
    let state = verify(&dir).unwrap_or_else(|err| panic!("{err}"));
    let weights = std::fs::read_to_string(dir.join("policy/weights.txt")).unwrap_or_default();
    (state.step, weights)
}

fn latest(output: &Path) -> String {
    std::fs::read_to_string(output.join("checkpoints/latest"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_ends_alike_in_the_metrics_file_the_observers_and_the_checkpoints() {
    let output = tempfile::tempdir().unwrap();
    let fakes = Fakes::new(FakeLearner::default());
    let summary = fakes
        .run(&run_config(output.path(), 3, 2, ""), Start::Fresh)
        .await
        .unwrap();
    assert_eq!(summary.steps_completed, 3);
    let lines = metrics(output.path());
    assert_eq!(lines, fakes.observer.metrics(), "one definition, one line");
    for (index, line) in lines.iter().enumerate() {
        let step = index as u64 + 1;
        assert_eq!((line.step, line.weight_version), (step, step));
        // In one process generation shares the learner's weights: no staleness.
        assert_eq!(line.generation_weight_version, Some(step - 1));
        assert_eq!(line.staleness_max, Some(0));
        // Two groups of two: the first sample of each scores 1.
        assert_eq!(line.reward_mean, Some(0.5));
        assert_eq!(line.measured["reward/fake"], 0.5);
        assert_eq!(
            (line.completions, line.generated_tokens),
            (Some(4), Some(8))
        );
        assert_eq!(line.loss, Some(1.0));
        assert_eq!(line.measured["loss_tokens"], 8.0);
        assert_eq!(
            line.measured["engine/steps"], 2.0,
            "the generator's metrics"
        );
        assert!(line.elapsed_seconds >= line.step_seconds);
    }
    // Step 2's checkpoint is written in the background and reported once committed, after
    // the next step at the earliest; the last one is waited for before the run ends.
    assert_eq!(
        fakes.observer.events(),
        [
            "start 0",
            "step 1",
            "step 2",
            "step 3",
            "checkpoint 2",
            "checkpoint 3",
            "end"
        ]
    );
    assert_eq!(checkpoint(output.path(), 3), (3, "3".into()));
    let logged = samples(output.path());
    assert_eq!(logged.len(), 12);
    assert_eq!(logged[0]["completion"], "ab");
    assert_eq!(logged[0]["reward"], 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn training_goes_on_while_a_checkpoint_is_written() {
    let output = tempfile::tempdir().unwrap();
    // Step 2's write finishes only once training is two updates further: waiting for it
    // before training on would hang.
    let fakes = Fakes::new(FakeLearner::default().holding_write_at(2));
    let config = run_config(output.path(), 4, 2, "");
    assert_eq!(
        fakes
            .run(&config, Start::Fresh)
            .await
            .unwrap()
            .steps_completed,
        4
    );
    let events = fakes.learner.events();
    let position = |event: &str| events.iter().position(|e| e == event);
    assert!(position("snapshot 2") < position("train 3"), "{events:?}");
    // The last one is saved in the foreground: nothing trains after it, so nothing needs a copy.
    assert_eq!(
        events.last().map(String::as_str),
        Some("save 4"),
        "{events:?}"
    );
    assert_eq!(position("snapshot 4"), None, "{events:?}");
    // Written after two more updates, step 2's checkpoint still holds what it copied.
    assert_eq!(checkpoint(output.path(), 2), (2, "2".into()));
    assert_eq!(checkpoint(output.path(), 4), (4, "4".into()));
    assert_eq!(latest(output.path()), "step-00000004");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_checkpoint_saves_before_the_next_update() {
    let output = tempfile::tempdir().unwrap();
    let config = run_config(output.path(), 3, 1, "[checkpoint]\nbackground = false");
    let fakes = Fakes::new(FakeLearner::default());
    fakes.run(&config, Start::Fresh).await.unwrap();
    assert_eq!(
        fakes.learner.events(),
        [
            "train 1", "save 1", "train 2", "save 2", "train 3", "save 3"
        ],
    );
    assert_eq!(checkpoint(output.path(), 3), (3, "3".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_background_write_ends_the_run_and_keeps_the_previous_checkpoint() {
    let output = tempfile::tempdir().unwrap();
    let config = run_config(output.path(), 6, 2, "");
    let fakes = Fakes::new(FakeLearner::default().failing_write_at(4));
    let message = fakes
        .run(&config, Start::Fresh)
        .await
        .unwrap_err()
        .to_string();
    assert!(message.contains("No space left on device"), "{message}");
    assert_eq!(latest(output.path()), "step-00000002");
    assert_eq!(checkpoint(output.path(), 2), (2, "2".into()));
    let partial = output.path().join("checkpoints/step-00000004.partial");
    assert!(partial.exists());

    let fakes = Fakes::new(FakeLearner::default());
    assert_eq!(
        fakes
            .run(&config, Start::Resume)
            .await
            .unwrap()
            .steps_completed,
        6
    );
    assert_eq!(fakes.learner.events()[0], "restore 2 as 2");
    assert_eq!(checkpoint(output.path(), 6), (6, "6".into()));
    assert!(!partial.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_run_continues_exactly_as_an_uninterrupted_one() {
    let straight = tempfile::tempdir().unwrap();
    let uninterrupted = Fakes::new(FakeLearner::default());
    uninterrupted
        .run(&run_config(straight.path(), 5, 2, ""), Start::Fresh)
        .await
        .unwrap();

    let resumed = tempfile::tempdir().unwrap();
    let first = Fakes::new(FakeLearner::default());
    first
        .run(&run_config(resumed.path(), 3, 2, ""), Start::Fresh)
        .await
        .unwrap();
    // The run stopped at step 3 checkpointed there; pretend it died after step 2's.
    std::fs::remove_dir_all(resumed.path().join("checkpoints/step-00000003")).unwrap();
    std::fs::write(resumed.path().join("checkpoints/latest"), "step-00000002\n").unwrap();
    let second = Fakes::new(FakeLearner::default());
    second
        .run(&run_config(resumed.path(), 5, 2, ""), Start::Resume)
        .await
        .unwrap();

    assert_eq!(second.learner.events()[0], "restore 2 as 2");
    let signal = |output: &Path| -> Vec<serde_json::Value> {
        metrics(output).iter().map(learning_signal).collect()
    };
    assert_eq!(signal(resumed.path()), signal(straight.path()));
    // The same updates, on the same data, from step 3 on.
    assert_eq!(
        second.learner.requests(),
        uninterrupted.learner.requests()[2..]
    );
    assert_eq!(samples(resumed.path()), samples(straight.path()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_lag_at_most_max_staleness_versions_and_generation_waits_for_them() {
    for max_staleness in [0, 1, 2] {
        let output = tempfile::tempdir().unwrap();
        let learner = FakeLearner::default()
            .with_weight_sync()
            .taking(std::time::Duration::from_millis(5));
        let mut fakes = Fakes::new(learner);
        fakes.policy = FakePolicy::holding_weights();
        let extra = format!("[cluster]\nmax_staleness = {max_staleness}");
        fakes
            .run(&run_config(output.path(), 8, 0, &extra), Start::Fresh)
            .await
            .unwrap();
        // Step k is sampled only once update k - 1 - max_staleness reached the generator.
        for (step, version) in fakes.policy.generated() {
            assert!(
                version + 1 + max_staleness >= step,
                "step {step} sampled with version {version} (max_staleness {max_staleness})"
            );
        }
        let lines = metrics(output.path());
        let most = lines.iter().filter_map(|m| m.staleness_max).max();
        // Bounded, and with nothing slower than the learner the bound is used up.
        assert_eq!(most, Some(max_staleness), "{lines:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_past_the_staleness_bound_are_generated_again_and_counted() {
    let output = tempfile::tempdir().unwrap();
    let mut fakes = Fakes::new(FakeLearner::default().with_weight_sync());
    // Step 4's first answer comes from weights 3 versions old (a worker that rejoined on old
    // weights): past the bound of 1, so its groups are generated again.
    fakes.policy = FakePolicy::holding_weights().lagging_once(4, 3);
    fakes
        .run(
            &run_config(output.path(), 6, 0, "[cluster]\nmax_staleness = 1"),
            Start::Fresh,
        )
        .await
        .unwrap();
    let lines = metrics(output.path());
    let regenerated: Vec<u64> = lines
        .iter()
        .map(|line| line.stale_groups_regenerated.unwrap())
        .collect();
    assert_eq!(regenerated, [0, 0, 0, 2, 0, 0], "{lines:?}");
    for line in &lines {
        assert_eq!(line.stale_groups_dropped, Some(0));
        assert!(line.staleness_max.unwrap() <= 1, "{line:?}");
        assert_eq!(line.completions, Some(4), "{line:?}");
    }
    // Step 4's groups were generated twice: once stale, once on current weights.
    let step_four: Vec<u64> = fakes
        .policy
        .generated()
        .into_iter()
        .filter(|&(step, _)| step == 4)
        .map(|(_, version)| version)
        .collect();
    assert_eq!(step_four.len(), 4, "{step_four:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_answer_that_moves_the_weight_version_back_ends_the_run() {
    let output = tempfile::tempdir().unwrap();
    let fakes = Fakes::new(FakeLearner::default().claiming_version(3, 1));
    let err = fakes
        .run(&run_config(output.path(), 5, 0, ""), Start::Fresh)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("step 3: the trainer answered with weight version 1, older than the 2"),
        "{err}"
    );
    assert_eq!(metrics(output.path()).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_generator_that_never_catches_up_ends_the_run_after_bounded_regeneration() {
    let output = tempfile::tempdir().unwrap();
    let fakes = Fakes::new(FakeLearner::default().with_weight_sync());
    // Its weights never move: version 0 whatever it is sent.
    let stuck = FakePolicy::sharing(Arc::new(AtomicU64::new(0)));
    let config = run_config(output.path(), 6, 0, "[cluster]\nmax_staleness = 1");
    let err = fakes
        .run_with(&config, Start::Fresh, &stuck, &stuck)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "step 3: no group within cluster.max_staleness = 1 of the trainer's version 2 \
             after 3 rounds of generation"
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_sampling_replaces_flat_groups_with_reserve_prompts() {
    let output = tempfile::tempdir().unwrap();
    let mut fakes = Fakes::new(FakeLearner::default());
    // Even records' groups are flat (every sample 0.5): no advantage to learn from.
    fakes.rewards = FakeRewards::new(|sample| {
        let record: usize = sample.prompt.split('+').next().unwrap().parse().unwrap();
        if record % 2 == 0 {
            Score::Reward(0.5)
        } else {
            Score::Reward(f64::from(u8::from(sample.completion.starts_with('a'))))
        }
    });
    let extra =
        "[algorithm]\ndynamic_sampling_rounds = 2\n[data]\nplugin = \"fake:Data\"\nshuffle = false";
    fakes
        .run(&run_config(output.path(), 2, 0, extra), Start::Fresh)
        .await
        .unwrap();
    let lines = metrics(output.path());
    // Unshuffled, each step draws 2 prompts and 4 in reserve: records 0-5, then 6, 7, 0-3.
    // Step 1 replaces its flat record 0 with the reserve's first record (2, flat too),
    // then with 3; step 2 replaces 6 with 0, then with 1.
    for line in &lines {
        assert_eq!(
            (line.refilled_groups, line.refill_rounds),
            (Some(2), Some(2))
        );
        assert_eq!(line.zero_std_group_fraction, Some(0.0));
        assert_eq!(line.completions, Some(4));
    }
    let prompts: Vec<Vec<String>> = [1, 2]
        .iter()
        .map(|&step| {
            let mut prompts: Vec<String> = samples(output.path())
                .iter()
                .filter(|s| s["step"] == step)
                .map(|s| s["prompt"].as_str().unwrap().to_owned())
                .collect();
            prompts.dedup();
            prompts
        })
        .collect();
    assert_eq!(prompts, [["1+1=", "3+3="], ["7+7=", "1+1="]]);
    // Every trained row carries an advantage.
    for rows in fakes.learner.trained_advantages() {
        assert_eq!(rows.len(), 4);
        assert!(rows.iter().all(|a| a.abs() > 0.5), "{rows:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ppo_trains_on_gae_returns_from_the_value_heads_predictions() {
    let output = tempfile::tempdir().unwrap();
    let fakes = Fakes::new(FakeLearner::default().predicting(0.5));
    let extra = "[algorithm]\nname = \"ppo\"\nlam = 1.0\nwhiten_advantages = false\ncritic_warmup_steps = 1";
    fakes
        .run(&run_config(output.path(), 2, 0, extra), Start::Fresh)
        .await
        .unwrap();
    let requests = fakes.learner.requests();
    assert_eq!(requests.len(), 2);
    for (step, request) in requests.iter().enumerate() {
        let Objective::Ppo { train_policy, .. } = request.micro_batches[0].objective else {
            panic!("not PPO: {:?}", request.micro_batches[0].objective);
        };
        assert_eq!(train_policy, step > 0, "the first step warms the critic up");
        for batch in &request.micro_batches {
            for row in 0..batch.rows {
                let span = row * batch.width..(row + 1) * batch.width;
                let trained: Vec<usize> = span.filter(|&t| batch.loss_mask[t] > 0.0).collect();
                assert_eq!(trained.len(), 2, "both generated tokens are actions");
                // gamma = lam = 1 and V = 0.5 everywhere: every action's return is the
                // sequence's reward and its advantage the reward less the value.
                let reward = batch.returns[trained[1]];
                assert!(reward == 0.0 || reward == 1.0, "{reward}");
                for &t in &trained {
                    assert_eq!(batch.old_values[t], 0.5);
                    assert_eq!(batch.returns[t], reward);
                    assert_eq!(batch.advantages[t], reward - 0.5);
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sft_and_dpo_steps_train_on_the_datas_own_completions() {
    // SFT: the answer (and the end-of-sequence token) after each prompt.
    let output = tempfile::tempdir().unwrap();
    let fakes = Fakes::new(FakeLearner::default());
    let extra = "[algorithm]\nname = \"sft\"\n[data]\nplugin = \"fake:Data\"\nshuffle = false";
    fakes
        .run(&run_config(output.path(), 2, 0, extra), Start::Fresh)
        .await
        .unwrap();
    let first = &fakes.learner.requests()[0].micro_batches[0];
    assert_eq!(first.objective, Objective::Sft);
    let row: Vec<u32> = first.input_ids[..first.width].to_vec();
    let trained: Vec<u32> = (0..first.width)
        .filter(|&t| first.loss_mask[t] > 0.0)
        .map(|t| row[t])
        .collect();
    assert_eq!(
        trained,
        [u32::from('0'), 0],
        "record 0's answer `0`, then EOS"
    );
    let lines = metrics(output.path());
    assert_eq!(lines.len(), 2);
    // Records 0 and 1: four prompt tokens, the answer and EOS each.
    assert_eq!(lines[0].tokens, Some(12));
    assert_eq!(lines[0].reward_mean, None, "nothing is sampled");
    assert!(fakes.policy.generated().is_empty());

    // DPO: a pair of rows per record, the chosen completion first.
    let output = tempfile::tempdir().unwrap();
    let fakes = Fakes::new(FakeLearner::default());
    let extra = "[algorithm]\nname = \"dpo\"\nbeta = 0.25\nchosen_key = \"answer\"\nrejected_key = \"prompt\"";
    fakes
        .run(&run_config(output.path(), 1, 0, extra), Start::Fresh)
        .await
        .unwrap();
    let batches = &fakes.learner.requests()[0].micro_batches;
    let rows: usize = batches.iter().map(|b| b.rows).sum();
    assert_eq!(rows, 4, "2 records, a chosen and a rejected row each");
    for batch in batches {
        assert_eq!(batch.objective, Objective::Dpo { beta: 0.25 });
        assert_eq!(batch.loss_scale, 0.5, "1 / pairs in the update");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_whose_reward_failed_are_logged_and_not_trained() {
    let output = tempfile::tempdir().unwrap();
    let mut fakes = Fakes::new(FakeLearner::default());
    // Groups of three: `ab` scores 1, `bb` fails, `cb` scores 0.
    fakes.rewards = FakeRewards::new(|sample| match sample.completion.chars().next() {
        Some('a') => Score::Reward(1.0),
        Some('b') => Score::Fails,
        _ => Score::Reward(0.0),
    });
    let extra = "[rollout]\ngroup_size = 3\n[sandbox]\nmax_failed_fraction_per_step = 0.9\nmax_failed_fraction = 0.9";
    fakes
        .run(&run_config(output.path(), 2, 0, extra), Start::Fresh)
        .await
        .unwrap();
    for line in metrics(output.path()) {
        assert_eq!(
            (line.reward_failed, line.reward_failed_raised),
            (Some(2), Some(2))
        );
        assert_eq!(line.reward_mean, Some(0.5), "over the scored samples only");
        assert_eq!(
            line.trained_rows,
            Some(4),
            "two scored samples of each group"
        );
        assert_eq!(line.measured["loss_tokens"], 8.0);
    }
    // The loss is normalised by the scored samples' tokens only: 4 rows of 2.
    for request in fakes.learner.requests() {
        assert!(
            request
                .micro_batches
                .iter()
                .all(|b| b.loss_scale == 1.0 / 8.0)
        );
    }
    let failed: Vec<serde_json::Value> = samples(output.path())
        .into_iter()
        .filter(|s| !s["failed"].is_null())
        .collect();
    assert_eq!(failed.len(), 4);
    for sample in failed {
        assert!(sample["completion"].as_str().unwrap().starts_with('b'));
        assert!(sample["reward"].is_null());
        assert_eq!(sample["failed"]["reason"], "raised");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_whose_environment_failed_are_counted_and_not_trained() {
    let output = tempfile::tempdir().unwrap();
    let mut fakes = Fakes::new(FakeLearner::default());
    fakes.environment = Some(FakeEnvironment::new(2).failing_every(4));
    fakes.rewards = FakeRewards::new(|_| Score::Reward(0.0));
    let extra = "[environment]\nplugin = \"fake:Env\"\nmax_turns = 3\n[sandbox]\nmax_failed_fraction_per_step = 0.9\nmax_failed_fraction = 0.9";
    fakes
        .run(&run_config(output.path(), 2, 0, extra), Start::Fresh)
        .await
        .unwrap();
    for line in metrics(output.path()) {
        // One episode in four fails in its second turn.
        assert_eq!(
            (line.environment_failed, line.environment_failed_raised),
            (Some(1), Some(1))
        );
        assert_eq!(
            line.reward_failed,
            Some(0),
            "a failed episode is not scored"
        );
        assert_eq!(line.completions, Some(4));
        // The other group's two episodes have a spread; the failed episode's partner is
        // alone in its group (no advantage), and the failed one is not trained at all.
        assert_eq!(line.trained_rows, Some(2));
        assert_eq!(line.skipped_rows, Some(1));
    }
    let environment = fakes.environment.as_ref().unwrap();
    assert_eq!(environment.finished().len(), 8, "every episode released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_holds_every_group_trained_once_when_a_remote_worker_dies() {
    let output = tempfile::tempdir().unwrap();
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let mut clients = Vec::new();
    for (index, behaviour) in [
        Behaviour::Healthy,
        Behaviour::DiesOnRequest,
        Behaviour::Healthy,
    ]
    .into_iter()
    .enumerate()
    {
        clients.push(
            fake_worker(&key, &format!("w{index}"), behaviour)
                .await
                .unwrap(),
        );
    }
    let journal = output.path().join("ledger.jsonl");
    let workers = RemoteWorkers::new(
        clients,
        Ledger::new(Some(&journal)),
        PoolSettings::default(),
    );
    let fakes = Fakes::new(FakeLearner::default().with_weight_sync());
    let config = run_config(output.path(), 3, 0, "[rollout]\nprompts_per_step = 6");
    fakes
        .run_with(&config, Start::Fresh, &workers, &fakes.policy)
        .await
        .unwrap();
    let audited = audit(&journal).unwrap();
    assert_eq!(audited.groups_trained, 18);
    assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
    assert!(
        audited.leases_revoked > 0,
        "the dead worker's groups went elsewhere"
    );
    let lines = metrics(output.path());
    assert_eq!(lines[0].measured["workers_lost"], 1.0);
    assert!(lines.iter().all(|l| l.completions == Some(12)));
}

/// A pool of fake workers over real links, one per behaviour, named `w0`, `w1`...
async fn remote_pool(behaviours: &[Behaviour], journal: &Path) -> RemoteWorkers {
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let mut clients = Vec::new();
    for (index, &behaviour) in behaviours.iter().enumerate() {
        clients.push(
            fake_worker(&key, &format!("w{index}"), behaviour)
                .await
                .unwrap(),
        );
    }
    RemoteWorkers::new(clients, Ledger::new(Some(journal)), PoolSettings::default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_sending_logprobs_of_minus_95_costs_its_samples_not_an_update() {
    let output = tempfile::tempdir().unwrap();
    let behaviours = [
        Behaviour::Healthy,
        Behaviour::Malformed(Malformation::PoisonedLogprob),
    ];
    let workers = remote_pool(&behaviours, &output.path().join("ledger.jsonl")).await;
    let fakes = Fakes::new(FakeLearner::default().with_weight_sync());
    let config = run_config(output.path(), 3, 0, "[rollout]\nprompts_per_step = 6");
    fakes
        .run_with(&config, Start::Fresh, &workers, &fakes.policy)
        .await
        .unwrap();
    // The run went on: every step trained one update, on every group.
    let trains: Vec<String> = fakes
        .learner
        .events()
        .into_iter()
        .filter(|e| e.starts_with("train"))
        .collect();
    assert_eq!(trains, ["train 1", "train 2", "train 3"]);
    let lines = metrics(output.path());
    assert!(lines.iter().all(|l| l.completions == Some(12)));
    assert!(lines.iter().all(|l| l.loss.is_some_and(f64::is_finite)));
    // No logprob below the peer check's floor reached the learner.
    for request in fakes.learner.requests() {
        for batch in &request.micro_batches {
            let trained = batch.old_logprobs.iter().zip(&batch.loss_mask);
            for (&logprob, _) in trained.filter(|(_, mask)| **mask > 0.0) {
                assert!(
                    (MIN_LOGPROB..=0.0).contains(&logprob),
                    "{logprob} was trained on"
                );
            }
        }
    }
    // The worker's answer was refused and counted: its 3 groups of 2 samples.
    let first = &lines[0].measured;
    assert_eq!(first["answers_malformed"], 1.0);
    assert_eq!(first["samples_excluded_malformed"], 6.0);
    assert_eq!(first["workers"], 1.0);
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.measured["samples_excluded_malformed"] == 0.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_whose_sample_the_trainer_left_out_is_sent_away() {
    let output = tempfile::tempdir().unwrap();
    let workers = remote_pool(
        &[Behaviour::Healthy, Behaviour::Healthy],
        &output.path().join("ledger.jsonl"),
    )
    .await;
    // The first update leaves out one row, as a trainer does a sample whose loss is NaN
    // (a KL term keeps every row in the update, whatever its advantage).
    let fakes = Fakes::new(
        FakeLearner::default()
            .with_weight_sync()
            .excluding_at(1, 0, 0),
    );
    let extra = "[rollout]\nprompts_per_step = 6\n[algorithm]\nkl_coef = 0.01";
    let config = run_config(output.path(), 3, 0, extra);
    fakes
        .run_with(&config, Start::Fresh, &workers, &fakes.policy)
        .await
        .unwrap();
    let lines = metrics(output.path());
    let first = &lines[0].measured;
    assert_eq!(first["samples_excluded_nonfinite"], 1.0);
    // Its producer is sent away as for a malformed answer; the other generates the rest.
    assert_eq!((first["answers_malformed"], first["workers"]), (1.0, 1.0));
    let producers = |line: &StepMetrics| {
        let names = line.measured.keys();
        names
            .filter(|name| name.starts_with("worker_completions/"))
            .count()
    };
    assert_eq!(producers(&lines[0]), 2);
    assert!(lines[1..].iter().all(|line| producers(line) == 1));
    assert!(lines.iter().all(|l| l.completions == Some(12)));
}
