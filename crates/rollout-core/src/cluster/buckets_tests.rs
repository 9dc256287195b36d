#![allow(clippy::unwrap_used, clippy::expect_used)]

use rollout_net::TensorBytes;

use super::*;

/// Tensors of 12 to 260 bytes, some not a multiple of the alignment.
fn tensors() -> Vec<TensorBytes> {
    [(3, 1), (4, 16), (65, 1), (5, 13), (0, 4), (2, 2)]
        .into_iter()
        .enumerate()
        .map(|(i, (rows, cols))| {
            let len = rows * cols * 4;
            TensorBytes {
                name: format!("layer.{i}.weight"),
                dtype: Dtype::F32,
                shape: vec![rows, cols],
                data: (0..len)
                    .map(|b| (b * 7 + i as u64) as u8)
                    .collect::<Vec<u8>>()
                    .into(),
            }
        })
        .collect()
}

fn built(tensors: &[TensorBytes], bucket_bytes: u64) -> VersionBuffer {
    let mut builder = VersionBuilder::new(5, bucket_bytes, Vec::new());
    for t in tensors {
        builder.push(&t.name, t.dtype, &t.shape, &t.data).unwrap();
    }
    builder.finish()
}

fn planned(tensors: &[TensorBytes], bucket_bytes: u64) -> Result<PlannedVersion<'_>, WeightsError> {
    PlannedVersion::plan(
        5,
        bucket_bytes,
        tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), &t.data[..])),
    )
}

#[test]
fn a_planned_version_is_the_built_one_before_a_byte_is_copied() {
    let tensors = tensors();
    for bucket_bytes in [1, 8, 30, 100, 256, 1 << 20] {
        let built = built(&tensors, bucket_bytes);
        let plan = planned(&tensors, bucket_bytes).unwrap();
        assert_eq!(
            plan.checksum(),
            built.checksum(),
            "{bucket_bytes}-byte buckets"
        );
        assert_eq!(plan.bytes(), built.bytes());
        let buffer = Arc::new(plan.buffer());
        assert_eq!(buffer.count, built.count);
        plan.fill(&buffer, Vec::new());
        assert_eq!(buffer.checksum(), built.checksum());
        assert_eq!(buffer.tensors().unwrap(), tensors);
        for index in 0..built.count {
            let (ours, theirs) = (buffer.bucket(index).unwrap(), built.bucket(index).unwrap());
            assert_eq!(ours.header, theirs.header);
            assert_eq!(ours.payload.owned(), theirs.payload.owned());
            assert_eq!(
                checksum(ours.payload.owned().unwrap()),
                ours.header.checksum
            );
        }
    }
}

#[test]
fn a_tensor_larger_than_a_bucket_travels_in_aligned_pieces_of_its_own() {
    let tensors = tensors();
    let plan = planned(&tensors, 30).unwrap();
    let pieces: Vec<&TensorMeta> = plan
        .tables
        .iter()
        .flat_map(|table| &table.tensors)
        .filter(|meta| meta.name == "layer.2.weight")
        .collect();
    // 260 bytes in 24-byte pieces, each alone in its bucket.
    assert_eq!(pieces.len(), 11);
    assert!(pieces.iter().all(|p| p.offset == 0 && p.len <= 24));
    let starts: Vec<u64> = pieces.iter().filter_map(|p| p.piece_start).collect();
    assert_eq!(starts, (0..11).map(|i| i * 24).collect::<Vec<_>>());
    for table in &plan.tables {
        let has_piece = table.tensors.iter().any(|m| m.piece_start.is_some());
        assert!(!has_piece || table.tensors.len() == 1);
    }
}

#[test]
fn duplicate_names_and_wrong_lengths_are_refused_whichever_way_a_version_is_cut() {
    let mut tensors = tensors();
    tensors[3].name = tensors[0].name.clone();
    // Far apart in buckets of 30 bytes: the duplicate is still seen.
    let err = planned(&tensors, 30).err().unwrap();
    assert!(err.to_string().contains("more than once"), "{err}");
    let mut builder = VersionBuilder::new(1, 30, Vec::new());
    let pushed: Result<Vec<()>, _> = tensors
        .iter()
        .map(|t| builder.push(&t.name, t.dtype, &t.shape, &t.data))
        .collect();
    assert!(pushed.unwrap_err().to_string().contains("more than once"));

    let mut tensors = self::tensors();
    tensors[1].shape = vec![4, 15];
    let err = planned(&tensors, 1 << 20).err().unwrap();
    assert!(err.to_string().contains("needs 240"), "{err}");
}

#[test]
fn a_model_without_tensors_is_one_empty_bucket() {
    let plan = planned(&[], 64).unwrap();
    assert_eq!(plan.tables.len(), 1);
    assert_eq!(plan.checksum(), built(&[], 64).checksum());
}

#[test]
fn filling_reuses_the_allocations_it_is_given() {
    let tensors = tensors();
    let plan = planned(&tensors, 100).unwrap();
    let allocations: Vec<Vec<u8>> = (0..plan.tables.len())
        .map(|_| Vec::with_capacity(128))
        .collect();
    let pointers: Vec<*const u8> = allocations.iter().map(|a| a.as_ptr()).collect();
    let buffer = Arc::new(plan.buffer());
    plan.fill(&buffer, allocations);
    let reused = (0..buffer.count)
        .filter(|&i| {
            pointers.contains(&buffer.bucket(i).unwrap().payload.owned().unwrap().as_ptr())
        })
        .count();
    assert_eq!(reused, pointers.len());
}

#[test]
fn a_bucket_filled_in_stretches_has_the_checksum_of_its_bytes() {
    // A 3 MiB tensor between two small ones: copied and hashed a stretch at a time, with an
    // alignment gap before the last.
    let mut tensors = tensors();
    tensors[1] = TensorBytes {
        name: "embed.weight".into(),
        dtype: Dtype::F32,
        shape: vec![3 << 18],
        data: (0..3u32 << 20)
            .map(|b| (b % 251) as u8)
            .collect::<Vec<u8>>()
            .into(),
    };
    let built = built(&tensors, 8 << 20);
    let plan = planned(&tensors, 8 << 20).unwrap();
    let buffer = Arc::new(plan.buffer());
    plan.fill(&buffer, Vec::new());
    assert_eq!(buffer.count, 1);
    let bucket = buffer.bucket(0).unwrap();
    assert_eq!(
        bucket.header.checksum,
        checksum(bucket.payload.owned().unwrap())
    );
    assert_eq!(
        bucket.payload.owned(),
        built.bucket(0).unwrap().payload.owned()
    );
    assert_eq!(buffer.checksum(), built.checksum());
}
