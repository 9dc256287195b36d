//! Benchmark of the weight-sync transport (bench/distributed.py runs it): one trainer store
//! and N generation-worker stores in a relay chain over loopback TCP, against raw loopback
//! TCP measured in the same run, each sync once with its version filled beforehand, once
//! filled by the trainer's bucket copy while the workers pull it, and once served from the
//! tensors in place (no copy, hashed as sent). Prints one JSON object.
//!
//! Usage: weight_sync LAYOUT.json BUCKET_BYTES REPEATS WORKERS...
//! where LAYOUT.json is `[["name", [shape...]], ...]` (float32 tensors).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use rollout_core::cluster::buckets::PlannedVersion;
use rollout_core::cluster::in_place::ServedInPlace;
use rollout_core::cluster::weights::{VersionBuffer, WeightStore};
use rollout_net::ClusterKey;
use rollout_net::TensorBytes;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{Hello, WeightsReport};
use rollout_net::tensor::Dtype;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

fn hello(name: &str) -> Hello {
    Hello {
        role: "bench".into(),
        name: name.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        credits: 16,
        info: serde_json::Value::Null,
    }
}

fn tensors(layout: &[(String, Vec<u64>)]) -> Vec<TensorBytes> {
    layout
        .iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let len = shape.iter().product::<u64>() as usize * 4;
            TensorBytes {
                name: name.clone(),
                dtype: Dtype::F32,
                shape: shape.clone(),
                data: (0..len)
                    .map(|b| (b.wrapping_mul(31) ^ i) as u8)
                    .collect::<Vec<u8>>()
                    .into(),
            }
        })
        .collect()
}

/// Bytes per second of one raw loopback TCP stream moving `total` bytes in 16 MiB writes.
async fn raw_loopback(total: usize) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut buffer = vec![0u8; 1 << 20];
        let mut seen = 0;
        while seen < total {
            let n = stream.read(&mut buffer).await.unwrap();
            assert!(n > 0);
            seen += n;
        }
    });
    let chunk = vec![7u8; 16 << 20];
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut sent = 0;
    while sent < total {
        let n = chunk.len().min(total - sent);
        stream.write_all(&chunk[..n]).await.unwrap();
        sent += n;
    }
    reader.await.unwrap();
    total as f64 / started.elapsed().as_secs_f64()
}

/// The most a raw relay reads at once.
const RELAY_READ_BYTES: usize = 1 << 20;

/// Bytes per second delivered to the last of `hops` raw loopback TCP relays (source -> r1 ->
/// ... -> r_hops, each forwarding 1 MiB reads as they arrive): the same topology as the
/// weight chain without framing, checksums or buffering. The source writes `total` bytes
/// from one 16 MiB chunk and each relay reads into one reused 1 MiB buffer, so every byte
/// the kernel copies is in cache.
async fn raw_chain(total: usize, hops: usize) -> f64 {
    let chunk = Bytes::from(vec![7u8; 16 << 20]);
    let source = (0..total)
        .step_by(chunk.len())
        .map(|sent| chunk.slice(..chunk.len().min(total - sent)))
        .collect::<Vec<_>>();
    let scratch = (0..hops).map(|_| vec![0u8; RELAY_READ_BYTES]).collect();
    relay_chain(&source, scratch).await.0
}

/// [`raw_chain`] moving the model's own bytes, as a weight sync does: the source writes
/// each tensor's bytes and each relay keeps what it reads, in a model-sized buffer of its
/// own (`kept`: one per relay, reused from sync to sync as the workers' pools are), so the
/// kernel copies to and from memory that is not in cache. Returns the buffers for the next
/// run.
async fn raw_chain_kept(weights: &[TensorBytes], kept: Vec<Vec<u8>>) -> (f64, Vec<Vec<u8>>) {
    let source = weights.iter().map(|t| t.data.clone()).collect::<Vec<_>>();
    relay_chain(&source, kept).await
}

/// Sends `source` along a chain of one relay per buffer of `landing`. A relay reads at most
/// 1 MiB at a time, each read at the start of its buffer unless the buffer holds all the
/// bytes (then it keeps every one in place), and forwards each read as it arrives.
async fn relay_chain(source: &[Bytes], landing: Vec<Vec<u8>>) -> (f64, Vec<Vec<u8>>) {
    let total: usize = source.iter().map(Bytes::len).sum();
    let (listeners, addrs) = listen_all(landing.len()).await;
    let mut relays = Vec::new();
    for (index, (listener, mut buffer)) in listeners.into_iter().zip(landing).enumerate() {
        let next = addrs.get(index + 1).copied();
        relays.push(tokio::spawn(async move {
            let (mut upstream, mut downstream) = relay_ends(listener, next).await;
            let mut seen = 0;
            while seen < total {
                let at = if buffer.len() >= total { seen } else { 0 };
                let end = buffer.len().min(at + RELAY_READ_BYTES);
                let n = upstream.read(&mut buffer[at..end]).await.unwrap();
                assert!(n > 0);
                if let Some(downstream) = downstream.as_mut() {
                    downstream.write_all(&buffer[at..at + n]).await.unwrap();
                }
                seen += n;
            }
            buffer
        }));
    }
    send_along(addrs[0], source, relays).await
}

