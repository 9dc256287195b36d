//! An observer that records the run.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Mutex;

use rollout_core::metrics::StepMetrics;
use rollout_core::roles::{Observer, RunStarted};

use super::lock;

type Notify<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Records every event (`start S`, `step S`, `checkpoint S`, `end`) and every step's
/// metrics.
#[derive(Default)]
pub struct RecordingObserver {
    events: Mutex<Vec<String>>,
    metrics: Mutex<Vec<StepMetrics>>,
}

impl RecordingObserver {
    pub fn events(&self) -> Vec<String> {
        lock(&self.events).clone()
    }

    /// The metrics of every step observed, in order.
    pub fn metrics(&self) -> Vec<StepMetrics> {
        lock(&self.metrics).clone()
    }

    fn record(&self, event: String) {
        lock(&self.events).push(event);
    }
}

impl Observer for RecordingObserver {
    fn run_started(&self, info: RunStarted) -> Notify<'_> {
        self.record(format!("start {}", info.start_step));
        Box::pin(async {})
    }

    fn step_ended(&self, metrics: StepMetrics) -> Notify<'_> {
        self.record(format!("step {}", metrics.step));
        lock(&self.metrics).push(metrics);
        Box::pin(async {})
    }

    fn checkpoint_written(&self, step: u64, _: PathBuf) -> Notify<'_> {
        self.record(format!("checkpoint {step}"));
        Box::pin(async {})
    }

    fn run_ended(&self, _: serde_json::Value) -> Notify<'_> {
        self.record("end".into());
        Box::pin(async {})
    }
}
