//! Colocated generation workers (`[cluster.devices] colocate = true`): the controller has
//! them release their device memory before every update and restore it after, against fake
//! workers that refuse to generate while released. No Python, no model.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rollout_core::cluster::ledger::{Ledger, audit};
use rollout_core::cluster::pool::{PoolSettings, RemoteWorkers};
use rollout_core::roles::{Generator, Publication, RoleFuture, StepGroups};
use rollout_core::train::{Controller, PolicyRoles, Roles, Start, Trainees};
use rollout_net::ClusterKey;
use rollout_net::messages::{
    GenerateRequest, GenerateResponse, PromptRequest, SamplingParams, WeightsReport,
};
use rollout_testkit::fakes::worker::{Behaviour, fake_worker};
use rollout_testkit::fakes::{
    FakeLearner, FakePolicy, FakeRewards, RecordingObserver, config, records,
};

async fn workers(count: usize, colocated: bool, journal: &std::path::Path) -> RemoteWorkers {
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let mut clients = Vec::new();
    for index in 0..count {
        clients.push(
            fake_worker(&key, &format!("w{index}"), Behaviour::Healthy)
                .await
                .unwrap(),
        );
    }
    let settings = PoolSettings {
        colocated,
        ..PoolSettings::default()
    };
    RemoteWorkers::new(clients, Ledger::new(Some(journal)), settings)
}

fn request(prompts: u32) -> GenerateRequest {
    GenerateRequest {
        prompts: (0..prompts)
            .map(|index| PromptRequest {
                prompt_ids: vec![1, 2],
                n: 2,
                max_new_tokens: Vec::new(),
                seed: Some(u64::from(index)),
                group: None,
            })
            .collect(),
        sampling: SamplingParams::plain(4, 1),
    }
}

/// The pool, with a record of what the controller asked of it, in order.
struct Recording {
    pool: RemoteWorkers,
    calls: Mutex<Vec<&'static str>>,
}

impl Recording {
    fn record(&self, call: &'static str) {
        self.calls.lock().unwrap().push(call);
    }
}

impl Generator for Recording {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        self.record("generate");
        self.pool.generate(request)
    }
    fn load_weights(&self, weights: Publication) -> RoleFuture<'_, Vec<WeightsReport>> {
        self.record("load_weights");
        self.pool.load_weights(weights)
    }
    fn step_trained(
        &self,
        step: u64,
        groups: &StepGroups,
    ) -> RoleFuture<'_, BTreeMap<String, f64>> {
        self.pool.step_trained(step, groups)
    }
    fn release_memory(&self) -> RoleFuture<'_, ()> {
        self.record("release");
        self.pool.release_memory()
    }
    fn restore_memory(&self) -> RoleFuture<'_, ()> {
        self.record("restore");
        self.pool.restore_memory()
    }
}

fn answered(response: &rollout_net::messages::GenerateResponse) -> usize {
    response.groups.iter().filter(|g| !g.is_empty()).count()
}

#[tokio::test]
async fn colocated_workers_are_told_to_release_and_restore_and_others_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let colocated = workers(2, true, &dir.path().join("a.jsonl")).await;
    colocated.release_memory().await.unwrap();
    // The fake workers refuse work while released.
    let refused = colocated.generate(request(4)).await.unwrap_err();
    assert!(refused.to_string().contains("memory released"), "{refused}");
    colocated.restore_memory().await.unwrap();
    assert_eq!(answered(&colocated.generate(request(4)).await.unwrap()), 4);

    // Not colocated, releasing sends nothing: the workers keep generating.
    let separate = workers(2, false, &dir.path().join("b.jsonl")).await;
    separate.release_memory().await.unwrap();
    assert_eq!(answered(&separate.generate(request(4)).await.unwrap()), 4);
}

#[tokio::test]
async fn a_colocated_run_releases_around_every_update_and_loses_nothing() {
    let output = tempfile::tempdir().unwrap();
    let journal = output.path().join("ledger.jsonl");
    let pool = Recording {
        pool: workers(2, true, &journal).await,
        calls: Mutex::default(),
    };
    let learner = FakeLearner::default().with_weight_sync();
    let policy = FakePolicy::sharing(learner.version.clone());
    let rewards = FakeRewards::first_letter();
    let observer = RecordingObserver::default();
    let base = format!(
        "[run]\nsteps = 3\noutput_dir = \"{}\"\n[policy]\nplugin = \"fake:Policy\"\n\
         [data]\nplugin = \"fake:Data\"\n[rollout]\nprompts_per_step = 4\ngroup_size = 2\n\
         [checkpoint]\nevery = 0\n",
        output.path().display()
    );
    let config = config(&base, "[cluster.devices]\ncolocate = true\n");
    assert!(config.cluster.colocated());
    let roles = Roles {
        trainees: Trainees::Policy(PolicyRoles {
            generator: &pool,
            learner: &learner,
            tokenizer: &policy,
            scorer: &rewards,
            environments: None,
        }),
        observer: &observer,
    };
    let interrupted = Arc::new(AtomicBool::new(false));
    let mut controller = Controller::new(&config, roles, records(8), interrupted);
    let run = tokio::time::timeout(Duration::from_secs(20), controller.run(Start::Fresh)).await;
    let result = run.unwrap_or_else(|_| panic!("the run hung: {:?}", learner.events()));
    controller.finish(result.as_ref().ok()).await;
    result.unwrap();
    // Had a worker been asked to generate while released, its groups would be missing.
    let audited = audit(&journal).unwrap();
    assert_eq!(audited.groups_trained, 12);
    assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
    assert_eq!(audited.leases_revoked, 0);
    assert_eq!(learner.requests().len(), 3);
    // Sampled awake; released for each update; restored before its weights are loaded.
    let calls = pool.calls.lock().unwrap().clone();
    let step = ["generate", "release", "restore", "load_weights"];
    assert_eq!(calls[..1], ["load_weights"], "{calls:?}");
    assert_eq!(calls[1..], step.repeat(3), "{calls:?}");
}
