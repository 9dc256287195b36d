//! A learner whose weights are its version number.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rollout_core::roles::{Learner, Publication, RoleError, RoleFuture, SaveWritten};
use rollout_net::messages::{
    ExcludedRow, Exclusion, TrainRequest, TrainResponse, ValuesRequest, ValuesResponse,
    WeightsReport,
};
use tokio::sync::watch;

use super::lock;

/// Its weights are its version number, saved as `weights.txt`; it records every request.
/// Configured with its builders: a background checkpoint write that is held back or fails,
/// weights that must be sent to generators (as trainer ranks' are), a value head.
pub struct FakeLearner {
    /// The weight version: the updates applied so far.
    pub version: Arc<AtomicU64>,
    trained: watch::Sender<u64>,
    /// The background write of the checkpoint taken at this version finishes only once the
    /// learner is two updates further.
    held: Option<u64>,
    /// The background write of the checkpoint taken at this version fails.
    failing: Option<u64>,
    needs_weight_sync: bool,
    value: f32,
    /// The update that reaches this version answers with the other instead.
    forged: Option<(u64, u64)>,
    /// The update that reaches this version leaves this row out, as for a non-finite loss.
    excluding: Option<(u64, ExcludedRow)>,
    /// How long each update takes.
    update_time: std::time::Duration,
    events: Mutex<Vec<String>>,
    requests: Mutex<Vec<TrainRequest>>,
}

impl Default for FakeLearner {
    fn default() -> Self {
        FakeLearner {
            version: Arc::default(),
            trained: watch::channel(0).0,
            held: None,
            failing: None,
            needs_weight_sync: false,
            value: 0.0,
            forged: None,
            excluding: None,
            update_time: std::time::Duration::ZERO,
            events: Mutex::default(),
            requests: Mutex::default(),
        }
    }
}

impl FakeLearner {
    /// The update that reaches version `at` claims version `claimed` in its answer.
    pub fn claiming_version(self, at: u64, claimed: u64) -> Self {
        FakeLearner {
            forged: Some((at, claimed)),
            ..self
        }
    }

    /// The update that reaches version `at` leaves row `row` of micro-batch `micro_batch`
    /// out, as a trainer does a row whose loss is not finite.
    pub fn excluding_at(self, at: u64, micro_batch: u32, row: u32) -> Self {
        let row = ExcludedRow {
            micro_batch,
            row,
            reason: Exclusion::NonFinite,
        };
        FakeLearner {
            excluding: Some((at, row)),
            ..self
        }
    }

    /// Holds the background write of the checkpoint taken at `version` until two more
    /// updates are applied.
    pub fn holding_write_at(self, version: u64) -> Self {
        FakeLearner {
            held: Some(version),
            ..self
        }
    }

    /// Fails the background write of the checkpoint taken at `version` (a full disk).
    pub fn failing_write_at(self, version: u64) -> Self {
        FakeLearner {
            failing: Some(version),
            ..self
        }
    }

    /// Generators hold their own weights: the controller publishes each version.
    pub fn with_weight_sync(self) -> Self {
        FakeLearner {
            needs_weight_sync: true,
            ..self
        }
    }

    /// Each update takes `update_time`: generation runs ahead of training, as it does
    /// against a real trainer, whatever the scheduling of the test's threads.
    pub fn taking(self, update_time: std::time::Duration) -> Self {
        FakeLearner {
            update_time,
            ..self
        }
    }

    /// Its value head predicts `value` for every token.
    pub fn predicting(self, value: f32) -> Self {
        FakeLearner { value, ..self }
    }

    /// What it was asked, in order: `train V` (the version after), `save V`, `snapshot V`,
    /// `restore W as V` (W what the checkpoint held).
    pub fn events(&self) -> Vec<String> {
        lock(&self.events).clone()
    }

    /// Every training request, in order.
    pub fn requests(&self) -> Vec<TrainRequest> {
        lock(&self.requests).clone()
    }

