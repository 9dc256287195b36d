//! The role processes: `rollout worker` (generation and tokenizer) and `rollout trainer`
//! (one data-parallel rank). Each connects to the controller, receives the run's config,
//! loads the policy and answers requests until the controller shuts it down.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{
    CheckpointRequest, Done, GenerateRequest, Hello, Message, MessageKind, PublishWeights,
    SyncWeights, TokenizerRequest, TokenizerResponse, TrainRequest, WeightsReport, Welcome,
};
use rollout_net::rpc::{Incoming, Responder, RpcServer};
use rollout_net::{ClusterKey, NetError};
use tokio::sync::mpsc;

use super::ClusterError;
use super::weights::{VersionBuffer, WeightStore};
use crate::config::{LoadedConfig, load_text};
use crate::local::PolicyHost;
use crate::python::{PythonSetup, PythonWorker};
use crate::roles::{Generator, Learner, RoleError, Tokenizer};

/// How a role process finds the controller and itself.
#[derive(Debug, Clone)]
pub struct RoleArgs {
    pub connect: String,
    pub name: String,
    /// Where this process serves weights to other processes (loopback by default).
    pub listen: String,
    pub key: ClusterKey,
    pub rank: u32,
    pub world_size: u32,
    /// How long to keep retrying a controller that refuses connections (not yet started).
    pub connect_retry: Duration,
    /// Link settings, TLS included (`--tls`, which must match the controller's
    /// `[cluster] tls`).
    pub limits: LinkLimits,
}

/// The `host:port` other processes reach this process's weight server at: the listening
/// address, or, when it listens on every interface, the local address of the route to the
/// controller (found without sending anything).
fn advertised(
    listener: &tokio::net::TcpListener,
    controller: &str,
) -> Result<String, ClusterError> {
    let local = listener.local_addr().map_err(ClusterError::Io)?;
    if !local.ip().is_unspecified() {
        return Ok(local.to_string());
    }
    let route = std::net::UdpSocket::bind((local.ip(), 0))
        .and_then(|socket| {
            socket.connect(controller)?;
            socket.local_addr()
        })
        .map_err(ClusterError::Io)?;
    Ok(std::net::SocketAddr::new(route.ip(), local.port()).to_string())
}

/// How long a weight server waits for a version or bucket it was asked for.
const WEIGHT_WAIT: Duration = Duration::from_secs(600);

fn hello(role: &str, args: &RoleArgs, info: serde_json::Value) -> Hello {
    Hello {
        role: role.into(),
        name: args.name.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        credits: 64,
        info,
    }
}

fn bad_request(incoming: &Incoming, err: impl std::fmt::Display) -> ClusterError {
    ClusterError::Protocol(format!("a bad {} request: {err}", incoming.frame.kind))
}

fn answer<M: Message>(responder: &Responder, call: u64, result: Result<M, RoleError>) {
    let sent = match result {
        Ok(message) => responder.reply(call, &message, Bytes::new(), false),
        Err(err) => responder.fail(call, err.to_string()),
    };
    if let Err(err) = sent {
        tracing::debug!("could not answer call {call}: {err}");
    }
}

