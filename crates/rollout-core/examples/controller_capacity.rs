//! Controller capacity with simulated generation workers (no model).
//!
//! Starts W simulated workers (the testkit's fake worker), each a real loopback TCP server
//! that accepts one authenticated [`Link`] and answers every `GenerateRequest` at once with
//! `n` fixed completions per prompt.
//! The controller side is the product's own [`RemoteWorkers`], driven as the training loop
//! drives it: a few requests in flight, each `P` prompts x group size `G`. Simulated work
//! costs nothing, so what is measured is the controller path: JSON encoding and decoding,
//! framing, authenticated TCP, dealing prompts out and reassembling groups.
//!
//! The simulated workers run on their own runtime (threads named `sim-worker`), so the CPU
//! time of the controller's threads can be told apart from theirs (Linux `/proc`); with
//! `--shared-runtime` they share the controller's threads and its CPU figures include theirs.
//!
//! ```text
//! cargo run --release --example controller_capacity -p rollout-core -- \
//!     [--seconds 3] [--warmup 0.5] [--workers 1,2,4,8,16,32,64] \
//!     [--shapes 64x8x4,64x8x4@50000,8x8x2,8x8x2@50000] [--completion-tokens 8] \
//!     [--prompt-tokens 16] [--controller-threads 2] [--sim-threads 1] [--shared-runtime]
//! ```
//!
//! A shape `PxGxK` is P prompts per request, group size G and K requests kept in flight back
//! to back (closed loop: the controller saturated, so latency includes queueing behind the
//! other K-1). `PxGxK@R` offers requests at R samples per second instead (open loop, at most
//! K in flight): the latency at a given load. Latency is from the `generate()` call to the
//! whole response reassembled. One JSON object goes to stdout, progress to stderr.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rollout_core::cluster::ledger::Ledger;
use rollout_core::cluster::pool::{PoolSettings, RemoteWorkers};
use rollout_core::roles::Generator;
use rollout_net::ClusterKey;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{
    Completion, FinishReason, GenerateRequest, GenerateResponse, PromptRequest, SamplingParams,
};
use rollout_net::rpc::RpcClient;
use rollout_testkit::fakes::worker::{Answer, Behaviour, hello, serve};
use serde_json::{Value, json};
use tokio::runtime::{Handle, Runtime};

/// The longest measured window allowed per configuration.
const MAX_SECONDS: f64 = 10.0;
/// Sequential calls made to one worker to measure its round trip alone (bounded in time too).
const RPC_PROBE_CALLS: usize = 300;
const RPC_PROBE_SECONDS: f64 = 0.5;

#[derive(Debug, Clone, Copy)]
struct Shape {
    prompts: usize,
    group: u32,
    /// Requests in flight (closed loop), or the most in flight when paced.
    in_flight: usize,
    /// Offered load in samples per second (open loop); `None`: back to back (closed loop).
    rate: Option<f64>,
}

#[derive(Debug, Clone)]
struct Settings {
    seconds: f64,
    warmup: f64,
    workers: Vec<usize>,
    shapes: Vec<Shape>,
    /// Tokens per simulated completion; each count is a separate set of configurations.
    completion_tokens: Vec<usize>,
    prompt_tokens: usize,
    controller_threads: usize,
    sim_threads: usize,
    shared_runtime: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            seconds: 3.0,
            warmup: 0.5,
            workers: vec![1, 2, 4, 8, 16, 32, 64],
            shapes: ["64x8x4", "64x8x4@50000", "8x8x2", "8x8x2@50000"]
                .into_iter()
                .map(parse_shape)
                .collect(),
            completion_tokens: vec![8],
            prompt_tokens: 16,
            controller_threads: 2,
            sim_threads: 1,
            shared_runtime: false,
        }
    }
}

fn parse_list<T: std::str::FromStr>(text: &str, what: &str) -> Vec<T> {
    text.split(',')
        .map(|item| {
            item.trim()
                .parse()
                .unwrap_or_else(|_| usage(&format!("bad {what} `{item}`")))
        })
        .collect()
}

fn parse_shape(text: &str) -> Shape {
    let (sizes, rate) = match text.split_once('@') {
        Some((sizes, rate)) => {
            let rate: f64 = rate
                .parse()
                .unwrap_or_else(|_| usage(&format!("bad rate in `{text}`")));
            if !(rate.is_finite() && rate > 0.0) {
                usage(&format!("the rate in `{text}` must be positive"));
            }
            (sizes, Some(rate))
        }
        None => (text, None),
    };
    let parts: Vec<usize> = sizes
        .split('x')
        .map(|n| {
            n.parse()
                .unwrap_or_else(|_| usage(&format!("bad shape `{text}`")))
        })
        .collect();
    match parts.as_slice() {
        [prompts, group, in_flight] if *prompts > 0 && *group > 0 && *in_flight > 0 => Shape {
            prompts: *prompts,
            group: u32::try_from(*group).unwrap_or_else(|_| usage("group size too large")),
            in_flight: *in_flight,
            rate,
        },
        _ => usage(&format!(
            "a shape is PROMPTSxGROUPxIN_FLIGHT[@SAMPLES_PER_SECOND], not `{text}`"
        )),
    }
}

