use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use rollout_net::heard::HeardClock;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;
use crate::roles::Observer;

type Notify<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

fn step_line(step: u64) -> StepMetrics {
    let line = json!({
        "step": step,
        "reward_mean": 0.75,
        "reward_std": 0.25,
        "reward/exact_match": 0.5,
        "loss": -0.125,
        "completions": 8,
        "generated_tokens": 30,
        "reward_failed": 1,
        "tokens_per_second": 120.5,
        "samples_per_second": 32.0,
        "step_seconds": 0.25,
        "engine/kv_utilisation_mean": 0.46,
        "engine/kv_occupancy_mean": 0.11,
        "engine/kv_blocks": 360.0,
        "weight_version": step + 2,
        "generation_weight_version": step + 1,
        "staleness_max": 1,
        "staleness_mean": 0.5,
        "worker_completions/worker-0": 8.0,
        "samples_excluded_malformed": 4.0,
        "samples_excluded_nonfinite": 0.0,
        "updates_skipped_nonfinite": 1.0,
        "epoch": 0,
        "elapsed_seconds": 1.0,
    });
    StepMetrics::from_line(&line.to_string()).unwrap()
}

/// The value of the sample line `series` (name and labels exactly as exposed).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

fn run_started(total_steps: u64, start_step: u64) -> RunStarted {
    RunStarted {
        name: "t".into(),
        output_dir: PathBuf::from("out"),
        total_steps,
        start_step,
        config: Value::Null,
    }
}

#[test]
fn a_step_line_sets_the_series() {
    let telemetry = Telemetry::new();
    telemetry.run_started(&run_started(3, 0));
    telemetry.step_ended(&step_line(1));
    telemetry.step_ended(&step_line(2));
    telemetry.checkpoint_written(2);
    let text = telemetry.render().unwrap();
    let expect = [
        ("rollout_step", 2.0),
        ("rollout_run_steps", 3.0),
        ("rollout_steps_total", 2.0),
        ("rollout_checkpoint_step", 2.0),
        ("rollout_reward_mean", 0.75),
        ("rollout_reward_std", 0.25),
        ("rollout_reward_component{reward=\"exact_match\"}", 0.5),
        ("rollout_loss", -0.125),
        ("rollout_tokens_per_second", 120.5),
        ("rollout_samples_per_second", 32.0),
        ("rollout_step_seconds", 0.25),
        ("rollout_generated_tokens_total", 60.0),
        ("rollout_completions_total", 16.0),
        ("rollout_reward_failed_total", 2.0),
        ("rollout_kv_cache_utilisation", 0.46),
        ("rollout_kv_cache_occupancy", 0.11),
        ("rollout_kv_cache_blocks", 360.0),
        ("rollout_weight_version", 4.0),
        ("rollout_generation_weight_version", 3.0),
        ("rollout_staleness_max", 1.0),
        ("rollout_staleness_mean", 0.5),
        (
            "rollout_worker_completions_total{worker=\"worker-0\"}",
            16.0,
        ),
        ("rollout_samples_excluded_total{reason=\"malformed\"}", 8.0),
        ("rollout_updates_skipped_total{reason=\"nonfinite\"}", 2.0),
    ];
    for (series, expected) in expect {
        assert_eq!(value(&text, series), Some(expected), "{series} in\n{text}");
    }
    let zero = "rollout_samples_excluded_total{reason=\"nonfinite\"}";
    assert_eq!(value(&text, zero), None, "a zero count makes no series");
    assert!(value(&text, "rollout_last_step_timestamp_seconds").unwrap() > 1.0e9);
    assert!(text.contains("# TYPE rollout_step gauge"), "{text}");
    assert!(text.contains("# TYPE rollout_steps counter"), "{text}");
    assert!(text.contains("# HELP rollout_weight_version "), "{text}");
    assert!(text.trim_end().ends_with("# EOF"), "{text}");
}

#[test]
fn absent_metrics_leave_their_series_alone() {
    let telemetry = Telemetry::new();
    telemetry.step_ended(&step_line(1));
    telemetry.step_ended(&StepMetrics {
        step: 2,
        completions: Some(0),
        ..StepMetrics::default()
    });
    let text = telemetry.render().unwrap();
    assert_eq!(value(&text, "rollout_step"), Some(2.0));
    assert_eq!(value(&text, "rollout_reward_mean"), Some(0.75));
    assert_eq!(value(&text, "rollout_completions_total"), Some(8.0));
    assert_eq!(value(&text, "rollout_kv_cache_blocks"), Some(360.0));
}

