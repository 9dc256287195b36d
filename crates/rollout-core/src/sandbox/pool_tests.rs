//! The pool against fake workers written in `sh`: each answers by the sample's completion
//! (`ok`, `hang`, `raise`, `segv`, `oom`, `garbage`), so every failure path runs without
//! Python.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use rollout_net::messages::{FailureReason, FinishReason, ScoreRequest, ScoreSample};

use super::*;
use crate::sandbox::classify_exit;

const FAKE_WORKER: &str = r#"
read -r init
case "$init" in *loadfail*) echo '{"op":"load_failed","reward":0,"key":["pattern"],"message":"bad regex"}'; exit 0;; esac
case "$init" in *silent*) sleep 30;; esac
echo '{"op":"ready"}'
while IFS= read -r line; do
  case "$line" in
    *'"completion":"hang"'*) sleep 30;;
    *'"completion":"segv"'*) kill -SEGV $$;;
    *'"completion":"raise"'*) echo '{"op":"failed","reward":0,"reason":"raised","message":"ValueError: no","traceback":"Traceback (most recent call last)"}';;
    *'"completion":"oom"'*) echo '{"op":"failed","reward":0,"reason":"memory","message":"MemoryError"}';;
    *'"completion":"garbage"'*) echo 'this is not json';;
    *) echo '{"op":"scored","scores":[1.0]}';;
  esac
done
"#;

fn spec(processes: usize, plugin: &str) -> PoolSpec {
    PoolSpec {
        launch: Launch {
            program: "sh".into(),
            args: vec!["-c".into(), FAKE_WORKER.into()],
            env: Vec::new(),
            inherit: Vec::new(),
        },
        rewards: vec![RewardSpec {
            plugin: plugin.into(),
            options: serde_json::json!({}),
        }],
        names: vec!["fake".into()],
        weights: vec![2.0],
        config: SandboxConfig {
            processes,
            timeout_seconds: 0.5,
            start_timeout_seconds: 2.0,
            max_failed_fraction: 1.0,
            max_failed_fraction_per_step: 1.0,
            ..SandboxConfig::default()
        },
        ledger: std::sync::Arc::default(),
    }
}

fn request(completions: &[&str]) -> ScoreRequest {
    ScoreRequest {
        samples: completions
            .iter()
            .map(|completion| ScoreSample {
                prompt: "p".into(),
                completion: (*completion).into(),
                record: serde_json::json!({}),
                finish_reason: FinishReason::Stop,
            })
            .collect(),
    }
}

fn reasons(response: &ScoreResponse) -> Vec<(usize, FailureReason)> {
    response
        .failed
        .iter()
        .map(|f| (f.index, f.reason))
        .collect()
}

async fn bounded<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), future)
        .await
        .expect("the test finished in time")
}

#[tokio::test]
async fn every_failure_costs_its_sample_only_and_workers_are_replaced() {
    let pool = bounded(SandboxPool::start(spec(2, "m:C"))).await.unwrap();
    let batch = ["ok", "hang", "raise", "segv", "oom", "garbage", "ok"];
    let started = Instant::now();
    let response = bounded(pool.score(&request(&batch))).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        reasons(&response),
        vec![
            (1, FailureReason::Timeout),
            (2, FailureReason::Raised),
            (3, FailureReason::Crashed),
            (4, FailureReason::Memory),
            (5, FailureReason::Crashed),
        ]
    );
    assert_eq!(response.totals, vec![2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]);
    assert_eq!(response.components[0].scores[6], 1.0);
    let raised = &response.failed[1];
    assert_eq!(raised.reward.as_deref(), Some("fake"));
    assert_eq!(raised.message, "ValueError: no");
    assert!(
        raised
            .traceback
            .as_deref()
            .unwrap()
            .starts_with("Traceback")
    );
    assert!(response.failed[0].message.contains("timed out after 0.5 s"));
    assert!(
        response.failed[2].message.contains("SIGSEGV"),
        "{:?}",
        response.failed[2]
    );
    // The replaced workers score the next request.
    let again = bounded(pool.score(&request(&["ok", "ok", "ok"])))
        .await
        .unwrap();
    assert!(again.failed.is_empty());
    assert_eq!(again.totals, vec![2.0; 3]);
}

#[tokio::test]
async fn a_step_past_its_fraction_ends_the_run_with_the_numbers() {
    let mut spec = spec(1, "m:C");
    spec.config.max_failed_fraction_per_step = 0.25;
    let pool = bounded(SandboxPool::start(spec)).await.unwrap();
    let err = bounded(pool.score(&request(&["ok", "raise", "ok", "raise"])))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("2 of 4 samples in this step (50.0%)"),
        "{text}"
    );
    assert!(
        text.contains("sandbox.max_failed_fraction_per_step = 0.25"),
        "{text}"
    );
    assert!(text.contains("2 raised"), "{text}");
}

#[tokio::test]
async fn the_run_fraction_accumulates_over_steps() {
    let mut spec = spec(1, "m:C");
    spec.config.max_failed_fraction = 0.3;
    let pool = bounded(SandboxPool::start(spec)).await.unwrap();
    let first = bounded(pool.score(&request(&["raise", "ok", "ok", "ok"]))).await;
    assert_eq!(first.unwrap().failed.len(), 1);
    let err = bounded(pool.score(&request(&["raise", "raise", "ok", "ok"])))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("3 of 8 samples so far in the run"), "{text}");
    assert!(text.contains("sandbox.max_failed_fraction = 0.3"), "{text}");
}

#[tokio::test]
async fn a_reward_that_fails_to_load_fails_the_start_with_its_option() {
    let err = bounded(SandboxPool::start(spec(2, "loadfail:C")))
        .await
        .err()
        .expect("the start fails");
    match err {
        SandboxError::LoadFailed {
            reward,
            key,
            message,
            ..
        } => {
            assert_eq!(reward, Some(0));
            assert_eq!(key, Some(vec!["pattern".to_owned()]));
            assert_eq!(message, "bad regex");
        }
        other => panic!("expected LoadFailed, got {other}"),
    }
}

#[tokio::test]
async fn a_worker_that_never_starts_times_out() {
    let started = Instant::now();
    let err = bounded(SandboxPool::start(spec(1, "silent:C")))
        .await
        .err()
        .expect("the start fails");
    assert!(matches!(err, SandboxError::StartTimeout { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn exits_are_classified_by_signal() {
    let signaled = |signal: i32| Some(ExitStatus::from_raw(signal));
    assert_eq!(classify_exit(signaled(24)).0, FailureReason::Timeout);
    assert_eq!(classify_exit(signaled(9)).0, FailureReason::Memory);
    let (reason, message) = classify_exit(signaled(11));
    assert_eq!(reason, FailureReason::Crashed);
    assert!(message.contains("signal 11 (SIGSEGV)"), "{message}");
    let (reason, message) = classify_exit(Some(ExitStatus::from_raw(3 << 8)));
    assert_eq!(reason, FailureReason::Crashed);
    assert!(message.contains("exited with status 3"), "{message}");
}