/// [`raw_chain_kept`] with each relay forwarding whole buckets of `bucket_bytes`, as a weight
/// store does, instead of each read as it arrives: a relay hands each bucket it has filled
/// to a task of its own that writes it on while the next one is read. `kept` holds one
/// model-sized buffer per relay, returned for the next run.
async fn raw_chain_bucketed(
    weights: &[TensorBytes],
    kept: Vec<BytesMut>,
    bucket_bytes: usize,
) -> (f64, Vec<BytesMut>) {
    let source = weights.iter().map(|t| t.data.clone()).collect::<Vec<_>>();
    let total: usize = source.iter().map(Bytes::len).sum();
    let (listeners, addrs) = listen_all(kept.len()).await;
    let mut relays = Vec::new();
    for (index, (listener, mut rest)) in listeners.into_iter().zip(kept).enumerate() {
        let next = addrs.get(index + 1).copied();
        relays.push(tokio::spawn(async move {
            let (mut upstream, downstream) = relay_ends(listener, next).await;
            let (buckets, filled) = tokio::sync::mpsc::unbounded_channel::<BytesMut>();
            let writer = tokio::spawn(forward_buckets(downstream, filled));
            rest.clear();
            let mut seen = 0;
            while seen < total {
                let wanted = RELAY_READ_BYTES.min(total - seen);
                let n = upstream
                    .read_buf(&mut (&mut rest).limit(wanted))
                    .await
                    .unwrap();
                assert!(n > 0);
                seen += n;
                if rest.len() >= bucket_bytes || seen == total {
                    let bucket = rest.split_to(rest.len());
                    buckets.send(bucket).unwrap();
                }
            }
            drop(buckets);
            writer.await.unwrap()
        }));
    }
    send_along(addrs[0], &source, relays).await
}

/// Writes each bucket from `filled` to `downstream` (if any, else keeps it) and returns them
/// joined again into the one buffer they were split from.
async fn forward_buckets(
    mut downstream: Option<TcpStream>,
    mut filled: tokio::sync::mpsc::UnboundedReceiver<BytesMut>,
) -> BytesMut {
    let mut whole = BytesMut::new();
    while let Some(bucket) = filled.recv().await {
        if let Some(downstream) = downstream.as_mut() {
            downstream.write_all(&bucket).await.unwrap();
        }
        whole.unsplit(bucket);
    }
    whole
}

