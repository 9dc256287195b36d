#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use rollout_net::messages::WeightsReport;
use rollout_net::tensor::{Dtype, TensorBytes};
use rollout_net::{ClusterKey, Link, LinkLimits};
use tokio::sync::watch;

use super::*;
use crate::cluster::buckets::PlannedVersion;
use crate::cluster::weights::tests::hello;
use crate::cluster::weights::{WeightStore, seal_of};

/// Tensors of odd sizes (so buckets have alignment gaps) and one larger than a bucket.
fn tensors() -> Vec<TensorBytes> {
    let sizes: [(&str, Vec<u64>); 4] = [
        ("embed", vec![300, 7]),
        ("norm", vec![3]),
        ("layer.0", vec![5, 9]),
        ("bias", vec![1]),
    ];
    sizes
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let len = shape.iter().product::<u64>() as usize * 4;
            let data: Vec<u8> = (0..len).map(|b| (b * 31 + i * 7) as u8).collect();
            TensorBytes::new(name.into(), Dtype::F32, shape, data).unwrap()
        })
        .collect()
}

const BUCKET_BYTES: u64 = 1000;

fn in_place(tensors: &[TensorBytes]) -> ServedInPlace {
    let views = tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.data.clone()));
    ServedInPlace::plan(3, BUCKET_BYTES, views, Vec::new()).unwrap()
}

/// What a rank that only reports the version computes for the same tensors.
fn expected_checksum(tensors: &[TensorBytes]) -> String {
    let views = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), &t.data[..]));
    PlannedVersion::plan(3, BUCKET_BYTES, views)
        .unwrap()
        .checksum()
}

fn unsealed() -> WeightsReport {
    WeightsReport {
        version: 3,
        checksum: String::new(),
        bytes: 0,
        source: String::new(),
        holder: "trainer".into(),
    }
}

/// Serves `store` on a loopback port; returns a client of it.
async fn serve(store: &WeightStore, key: &ClusterKey) -> rollout_net::RpcClient {
    let listener = rollout_net::link::listen("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let limits = LinkLimits::default();
    store.serve(
        listener,
        key.clone(),
        hello("server"),
        limits.clone(),
        Duration::from_secs(10),
    );
    Link::connect(&address, key, &hello("puller"), &limits)
        .await
        .unwrap()
        .client()
}

/// Pulled from the tensors in place and relayed on: every worker has the tensors, the
/// sends' hashes seal the trainer's buffer with the checksum a reporting rank computes, and
/// the relay serves each bucket with its checksum filled in.
#[tokio::test]
async fn a_version_served_in_place_is_pulled_relayed_and_sealed_by_its_sends() {
    let tensors = tensors();
    let served = in_place(&tensors);
    assert!(served.buffer().count > 2, "the test wants several buckets");
    assert!(!served.buffer().is_hashed());
    let trainer = WeightStore::default();
    trainer.publish(served.buffer().clone());
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let first = WeightStore::default();
    let pulled = first
        .pull(&serve(&trainer, &key).await, &unsealed())
        .await
        .unwrap();
    let wait = Duration::from_secs(10);
    let sealed = served
        .buffer()
        .sealed(wait)
        .await
        .expect("sealed by the sends");
    assert_eq!(sealed, expected_checksum(&tensors));
    let (_seals, mut heard) = watch::channel(Some(WeightsReport {
        checksum: sealed.clone(),
        ..unsealed()
    }));
    seal_of(&pulled, &mut heard, wait).await.unwrap();
    assert_eq!(pulled.tensors().unwrap(), tensors);

    let second = WeightStore::default();
    let sealed_report = WeightsReport {
        checksum: sealed,
        ..unsealed()
    };
    let relayed = second
        .pull(&serve(&first, &key).await, &sealed_report)
        .await
        .unwrap();
    assert_eq!(relayed.tensors().unwrap(), tensors);
    for index in 0..relayed.count {
        assert!(!relayed.bucket(index).unwrap().header.checksum.is_empty());
    }
}

/// Settling copies every bucket (hashing those no send hashed), so the version is still
/// served, and lets go of the tensors: their bytes are held by nothing else afterwards.
#[test]
fn settling_copies_the_buckets_and_lets_go_of_the_tensors() {
    let tensors = tensors();
    let served = in_place(&tensors);
    let buffer = served.buffer().clone();
    assert!(served.settle(Duration::from_secs(1)));
    assert!(buffer.is_hashed());
    assert_eq!(buffer.checksum(), expected_checksum(&tensors));
    for index in 0..buffer.count {
        assert!(buffer.bucket(index).unwrap().payload.owned().is_some());
    }
    assert_eq!(buffer.tensors().unwrap(), tensors);
    for tensor in tensors {
        assert!(tensor.data.is_unique(), "`{}` is still held", tensor.name);
    }
}

/// A send still holding a piece keeps settling waiting until it lets go, at most the limit.
#[test]
fn settling_waits_for_a_send_that_still_holds_a_piece() {
    let tensors = tensors();
    let served = in_place(&tensors);
    let held = served.buffer().bucket(0).unwrap();
    let sending = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        drop(held);
    });
    let started = Instant::now();
    assert!(served.settle(Duration::from_secs(5)));
    assert!(started.elapsed() >= Duration::from_millis(50));
    sending.join().unwrap();

    let served = in_place(&tensors);
    let _stuck = served.buffer().bucket(1).unwrap();
    assert!(!served.settle(Duration::from_millis(20)));
}

/// A version no puller hashes is sealed in place once its grace has passed.
#[tokio::test]
async fn a_version_nobody_pulls_is_sealed_in_place() {
    let tensors = tensors();
    let served = in_place(&tensors);
    served.seal_unless_pulled();
    let sealed = served.buffer().sealed(Duration::from_secs(10)).await;
    assert_eq!(sealed, Some(expected_checksum(&tensors)));
    assert!(served.settle(Duration::from_secs(1)));
}

/// The pieces of an in-place bucket are its payload: tensors at their offsets, zero gaps.
#[test]
fn in_place_buckets_lay_tensors_out_as_copied_ones() {
    let tensors = tensors();
    let served = in_place(&tensors);
    let copied =
        crate::cluster::weights::VersionBuffer::from_tensors(3, &tensors, BUCKET_BYTES).unwrap();
    assert_eq!(served.buffer().count, copied.count);
    for index in 0..copied.count {
        let ours = served.buffer().bucket(index).unwrap();
        let theirs = copied.bucket(index).unwrap();
        assert_eq!(ours.header.tensors, theirs.header.tensors);
        let Payload::InPlace(pieces) = &ours.payload else {
            panic!("bucket {index} was copied");
        };
        assert_eq!(pieces.concat(), theirs.payload.owned().unwrap()[..]);
    }
}