#[test]
fn worker_health_reports_up_down_last_heard_and_restarts() {
    let telemetry = Telemetry::new();
    let health = telemetry.health();
    let clock = HeardClock::starting_now();
    let (w1_clock, t0_clock) = (HeardClock::starting_now(), HeardClock::starting_now());
    health.joined(RoleKind::Worker, "worker-0", clock.clone());
    health.joined(RoleKind::Worker, "worker-1", w1_clock.clone());
    health.joined(RoleKind::Trainer, "trainer-0", t0_clock.clone());
    health.restarted(RoleKind::Worker, "worker-0");
    // The restarted process joins before its old connection is found lost: it stays up.
    let rejoined = HeardClock::starting_now();
    health.joined(RoleKind::Worker, "worker-0", rejoined.clone());
    health.lost(RoleKind::Worker, "worker-0", &clock);
    health.lost(RoleKind::Worker, "worker-1", &w1_clock);
    let text = telemetry.render().unwrap();
    let w0 = "{role=\"worker\",worker=\"worker-0\"}";
    let w1 = "{role=\"worker\",worker=\"worker-1\"}";
    let t0 = "{role=\"trainer\",worker=\"trainer-0\"}";
    let at = |name: &str, labels: &str| value(&text, &format!("{name}{labels}"));
    assert_eq!(at("rollout_worker_up", w0), Some(1.0), "{text}");
    assert_eq!(at("rollout_worker_up", w1), Some(0.0));
    assert_eq!(at("rollout_worker_up", t0), Some(1.0));
    assert_eq!(at("rollout_worker_joins_total", w0), Some(2.0));
    assert_eq!(at("rollout_worker_losses_total", w0), Some(1.0));
    assert_eq!(at("rollout_worker_restarts_total", w0), Some(1.0));
    assert_eq!(at("rollout_worker_losses_total", w1), Some(1.0));
    let heard = at("rollout_worker_last_heard_seconds", w1).unwrap();
    assert!((0.0..5.0).contains(&heard), "{heard}");
    health.left(RoleKind::Trainer, "trainer-0", &t0_clock);
    health.left(RoleKind::Worker, "worker-0", &clock);
    let text = telemetry.render().unwrap();
    assert_eq!(value(&text, &format!("rollout_worker_up{t0}")), Some(0.0));
    assert_eq!(value(&text, &format!("rollout_worker_up{w0}")), Some(1.0));
    health.left(RoleKind::Worker, "worker-0", &rejoined);
    let text = telemetry.render().unwrap();
    assert_eq!(value(&text, &format!("rollout_worker_up{w0}")), Some(0.0));
}

#[test]
fn last_heard_is_the_age_of_the_clock() {
    let telemetry = Telemetry::new();
    let clock = HeardClock::starting_now();
    telemetry
        .health()
        .joined(RoleKind::Worker, "w", clock.clone());
    let later = clock.last() + Duration::from_secs(42);
    telemetry.inner.health.refresh(later);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &telemetry.inner.registry).unwrap();
    let series = "rollout_worker_last_heard_seconds{role=\"worker\",worker=\"w\"}";
    assert_eq!(value(&text, series), Some(42.0), "{text}");
    // A clock ahead of `now` (it moved after `now` was taken) reads as just heard.
    telemetry.inner.health.refresh(SystemTime::UNIX_EPOCH);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &telemetry.inner.registry).unwrap();
    assert_eq!(value(&text, series), Some(0.0), "{text}");
}

#[test]
fn a_default_health_handle_records_nothing() {
    let health = WorkerHealth::default();
    health.joined(RoleKind::Worker, "w", HeardClock::starting_now());
    health.lost(RoleKind::Worker, "w", &HeardClock::starting_now());
    health.refresh(SystemTime::now());
    assert!(format!("{health:?}").contains("false"));
}

#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl Observer for Recorder {
    fn run_started(&self, info: RunStarted) -> Notify<'_> {
        self.0
            .lock()
            .unwrap()
            .push(format!("start {}", info.start_step));
        Box::pin(async {})
    }
    fn step_ended(&self, metrics: StepMetrics) -> Notify<'_> {
        self.0
            .lock()
            .unwrap()
            .push(format!("step {}", metrics.step));
        Box::pin(async {})
    }
    fn checkpoint_written(&self, step: u64, _path: PathBuf) -> Notify<'_> {
        self.0.lock().unwrap().push(format!("checkpoint {step}"));
        Box::pin(async {})
    }
    fn run_ended(&self, _summary: Value) -> Notify<'_> {
        self.0.lock().unwrap().push("end".into());
        Box::pin(async {})
    }
}

