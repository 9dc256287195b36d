#![allow(clippy::unwrap_used, clippy::expect_used)]

use rollout_net::Dtype;
use rollout_net::tensor::TensorBytes;

use super::*;
use crate::cluster::buckets::{PlannedVersion, VersionBuilder};

/// Five small float32 tensors (also [`crate::cluster::assemble`]'s tests).
pub(in crate::cluster) fn tensors() -> Vec<TensorBytes> {
    (0..5)
        .map(|i| TensorBytes {
            name: format!("layer.{i}.weight"),
            dtype: Dtype::F32,
            shape: vec![4, 4 + i],
            data: (0..(16 * (4 + i)))
                .map(|b| (b * 7 + i) as u8)
                .collect::<Vec<u8>>()
                .into(),
        })
        .collect()
}

#[test]
fn bucketing_keeps_every_tensor_in_order() {
    let tensors = tensors();
    // 64 to 128 bytes each: split into pieces below 128 bytes a bucket.
    for bucket_bytes in [1, 20, 100, 200, 1 << 20] {
        let buffer = VersionBuffer::from_tensors(3, &tensors, bucket_bytes).unwrap();
        let back = buffer.tensors().unwrap();
        assert_eq!(back, tensors, "{bucket_bytes}-byte buckets");
        let again = VersionBuffer::from_tensors(3, &tensors, bucket_bytes).unwrap();
        assert_eq!(buffer.checksum(), again.checksum());
        let largest = buffer
            .buckets
            .lock()
            .unwrap()
            .iter()
            .map(|b| b.payload.len() as u64)
            .max()
            .unwrap();
        assert!(largest <= bucket_bytes.max(8), "{largest} > {bucket_bytes}");
    }
    let total: usize = tensors.iter().map(|t| t.data.len()).sum();
    // One 8-byte piece a bucket.
    let tiny = VersionBuffer::from_tensors(3, &tensors, 1).unwrap();
    assert_eq!(tiny.count as usize, total / 8);
    let one = VersionBuffer::from_tensors(3, &tensors, 1 << 20).unwrap();
    assert_eq!(one.count, 1);
}

#[test]
fn pieces_that_do_not_join_are_refused() {
    let tensors = tensors();
    let whole = VersionBuffer::from_tensors(3, &tensors, 16).unwrap();
    let buckets = whole.buckets.lock().unwrap().clone();
    let rebuilt = |keep: &dyn Fn(usize) -> bool| {
        let buffer = VersionBuffer::new(3, buckets.len() as u32);
        for (index, bucket) in buckets.iter().enumerate() {
            if keep(index) {
                buffer.push(bucket.clone());
            }
        }
        buffer.tensors()
    };
    assert_eq!(rebuilt(&|_| true).unwrap(), tensors);
    let gap = rebuilt(&|index| index != 1).unwrap_err();
    assert!(matches!(gap, WeightsError::Pieces { .. }), "{gap}");
    let cut_short = rebuilt(&|index| index + 1 < buckets.len()).unwrap_err();
    assert!(
        cut_short.to_string().contains("never arrived"),
        "{cut_short}"
    );
    let no_start = rebuilt(&|index| index != 0).unwrap_err();
    assert!(no_start.to_string().contains("byte 0"), "{no_start}");
}

#[test]
fn a_later_version_is_built_in_the_allocations_of_an_earlier_one() {
    let tensors = tensors();
    let first = VersionBuffer::from_tensors(1, &tensors, 100).unwrap();
    let pointers: Vec<*const u8> = first
        .buckets
        .lock()
        .unwrap()
        .iter()
        .map(|b| b.payload.owned().unwrap().as_ptr())
        .collect();
    let allocations = first.into_allocations();
    assert_eq!(allocations.len(), pointers.len());
    let mut builder = VersionBuilder::new(2, 100, allocations);
    for tensor in &tensors {
        builder
            .push(&tensor.name, tensor.dtype, &tensor.shape, &tensor.data)
            .unwrap();
    }
    let second = builder.finish();
    assert_eq!(second.tensors().unwrap(), tensors);
    let reused = second
        .buckets
        .lock()
        .unwrap()
        .iter()
        .filter(|b| pointers.contains(&b.payload.owned().unwrap().as_ptr()))
        .count();
    assert_eq!(reused, pointers.len());
    // A bucket still held elsewhere (being sent) is not handed back.
    let held = second.buckets.lock().unwrap()[0].clone();
    assert_eq!(second.into_allocations().len(), pointers.len() - 1);
    drop(held);
}