async fn listen_all(count: usize) -> (Vec<TcpListener>, Vec<std::net::SocketAddr>) {
    let mut listeners = Vec::new();
    for _ in 0..count {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let addrs = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    (listeners, addrs)
}

/// A relay's connection from upstream and, unless it is the last, to the next relay.
async fn relay_ends(
    listener: TcpListener,
    next: Option<std::net::SocketAddr>,
) -> (TcpStream, Option<TcpStream>) {
    let (upstream, _) = listener.accept().await.unwrap();
    let downstream = match next {
        Some(addr) => Some(TcpStream::connect(addr).await.unwrap()),
        None => None,
    };
    (upstream, downstream)
}

/// Writes `source` to the chain's first relay at `first`; the bytes per second until every
/// one of `relays` has all of them, and what each relay returned.
async fn send_along<T>(
    first: std::net::SocketAddr,
    source: &[Bytes],
    relays: Vec<JoinHandle<T>>,
) -> (f64, Vec<T>) {
    let total: usize = source.iter().map(Bytes::len).sum();
    let started = Instant::now();
    let mut stream = TcpStream::connect(first).await.unwrap();
    for bytes in source {
        stream.write_all(bytes).await.unwrap();
    }
    let mut returned = Vec::new();
    for relay in relays {
        returned.push(relay.await.unwrap());
    }
    (total as f64 / started.elapsed().as_secs_f64(), returned)
}

async fn serve(store: &WeightStore, key: &ClusterKey, name: &str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    store.serve(
        listener,
        key.clone(),
        hello(name),
        LinkLimits::default(),
        Duration::from_secs(120),
    );
    addr
}

/// A generation worker's weight store, the address it serves on, and the limits its pulls
/// connect with: one receive-buffer pool for all its pulls, as in a worker process.
struct Worker {
    store: WeightStore,
    addr: String,
    limits: LinkLimits,
}

/// A trainer store and `count` worker stores, each serving on loopback.
struct Chain {
    trainer: WeightStore,
    trainer_addr: String,
    workers: Vec<Worker>,
}

impl Chain {
    async fn start(count: usize, key: &ClusterKey) -> Chain {
        let trainer = WeightStore::default();
        let trainer_addr = serve(&trainer, key, "trainer").await;
        let mut workers = Vec::new();
        for index in 0..count {
            let store = WeightStore::default();
            let addr = serve(&store, key, &format!("worker-{index}")).await;
            workers.push(Worker {
                store,
                addr,
                limits: LinkLimits::default(),
            });
        }
        Chain {
            trainer,
            trainer_addr,
            workers,
        }
    }
}

/// One sync of `version` along trainer -> worker 0 -> ... ; returns the seconds until every
/// worker has verified the whole version, and the CPU seconds the process spent meanwhile.
async fn sync(
    chain: &Chain,
    key: &ClusterKey,
    version: u64,
    weights: &[TensorBytes],
    bucket_bytes: u64,
) -> (f64, f64) {
    // The version before is retired first, as a trainer does before it exports the next one:
    // its allocations are not freed inside the timed sync.
    let Chain {
        trainer,
        trainer_addr,
        ..
    } = chain;
    drop(trainer.retire());
    let buffer = VersionBuffer::from_tensors(version, weights, bucket_bytes).unwrap();
    let report = WeightsReport {
        version,
        checksum: buffer.checksum(),
        bytes: buffer.bytes(),
        source: trainer_addr.clone(),
        holder: "trainer".into(),
    };
    let cpu_before = process_cpu_seconds();
    let started = Instant::now();
    trainer.publish(Arc::new(buffer));
    pull_along(chain, key, &report).await;
    (
        started.elapsed().as_secs_f64(),
        process_cpu_seconds() - cpu_before,
    )
}

/// Each tensor as a trainer lends it to be bucketed: name, dtype, shape and bytes in place.
fn views(weights: &[TensorBytes]) -> Vec<(&str, Dtype, &[u64], &[u8])> {
    weights
        .iter()
        .map(|t| (t.name.as_str(), t.dtype, t.shape.as_slice(), &t.data[..]))
        .collect()
}

/// The report of `version` with the checksum the pullers verify, computed before the clock
/// starts (a trainer seals the version with it once every bucket is hashed).
fn sealed_report(
    chain: &Chain,
    version: u64,
    weights: &[TensorBytes],
    bucket_bytes: u64,
) -> WeightsReport {
    let planned = PlannedVersion::plan(version, bucket_bytes, views(weights)).unwrap();
    WeightsReport {
        version,
        checksum: planned.checksum(),
        bytes: planned.bytes(),
        source: chain.trainer_addr.clone(),
        holder: "trainer".into(),
    }
}

/// One sync of `version` as a trainer serves it: announced before its buckets hold a byte,
/// then filled by a thread of its own (`PlannedVersion::fill`, the trainer's `weights.fill`:
/// each bucket copied and checksummed into the allocations of the version before) while the
/// workers already pull. Returns the seconds until every worker has verified the version.
async fn sync_while_filling(
    chain: &Chain,
    key: &ClusterKey,
    version: u64,
    weights: &[TensorBytes],
    bucket_bytes: u64,
) -> f64 {
    let report = sealed_report(chain, version, weights, bucket_bytes);
    let allocations = chain.trainer.retire();
    let owned = weights.to_vec();
    let started = Instant::now();
    let (announce, announced) = tokio::sync::oneshot::channel();
    let filler = std::thread::spawn(move || {
        let planned = PlannedVersion::plan(version, bucket_bytes, views(&owned)).unwrap();
        let buffer = Arc::new(planned.buffer());
        announce.send(buffer.clone()).unwrap();
        planned.fill(&buffer, allocations);
    });
    chain.trainer.publish(announced.await.unwrap());
    pull_along(chain, key, &report).await;
    let seconds = started.elapsed().as_secs_f64();
    filler.join().unwrap();
    seconds
}

/// One sync of `version` served from the tensors in place, as a trainer serves it: no copy,
/// each bucket hashed as it is sent; then settled (copied for later pullers, outside the
/// clock: a trainer does it before its next optimizer step). Returns the seconds until every
/// worker has verified the version.
async fn sync_in_place(
    chain: &Chain,
    key: &ClusterKey,
    version: u64,
    weights: &[TensorBytes],
    bucket_bytes: u64,
) -> f64 {
    let report = sealed_report(chain, version, weights, bucket_bytes);
    let allocations = chain.trainer.retire();
    let started = Instant::now();
    let lent = weights
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone(), t.data.clone()));
    let served = ServedInPlace::plan(version, bucket_bytes, lent, allocations).unwrap();
    chain.trainer.publish(served.buffer().clone());
    pull_along(chain, key, &report).await;
    let seconds = started.elapsed().as_secs_f64();
    assert_eq!(
        served.buffer().sealed(Duration::from_secs(10)).await,
        Some(report.checksum)
    );
    tokio::task::spawn_blocking(move || assert!(served.settle(Duration::from_secs(10))))
        .await
        .unwrap();
    seconds
}