fn usage(problem: &str) -> ! {
    eprintln!("controller_capacity: {problem}");
    eprintln!(
        "usage: controller_capacity [--seconds S] [--warmup S] [--workers 1,2,..] \
         [--shapes PxGxK[@RATE],..] [--completion-tokens N] [--prompt-tokens N] \
         [--controller-threads N] [--sim-threads N] [--shared-runtime]"
    );
    std::process::exit(2)
}

fn parse_args() -> Settings {
    let mut settings = Settings::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--shared-runtime" {
            settings.shared_runtime = true;
            continue;
        }
        let value = args
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        let number = |what: &str| -> usize {
            value
                .parse()
                .unwrap_or_else(|_| usage(&format!("bad {what} `{value}`")))
        };
        match flag.as_str() {
            "--seconds" => settings.seconds = parse_list::<f64>(&value, "seconds")[0],
            "--warmup" => settings.warmup = parse_list::<f64>(&value, "warmup")[0],
            "--workers" => settings.workers = parse_list(&value, "worker count"),
            "--shapes" => settings.shapes = value.split(',').map(parse_shape).collect(),
            "--completion-tokens" => {
                settings.completion_tokens = parse_list(&value, "token count");
            }
            "--prompt-tokens" => settings.prompt_tokens = number("token count"),
            "--controller-threads" => settings.controller_threads = number("thread count"),
            "--sim-threads" => settings.sim_threads = number("thread count"),
            other => usage(&format!("unknown flag {other}")),
        }
    }
    if !(settings.seconds > 0.0 && settings.seconds <= MAX_SECONDS) {
        usage(&format!("--seconds must be in (0, {MAX_SECONDS}]"));
    }
    if !(0.0..=MAX_SECONDS).contains(&settings.warmup) {
        usage("--warmup must be in [0, 10]");
    }
    if settings.workers.contains(&0) || settings.workers.is_empty() {
        usage("worker counts must be positive");
    }
    settings.controller_threads = settings.controller_threads.max(1);
    settings.sim_threads = settings.sim_threads.max(1);
    settings
}

/// A token id and a logprob that look like real ones (5-6 digit ids, 7-8 significant digits).
fn fake_token(i: usize) -> u32 {
    (1_000 + i.wrapping_mul(37_171) % 150_000) as u32
}

fn fake_logprob(i: usize) -> f32 {
    -0.012_345_67 - (i % 13) as f32 * 0.173_205_08
}

/// The completions a simulated worker answers each prompt with.
fn completion_template(tokens: usize) -> Completion {
    Completion {
        token_ids: (0..tokens).map(fake_token).collect(),
        logprobs: (0..tokens).map(fake_logprob).collect(),
        finish_reason: FinishReason::Stop,
        weight_version: 0,
    }
}

fn response_metrics() -> BTreeMap<String, f64> {
    [
        ("engine/steps", 8.0),
        ("engine/seconds", 0.001_234_5),
        ("engine/forward_seconds", 0.000_987_6),
        ("engine/kv_blocks", 42.0),
        ("engine/kv_utilisation_mean", 0.123_456),
        ("engine/overhead_fraction", 0.2),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect()
}

/// Answers every prompt at once with `n` copies of a `completion_tokens`-token completion.
fn answers(completion_tokens: usize) -> Answer {
    let template = completion_template(completion_tokens);
    Arc::new(move |request: &GenerateRequest| GenerateResponse {
        groups: request
            .prompts
            .iter()
            .map(|prompt| vec![template.clone(); prompt.n as usize])
            .collect(),
        metrics: response_metrics(),
        producers: Vec::new(),
    })
}

fn request_template(shape: Shape, prompt_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompts: (0..shape.prompts)
            .map(|p| PromptRequest {
                prompt_ids: (0..prompt_tokens)
                    .map(|t| fake_token(p * 131 + t))
                    .collect(),
                n: shape.group,
                max_new_tokens: Vec::new(),
                seed: Some(p as u64),
                group: None,
            })
            .collect(),
        sampling: SamplingParams {
            stop_token_ids: vec![2],
            ..SamplingParams::plain(8, 1234)
        },
    }
}