/// Connects to the controller, retrying while nothing listens there yet (roles are often
/// started before the controller, e.g. by Slurm or Kubernetes). A refused secret is final.
async fn connect_with_retry(args: &RoleArgs, hello: &Hello) -> Result<Link, ClusterError> {
    let deadline = tokio::time::Instant::now() + args.connect_retry;
    let mut pause = Duration::from_millis(100);
    loop {
        match Link::connect(&args.connect, &args.key, hello, &args.limits).await {
            Ok(link) => return Ok(link),
            Err(NetError::Connect { reason, .. }) if tokio::time::Instant::now() < deadline => {
                tracing::debug!(
                    "the controller at {} is not reachable yet: {reason}",
                    args.connect
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(err) => return Err(err.into()),
        }
    }
}

/// Connects, waits for the controller's `Welcome` and loads the policy from its config.
async fn join(
    role: &str,
    args: &RoleArgs,
    info: serde_json::Value,
) -> Result<(RpcServer, LoadedConfig, Arc<PolicyHost>), ClusterError> {
    let link = connect_with_retry(args, &hello(role, args, info)).await?;
    tracing::info!(
        "{role} `{}` connected to the controller at {}",
        args.name,
        args.connect
    );
    let mut server = link.server();
    let incoming = server
        .requests
        .recv()
        .await
        .ok_or_else(|| ClusterError::ControllerLost(server.closed_reason()))?;
    let welcome: Welcome = incoming
        .decode()
        .map_err(|err| bad_request(&incoming, err))?;
    let loaded = match load_text(
        Path::new("<config from the controller>"),
        welcome.config_toml,
        &[],
    ) {
        Ok(loaded) => loaded,
        Err(err) => {
            let _ = server.responder.fail(incoming.call, err.to_string());
            return Err(err.into());
        }
    };
    match load_policy(&loaded).await {
        Ok(host) => {
            answer(&server.responder, incoming.call, Ok(Done {}));
            Ok((server, loaded, Arc::new(host)))
        }
        Err(err) => {
            let _ = server.responder.fail(incoming.call, err.to_string());
            Err(err)
        }
    }
}

async fn load_policy(loaded: &LoadedConfig) -> Result<PolicyHost, ClusterError> {
    let python = &loaded.config.python;
    let setup = PythonSetup::discover(python.venv.as_deref(), &python.paths)?;
    let worker = tokio::task::spawn_blocking(move || PythonWorker::start(setup))
        .await
        .map_err(|err| {
            ClusterError::Protocol(format!("the Python start-up task failed: {err}"))
        })??;
    Ok(PolicyHost::load(Arc::new(worker), loaded).await?)
}

/// Work a generation worker does strictly in arrival order: generation, and swapping in
/// weight versions between generations.
enum Ordered {
    Generate(u64, GenerateRequest),
    Swap(
        u64,
        tokio::task::JoinHandle<Result<Arc<VersionBuffer>, ClusterError>>,
        WeightsReport,
    ),
}

/// `rollout worker`: serves generation and tokenization until shut down.
pub async fn run_worker(args: RoleArgs) -> Result<(), ClusterError> {
    let listener = rollout_net::link::listen(&args.listen).await?;
    let weights_address = advertised(&listener, &args.connect)?;
    let info = serde_json::json!({ "weights_address": weights_address });
    let (mut server, _loaded, host) = join("worker", &args, info.clone()).await?;
    let store = WeightStore::default();
    store.serve(
        listener,
        args.key.clone(),
        hello("worker", &args, info),
        args.limits.clone(),
        WEIGHT_WAIT,
    );
    let (ordered, mut queue) = mpsc::unbounded_channel::<Ordered>();
    let executor_host = host.clone();
    let responder = server.responder.clone();
    let name = args.name.clone();
    let executor = tokio::spawn(async move {
        while let Some(job) = queue.recv().await {
            match job {
                Ordered::Generate(call, request) => {
                    answer(&responder, call, executor_host.generate(request).await);
                }
                Ordered::Swap(call, pulled, report) => {
                    let swapped = swap_in(&executor_host, pulled, report, &name).await;
                    answer(&responder, call, swapped);
                }
            }
        }
    });
    let result = loop {
        let Some(incoming) = server.requests.recv().await else {
            break Err(ClusterError::ControllerLost(server.closed_reason()));
        };
        let call = incoming.call;
        match incoming.frame.kind {
            MessageKind::GenerateRequest => {
                let request = incoming
                    .decode()
                    .map_err(|err| bad_request(&incoming, err))?;
                let _ = ordered.send(Ordered::Generate(call, request));
            }
            MessageKind::SyncWeights => {
                let SyncWeights { weights } = incoming
                    .decode()
                    .map_err(|err| bad_request(&incoming, err))?;
                // The pull starts at once, while earlier generations still run.
                let (store, key, report) = (store.clone(), args.key.clone(), weights.clone());
                let source_hello = hello("worker", &args, serde_json::Value::Null);
                let limits = args.limits.clone();
                let pulled = tokio::spawn(async move {
                    let source = Link::connect(&report.source, &key, &source_hello, &limits)
                        .await?
                        .client();
                    Ok(store.pull(&source, &report).await?)
                });
                let _ = ordered.send(Ordered::Swap(call, pulled, weights));
            }
            MessageKind::TokenizerRequest => {
                let request: TokenizerRequest = incoming
                    .decode()
                    .map_err(|err| bad_request(&incoming, err))?;
                let (host, responder) = (host.clone(), server.responder.clone());
                tokio::spawn(async move {
                    answer(&responder, call, tokenize(&host, request).await);
                });
            }
            MessageKind::Shutdown => {
                answer(&server.responder, call, Ok(Done {}));
                break Ok(());
            }
            other => {
                let _ = server
                    .responder
                    .fail(call, format!("a generation worker does not serve {other}"));
            }
        }
    };
    drop(ordered);
    let _ = executor.await;
    result
}

async fn swap_in(
    host: &PolicyHost,
    pulled: tokio::task::JoinHandle<Result<Arc<VersionBuffer>, ClusterError>>,
    report: WeightsReport,
    name: &str,
) -> Result<WeightsReport, RoleError> {
    let started = std::time::Instant::now();
    let buffer = pulled
        .await
        .map_err(|err| RoleError::Runtime(format!("the weight pull failed: {err}")))?
        .map_err(|err| RoleError::Protocol(err.to_string()))?;
    let tensors = buffer
        .tensors()
        .map_err(|err| RoleError::Protocol(err.to_string()))?;
    host.import_weights(report.version, Arc::new(tensors))
        .await?;
    tracing::debug!(
        "serving weight version {} ({} bytes, {:.3} s after the request)",
        report.version,
        buffer.bytes(),
        started.elapsed().as_secs_f64()
    );
    Ok(WeightsReport {
        holder: name.to_owned(),
        bytes: buffer.bytes(),
        ..report
    })
}

async fn tokenize(
    host: &PolicyHost,
    request: TokenizerRequest,
) -> Result<TokenizerResponse, RoleError> {
    Ok(match request {
        TokenizerRequest::Encode {
            texts,
            continuation,
        } => TokenizerResponse::Ids {
            ids: host.encode(texts, continuation).await?,
        },
        TokenizerRequest::Decode { sequences } => TokenizerResponse::Texts {
            texts: host.decode(sequences).await?,
        },
        TokenizerRequest::EosTokenIds => TokenizerResponse::Ids {
            ids: vec![host.eos_token_ids().await?],
        },
    })
}

/// `rollout trainer`: one data-parallel rank, answering in order until shut down.
pub async fn run_trainer(args: RoleArgs) -> Result<(), ClusterError> {
    let listener = if args.rank == 0 {
        Some(rollout_net::link::listen(&args.listen).await?)
    } else {
        None
    };
    let weights_address = match &listener {
        Some(listener) => advertised(listener, &args.connect)?,
        None => String::new(),
    };
    let info = serde_json::json!({
        "rank": args.rank,
        "world_size": args.world_size,
        "weights_address": weights_address,
    });
    let (mut server, loaded, host) = join("trainer", &args, info.clone()).await?;
    let cluster = &loaded.config.cluster;
    if args.world_size > 1 {
        host.join_data_parallel(args.rank, args.world_size, cluster.clone())
            .await?;
        tracing::info!(
            "trainer rank {} of {} joined the process group",
            args.rank,
            args.world_size
        );
    }
    let store = WeightStore::default();
    if let Some(listener) = listener {
        store.serve(
            listener,
            args.key.clone(),
            hello("trainer", &args, info),
            args.limits.clone(),
            WEIGHT_WAIT,
        );
    }
    loop {
        let Some(incoming) = server.requests.recv().await else {
            return Err(ClusterError::ControllerLost(server.closed_reason()));
        };
        let call = incoming.call;
        let responder = &server.responder;
        match incoming.frame.kind {
            MessageKind::TrainRequest => {
                let request: TrainRequest = incoming
                    .decode()
                    .map_err(|err| bad_request(&incoming, err))?;
                answer(responder, call, host.train(request).await);
            }
            MessageKind::CheckpointRequest => {
                let request: CheckpointRequest = incoming
                    .decode()
                    .map_err(|err| bad_request(&incoming, err))?;
                let done = match request {
                    CheckpointRequest::Save { directory } => host.save(directory.into()).await,
                    CheckpointRequest::Restore {
                        directory,
                        weight_version,
                    } => host.restore(directory.into(), weight_version).await,
                };
                answer(responder, call, done.map(|()| Done {}));
            }
            MessageKind::PublishWeights => {
                let request: PublishWeights = incoming
                    .decode()
                    .map_err(|err| bad_request(&incoming, err))?;
                let published = publish(&host, &store, request, &weights_address, &args.name).await;
                answer(responder, call, published);
            }
            MessageKind::Shutdown => {
                answer(
                    responder,
                    call,
                    host.leave_data_parallel().await.map(|()| Done {}),
                );
                return Ok(());
            }
            other => {
                let _ = responder.fail(call, format!("a trainer does not serve {other}"));
            }
        }
    }
}

/// Snapshots the weights: rank 0 keeps the buckets to serve; every rank reports the
/// checksum so the controller can check that the ranks agree.
async fn publish(
    host: &PolicyHost,
    store: &WeightStore,
    request: PublishWeights,
    weights_address: &str,
    name: &str,
) -> Result<WeightsReport, RoleError> {
    let (version, tensors) = host.export_weights().await?;
    let buffer = VersionBuffer::from_tensors(version, &tensors, request.bucket_bytes)
        .map_err(|err| RoleError::Protocol(err.to_string()))?;
    let (bytes, checksum) = (buffer.bytes(), buffer.checksum());
    if !weights_address.is_empty() {
        store.publish(Arc::new(buffer));
    }
    Ok(WeightsReport {
        version,
        checksum,
        bytes,
        source: weights_address.to_owned(),
        holder: name.to_owned(),
    })
}

impl From<NetError> for ClusterError {
    fn from(err: NetError) -> Self {
        ClusterError::Net(err)
    }
}