#[test]
fn the_checksum_sees_a_flipped_bit_and_a_renamed_tensor() {
    let checksum = |tensors: &[TensorBytes]| {
        VersionBuffer::from_tensors(1, tensors, 200)
            .unwrap()
            .checksum()
    };
    let tensors = tensors();
    let original = checksum(&tensors);
    let mut flipped = tensors.clone();
    let mut data = flipped[2].data.to_vec();
    data[5] ^= 1;
    flipped[2].data = data.into();
    assert_ne!(checksum(&flipped), original);
    let mut renamed = tensors.clone();
    renamed[0].name = "layer.0.bias".into();
    assert_ne!(checksum(&renamed), original);
}

fn report(version: u64, checksum: &str) -> WeightsReport {
    WeightsReport {
        version,
        checksum: checksum.into(),
        bytes: 0,
        source: String::new(),
        holder: "trainer".into(),
    }
}

fn planned(tensors: &[TensorBytes]) -> PlannedVersion<'_> {
    let views = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), &t.data[..]));
    PlannedVersion::plan(3, 100, views).unwrap()
}

#[tokio::test]
async fn a_buffer_is_sealed_by_its_last_bucket() {
    let tensors = tensors();
    let plan = planned(&tensors);
    let expected = plan.checksum();
    let buffer = Arc::new(plan.buffer());
    assert_eq!(buffer.sealed(Duration::from_millis(20)).await, None);
    let waiting = tokio::spawn({
        let buffer = buffer.clone();
        async move { buffer.sealed(Duration::from_secs(10)).await }
    });
    plan.fill(&buffer, Vec::new());
    assert_eq!(waiting.await.unwrap(), Some(expected));
}

#[tokio::test]
async fn a_version_pulled_unsealed_is_served_only_with_its_own_seal() {
    let buffer = VersionBuffer::from_tensors(3, &tensors(), 100).unwrap();
    let checksum = buffer.checksum();
    let limit = Duration::from_secs(10);
    let (seals, mut heard) = watch::channel(None);
    let sealing = tokio::spawn({
        let checksum = checksum.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            seals.send_replace(Some(report(3, &checksum)));
            seals
        }
    });
    let sealed = seal_of(&buffer, &mut heard, limit).await.unwrap();
    assert_eq!(sealed, report(3, &checksum));
    let seals = sealing.await.unwrap();

    seals.send_replace(Some(report(3, &"0".repeat(32))));
    let err = seal_of(&buffer, &mut seals.subscribe(), limit).await;
    assert!(
        matches!(err, Err(WeightsError::ChecksumMismatch { .. })),
        "{err:?}"
    );
    seals.send_replace(Some(report(4, &checksum)));
    let err = seal_of(&buffer, &mut seals.subscribe(), limit).await;
    assert!(format!("{err:?}").contains("a later version"), "{err:?}");

    let (gone, mut heard) = watch::channel(None);
    drop(gone);
    let err = seal_of(&buffer, &mut heard, limit).await;
    assert!(
        format!("{err:?}").contains("can no longer arrive"),
        "{err:?}"
    );
    let (_quiet, mut heard) = watch::channel(None);
    let err = seal_of(&buffer, &mut heard, Duration::from_millis(20)).await;
    assert!(format!("{err:?}").contains("no seal arrived"), "{err:?}");
}

/// A greeting for a test's links (also [`crate::cluster::in_place`]'s tests).
pub(in crate::cluster) fn hello(name: &str) -> Hello {
    Hello {
        role: "test".into(),
        name: name.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        credits: 16,
        info: serde_json::Value::Null,
    }
}

#[tokio::test]
async fn a_version_announced_before_it_is_filled_is_pulled_whole() {
    let tensors = tensors();
    let plan = planned(&tensors);
    let sealed = plan.checksum();
    let buffer = Arc::new(plan.buffer());
    let trainer = WeightStore::default();
    trainer.publish(buffer.clone());
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).unwrap();
    let listener = rollout_net::link::listen("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (limits, wait) = (LinkLimits::default(), Duration::from_secs(10));
    trainer.serve(
        listener,
        key.clone(),
        hello("trainer"),
        limits.clone(),
        wait,
    );
    let link = Link::connect(&address, &key, &hello("worker"), &limits)
        .await
        .unwrap();
    let announced = report(3, "");
    let worker = WeightStore::default();
    let pulling = tokio::spawn(async move { worker.pull(&link.client(), &announced).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    plan.fill(&buffer, Vec::new());
    let pulled = pulling.await.unwrap().unwrap();
    let (_seals, mut heard) = watch::channel(Some(report(3, &sealed)));
    assert_eq!(
        seal_of(&pulled, &mut heard, wait).await.unwrap().checksum,
        sealed
    );
    assert_eq!(pulled.tensors().unwrap(), tensors);
}
