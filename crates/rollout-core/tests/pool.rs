//! The generation pool against fake workers over real authenticated links: no Python, no
//! model.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use rollout_core::cluster::ledger::{Ledger, audit};
use rollout_core::cluster::pool::MIN_LOGPROB;
use rollout_core::cluster::pool::{PoolSettings, RemoteWorkers};
use rollout_core::roles::{
    DropReason, DroppedGroup, Generator, GroupRecord, Publication, StepGroups, Tokenizer,
};
use rollout_core::telemetry::Telemetry;
use rollout_net::ClusterKey;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{
    GenerateRequest, GenerateResponse, GroupRef, Loaded, MessageKind, PromptRequest,
    SamplingParams, SyncWeights, WeightsReport,
};
use rollout_testkit::fakes::worker::{
    Behaviour, Malformation, POISONED_LOGPROB, fake_worker, hello, seed_completion,
};

fn request(step: u64, prompts: u32) -> GenerateRequest {
    GenerateRequest {
        prompts: (0..prompts)
            .map(|index| PromptRequest {
                prompt_ids: vec![1, 2, 3],
                n: 2,
                max_new_tokens: Vec::new(),
                seed: Some(u64::from(100 + index)),
                group: Some(GroupRef { step, index }),
            })
            .collect(),
        sampling: SamplingParams::plain(4, 7),
    }
}

/// Groups `0..count` of a step, all trained (record = index).
fn all_trained(count: u32) -> StepGroups {
    StepGroups {
        trained: (0..count)
            .map(|group| GroupRecord {
                group,
                record: u64::from(group),
            })
            .collect(),
        ..StepGroups::default()
    }
}

async fn pool(
    behaviours: &[Behaviour],
    settings: PoolSettings,
    journal: &std::path::Path,
) -> RemoteWorkers {
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let mut clients = Vec::new();
    for (index, &behaviour) in behaviours.iter().enumerate() {
        clients.push(
            fake_worker(&key, &format!("fake-{index}"), behaviour)
                .await
                .unwrap(),
        );
    }
    RemoteWorkers::new(clients, Ledger::new(Some(journal)), settings)
}

/// Version `version` announced unsealed, and the sender of its seal.
fn announced(version: u64) -> (Publication, tokio::sync::oneshot::Sender<WeightsReport>) {
    let (seal, sealed) = tokio::sync::oneshot::channel::<WeightsReport>();
    let publication = Publication {
        announced: WeightsReport {
            checksum: String::new(),
            ..weights(version)
        },
        sealed: Box::pin(async move { Ok(sealed.await.unwrap()) }),
    };
    (publication, seal)
}

/// A pool without workers that admits those connecting through the returned sender.
async fn admitting_pool(dir: &std::path::Path) -> (RemoteWorkers, tokio::sync::mpsc::Sender<Link>) {
    let workers = pool(&[], PoolSettings::default(), &dir.join("ledger.jsonl")).await;
    let (links, joined) = tokio::sync::mpsc::channel(1);
    workers.admit_late_workers(joined, "config".into());
    (workers, links)
}

fn assert_every_prompt_answered(response: &GenerateResponse, prompts: u32) {
    assert_eq!(response.groups.len(), prompts as usize);
    for (index, group) in response.groups.iter().enumerate() {
        assert_eq!(group.len(), 2, "prompt {index}");
        assert!(
            group
                .iter()
                .all(|c| c.token_ids == vec![100 + index as u32])
        );
    }
}