/// CPU nanoseconds per thread of this process: (thread name, nanoseconds) by thread id.
fn thread_cpu() -> HashMap<u32, (String, u64)> {
    let mut threads = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc/self/task") else {
        return threads;
    };
    for entry in entries.flatten() {
        let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let path = entry.path();
        let name = std::fs::read_to_string(path.join("comm"))
            .map(|n| n.trim().to_owned())
            .unwrap_or_default();
        let nanos = std::fs::read_to_string(path.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|n| n.parse().ok()));
        if let Some(nanos) = nanos {
            threads.insert(tid, (name, nanos));
        }
    }
    threads
}

/// CPU seconds spent between two snapshots by the controller's threads and the simulated
/// workers' threads.
fn cpu_split(
    before: &HashMap<u32, (String, u64)>,
    after: &HashMap<u32, (String, u64)>,
) -> (f64, f64) {
    let (mut controller, mut workers) = (0u64, 0u64);
    for (tid, (name, nanos)) in after {
        let spent = nanos.saturating_sub(before.get(tid).map_or(0, |(_, n)| *n));
        if name.starts_with("sim-worker") {
            workers += spent;
        } else {
            controller += spent;
        }
    }
    (controller as f64 * 1e-9, workers as f64 * 1e-9)
}

/// Nearest-rank percentile of sorted milliseconds.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

fn number(value: f64, digits: i32) -> Value {
    if value.is_finite() {
        json!(round(value, digits))
    } else {
        Value::Null
    }
}

struct Finished {
    started: Instant,
    finished: Instant,
    samples: usize,
}

/// Calls `generate` back to back until `stop_at`, checking every answer's shape.
async fn drive(
    workers: Arc<RemoteWorkers>,
    template: GenerateRequest,
    stop_at: Instant,
) -> Vec<Finished> {
    let mut done = Vec::new();
    while Instant::now() < stop_at {
        let request = template.clone();
        let started = Instant::now();
        let response = workers.generate(request).await.expect("generate");
        let finished = Instant::now();
        assert_eq!(response.groups.len(), template.prompts.len());
        let mut samples = 0;
        for (group, prompt) in response.groups.iter().zip(&template.prompts) {
            assert_eq!(group.len(), prompt.n as usize);
            samples += group.len();
        }
        done.push(Finished {
            started,
            finished,
            samples,
        });
    }
    done
}

/// Offers requests at `rate` samples per second until `stop_at`, at most `in_flight` at a
/// time (a request due while all are busy waits, and is then sent late).
async fn pace(
    workers: Arc<RemoteWorkers>,
    template: GenerateRequest,
    rate: f64,
    in_flight: usize,
    stop_at: Instant,
) -> Vec<Finished> {
    let per_request: f64 = template.prompts.iter().map(|p| f64::from(p.n)).sum();
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(per_request / rate));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let slots = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let mut calls = Vec::new();
    loop {
        ticks.tick().await;
        if Instant::now() >= stop_at {
            break;
        }
        let slot = slots.clone().acquire_owned().await.expect("open semaphore");
        let (workers, template) = (workers.clone(), template.clone());
        calls.push(tokio::spawn(async move {
            let expected = template.prompts.len();
            let started = Instant::now();
            let response = workers.generate(template).await.expect("generate");
            let finished = Instant::now();
            drop(slot);
            assert_eq!(response.groups.len(), expected);
            Finished {
                started,
                finished,
                samples: response.groups.iter().map(Vec::len).sum(),
            }
        }));
    }
    let mut done = Vec::with_capacity(calls.len());
    for call in calls {
        done.push(call.await.expect("a paced call"));
    }
    done
}

/// The 1-minute load average, to tell a busy machine's results apart.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Starts `count` simulated workers on `sim` and connects to each from the current runtime.
async fn start_workers(
    sim: &Handle,
    count: usize,
    key: &ClusterKey,
    completion_tokens: usize,
) -> Vec<RpcClient> {
    let mut clients = Vec::with_capacity(count);
    for index in 0..count {
        let listener = rollout_net::link::listen("127.0.0.1:0")
            .await
            .expect("listen on loopback");
        let addr = listener.local_addr().expect("local address").to_string();
        sim.spawn(serve(
            listener,
            key.clone(),
            format!("sim-{index}"),
            Behaviour::Healthy,
            answers(completion_tokens),
        ));
        let link = Link::connect(
            &addr,
            key,
            &hello("controller", "controller"),
            &LinkLimits::default(),
        )
        .await
        .expect("connect to a simulated worker");
        clients.push(link.client());
    }
    clients
}

