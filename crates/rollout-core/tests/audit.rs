//! The ledger's audit against what the controller trained (`samples.jsonl`), group by group,
//! in runs whose generation pool of fake workers loses groups and delivers stale ones: what
//! each update trained, which groups were replaced (and by which), which were dropped, and
//! where the records of dropped groups were trained again, also across a resume.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use rollout_core::cluster::ledger::{Audit, Ledger, audit_with_steps};
use rollout_core::cluster::pool::{PoolSettings, RemoteWorkers};
use rollout_core::config::Config;
use rollout_core::metrics::StepMetrics;
use rollout_core::roles::{Generator, Publication, RoleFuture, StepGroups};
use rollout_core::train::{Controller, PolicyRoles, Roles, Start, Trainees};
use rollout_net::ClusterKey;
use rollout_net::messages::{GenerateRequest, GenerateResponse, GroupRef, WeightsReport};
use rollout_testkit::fakes::worker::{Behaviour, fake_worker};
use rollout_testkit::fakes::{FakeLearner, FakePolicy, FakeRewards, RecordingObserver, config};

const PROMPTS: u32 = 6;
const RECORDS: usize = 8;

/// Generation through a pool of fake workers, with churn injected by group: answers that
/// come back generated on weight version 0 (a worker that rejoined on old weights), and
/// groups that come back empty (every lease lost, as the pool answers them).
struct Churn {
    pool: RemoteWorkers,
    stale: fn(GroupRef) -> bool,
    lost: fn(GroupRef) -> bool,
}

impl Generator for Churn {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let groups: Vec<Option<GroupRef>> = request.prompts.iter().map(|p| p.group).collect();
        Box::pin(async move {
            let mut response = self.pool.generate(request).await?;
            for (group, completions) in groups.into_iter().zip(&mut response.groups) {
                let Some(group) = group else { continue };
                if (self.lost)(group) {
                    completions.clear();
                }
                if (self.stale)(group) {
                    completions.iter_mut().for_each(|c| c.weight_version = 0);
                }
            }
            Ok(response)
        })
    }

    fn load_weights(&self, weights: Publication) -> RoleFuture<'_, Vec<WeightsReport>> {
        self.pool.load_weights(weights)
    }

    fn step_trained(
        &self,
        step: u64,
        groups: &StepGroups,
    ) -> RoleFuture<'_, BTreeMap<String, f64>> {
        self.pool.step_trained(step, groups)
    }

    fn resumed_from(&self, step: u64) -> RoleFuture<'_, ()> {
        self.pool.resumed_from(step)
    }
}

fn never(_: GroupRef) -> bool {
    false
}

/// Step 4's group 1 comes back stale once (generated again, fresh); step 5's group 0 and
/// every regeneration of it come back stale (left out after the last round).
fn stale_at_steps_4_and_5(group: GroupRef) -> bool {
    (group.step, group.index) == (4, 1)
        || (group.step == 5 && (group.index == 0 || group.index >= PROMPTS))
}

/// Step 2's group 3 gets no answer.
fn lost_at_step_2(group: GroupRef) -> bool {
    (group.step, group.index) == (2, 3)
}

async fn pool(behaviours: &[Behaviour], max_attempts: u32, journal: &Path) -> RemoteWorkers {
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let mut clients = Vec::new();
    for (index, &behaviour) in behaviours.iter().enumerate() {
        clients.push(
            fake_worker(&key, &format!("w{index}"), behaviour)
                .await
                .unwrap(),
        );
    }
    let settings = PoolSettings {
        max_attempts,
        ..PoolSettings::default()
    };
    RemoteWorkers::new(clients, Ledger::new(Some(journal)), settings)
}