/// Has every worker of `chain` pull `report`'s version along the chain and verify it.
async fn pull_along(chain: &Chain, key: &ClusterKey, report: &WeightsReport) {
    let Chain {
        trainer_addr,
        workers,
        ..
    } = chain;
    let mut pulls = Vec::new();
    let mut source = trainer_addr.clone();
    for (index, worker) in workers.iter().enumerate() {
        let (store, limits, key, report, from) = (
            worker.store.clone(),
            worker.limits.clone(),
            key.clone(),
            report.clone(),
            source.clone(),
        );
        pulls.push(tokio::spawn(async move {
            let link = Link::connect(&from, &key, &hello(&format!("worker-{index}")), &limits)
                .await
                .unwrap();
            let pulled = store.pull(&link.client(), &report).await.unwrap();
            assert_eq!(pulled.checksum(), report.checksum);
        }));
        source = worker.addr.clone();
    }
    for pull in pulls {
        pull.await.unwrap();
    }
}

/// CPU seconds the process's live threads have run so far (the scheduler's nanosecond
/// count of each, `/proc/self/task/*/schedstat`).
fn process_cpu_seconds() -> f64 {
    let mut nanoseconds = 0u64;
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        if let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) {
            nanoseconds += stat
                .split_whitespace()
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap();
        }
    }
    nanoseconds as f64 / 1e9
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// What the repeats at one worker count measured: the syncs and, between them, the three
/// baselines, so that all see the same machine.
#[derive(Default)]
struct Samples {
    raw_loopback: Vec<f64>,
    raw_chain: Vec<f64>,
    raw_chain_cpu_seconds: Vec<f64>,
    raw_chain_kept: Vec<f64>,
    raw_chain_bucketed: Vec<f64>,
    sync_seconds: Vec<f64>,
    sync_cpu_seconds: Vec<f64>,
    sync_while_filling_seconds: Vec<f64>,
    sync_in_place_seconds: Vec<f64>,
    trainer_egress_bytes: u64,
}

/// `repeats` rounds of the baselines and one sync each at `count` workers; `version` is the
/// last version synced before, and afterwards the last one synced here.
async fn measure(
    count: usize,
    weights: &[TensorBytes],
    key: &ClusterKey,
    bucket_bytes: u64,
    repeats: usize,
    version: &mut u64,
) -> Samples {
    let chain = Chain::start(count, key).await;
    let model_bytes: usize = weights.iter().map(|t| t.data.len()).sum();
    // Faulted in before the first run, as a worker's pool is after its first sync.
    let mut kept: Vec<Vec<u8>> = (0..count).map(|_| vec![1u8; model_bytes]).collect();
    let mut kept_in_buckets: Vec<BytesMut> = (0..count)
        .map(|_| BytesMut::from(&vec![1u8; model_bytes][..]))
        .collect();
    let mut samples = Samples::default();
    for _ in 0..repeats {
        samples.raw_loopback.push(raw_loopback(model_bytes).await);
        let cpu_before = process_cpu_seconds();
        samples.raw_chain.push(raw_chain(model_bytes, count).await);
        samples
            .raw_chain_cpu_seconds
            .push(process_cpu_seconds() - cpu_before);
        let (kept_rate, returned) = raw_chain_kept(weights, kept).await;
        samples.raw_chain_kept.push(kept_rate);
        kept = returned;
        let (bucketed_rate, returned) =
            raw_chain_bucketed(weights, kept_in_buckets, bucket_bytes as usize).await;
        samples.raw_chain_bucketed.push(bucketed_rate);
        kept_in_buckets = returned;
        *version += 1;
        let sent_before = chain.trainer.sent_bytes.load(Ordering::Relaxed);
        let (wall, cpu) = sync(&chain, key, *version, weights, bucket_bytes).await;
        samples.sync_seconds.push(wall);
        samples.sync_cpu_seconds.push(cpu);
        samples.trainer_egress_bytes +=
            chain.trainer.sent_bytes.load(Ordering::Relaxed) - sent_before;
        *version += 1;
        samples
            .sync_while_filling_seconds
            .push(sync_while_filling(&chain, key, *version, weights, bucket_bytes).await);
        *version += 1;
        samples
            .sync_in_place_seconds
            .push(sync_in_place(&chain, key, *version, weights, bucket_bytes).await);
    }
    samples
}

