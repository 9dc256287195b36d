//! The controller against fake roles (no Python): what it asks of them, in which order, and
//! what it leaves on disk.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rollout_net::messages::{
    Completion, FinishReason, GenerateRequest, GenerateResponse, ScoreRequest, ScoreResponse,
    TrainRequest, TrainResponse, ValuesRequest, ValuesResponse, WeightsReport,
};
use tokio::sync::watch;

use super::{Controller, Roles, RunError, Start, verify};
use crate::config::Config;
use crate::plugins::Record;
use crate::roles::{
    Generator, Learner, Observer, RoleError, RoleFuture, RunStarted, SaveWritten, Scorer, Tokenizer,
};

/// One character per token id; completions are two tokens, generated with the learner's
/// current weights (they share them, as in one process).
pub(super) struct FakeModel {
    pub(super) version: Arc<AtomicU64>,
}

impl Tokenizer for FakeModel {
    fn encode(&self, texts: Vec<String>, _: bool) -> RoleFuture<'_, Vec<Vec<u32>>> {
        let ids = texts
            .iter()
            .map(|text| text.chars().map(u32::from).collect())
            .collect();
        Box::pin(async move { Ok(ids) })
    }

    fn decode(&self, sequences: Vec<Vec<u32>>) -> RoleFuture<'_, Vec<String>> {
        let texts = sequences
            .iter()
            .map(|ids| ids.iter().filter_map(|&id| char::from_u32(id)).collect())
            .collect();
        Box::pin(async move { Ok(texts) })
    }

    fn eos_token_ids(&self) -> RoleFuture<'_, Vec<u32>> {
        Box::pin(async { Ok(vec![0]) })
    }
}

impl Generator for FakeModel {
    fn generate(&self, request: GenerateRequest) -> RoleFuture<'_, GenerateResponse> {
        let groups = request
            .prompts
            .iter()
            .map(|prompt| {
                (0..prompt.n)
                    .map(|sample| Completion {
                        token_ids: vec![u32::from('a') + sample, u32::from('b')],
                        logprobs: vec![-0.5, -0.5],
                        finish_reason: FinishReason::Stop,
                        weight_version: self.version.load(Ordering::SeqCst),
                    })
                    .collect()
            })
            .collect();
        Box::pin(async move {
            Ok(GenerateResponse {
                groups,
                metrics: Default::default(),
            })
        })
    }

    fn load_weights(&self, weights: WeightsReport) -> RoleFuture<'_, Vec<WeightsReport>> {
        Box::pin(async move { Ok(vec![weights]) })
    }
}

/// Rewards the completions starting with `a`, so groups have a spread.
impl Scorer for FakeModel {
    fn score(&self, request: ScoreRequest) -> RoleFuture<'_, ScoreResponse> {
        let totals = request
            .samples
            .iter()
            .map(|s| f64::from(u8::from(s.completion.starts_with('a'))))
            .collect();
        Box::pin(async move {
            Ok(ScoreResponse {
                totals,
                components: Vec::new(),
                failed: Vec::new(),
            })
        })
    }
}

impl Observer for FakeModel {
    fn run_started(&self, _: RunStarted) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
    fn step_ended(
        &self,
        _: u64,
        _: serde_json::Value,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
    fn checkpoint_written(
        &self,
        _: u64,
        _: PathBuf,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
    fn run_ended(&self, _: serde_json::Value) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
}

/// A learner whose weights are its version number, saved as `weights.txt`. The background
/// write of the checkpoint taken at version `held` finishes only once the learner is two
/// updates further; the write of the one taken at `failing` fails.
#[derive(Default)]
pub(super) struct FakeLearner {
    pub(super) version: Arc<AtomicU64>,
    trained: watch::Sender<u64>,
    held: Option<u64>,
    failing: Option<u64>,
    log: Mutex<Vec<String>>,
    /// Per update: the advantage of every trained row.
    pub(super) trained_rows: Mutex<Vec<Vec<f32>>>,
}

impl FakeLearner {
    fn holding(version: u64) -> Self {
        FakeLearner {
            held: Some(version),
            ..Default::default()
        }
    }

    fn failing(version: u64) -> Self {
        FakeLearner {
            failing: Some(version),
            ..Default::default()
        }
    }

    fn record(&self, event: String) {
        if let Ok(mut log) = self.log.lock() {
            log.push(event);
        }
    }

    pub(super) fn events(&self) -> Vec<String> {
        self.log.lock().map(|log| log.clone()).unwrap_or_default()
    }
}

impl Learner for FakeLearner {
    fn train(&self, request: TrainRequest) -> RoleFuture<'_, TrainResponse> {
        let rows = request
            .micro_batches
            .iter()
            .flat_map(|batch| {
                let row_advantage = |row: usize| {
                    let tokens = row * batch.width..(row + 1) * batch.width;
                    tokens
                        .filter(|&t| batch.loss_mask[t] > 0.0)
                        .map(|t| batch.advantages[t])
                        .next()
                };
                (0..batch.rows)
                    .filter_map(row_advantage)
                    .collect::<Vec<_>>()
            })
            .collect();
        if let Ok(mut trained) = self.trained_rows.lock() {
            trained.push(rows);
        }
        let version = self.version.fetch_add(1, Ordering::SeqCst) + 1;
        self.record(format!("train {version}"));
        self.trained.send_replace(version);
        Box::pin(async move {
            Ok(TrainResponse {
                metrics: [("loss".to_string(), 1.0)].into(),
                weight_version: version,
            })
        })
    }

    fn values(&self, request: ValuesRequest) -> RoleFuture<'_, ValuesResponse> {
        let values = request
            .micro_batches
            .iter()
            .map(|b| vec![0.0; b.rows * b.width])
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
        Box::pin(async { Ok(()) })
    }

