//! The environment pool against fake workers written in `sh`. Each worker remembers the
//! episodes reset in it and refuses a step of any other (so a step sent to the wrong
//! process fails the test), answers with its pid (so pinning is visible), and misbehaves by
//! the action: `hang`, `segv`, `exit`, `raise`, `done`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use super::*;
use crate::sandbox::RunCounts;

const FAKE_ENVIRONMENT: &str = r#"
read -r init
case "$init" in *loadfail*) echo '{"op":"load_failed","reward":null,"key":["low"],"message":"bad low"}'; exit 0;; esac
echo '{"op":"ready"}'
known=" "
while IFS= read -r line; do
  episode=$(echo "$line" | sed -n 's/.*"episode":\([0-9]*\).*/\1/p')
  case "$line" in
    *'"op":"reset"'*)
      case "$line" in
        *'"record":{"do":"raise"}'*) echo '{"op":"failed","reward":null,"reason":"raised","message":"ValueError: bad record","traceback":"Traceback (most recent call last)"}';;
        *) known="$known$episode "; echo '{"op":"started","prompt":"pid-'$$'"}';;
      esac;;
    *'"op":"step"'*)
      case "$known" in *" $episode "*) ;; *) echo '{"op":"protocol_error","message":"not here"}'; continue;; esac
      case "$line" in
        *'"action":"hang"'*) sleep 30;;
        *'"action":"segv"'*) kill -SEGV $$;;
        *'"action":"exit"'*) exit 3;;
        *'"action":"raise"'*) echo '{"op":"failed","reason":"raised","message":"ValueError: no","traceback":"Traceback (most recent call last)"}';;
        *'"action":"done"'*) echo '{"op":"stepped","observation":"","reward":1.0,"done":true}';;
        *) echo '{"op":"stepped","observation":"pid-'$$'","reward":0.5,"done":false}';;
      esac;;
    *'"op":"finish"'*) echo '{"op":"finished"}';;
    *) echo '{"op":"protocol_error","message":"unknown"}';;
  esac
done
"#;

const FIRST: u64 = 100;

fn spec(processes: usize, plugin: &str) -> EnvironmentPoolSpec {
    EnvironmentPoolSpec {
        launch: Launch {
            program: "sh".into(),
            args: vec!["-c".into(), FAKE_ENVIRONMENT.into()],
            env: Vec::new(),
            inherit: Vec::new(),
        },
        environment: EnvironmentSpec {
            plugin: plugin.into(),
            options: serde_json::json!({}),
        },
        seed: 3,
        config: SandboxConfig {
            processes,
            timeout_seconds: 0.5,
            start_timeout_seconds: 5.0,
            max_failed_fraction: 1.0,
            max_failed_fraction_per_step: 1.0,
            ..SandboxConfig::default()
        },
        ledger: Arc::new(FailureLedger::new(true)),
    }
}

fn starts(records: &[serde_json::Value]) -> Vec<EpisodeStart> {
    records
        .iter()
        .map(|record| EpisodeStart {
            record: record.clone(),
            seed: 1,
        })
        .collect()
}

fn plain(count: usize) -> Vec<EpisodeStart> {
    starts(&vec![serde_json::json!({}); count])
}

fn actions(texts: &[&str]) -> Vec<(u64, String)> {
    texts
        .iter()
        .enumerate()
        .map(|(i, text)| (FIRST + i as u64, (*text).to_owned()))
        .collect()
}

fn prompt(result: &EpisodeResult<String>) -> &str {
    result.as_deref().expect("the episode started")
}

async fn bounded<T>(future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), future)
        .await
        .expect("the test finished in time")
}

#[tokio::test]
async fn episodes_are_pinned_round_robin_and_every_step_goes_to_their_process() {
    let spec = spec(2, "m:C");
    let ledger = spec.ledger.clone();
    let pool = bounded(EnvironmentPool::start(spec)).await.unwrap();
    let prompts = bounded(pool.start_episodes(FIRST, &plain(4)))
        .await
        .unwrap();
    let pids: Vec<&str> = prompts.iter().map(prompt).collect();
    assert_eq!(pids[0], pids[2]);
    assert_eq!(pids[1], pids[3]);
    assert_ne!(pids[0], pids[1]);
    for _ in 0..2 {
        let outcomes = bounded(pool.step(&actions(&["a", "b", "c", "d"])))
            .await
            .unwrap();
        for (outcome, pid) in outcomes.iter().zip(&pids) {
            let outcome = outcome.as_ref().unwrap();
            assert_eq!(&outcome.observation, pid);
            assert_eq!((outcome.reward, outcome.done), (0.5, false));
        }
    }
    let ids: Vec<u64> = (FIRST..FIRST + 4).collect();
    bounded(pool.finish(&ids)).await.unwrap();
    let run = ledger.add_episodes(FailureCounts::default());
    assert_eq!(
        run,
        RunCounts {
            total: 4,
            failed: 0,
            environment_failed: 0
        }
    );
    let err = bounded(pool.step(&actions(&["a"]))).await.unwrap_err();
    assert!(
        err.to_string().contains("episode 100 is not running"),
        "{err}"
    );
}

