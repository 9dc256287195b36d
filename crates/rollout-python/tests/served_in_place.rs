//! A trainer serving its weights in place (`weight_views`) copies them before a hook that
//! changes them runs: a version exported before `apply_update`, `load` or `release_memory`
//! is still delivered as it was exported, with the checksum of those weights.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rollout_core::cluster::buckets::{ExportedVersion, Serving};
use rollout_core::config::{LoadedConfig, load_text};
use rollout_core::roles::Learner;
use rollout_net::messages::TrainRequest;
use rollout_python::hosts::PolicyHost;
use rollout_python::interpreter::{PythonSetup, PythonWorker};

/// Small enough that the 16 KiB tensor is split across buckets.
const BUCKET_BYTES: u64 = 4096;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn config(out: &Path) -> LoadedConfig {
    let text = format!(
        r#"[run]
name = "served-in-place"
output_dir = "{out}"
steps = 1

[python]
paths = ["{fixtures}"]

[policy]
plugin = "toy_plugins:WeightedToyPolicy"

[engine]
enabled = false

[data]
plugin = "python_plugins.data:JsonlPrompts"
options = {{ path = "{prompts}" }}

[[rewards]]
plugin = "toy_plugins:DigitSum"
"#,
        out = out.display(),
        fixtures = fixtures().display(),
        prompts = fixtures().join("prompts.jsonl").display(),
    );
    load_text(&out.join("served.toml"), text, &[]).unwrap()
}

/// Every float of the version's one tensor, `w`.
fn values(exported: &ExportedVersion) -> Vec<f32> {
    let buffer = exported
        .buffer
        .as_ref()
        .expect("a served version has a buffer");
    let tensors = buffer.tensors().unwrap();
    assert_eq!(tensors.len(), 1);
    assert_eq!(tensors[0].name, "w");
    tensors[0]
        .data
        .chunks_exact(4)
        .map(|bytes| f32::from_le_bytes(bytes.try_into().unwrap()))
        .collect()
}

/// Exports the current weights served in place, with the checksum of a copy of them.
async fn serve(host: &PolicyHost) -> (ExportedVersion, String) {
    let copied = host.export_weights(BUCKET_BYTES, None).await.unwrap();
    let served = host
        .export_weights(BUCKET_BYTES, Some(Serving::InPlace(Vec::new())))
        .await
        .unwrap();
    assert!(
        served.checksum.is_none(),
        "in place, the checksum comes later"
    );
    (served, copied.checksum.unwrap())
}

/// `exported` seals with `checksum`, and holds 4096 floats of `value`.
async fn assert_delivered(exported: &ExportedVersion, checksum: &str, value: f32, hook: &str) {
    let buffer = exported.buffer.as_ref().unwrap();
    let sealed = buffer.sealed(Duration::from_secs(10)).await;
    assert_eq!(sealed.as_deref(), Some(checksum), "after {hook}");
    let values = values(exported);
    assert_eq!(values.len(), 4096);
    assert!(
        values.iter().all(|&v| v == value),
        "after {hook} the version exported before it holds {:?}, not {value}",
        &values[..4]
    );
}

#[test]
fn a_version_served_in_place_is_delivered_as_exported_after_the_weights_change() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let loaded = config(out.path());
    let setup = PythonSetup::discover(None, &[fixtures()]).expect("a Python environment");
    let worker = Arc::new(PythonWorker::start(setup).expect("the interpreter starts"));
    runtime.block_on(async {
        let host = PolicyHost::load(worker, &loaded).await.unwrap();
        let update = TrainRequest {
            micro_batches: Vec::new(),
            learning_rate: 0.1,
            epochs: 1,
        };

        let (zeros, checksum) = serve(&host).await;
        host.train(update.clone()).await.unwrap();
        assert_delivered(&zeros, &checksum, 0.0, "apply_update").await;

        let saved = out.path().join("saved");
        std::fs::create_dir_all(&saved).unwrap();
        host.save(saved.clone()).await.unwrap();
        host.train(update).await.unwrap();
        let (twos, checksum) = serve(&host).await;
        host.restore(saved, 1).await.unwrap();
        assert_delivered(&twos, &checksum, 2.0, "load").await;

        let (ones, checksum) = serve(&host).await;
        host.release_memory().await.unwrap();
        assert_delivered(&ones, &checksum, 1.0, "release_memory").await;
    });
}