/// Round trips of one worker alone, one call at a time, with a share of `prompts` prompts.
async fn probe_one_worker(client: &RpcClient, share: &GenerateRequest) -> Vec<f64> {
    let mut millis = Vec::with_capacity(RPC_PROBE_CALLS);
    let deadline = Instant::now() + Duration::from_secs_f64(RPC_PROBE_SECONDS);
    while millis.len() < RPC_PROBE_CALLS && Instant::now() < deadline {
        let started = Instant::now();
        let (response, _): (GenerateResponse, Bytes) = client
            .request(share, Bytes::new())
            .await
            .expect("a worker's answer");
        millis.push(started.elapsed().as_secs_f64() * 1e3);
        assert_eq!(response.groups.len(), share.prompts.len());
    }
    millis.sort_by(f64::total_cmp);
    millis
}

/// The measured window of one configuration: the requests that finished in it, the
/// latencies (ms, sorted) of those that also started in it, and the CPU each side spent.
struct Window {
    requests: usize,
    samples: usize,
    latencies_ms: Vec<f64>,
    seconds: f64,
    controller_cpu: f64,
    worker_cpu: f64,
    load: Option<f64>,
}

/// Loads `remote` with `template` as `shape` says through the warm-up and the window.
async fn load_window(
    remote: &Arc<RemoteWorkers>,
    template: &GenerateRequest,
    shape: Shape,
    settings: &Settings,
) -> Window {
    let begin = Instant::now();
    let warm_until = begin + Duration::from_secs_f64(settings.warmup);
    let stop_at = warm_until + Duration::from_secs_f64(settings.seconds);
    let drivers: Vec<_> = match shape.rate {
        None => (0..shape.in_flight)
            .map(|_| tokio::spawn(drive(remote.clone(), template.clone(), stop_at)))
            .collect(),
        Some(rate) => vec![tokio::spawn(pace(
            remote.clone(),
            template.clone(),
            rate,
            shape.in_flight,
            stop_at,
        ))],
    };
    tokio::time::sleep_until(warm_until.into()).await;
    let cpu_before = thread_cpu();
    let window_start = Instant::now();
    tokio::time::sleep_until(stop_at.into()).await;
    let cpu_after = thread_cpu();
    let seconds = window_start.elapsed().as_secs_f64();
    let load = load_average();
    let mut finished = Vec::new();
    for driver in drivers {
        finished.extend(driver.await.expect("a driver"));
    }
    let (controller_cpu, worker_cpu) = cpu_split(&cpu_before, &cpu_after);
    finished.retain(|f| f.finished >= window_start && f.finished <= stop_at);
    let mut latencies_ms: Vec<f64> = finished
        .iter()
        .filter(|f| f.started >= window_start)
        .map(|f| (f.finished - f.started).as_secs_f64() * 1e3)
        .collect();
    latencies_ms.sort_by(f64::total_cmp);
    Window {
        requests: finished.len(),
        samples: finished.iter().map(|f| f.samples).sum(),
        latencies_ms,
        seconds,
        controller_cpu,
        worker_cpu,
        load,
    }
}