impl Samples {
    /// The JSON row of one worker count (medians over the repeats), logged on stderr too.
    fn row(mut self, count: usize, model_bytes: u64, bucket_bytes: u64) -> serde_json::Value {
        let repeats = self.sync_seconds.len() as u64;
        let cpu_median = median(&mut self.sync_cpu_seconds);
        let raw_chain_cpu_median = median(&mut self.raw_chain_cpu_seconds);
        let raw = median(&mut self.raw_loopback);
        let raw_chain = median(&mut self.raw_chain);
        let kept_chain = median(&mut self.raw_chain_kept);
        let bucketed_chain = median(&mut self.raw_chain_bucketed);
        let while_filling = median(&mut self.sync_while_filling_seconds);
        let in_place = median(&mut self.sync_in_place_seconds);
        let median = median(&mut self.sync_seconds);
        let delivered = model_bytes as f64 / median;
        eprintln!(
            "{count} workers: {median:.3} s per sync ({while_filling:.3} s filled while pulled, {in_place:.3} s in place), {:.2} GB/s to the last worker, {cpu_median:.3} CPU s; raw loopback {:.2} GB/s, raw relay chain {:.2} GB/s, {raw_chain_cpu_median:.3} CPU s, keeping the model's bytes {:.2} GB/s, relaying them in whole buckets {:.2} GB/s",
            delivered / 1e9,
            raw / 1e9,
            raw_chain / 1e9,
            kept_chain / 1e9,
            bucketed_chain / 1e9
        );
        serde_json::json!({
            "workers": count,
            "model_bytes": model_bytes,
            "bucket_bytes": bucket_bytes,
            "seconds": self.sync_seconds,
            "raw_loopback_samples": self.raw_loopback,
            "seconds_median": median,
            "bytes_per_second": delivered,
            "raw_loopback_bytes_per_second": raw,
            "fraction_of_loopback": delivered / raw,
            "raw_relay_chain_bytes_per_second": raw_chain,
            "fraction_of_raw_relay_chain": delivered / raw_chain,
            "while_filling_seconds": self.sync_while_filling_seconds,
            "while_filling_seconds_median": while_filling,
            "while_filling_fraction_of_raw_relay_chain": model_bytes as f64 / while_filling / raw_chain,
            "in_place_seconds": self.sync_in_place_seconds,
            "in_place_seconds_median": in_place,
            "in_place_fraction_of_raw_relay_chain": model_bytes as f64 / in_place / raw_chain,
            "raw_relay_chain_kept_bytes_per_second": kept_chain,
            "fraction_of_raw_relay_chain_kept": delivered / kept_chain,
            "raw_relay_chain_bucketed_bytes_per_second": bucketed_chain,
            "fraction_of_raw_relay_chain_bucketed": delivered / bucketed_chain,
            "trainer_egress_per_model_bytes": self.trainer_egress_bytes as f64 / (repeats * model_bytes) as f64,
            "cpu_seconds_median": cpu_median,
            "raw_relay_chain_cpu_seconds_median": raw_chain_cpu_median,
        })
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let layout: Vec<(String, Vec<u64>)> =
        serde_json::from_str(&std::fs::read_to_string(&args[1]).unwrap()).unwrap();
    let bucket_bytes: u64 = args[2].parse().unwrap();
    let repeats: usize = args[3].parse().unwrap();
    let counts: Vec<usize> = args[4..].iter().map(|a| a.parse().unwrap()).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let result = runtime.block_on(async {
        let weights = tensors(&layout);
        let model_bytes: u64 = weights.iter().map(|t| t.data.len() as u64).sum();
        let key = ClusterKey::from_secret(b"benchmark secret, long enough").unwrap();
        let mut rows = Vec::new();
        let mut version = 0;
        for &count in &counts {
            let samples = measure(count, &weights, &key, bucket_bytes, repeats, &mut version).await;
            rows.push(samples.row(count, model_bytes, bucket_bytes));
        }
        serde_json::json!({ "transport": rows })
    });
    println!("{result}");
}