    /// Per update, the advantage of every row trained on (rows in batch order).
    pub fn trained_advantages(&self) -> Vec<Vec<f32>> {
        self.requests()
            .iter()
            .map(|request| {
                request
                    .micro_batches
                    .iter()
                    .flat_map(|batch| {
                        (0..batch.rows).filter_map(move |row| {
                            let tokens = row * batch.width..(row + 1) * batch.width;
                            tokens
                                .filter(|&t| batch.loss_mask[t] > 0.0)
                                .map(|t| batch.advantages[t])
                                .next()
                        })
                    })
                    .collect()
            })
            .collect()
    }

    fn record(&self, event: String) {
        lock(&self.events).push(event);
    }
}

impl Learner for FakeLearner {
    fn train(&self, request: TrainRequest) -> RoleFuture<'_, TrainResponse> {
        let loss_tokens: usize = request.micro_batches.iter().map(|b| b.loss_tokens()).sum();
        lock(&self.requests).push(request);
        let version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        self.record(format!("train {version}"));
        self.trained.send_replace(version);
        let excluded: Vec<ExcludedRow> = match self.excluding {
            Some((at, row)) if at == version => vec![row],
            _ => Vec::new(),
        };
        let version = match self.forged {
            Some((at, claimed)) if at == version => claimed,
            _ => version,
        };
        let update_time = self.update_time;
        Box::pin(async move {
            tokio::time::sleep(update_time).await;
            Ok(TrainResponse {
                metrics: [
                    ("loss".to_string(), 1.0),
                    ("loss_tokens".to_string(), loss_tokens as f64),
                    (
                        "samples_excluded_nonfinite".to_string(),
                        excluded.len() as f64,
                    ),
                ]
                .into(),
                weight_version: version,
                excluded,
            })
        })
    }

    fn values(&self, request: ValuesRequest) -> RoleFuture<'_, ValuesResponse> {
        let values = request
            .micro_batches
            .iter()
            .map(|b| vec![self.value; b.rows * b.width])
            .collect();
        Box::pin(async move { Ok(ValuesResponse { values }) })
    }

    fn save(&self, directory: PathBuf) -> RoleFuture<'_, ()> {
        let version = self.version.load(Ordering::SeqCst);
        self.record(format!("save {version}"));
        Box::pin(async move { write_weights(&directory, version) })
    }

    fn save_in_background(&self, directory: PathBuf) -> RoleFuture<'_, SaveWritten> {
        let version = self.version.load(Ordering::SeqCst);
        self.record(format!("snapshot {version}"));
        let mut trained = self.trained.subscribe();
        let release_at = if self.held == Some(version) {
            version + 2
        } else {
            0
        };
        let fails = self.failing == Some(version);
        Box::pin(async move {
            let written: SaveWritten = Box::pin(async move {
                let _ = trained.wait_for(|&v| v >= release_at).await;
                if fails {
                    return Err(RoleError::Runtime("No space left on device".into()));
                }
                write_weights(&directory, version)
            });
            Ok(written)
        })
    }

    fn restore(&self, directory: PathBuf, weight_version: u64) -> RoleFuture<'_, ()> {
        let saved = std::fs::read_to_string(directory.join("weights.txt")).unwrap_or_default();
        self.record(format!("restore {saved} as {weight_version}"));
        self.version.store(weight_version, Ordering::SeqCst);
        self.trained.send_replace(weight_version);
        Box::pin(async { Ok(()) })
    }

    fn publish_weights(&self, bucket_bytes: u64) -> RoleFuture<'_, Publication> {
        let version = self.version.load(Ordering::SeqCst);
        Box::pin(async move {
            Ok(Publication::sealed(WeightsReport {
                version,
                checksum: format!("fake-{version}"),
                bytes: bucket_bytes.min(8),
                source: String::new(),
                holder: "fake".into(),
            }))
        })
    }

    fn needs_weight_sync(&self) -> bool {
        self.needs_weight_sync
    }
}

fn write_weights(directory: &Path, version: u64) -> Result<(), RoleError> {
    std::fs::write(directory.join("weights.txt"), version.to_string())
        .map_err(|err| RoleError::Runtime(err.to_string()))
}