#[tokio::test]
async fn a_worker_lost_mid_request_has_its_groups_generated_by_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("ledger.jsonl");
    let telemetry = Telemetry::new();
    let settings = PoolSettings {
        health: telemetry.health(),
        ..PoolSettings::default()
    };
    let workers = pool(
        &[
            Behaviour::Healthy,
            Behaviour::DiesOnRequest,
            Behaviour::Healthy,
        ],
        settings,
        &journal,
    )
    .await;
    let response = workers.generate(request(1, 12)).await.unwrap();
    assert_every_prompt_answered(&response, 12);
    assert_eq!(response.metrics["groups_dropped"], 0.0);
    let metrics = workers.step_trained(1, &all_trained(12)).await.unwrap();
    assert_eq!(metrics["workers"], 2.0);
    assert_eq!(metrics["workers_lost"], 1.0);
    // `/metrics` shows who is up and who was lost.
    let text = telemetry.render().unwrap();
    for series in [
        "rollout_worker_up{role=\"worker\",worker=\"fake-0\"} 1",
        "rollout_worker_up{role=\"worker\",worker=\"fake-1\"} 0",
        "rollout_worker_losses_total{role=\"worker\",worker=\"fake-1\"} 1",
        "rollout_worker_losses_total{role=\"worker\",worker=\"fake-2\"} 0",
    ] {
        assert!(text.lines().any(|line| line == series), "{series}\n{text}");
    }
    workers.report_left();
    let text = telemetry.render().unwrap();
    assert!(!text.contains("rollout_worker_up{role=\"worker\",worker=\"fake-2\"} 1"));
    // Round-robin gave the dying worker 4 of the 12 groups; they were leased again.
    assert_eq!(metrics["leases_revoked"], 4.0);
    assert_eq!(metrics["leases"], 16.0);
    let audited = audit(&journal).unwrap();
    assert_eq!(audited.groups_trained, 12);
    assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
}

#[tokio::test]
async fn a_worker_whose_connection_ends_leaves_the_pool_without_being_called() {
    let dir = tempfile::tempdir().unwrap();
    let telemetry = Telemetry::new();
    let settings = PoolSettings {
        health: telemetry.health(),
        ..PoolSettings::default()
    };
    let journal = dir.path().join("ledger.jsonl");
    let workers = pool(&[Behaviour::Healthy, Behaviour::Leaves], settings, &journal).await;
    // No request is made: the pool notices the closed connection by itself.
    let down = "rollout_worker_up{role=\"worker\",worker=\"fake-1\"} 0";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !telemetry.render().unwrap().lines().any(|line| line == down) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "fake-1 was never noticed leaving"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let metrics = workers.step_trained(1, &all_trained(0)).await.unwrap();
    assert_eq!((metrics["workers"], metrics["workers_lost"]), (1.0, 1.0));
    let response = workers.generate(request(2, 4)).await.unwrap();
    assert_every_prompt_answered(&response, 4);
    assert_eq!(
        workers.step_trained(2, &all_trained(4)).await.unwrap()["leases_revoked"],
        0.0
    );
}

#[tokio::test]
async fn a_worker_that_sends_a_malformed_answer_loses_its_leases_and_its_place() {
    for malformation in Malformation::ALL {
        let dir = tempfile::tempdir().unwrap();
        let journal = dir.path().join("ledger.jsonl");
        let settings = PoolSettings {
            vocabulary: Some(1000),
            ..PoolSettings::default()
        };
        let behaviours = [Behaviour::Healthy, Behaviour::Malformed(malformation)];
        let workers = pool(&behaviours, settings, &journal).await;
        let response = workers.generate(request(1, 6)).await.unwrap();
        assert_every_prompt_answered(&response, 6);
        let metrics = workers.step_trained(1, &all_trained(6)).await.unwrap();
        let counted = (
            metrics["answers_malformed"],
            metrics["workers"],
            metrics["leases_revoked"],
        );
        assert_eq!(counted, (1.0, 1.0, 3.0), "{malformation:?}");
        // Its 3 groups of 2 samples were refused, counted, and generated elsewhere.
        assert_eq!(
            metrics["samples_excluded_malformed"], 6.0,
            "{malformation:?}"
        );
        assert!(response.producers.iter().all(|p| p == "fake-0"));
        let audited = audit(&journal).unwrap();
        assert_eq!(audited.groups_trained, 6, "{malformation:?}");
        assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
    }
}

#[tokio::test]
async fn logprobs_of_minus_95_are_refused_and_only_honest_samples_are_returned() {
    let dir = tempfile::tempdir().unwrap();
    let behaviours = [
        Behaviour::Malformed(Malformation::PoisonedLogprob),
        Behaviour::Healthy,
    ];
    let settings = PoolSettings {
        vocabulary: Some(u64::from(u32::MAX) + 1),
        ..PoolSettings::default()
    };
    let workers = pool(&behaviours, settings, &dir.path().join("ledger.jsonl")).await;
    let response = workers.generate(request(1, 4)).await.unwrap();
    assert_every_prompt_answered(&response, 4);
    let logprobs = response.groups.iter().flatten().flat_map(|c| &c.logprobs);
    assert!(
        logprobs
            .into_iter()
            .all(|&lp| lp >= MIN_LOGPROB && lp != POISONED_LOGPROB)
    );
    let metrics = workers.step_trained(1, &all_trained(4)).await.unwrap();
    assert_eq!(metrics["samples_excluded_malformed"], 4.0);
    assert_eq!(
        (metrics["answers_malformed"], metrics["workers"]),
        (1.0, 1.0)
    );
}