/// `steps` steps of PROMPTS groups of 2, staleness 1, every sample logged, checkpoints
/// every 3 steps; `extra` overrides.
fn run_config_with(output: &Path, steps: u64, extra: &str) -> Config {
    let base = format!(
        "[run]\nsteps = {steps}\noutput_dir = \"{}\"\nlog_samples = 100\n\
         [policy]\nplugin = \"fake:Policy\"\n[data]\nplugin = \"fake:Data\"\n\
         [rollout]\nprompts_per_step = {PROMPTS}\ngroup_size = 2\n\
         [checkpoint]\nevery = 3\n[cluster]\nmax_staleness = 1\n",
        output.display()
    );
    config(&base, extra)
}

fn run_config(output: &Path, steps: u64) -> Config {
    run_config_with(output, steps, "")
}

async fn run(config: &Config, start: Start, generator: &Churn) {
    let learner = FakeLearner::default().with_weight_sync();
    let tokenizer = FakePolicy::holding_weights();
    let rewards = FakeRewards::first_letter();
    let observer = RecordingObserver::default();
    let roles = Roles {
        trainees: Trainees::Policy(PolicyRoles {
            generator,
            learner: &learner,
            tokenizer: &tokenizer,
            scorer: &rewards,
            environments: None,
        }),
        observer: &observer,
    };
    let interrupted = Arc::new(AtomicBool::new(false));
    let records = rollout_testkit::fakes::records(RECORDS);
    let mut controller = Controller::new(config, roles, records, interrupted);
    let ran = tokio::time::timeout(Duration::from_secs(30), controller.run(start)).await;
    let result = ran.unwrap_or_else(|_| panic!("the run hung: {:?}", learner.events()));
    controller.finish(result.as_ref().ok()).await;
    result.unwrap();
}

fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

fn metric(output: &Path, name: &str) -> f64 {
    std::fs::read_to_string(output.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| StepMetrics::from_line(line).unwrap())
        .map(|line| line.to_line()[name].as_f64().unwrap_or(0.0))
        .sum()
}

/// The prompt of record `record` (the fakes' addition records).
fn prompt(record: u64) -> String {
    format!("{record}+{record}=")
}

/// `(step, group)` -> prompt of every sample of `samples.jsonl`.
fn logged_groups(output: &Path) -> BTreeMap<(u64, u32), String> {
    read_lines(&output.join("samples.jsonl"))
        .iter()
        .map(|sample| {
            let key = (
                sample["step"].as_u64().unwrap(),
                sample["group"].as_u64().unwrap() as u32,
            );
            (key, sample["prompt"].as_str().unwrap().to_owned())
        })
        .collect()
}