/// One configuration: `workers` simulated workers loaded as `shape` says, and one of them
/// probed alone with its share of a request; the figures as JSON.
async fn measure(
    settings: &Settings,
    sim: &Handle,
    workers: usize,
    shape: Shape,
    completion_tokens: usize,
) -> Value {
    let key = ClusterKey::from_secret(ClusterKey::random_secret().as_bytes()).expect("a key");
    let clients = start_workers(sim, workers, &key, completion_tokens).await;
    let first = clients[0].clone();
    let remote = Arc::new(RemoteWorkers::new(
        clients,
        Ledger::new(None),
        PoolSettings::default(),
    ));
    let template = request_template(shape, settings.prompt_tokens);

    // Sizes of what travels: the request's JSON, and the answer's for all prompts.
    let request_bytes = serde_json::to_vec(&template).expect("json").len();
    let response_bytes = serde_json::to_vec(&answers(completion_tokens)(&template))
        .expect("json")
        .len();

    let window = load_window(&remote, &template, shape, settings).await;

    // One worker alone, with the share a worker receives in this configuration.
    let share_prompts = shape.prompts.div_ceil(workers);
    let mut share = template.clone();
    share.prompts.truncate(share_prompts);
    let rpc = probe_one_worker(&first, &share).await;
    drop(first);
    drop(remote);

    let samples_per_second = window.samples as f64 / window.seconds;
    let per_sample_us = if window.samples > 0 {
        window.controller_cpu / window.samples as f64 * 1e6
    } else {
        f64::NAN
    };
    let latencies = &window.latencies_ms;
    json!({
        "workers": workers,
        "prompts_per_request": shape.prompts,
        "group_size": shape.group,
        "in_flight": shape.in_flight,
        "completion_tokens": completion_tokens,
        "mode": if shape.rate.is_some() { "paced" } else { "back_to_back" },
        "offered_samples_per_second": shape.rate,
        "samples_per_second": number(samples_per_second, 1),
        "requests_per_second": number(window.requests as f64 / window.seconds, 1),
        "p50_ms": number(percentile(latencies, 0.50), 3),
        "p99_ms": number(percentile(latencies, 0.99), 3),
        "max_ms": number(latencies.last().copied().unwrap_or(f64::NAN), 3),
        "requests": window.requests,
        "samples": window.samples,
        "seconds": number(window.seconds, 3),
        "controller_cpu_seconds": number(window.controller_cpu, 3),
        "worker_cpu_seconds": number(window.worker_cpu, 3),
        "controller_cpu_us_per_sample": number(per_sample_us, 3),
        "controller_cpu_bound_samples_per_second": number(1e6 / per_sample_us, 1),
        "request_json_bytes": request_bytes,
        "response_json_bytes": response_bytes,
        "worker_share_prompts": share_prompts,
        "worker_rpc_calls": rpc.len(),
        "worker_rpc_p50_ms": number(percentile(&rpc, 0.50), 3),
        "worker_rpc_p99_ms": number(percentile(&rpc, 0.99), 3),
        "load_average_1m": window.load,
    })
}

fn runtime(name: &str, threads: usize) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// One configuration's figures, as one line on stderr.
fn log_configuration(workers: usize, shape: Shape, tokens: usize, result: &Value) {
    eprintln!(
        "  workers {workers:>2}  {}x{} {:<22} {tokens:>4} tokens {:>9} samples/s  p50 {} ms  \
         p99 {} ms  controller cpu {} us/sample  one-worker rpc p50 {} ms",
        shape.prompts,
        shape.group,
        match shape.rate {
            None => format!("({} in flight)", shape.in_flight),
            Some(rate) => format!("(paced {rate}/s, <={})", shape.in_flight),
        },
        result["samples_per_second"],
        result["p50_ms"],
        result["p99_ms"],
        result["controller_cpu_us_per_sample"],
        result["worker_rpc_p50_ms"],
    );
}

/// The settings every configuration ran under, for the JSON output.
fn settings_json(settings: &Settings, cores: usize) -> Value {
    json!({
        "seconds": settings.seconds,
        "warmup_seconds": settings.warmup,
        "completion_tokens": settings.completion_tokens,
        "prompt_tokens": settings.prompt_tokens,
        "controller_threads": settings.controller_threads,
        "sim_worker_threads": if settings.shared_runtime { Value::Null } else { json!(settings.sim_threads) },
        "shared_runtime": settings.shared_runtime,
        "cores": cores,
    })
}

fn main() {
    let settings = parse_args();
    let controller = runtime("controller", settings.controller_threads);
    let sim = if settings.shared_runtime {
        None
    } else {
        Some(runtime("sim-worker", settings.sim_threads))
    };
    let sim_handle = sim
        .as_ref()
        .map_or_else(|| controller.handle().clone(), |rt| rt.handle().clone());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    eprintln!(
        "controller capacity: {} s per configuration (+{} s warm-up), {} controller threads, {}, \
         {cores} cores",
        settings.seconds,
        settings.warmup,
        settings.controller_threads,
        if settings.shared_runtime {
            "simulated workers on the controller's runtime".to_owned()
        } else {
            format!("{} simulated-worker threads", settings.sim_threads)
        }
    );
    let mut configurations = Vec::new();
    let mut runs = Vec::new();
    for &tokens in &settings.completion_tokens {
        for &shape in &settings.shapes {
            for &workers in &settings.workers {
                runs.push((tokens, shape, workers));
            }
        }
    }
    for (tokens, shape, workers) in runs {
        let settings_for_run = settings.clone();
        let handle = sim_handle.clone();
        let result = controller.block_on(async move {
            tokio::spawn(async move {
                measure(&settings_for_run, &handle, workers, shape, tokens).await
            })
            .await
            .expect("a measurement")
        });
        log_configuration(workers, shape, tokens, &result);
        configurations.push(result);
    }
    let output = json!({
        "settings": settings_json(&settings, cores),
        "configurations": configurations,
    });
    println!("{output}");
    // Connections still closing are not waited for.
    if let Some(sim) = sim {
        sim.shutdown_background();
    }
    controller.shutdown_background();
}