#[tokio::test]
async fn workers_the_trainer_names_are_sent_away_and_generation_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let behaviours = [Behaviour::Healthy, Behaviour::Healthy];
    let settings = PoolSettings::default();
    let workers = pool(&behaviours, settings, &dir.path().join("ledger.jsonl")).await;
    let response = workers.generate(request(1, 4)).await.unwrap();
    // Round-robin: each group's producer is recorded.
    assert_eq!(response.producers, ["fake-0", "fake-1", "fake-0", "fake-1"]);
    let reason = "the trainer left samples it generated out of step 1's update";
    let gone = vec!["fake-1".to_owned(), "no-such-worker".to_owned()];
    workers.send_away(gone, reason.into()).await.unwrap();
    let metrics = workers.step_trained(1, &all_trained(4)).await.unwrap();
    assert_eq!(
        (metrics["answers_malformed"], metrics["workers"]),
        (1.0, 1.0)
    );
    let response = workers.generate(request(2, 4)).await.unwrap();
    assert_every_prompt_answered(&response, 4);
    assert!(response.producers.iter().all(|p| p == "fake-0"));
}

#[tokio::test]
async fn a_tokenizer_answer_outside_the_vocabulary_is_refused_and_asked_elsewhere() {
    let dir = tempfile::tempdir().unwrap();
    let behaviours = [
        Behaviour::Malformed(Malformation::OutOfVocabulary),
        Behaviour::Healthy,
    ];
    let settings = PoolSettings {
        vocabulary: Some(256),
        ..PoolSettings::default()
    };
    let workers = pool(&behaviours, settings, &dir.path().join("ledger.jsonl")).await;
    let ids = workers.encode(vec!["ab".into()], false).await.unwrap();
    assert_eq!(ids, [[97, 98]], "answered by the healthy worker");
    let metrics = workers.step_trained(1, &all_trained(0)).await.unwrap();
    assert_eq!(
        (metrics["answers_malformed"], metrics["workers"]),
        (1.0, 1.0)
    );
}

#[tokio::test]
async fn a_worker_past_its_lease_deadline_is_dropped_and_its_groups_leased_again() {
    let dir = tempfile::tempdir().unwrap();
    let settings = PoolSettings {
        lease_timeout: Duration::from_millis(300),
        ..PoolSettings::default()
    };
    let workers = pool(
        &[Behaviour::Hangs, Behaviour::Healthy],
        settings,
        &dir.path().join("ledger.jsonl"),
    )
    .await;
    let response = tokio::time::timeout(Duration::from_secs(10), workers.generate(request(1, 6)))
        .await
        .expect("the hung worker's groups must not wait forever")
        .unwrap();
    assert_every_prompt_answered(&response, 6);
    let metrics = workers.step_trained(1, &all_trained(6)).await.unwrap();
    assert_eq!((metrics["workers"], metrics["leases_revoked"]), (1.0, 3.0));
}

#[tokio::test]
async fn groups_are_dropped_after_their_attempts_and_generation_fails_without_workers() {
    let dir = tempfile::tempdir().unwrap();
    let settings = PoolSettings {
        max_attempts: 1,
        join_timeout: Duration::from_millis(200),
        ..PoolSettings::default()
    };
    let journal = dir.path().join("ledger.jsonl");
    let workers = pool(
        &[Behaviour::DiesOnRequest, Behaviour::Healthy],
        settings,
        &journal,
    )
    .await;
    // One lease per group: the dying worker's share is dropped, not generated again.
    let response = workers.generate(request(1, 4)).await.unwrap();
    assert_eq!(response.metrics["groups_dropped"], 2.0);
    let empty: Vec<usize> = (0..4).filter(|&i| response.groups[i].is_empty()).collect();
    assert_eq!(empty, vec![0, 2]);
    let dropped = |group| DroppedGroup {
        group,
        record: u64::from(group),
        reason: DropReason::Attempts,
        requeued: true,
    };
    let step = StepGroups {
        trained: all_trained(4)
            .trained
            .into_iter()
            .skip(1)
            .step_by(2)
            .collect(),
        dropped: vec![dropped(0), dropped(2)],
        ..StepGroups::default()
    };
    workers.step_trained(1, &step).await.unwrap();
    // The journal holds the pool's reason; the controller's account makes the audit whole.
    let journaled = std::fs::read_to_string(&journal).unwrap();
    assert_eq!(journaled.matches(r#""event":"abandoned""#).count(), 2);
    let audited = audit(&journal).unwrap();
    let counts = (
        audited.groups_trained,
        audited.groups_dropped_attempts,
        audited.groups_requeued,
    );
    assert_eq!(counts, (2, 2, 2), "{audited:?}");
    assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));

    let workers = pool(
        &[Behaviour::DiesOnRequest],
        PoolSettings {
            join_timeout: Duration::from_millis(200),
            ..PoolSettings::default()
        },
        &dir.path().join("second.jsonl"),
    )
    .await;
    let err = workers.generate(request(1, 2)).await.unwrap_err();
    assert!(err.to_string().contains("none joined"), "{err}");
}