/// Checks `rollout audit --groups` of `output`'s ledger against its `samples.jsonl`, group
/// by group: the groups each update trained are exactly the step's logged groups, with the
/// same prompts, and each requeued record was trained again where the ledger says.
fn assert_audit_matches_samples(output: &Path) -> Audit {
    let audited = audit_with_steps(&output.join("ledger.jsonl"), true).unwrap();
    assert_eq!(
        (audited.groups_lost, audited.groups_duplicated),
        (0, 0),
        "{audited:?}"
    );
    let logged = logged_groups(output);
    let steps = audited.steps.clone().unwrap();
    let mut audited_groups = BTreeMap::new();
    let mut dropped_records = BTreeMap::new();
    for step in &steps {
        for trained in &step.trained {
            audited_groups.insert((step.step, trained.group), prompt(trained.record.unwrap()));
        }
        for dropped in &step.dropped {
            let from = GroupRef {
                step: step.step,
                index: dropped.group,
            };
            dropped_records.insert(from, dropped.record.unwrap());
        }
    }
    assert_eq!(
        audited_groups, logged,
        "the ledger's trained groups are samples.jsonl's"
    );
    assert_eq!(audited.groups_trained, logged.len() as u64);
    for step in &steps {
        for redrawn in &step.redrawn {
            let record = dropped_records[&redrawn.from];
            // The group that drew the record may itself have been replaced (regenerated
            // when it came back stale): the record is trained as its replacement.
            let mut group = redrawn.group;
            while let Some(replaced) = step.replaced.iter().find(|r| r.group == group) {
                group = replaced.by;
            }
            if step.dropped.iter().any(|d| d.group == group) {
                continue; // dropped again: requeued, and checked where it is redrawn
            }
            let trained_as = logged.get(&(step.step, group));
            assert_eq!(
                trained_as,
                Some(&prompt(record)),
                "{redrawn:?} of step {}, trained as group {group}",
                step.step
            );
        }
    }
    audited
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_counts_what_each_update_trained_apart_from_replaced_and_dropped_groups() {
    let output = tempfile::tempdir().unwrap();
    let journal = output.path().join("ledger.jsonl");
    // One lease per group: the groups dealt to the worker that dies are dropped.
    let behaviours = [
        Behaviour::Healthy,
        Behaviour::DiesOnRequest,
        Behaviour::Healthy,
    ];
    let churn = Churn {
        pool: pool(&behaviours, 1, &journal).await,
        stale: stale_at_steps_4_and_5,
        lost: never,
    };
    run(&run_config(output.path(), 8), Start::Fresh, &churn).await;
    let audited = assert_audit_matches_samples(output.path());

    // Step 4: group 1 replaced once; step 5: group 0 replaced three times, then dropped.
    let regenerated = metric(output.path(), "stale_groups_regenerated");
    assert_eq!(
        (audited.groups_replaced, regenerated),
        (4, 4.0),
        "{audited:?}"
    );
    assert_eq!(audited.groups_dropped_stale, 1);
    let lost_leases = metric(output.path(), "groups_dropped");
    assert!(audited.groups_dropped_attempts >= 1, "{audited:?}");
    assert_eq!(audited.groups_dropped_attempts as f64, lost_leases);
    // Every dropped group's record went back to the data queue and a later step trained it
    // (the last drop, at step 5, is drawn again by step 7).
    assert_eq!(audited.groups_requeued, audited.groups_dropped);
    assert_eq!(
        (audited.groups_redrawn, audited.requeued_pending),
        (audited.groups_requeued, 0)
    );
    assert_eq!(audited.prompts_lost, 0);
    // Each step trained its groups less those it dropped.
    let logged = logged_groups(output.path());
    let trained: u64 = (1..=8)
        .map(|s| logged.keys().filter(|k| k.0 == s).count() as u64)
        .sum();
    assert_eq!(trained + audited.groups_dropped, 8 * u64::from(PROMPTS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeued_records_are_drawn_alike_by_a_resumed_run_and_never_twice() {
    let straight = tempfile::tempdir().unwrap();
    let churn = |journal: &Path| {
        let journal = journal.to_owned();
        async move {
            Churn {
                pool: pool(&[Behaviour::Healthy; 2], 3, &journal).await,
                stale: stale_at_steps_4_and_5,
                lost: lost_at_step_2,
            }
        }
    };
    let uninterrupted = churn(&straight.path().join("ledger.jsonl")).await;
    run(
        &run_config(straight.path(), 8),
        Start::Fresh,
        &uninterrupted,
    )
    .await;
    let expected = assert_audit_matches_samples(straight.path());
    assert_eq!((expected.groups_requeued, expected.groups_redrawn), (2, 2));

    // The same run, killed after the checkpoint of step 6: step 7 had drawn step 5's
    // dropped record (sampled ahead), and must draw it again.
    let resumed = tempfile::tempdir().unwrap();
    let journal = resumed.path().join("ledger.jsonl");
    run(
        &run_config(resumed.path(), 8),
        Start::Fresh,
        &churn(&journal).await,
    )
    .await;
    std::fs::remove_dir_all(resumed.path().join("checkpoints/step-00000008")).unwrap();
    std::fs::write(resumed.path().join("checkpoints/latest"), "step-00000006\n").unwrap();
    let state =
        std::fs::read_to_string(resumed.path().join("checkpoints/step-00000006/state.json"));
    assert!(
        state.unwrap().contains("\"requeued\""),
        "the queue is checkpointed"
    );
    run(
        &run_config(resumed.path(), 8),
        Start::Resume,
        &churn(&journal).await,
    )
    .await;

    assert_eq!(
        logged_groups(resumed.path()),
        logged_groups(straight.path())
    );
    let audited = assert_audit_matches_samples(resumed.path());
    assert_eq!(audited.rollbacks, 1);
    let counts = |a: &Audit| {
        (
            a.groups_trained,
            a.groups_replaced,
            a.groups_dropped,
            a.groups_redrawn,
            a.requeued_pending,
        )
    };
    assert_eq!(counts(&audited), counts(&expected));
    let dropped: BTreeSet<(u64, u32)> = audited
        .steps
        .unwrap()
        .iter()
        .flat_map(|s| s.dropped.iter().map(move |d| (s.step, d.group)))
        .collect();
    assert_eq!(dropped, BTreeSet::from([(2, 3), (5, PROMPTS + 2)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_strict_data_order_a_dropped_prompt_is_reported_lost_and_never_trained() {
    let calm = tempfile::tempdir().unwrap();
    let undisturbed = Churn {
        pool: pool(
            &[Behaviour::Healthy; 2],
            3,
            &calm.path().join("ledger.jsonl"),
        )
        .await,
        stale: never,
        lost: never,
    };
    run(&run_config(calm.path(), 8), Start::Fresh, &undisturbed).await;

    let strict = tempfile::tempdir().unwrap();
    let churn = Churn {
        pool: pool(
            &[Behaviour::Healthy; 2],
            3,
            &strict.path().join("ledger.jsonl"),
        )
        .await,
        stale: stale_at_steps_4_and_5,
        lost: lost_at_step_2,
    };
    let config = run_config_with(strict.path(), 8, "[cluster]\ndropped_groups = \"skip\"");
    run(&config, Start::Fresh, &churn).await;
    let audited = assert_audit_matches_samples(strict.path());
    assert_eq!((audited.groups_dropped, audited.prompts_lost), (2, 2));
    let requeue = (
        audited.groups_requeued,
        audited.groups_redrawn,
        audited.requeued_pending,
    );
    assert_eq!(requeue, (0, 0, 0));
    // Every step drew the records an undisturbed run draws, in the same order: each of its
    // first groups trained (or its replacement, on the same record) has the same prompt.
    let expected = logged_groups(calm.path());
    let logged = logged_groups(strict.path());
    for step in 1..=8 {
        let prompts = |groups: &BTreeMap<(u64, u32), String>| -> BTreeSet<String> {
            groups
                .iter()
                .filter(|(k, _)| k.0 == step)
                .map(|(_, p)| p.clone())
                .collect()
        };
        assert!(
            prompts(&logged).is_subset(&prompts(&expected)),
            "step {step}"
        );
    }
    assert_eq!(logged.len() + 2, expected.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_without_reward_spread_replaced_by_reserve_prompts_are_counted_as_replaced() {
    let output = tempfile::tempdir().unwrap();
    // The fake workers answer each prompt with copies of one completion: every group is flat,
    // and dynamic sampling replaces it with a reserve prompt's group (flat too, and trained).
    let churn = Churn {
        pool: pool(
            &[Behaviour::Healthy; 2],
            3,
            &output.path().join("ledger.jsonl"),
        )
        .await,
        stale: never,
        lost: never,
    };
    let extra = "[algorithm]\ndynamic_sampling_rounds = 1";
    run(
        &run_config_with(output.path(), 3, extra),
        Start::Fresh,
        &churn,
    )
    .await;
    let audited = assert_audit_matches_samples(output.path());
    let per_run = 3 * u64::from(PROMPTS);
    assert_eq!(
        (audited.groups_trained, audited.groups_replaced),
        (per_run, per_run)
    );
    for step in audited.steps.unwrap() {
        let trained: Vec<u32> = step.trained.iter().map(|t| t.group).collect();
        assert_eq!(trained, (PROMPTS..2 * PROMPTS).collect::<Vec<_>>());
        assert!(
            step.replaced
                .iter()
                .all(|r| r.reason == "flat" && r.by == r.group + PROMPTS)
        );
    }
}