#[tokio::test]
async fn a_hang_times_out_and_costs_the_episodes_its_process_held() {
    let pool = bounded(EnvironmentPool::start(spec(2, "m:C")))
        .await
        .unwrap();
    let prompts = bounded(pool.start_episodes(FIRST, &plain(4)))
        .await
        .unwrap();
    let started = Instant::now();
    // Episodes 100 and 102 live in one process, 101 and 103 in the other.
    let outcomes = bounded(pool.step(&actions(&["a", "b", "hang", "d"])))
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(outcomes[0].is_ok() && outcomes[1].is_ok() && outcomes[3].is_ok());
    let timeout = outcomes[2].as_ref().unwrap_err();
    assert_eq!(
        (timeout.hook, timeout.reason),
        ("step", FailureReason::Timeout)
    );
    assert!(
        timeout.message.contains("timed out after 0.5 s"),
        "{timeout:?}"
    );
    // 100 stepped before the kill; its state is gone, so its next call fails.
    let next = bounded(pool.step(&actions(&["a", "b"]))).await.unwrap();
    let lost = next[0].as_ref().unwrap_err();
    assert_eq!(lost.reason, FailureReason::Restarted);
    assert!(
        lost.message
            .contains("episode 102's `step` failed in it (timeout"),
        "{lost:?}"
    );
    assert_eq!(next[1].as_ref().unwrap().observation, prompt(&prompts[1]));
    // The next episodes get a fresh process in the killed one's place.
    let fresh = bounded(pool.start_episodes(FIRST + 10, &plain(2)))
        .await
        .unwrap();
    assert_ne!(prompt(&fresh[0]), prompt(&prompts[0]));
    assert_eq!(prompt(&fresh[1]), prompt(&prompts[1]));
    let stepped = bounded(pool.step(&[(FIRST + 10, "a".to_owned())]))
        .await
        .unwrap();
    assert_eq!(stepped[0].as_ref().unwrap().observation, prompt(&fresh[0]));
}

#[tokio::test]
async fn raises_crashes_and_exits_fail_their_episodes_and_the_run_goes_on() {
    let pool = bounded(EnvironmentPool::start(spec(3, "m:C")))
        .await
        .unwrap();
    let records = [
        serde_json::json!({}),
        serde_json::json!({}),
        serde_json::json!({}),
        serde_json::json!({"do": "raise"}),
        serde_json::json!({}),
        serde_json::json!({}),
    ];
    let prompts = bounded(pool.start_episodes(FIRST, &starts(&records)))
        .await
        .unwrap();
    let reset = prompts[3].as_ref().unwrap_err();
    assert_eq!((reset.hook, reset.reason), ("reset", FailureReason::Raised));
    assert_eq!(reset.message, "ValueError: bad record");
    assert!(reset.traceback.as_deref().unwrap().starts_with("Traceback"));
    // Processes: 0 holds 100 (and the failed 103), 1 holds 101 and 104, 2 holds 102, 105.
    let turn = [
        (FIRST, "raise".to_owned()),
        (FIRST + 1, "segv".to_owned()),
        (FIRST + 2, "exit".to_owned()),
        (FIRST + 4, "b".to_owned()),
        (FIRST + 5, "done".to_owned()),
    ];
    let outcomes = bounded(pool.step(&turn)).await.unwrap();
    let reasons: Vec<_> = outcomes
        .iter()
        .map(|o| o.as_ref().err().map(|f| f.reason))
        .collect();
    assert_eq!(
        reasons,
        vec![
            Some(FailureReason::Raised),
            Some(FailureReason::Crashed),
            Some(FailureReason::Crashed),
            Some(FailureReason::Restarted),
            Some(FailureReason::Restarted),
        ]
    );
    let crashed = outcomes[1].as_ref().unwrap_err();
    assert!(crashed.message.contains("SIGSEGV"), "{crashed:?}");
    let exited = outcomes[2].as_ref().unwrap_err();
    assert!(
        exited.message.contains("exited with status 3"),
        "{exited:?}"
    );
    // A raise leaves its process serving: a new episode there plays on.
    let again = bounded(pool.start_episodes(FIRST + 20, &plain(1)))
        .await
        .unwrap();
    assert_eq!(prompt(&again[0]), prompt(&prompts[0]));
    let ids: Vec<u64> = (FIRST..FIRST + 6).collect();
    let spec_ledger = {
        bounded(pool.finish(&ids)).await.unwrap();
        pool.spec.ledger.add_episodes(FailureCounts::default())
    };
    assert_eq!(
        spec_ledger,
        RunCounts {
            total: 6,
            failed: 6,
            environment_failed: 6
        }
    );
}

#[tokio::test]
async fn failed_episodes_past_the_run_fraction_end_the_run_when_they_finish() {
    let mut spec = spec(1, "m:C");
    spec.config.max_failed_fraction = 0.3;
    let pool = bounded(EnvironmentPool::start(spec)).await.unwrap();
    let records = [
        serde_json::json!({"do": "raise"}),
        serde_json::json!({}),
        serde_json::json!({"do": "raise"}),
        serde_json::json!({}),
    ];
    bounded(pool.start_episodes(FIRST, &starts(&records)))
        .await
        .unwrap();
    let ids: Vec<u64> = (FIRST..FIRST + 4).collect();
    let text = bounded(pool.finish(&ids)).await.unwrap_err().to_string();
    assert!(
        text.starts_with("environments failed on 2 of 4 samples so far in the run (50.0%)"),
        "{text}"
    );
    assert!(text.contains("sandbox.max_failed_fraction = 0.3"), "{text}");
    assert!(text.contains("2 raised in the environment"), "{text}");
    assert!(text.contains("sample 2 (environment `reset`)"), "{text}");
}

#[tokio::test]
async fn an_environment_that_fails_to_load_fails_the_start_with_its_option() {
    let err = bounded(EnvironmentPool::start(spec(2, "loadfail:C")))
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
            assert_eq!(reward, None);
            assert_eq!(key, Some(vec!["low".to_owned()]));
            assert_eq!(message, "bad low");
        }
        other => panic!("expected LoadFailed, got {other}"),
    }
}