    fn publish_weights(&self, _: u64) -> RoleFuture<'_, WeightsReport> {
        Box::pin(async { Err(RoleError::Protocol("not a distributed learner".into())) })
    }

    fn needs_weight_sync(&self) -> bool {
        false
    }
}

fn write_weights(directory: &Path, version: u64) -> Result<(), RoleError> {
    std::fs::write(directory.join("weights.txt"), version.to_string())
        .map_err(|err| RoleError::Runtime(err.to_string()))
}

fn config(output: &Path, steps: u64, every: u64, background: bool) -> Config {
    let text = format!(
        r#"
        [run]
        steps = {steps}
        output_dir = "{}"
        [policy]
        plugin = "fake:Model"
        [data]
        plugin = "fake:Data"
        [rollout]
        prompts_per_step = 2
        group_size = 2
        [checkpoint]
        every = {every}
        background = {background}
        "#,
        output.display()
    );
    match toml::from_str(&text) {
        Ok(config) => config,
        Err(err) => panic!("bad test config: {err}"),
    }
}

pub(super) fn records() -> Vec<Record> {
    (0..8)
        .map(|i| Record {
            prompt: format!("{i}+{i}="),
            fields: serde_json::json!({ "answer": (2 * i).to_string() }),
        })
        .collect()
}

async fn run(config: &Config, learner: &FakeLearner, start: Start) -> Result<u64, RunError> {
    let model = FakeModel {
        version: learner.version.clone(),
    };
    let roles = Roles {
        generator: &model,
        scorer: &model,
        learner,
        tokenizer: &model,
        environments: None,
        observer: &model,
    };
    let mut controller =
        Controller::new(config, roles, records(), Arc::new(AtomicBool::new(false)));
    let run = controller.run(start);
    match tokio::time::timeout(Duration::from_secs(20), run).await {
        Ok(summary) => summary.map(|s| s.steps_completed),
        Err(_) => panic!("the run hung: {:?}", learner.events()),
    }
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
async fn training_goes_on_while_a_checkpoint_is_written() {
    let output = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let config = config(output.path(), 4, 2, true);
    // Step 2's write finishes only once training is two updates further: waiting for it
    // before training on would hang.
    let learner = FakeLearner::holding(2);
    assert_eq!(run(&config, &learner, Start::Fresh).await.ok(), Some(4));
    let events = learner.events();
    let position = |event: &str| events.iter().position(|e| e == event);
    assert!(position("snapshot 2") < position("train 3"), "{events:?}");
    assert!(position("train 4") < position("snapshot 4"), "{events:?}");
    // Written after two more updates, step 2's checkpoint still holds what it copied.
    assert_eq!(checkpoint(output.path(), 2), (2, "2".into()));
    assert_eq!(checkpoint(output.path(), 4), (4, "4".into()));
    assert_eq!(latest(output.path()), "step-00000004");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_checkpoint_saves_before_the_next_update() {
    let output = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let config = config(output.path(), 3, 1, false);
    let learner = FakeLearner::default();
    assert_eq!(run(&config, &learner, Start::Fresh).await.ok(), Some(3));
    let events = learner.events();
    assert_eq!(
        events,
        [
            "train 1", "save 1", "train 2", "save 2", "train 3", "save 3"
        ],
    );
    assert_eq!(checkpoint(output.path(), 3), (3, "3".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_background_write_ends_the_run_and_keeps_the_previous_checkpoint() {
    let output = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
    let config = config(output.path(), 6, 2, true);
    let learner = FakeLearner::failing(4);
    let failed = run(&config, &learner, Start::Fresh).await;
    let message = failed.err().map(|err| err.to_string()).unwrap_or_default();
    assert!(message.contains("No space left on device"), "{message}");
    assert_eq!(latest(output.path()), "step-00000002");
    assert_eq!(checkpoint(output.path(), 2), (2, "2".into()));
    let partial = output.path().join("checkpoints/step-00000004.partial");
    assert!(partial.exists());

    let learner = FakeLearner::default();
    assert_eq!(run(&config, &learner, Start::Resume).await.ok(), Some(6));
    assert_eq!(
        learner.events().first().map(String::as_str),
        Some("restore 2 as 2")
    );
    assert_eq!(checkpoint(output.path(), 6), (6, "6".into()));
    assert!(!partial.exists());
}
