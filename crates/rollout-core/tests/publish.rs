//! Trainer ranks publishing a weight version, against fake ranks over real authenticated
//! links: rank 0 announces the version before its checksum is known, and the seal waits for
//! every rank's checksum.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use rollout_core::cluster::remote::RemoteTrainers;
use rollout_core::config::Sharding;
use rollout_core::roles::Learner;
use rollout_net::ClusterKey;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{MessageKind, WeightsReport};
use rollout_net::rpc::RpcClient;
use rollout_testkit::fakes::worker::hello;

fn report(checksum: &str) -> WeightsReport {
    WeightsReport {
        version: 4,
        checksum: checksum.into(),
        bytes: 64,
        source: "127.0.0.1:1".into(),
        holder: "trainer".into(),
    }
}

/// A fake trainer rank: answers each `PublishWeights` with `answers` in order (the last one
/// ending the call), `pause` apart.
async fn rank(key: &ClusterKey, answers: Vec<WeightsReport>, pause: Duration) -> RpcClient {
    let listener = rollout_net::link::listen("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let limits = LinkLimits::default();
    tokio::spawn({
        let (key, limits) = (key.clone(), limits.clone());
        async move {
            let (stream, _) = listener.accept().await.unwrap();
            let link = Link::accept(stream, &key, &hello("trainer", "rank"), &limits)
                .await
                .unwrap();
            let mut server = link.server();
            while let Some(incoming) = server.requests.recv().await {
                assert_eq!(incoming.frame.kind, MessageKind::PublishWeights);
                for (index, answer) in answers.iter().enumerate() {
                    if index > 0 {
                        tokio::time::sleep(pause).await;
                    }
                    let more = index + 1 < answers.len();
                    let responder = &server.responder;
                    responder
                        .reply(incoming.call, answer, Bytes::new(), more)
                        .unwrap();
                }
            }
        }
    });
    Link::connect(&address, key, &hello("controller", "controller"), &limits)
        .await
        .unwrap()
        .client()
}

#[tokio::test]
async fn rank_0_announces_at_once_and_the_seal_waits_for_every_rank() {
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let sealing = Duration::from_millis(300);
    let rank0 = rank(&key, vec![report(""), report("abc")], sealing).await;
    let rank1 = rank(&key, vec![report("abc")], sealing).await;
    let trainers = RemoteTrainers::new(vec![rank0, rank1], Sharding::Replicate);

    let started = std::time::Instant::now();
    let publication = trainers.publish_weights(1 << 20).await.unwrap();
    assert!(started.elapsed() < sealing, "{:?}", started.elapsed());
    assert_eq!(publication.announced, report(""));
    assert!(!publication.announced.is_sealed());
    assert_eq!(publication.sealed.await.unwrap(), report("abc"));
    assert!(started.elapsed() >= sealing);
}

#[tokio::test]
async fn ranks_that_diverged_fail_the_seal_not_the_announcement() {
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let pause = Duration::from_millis(10);
    let rank0 = rank(&key, vec![report(""), report("abc")], pause).await;
    let rank1 = rank(&key, vec![report("def")], pause).await;
    let trainers = RemoteTrainers::new(vec![rank0, rank1], Sharding::Replicate);
    let publication = trainers.publish_weights(1 << 20).await.unwrap();
    let err = publication.sealed.await.unwrap_err();
    assert!(err.to_string().contains("diverged"), "{err}");

    // Sharded ranks hold parts of the weights: only rank 0's checksum counts.
    let rank0 = rank(&key, vec![report("abc")], pause).await;
    let rank1 = rank(&key, vec![report("def")], pause).await;
    let trainers = RemoteTrainers::new(vec![rank0, rank1], Sharding::Fsdp);
    let publication = trainers.publish_weights(1 << 20).await.unwrap();
    assert!(publication.announced.is_sealed());
    assert_eq!(publication.sealed.await.unwrap(), report("abc"));
}