#[tokio::test]
async fn the_observer_publishes_and_passes_every_event_on() {
    let telemetry = Telemetry::new();
    let recorder = Recorder::default();
    let observed = Observed::new(&recorder, Some(&telemetry));
    observed.run_started(run_started(5, 1)).await;
    observed.step_ended(step_line(2)).await;
    observed.checkpoint_written(2, PathBuf::from("c")).await;
    observed.run_ended(Value::Null).await;
    assert_eq!(
        *recorder.0.lock().unwrap(),
        ["start 1", "step 2", "checkpoint 2", "end"]
    );
    let text = telemetry.render().unwrap();
    assert_eq!(value(&text, "rollout_step"), Some(2.0));
    assert_eq!(value(&text, "rollout_start_step"), Some(1.0));
    // Without telemetry it only passes events on.
    Observed::new(&recorder, None)
        .step_ended(step_line(3))
        .await;
    assert_eq!(recorder.0.lock().unwrap().len(), 5);
}

/// Sends `request` as raw bytes and returns everything the server answers.
async fn exchange(address: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let read = stream.read_to_end(&mut answer);
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the server answers and closes")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn the_server_answers_metrics_404_and_survives_garbage() {
    let server = MetricsServer::start("127.0.0.1:0", Telemetry::new())
        .await
        .unwrap();
    server.telemetry().step_ended(&step_line(7));
    let address = server.address();
    assert!(address.ip().is_loopback() && address.port() != 0);

    let answer = exchange(
        address,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains(CONTENT_TYPE), "{answer}");
    assert!(answer.contains("\r\n\r\n# HELP "), "{answer}");
    assert!(answer.contains("\nrollout_step 7\n"), "{answer}");

    let answer = exchange(
        address,
        b"GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 404 Not Found\r\n"), "{answer}");
    let answer = exchange(
        address,
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 405 "), "{answer}");

    let garbage = exchange(address, b"\x00\xff not http at all\r\n\r\n").await;
    assert!(
        garbage.is_empty() || garbage.starts_with("HTTP/1.1 400"),
        "{garbage}"
    );
    let answer = exchange(
        address,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 200 OK\r\n"),
        "still serving: {answer}"
    );
}

#[tokio::test]
async fn a_bad_or_busy_address_is_an_error() {
    let err = MetricsServer::start("localhost:x", Telemetry::new()).await;
    assert!(matches!(err, Err(TelemetryError::Address { .. })));
    let first = MetricsServer::start("127.0.0.1:0", Telemetry::new())
        .await
        .unwrap();
    let taken = first.address().to_string();
    let err = MetricsServer::start(&taken, Telemetry::new()).await;
    match err {
        Err(err @ TelemetryError::Bind { .. }) => assert!(err.to_string().contains(&taken)),
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("bound {taken} twice"),
    }
    assert!(start(&MetricsConfig::default()).await.unwrap().is_none());
}

const SCRAPE: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

/// Waits (5 s at most) for the server to close `stream`, discarding what it sends.
async fn closed_by_the_server(stream: &mut TcpStream) -> bool {
    let mut sink = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut sink));
    read.await.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_close_the_oldest_and_a_scrape_is_answered() {
    let server = MetricsServer::start("127.0.0.1:0", Telemetry::new())
        .await
        .unwrap();
    let address = server.address();
    let extra = 8;
    // Connections that say nothing, or start a request they never finish.
    let mut held = Vec::new();
    for index in 0..server::MAX_CONNECTIONS + extra {
        let mut stream = TcpStream::connect(address).await.unwrap();
        if index % 2 == 1 {
            stream.write_all(b"GET /metr").await.unwrap();
        }
        held.push(stream);
        assert!(server.open_connections() <= server::MAX_CONNECTIONS);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while server.closed_connections() < extra as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "the oldest were not closed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(server.open_connections(), server::MAX_CONNECTIONS);
    // A scrape still gets its answer at once, closing one more of the held ones.
    let started = std::time::Instant::now();
    let answer = exchange(address, SCRAPE).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(server.closed_connections(), extra as u64 + 1);
    for stream in held.iter_mut().take(extra + 1) {
        assert!(closed_by_the_server(stream).await);
    }
    assert!(server.open_connections() <= server::MAX_CONNECTIONS);
}

#[tokio::test]
async fn a_connection_is_served_for_its_lifetime_at_most() {
    let limits = server::Limits {
        lifetime: Duration::from_millis(300),
        ..server::Limits::default()
    };
    let server = MetricsServer::start_with("127.0.0.1:0", Telemetry::new(), limits)
        .await
        .unwrap();
    let address = server.address();
    // Silent, and kept alive after an answer: both closed well before the header timeout.
    let mut silent = TcpStream::connect(address).await.unwrap();
    let mut kept = TcpStream::connect(address).await.unwrap();
    kept.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), kept.read_to_end(&mut answer));
    assert!(
        read.await.is_ok(),
        "a kept-alive connection outlived its lifetime"
    );
    assert!(answer.starts_with(b"HTTP/1.1 200 OK\r\n"));
    assert!(closed_by_the_server(&mut silent).await);
    assert_eq!(server.closed_connections(), 0);
}