#[tokio::test]
async fn a_worker_that_connects_after_the_run_is_told_it_is_over() {
    let dir = tempfile::tempdir().unwrap();
    let (workers, links) = admitting_pool(dir.path()).await;
    workers.shutdown("the run finished").await;

    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let listener = rollout_net::link::listen("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let limits = LinkLimits::default();
    let latecomer = tokio::spawn({
        let (key, limits) = (key.clone(), limits.clone());
        async move {
            let link = Link::connect(&address, &key, &hello("worker", "late"), &limits)
                .await
                .unwrap();
            let mut server = link.server();
            server.requests.recv().await.unwrap().frame.kind
        }
    });
    let (stream, _) = listener.accept().await.unwrap();
    let link = Link::accept(stream, &key, &hello("controller", "controller"), &limits)
        .await
        .unwrap();
    links.send(link).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), latecomer)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        first,
        MessageKind::Shutdown,
        "no Welcome once the run is over"
    );
}

fn weights(version: u64) -> WeightsReport {
    WeightsReport {
        version,
        checksum: format!("checksum-{version}"),
        bytes: 8,
        source: "127.0.0.1:1".into(),
        holder: "trainer-0".into(),
    }
}

/// A worker that connects mid-run over a real link handed to the pool through `links`: it
/// answers its welcome, each weight sync as `sync` decides (the report it then serves, or a
/// failure), and its first generation request with [`seed_completion`]s; it returns the
/// syncs it was sent.
async fn late_worker<Sync, Answer>(
    links: &tokio::sync::mpsc::Sender<Link>,
    mut sync: Sync,
) -> tokio::task::JoinHandle<Vec<WeightsReport>>
where
    Sync: FnMut(WeightsReport) -> Answer + Send + 'static,
    Answer: std::future::Future<Output = Result<WeightsReport, String>> + Send,
{
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let listener = rollout_net::link::listen("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let limits = LinkLimits::default();
    let worker = tokio::spawn({
        let (key, limits) = (key.clone(), limits.clone());
        async move {
            let link = Link::connect(&address, &key, &hello("worker", "late"), &limits)
                .await
                .unwrap();
            let mut server = link.server();
            let mut synced = Vec::new();
            while let Some(incoming) = server.requests.recv().await {
                let (call, responder) = (incoming.call, &server.responder);
                match incoming.frame.kind {
                    MessageKind::Welcome => {
                        let loaded = Loaded { vocabulary: 1000 };
                        responder.reply(call, &loaded, Bytes::new(), false)
                    }
                    MessageKind::SyncWeights => {
                        let request: SyncWeights = incoming.decode().unwrap();
                        synced.push(request.weights.clone());
                        match sync(request.weights).await {
                            Ok(served) => responder.reply(call, &served, Bytes::new(), false),
                            Err(failure) => responder.fail(call, failure),
                        }
                    }
                    MessageKind::GenerateRequest => {
                        let request: GenerateRequest = incoming.decode().unwrap();
                        let groups = request.prompts.iter().map(|p| vec![seed_completion(p); 2]);
                        let response = GenerateResponse {
                            groups: groups.collect(),
                            metrics: Default::default(),
                            producers: Vec::new(),
                        };
                        responder
                            .reply(call, &response, Bytes::new(), false)
                            .unwrap();
                        return synced;
                    }
                    other => panic!("unexpected {other:?}"),
                }
                .unwrap();
            }
            synced
        }
    });
    let (stream, _) = listener.accept().await.unwrap();
    let link = Link::accept(stream, &key, &hello("controller", "controller"), &limits)
        .await
        .unwrap();
    links.send(link).await.unwrap();
    worker
}

/// A late worker whose first pull fails because the trainer moved on to a newer version
/// meanwhile (the trainer keeps one version): it pulls the newer one and joins.
#[tokio::test]
async fn a_late_worker_whose_version_is_replaced_mid_pull_pulls_the_newer_one() {
    let dir = tempfile::tempdir().unwrap();
    let (workers, links) = admitting_pool(dir.path()).await;
    workers
        .load_weights(Publication::sealed(weights(1)))
        .await
        .unwrap();

    let (pulling, mut first_pull) = tokio::sync::mpsc::channel(1);
    let (replaced, go_on) = tokio::sync::oneshot::channel::<()>();
    let mut go_on = Some(go_on);
    let latecomer = late_worker(&links, move |weights| {
        let first = go_on.take();
        let pulling = pulling.clone();
        async move {
            let Some(go_on) = first else {
                return Ok(weights);
            };
            pulling.send(()).await.unwrap();
            go_on.await.unwrap();
            Err("version 1 was replaced by 2 before it was pulled".to_owned())
        }
    })
    .await;
    first_pull.recv().await.unwrap();
    workers
        .load_weights(Publication::sealed(weights(2)))
        .await
        .unwrap();
    replaced.send(()).unwrap();

    let response = tokio::time::timeout(Duration::from_secs(10), workers.generate(request(1, 2)))
        .await
        .unwrap()
        .unwrap();
    assert_every_prompt_answered(&response, 2);
    let pulled: Vec<u64> = latecomer.await.unwrap().iter().map(|w| w.version).collect();
    assert_eq!(
        pulled,
        vec![1, 2],
        "the newer version is pulled after the failed one"
    );
}

/// A version announced before its checksum is known: the workers are told to pull it at
/// once, but it is served (and generation carries it) only once each has its seal.
#[tokio::test]
async fn an_unsealed_version_is_served_once_every_worker_has_its_seal() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("ledger.jsonl");
    let behaviours = [Behaviour::Healthy, Behaviour::Healthy];
    let workers = pool(&behaviours, PoolSettings::default(), &journal).await;
    let (publication, seal) = announced(1);
    let mut loading = workers.load_weights(publication);
    let early = tokio::time::timeout(Duration::from_millis(100), &mut loading).await;
    assert!(early.is_err(), "served before the seal: {early:?}");
    seal.send(weights(1)).unwrap();
    let served = loading.await.unwrap();
    assert_eq!(served.len(), 2);
    assert!(
        served.iter().all(|report| *report == weights(1)),
        "{served:?}"
    );
    let response = workers.generate(request(1, 2)).await.unwrap();
    assert!(
        response
            .groups
            .iter()
            .flatten()
            .all(|c| c.weight_version == 1)
    );

    // A seal of another version than the one announced stops the sync.
    let publication = Publication {
        announced: WeightsReport {
            checksum: String::new(),
            ..weights(2)
        },
        sealed: Box::pin(async { Ok(weights(3)) }),
    };
    let err = workers.load_weights(publication).await.unwrap_err();
    assert!(err.to_string().contains("version 3 sealed"), "{err}");
}

/// A worker that joins while a version is announced but not yet sealed is given it sealed,
/// whether or not the controller is awaiting the load (with staleness, nothing is).
#[tokio::test]
async fn a_worker_joining_before_the_seal_pulls_the_sealed_version() {
    let dir = tempfile::tempdir().unwrap();
    let (workers, links) = admitting_pool(dir.path()).await;
    let (publication, seal) = announced(1);
    let _loading_not_awaited = workers.load_weights(publication);

    let latecomer = late_worker(&links, |weights| async move { Ok(weights) }).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    seal.send(weights(1)).unwrap();

    let response = tokio::time::timeout(Duration::from_secs(10), workers.generate(request(1, 2)))
        .await
        .unwrap()
        .unwrap();
    assert_every_prompt_answered(&response, 2);
    assert_eq!(latecomer.await.unwrap(), vec![weights(1)]);
}
