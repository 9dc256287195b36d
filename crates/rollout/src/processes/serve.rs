//! The role processes: `rollout trainer` (one data-parallel rank) and what it shares with
//! `rollout worker` ([`super::worker`]): connecting to the controller, receiving the run's
//! config, loading the policy and answering requests until the controller shuts it down.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{
    CheckpointRequest, Done, Hello, Message, MessageKind, PublishWeights, TrainRequest,
    ValuesRequest, WeightsReport, Welcome,
};
use rollout_net::rpc::{Incoming, Responder, RpcServer};
use rollout_net::{ClusterKey, NetError};
use tracing::Instrument;

use super::ClusterError;
use rollout_core::cluster::weights::{VersionBuffer, WeightStore};
use rollout_core::config::{LoadedConfig, load_text};
use rollout_core::roles::{Learner, RoleError, SaveWritten};
use rollout_python::hosts::PolicyHost;

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
pub(super) fn advertised(
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
pub(super) const WEIGHT_WAIT: Duration = Duration::from_secs(600);

pub(super) fn hello(role: &str, args: &RoleArgs, info: serde_json::Value) -> Hello {
    Hello {
        role: role.into(),
        name: args.name.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        credits: 64,
        info,
    }
}

pub(super) fn bad_request(incoming: &Incoming, err: impl std::fmt::Display) -> ClusterError {
    ClusterError::Protocol(format!("a bad {} request: {err}", incoming.frame.kind))
}

pub(super) fn answer<M: Message>(responder: &Responder, call: u64, result: Result<M, RoleError>) {
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

/// A connection to the controller that has received the run's config (`Welcome`) and has
/// yet to answer it.
pub(super) struct Welcomed {
    pub server: RpcServer,
    pub call: u64,
    pub config_toml: String,
    pub loaded: LoadedConfig,
}

impl Welcomed {
    /// Answers the welcome: loaded and ready, or why not.
    pub fn answer(&self, loaded: Result<(), &ClusterError>) {
        let answered = match loaded {
            Ok(()) => Ok(Done {}),
            Err(err) => Err(RoleError::Runtime(err.to_string())),
        };
        answer(&self.server.responder, self.call, answered);
    }
}

/// Connects (retrying while nothing listens) and waits for the controller's `Welcome`.
pub(super) async fn welcome(
    role: &str,
    args: &RoleArgs,
    info: serde_json::Value,
) -> Result<Welcomed, ClusterError> {
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
    if incoming.frame.kind == MessageKind::Shutdown {
        answer(&server.responder, incoming.call, Ok(Done {}));
        return Err(ClusterError::RunOver);
    }
    let welcome: Welcome = incoming
        .decode()
        .map_err(|err| bad_request(&incoming, err))?;
    let path = Path::new("<config from the controller>");
    match load_text(path, welcome.config_toml.clone(), &[]) {
        Ok(loaded) => Ok(Welcomed {
            server,
            call: incoming.call,
            config_toml: welcome.config_toml,
            loaded,
        }),
        Err(err) => {
            let _ = server.responder.fail(incoming.call, err.to_string());
            Err(err.into())
        }
    }
}

/// Connects, waits for the controller's `Welcome` and loads the policy from its config.
async fn join(
    role: &str,
    args: &RoleArgs,
    info: serde_json::Value,
) -> Result<(RpcServer, LoadedConfig, Arc<PolicyHost>), ClusterError> {
    let welcomed = welcome(role, args, info).await?;
    match load_policy(&welcomed.loaded).await {
        Ok(host) => {
            welcomed.answer(Ok(()));
            Ok((welcomed.server, welcomed.loaded, Arc::new(host)))
        }
        Err(err) => {
            welcomed.answer(Err(&err));
            Err(err)
        }
    }
}

pub(super) async fn load_policy(loaded: &LoadedConfig) -> Result<PolicyHost, ClusterError> {
    let worker = rollout_python::interpreter::start(&loaded.config.python).await?;
    Ok(PolicyHost::load(worker, loaded)
        .instrument(tracing::info_span!("policy.load"))
        .await?)
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
    let mut writes = HashMap::new();
    loop {
        let Some(incoming) = server.requests.recv().await else {
            return Err(ClusterError::ControllerLost(server.closed_reason()));
        };
        let call = incoming.call;
        let responder = &server.responder;
        match incoming.frame.kind {
            // Each request in a span of its own (`--trace`), decoding included.
            MessageKind::TrainRequest => {
                let span = tracing::info_span!("rpc.train");
                let request: TrainRequest = span
                    .in_scope(|| incoming.decode())
                    .map_err(|err| bad_request(&incoming, err))?;
                answer(responder, call, host.train(request).instrument(span).await);
            }
            MessageKind::ValuesRequest => {
                let span = tracing::info_span!("rpc.values");
                let request: ValuesRequest = span
                    .in_scope(|| incoming.decode())
                    .map_err(|err| bad_request(&incoming, err))?;
                answer(responder, call, host.values(request).instrument(span).await);
            }
            MessageKind::CheckpointRequest => {
                let request: CheckpointRequest = incoming
                    .decode()
                    .map_err(|err| bad_request(&incoming, err))?;
                let span =
                    tracing::info_span!("rpc.checkpoint", request = checkpoint_kind(&request));
                checkpoint(&host, &mut writes, request, responder, call)
                    .instrument(span)
                    .await;
            }
            MessageKind::PublishWeights => {
                let request: PublishWeights = incoming
                    .decode()
                    .map_err(|err| bad_request(&incoming, err))?;
                let published = publish(&host, &store, request, &weights_address, &args.name)
                    .instrument(tracing::info_span!("rpc.publish_weights"))
                    .await;
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

fn checkpoint_kind(request: &CheckpointRequest) -> &'static str {
    match request {
        CheckpointRequest::Save { .. } => "save",
        CheckpointRequest::SaveInBackground { .. } => "save_in_background",
        CheckpointRequest::Written { .. } => "written",
        CheckpointRequest::Restore { .. } => "restore",
    }
}

/// Serves a checkpoint request. A background save's writer is kept in `writes` until the
/// controller asks whether it finished; that answer waits on its own task, so training
/// requests are served meanwhile.
async fn checkpoint(
    host: &PolicyHost,
    writes: &mut HashMap<String, SaveWritten>,
    request: CheckpointRequest,
    responder: &Responder,
    call: u64,
) {
    let done = match request {
        CheckpointRequest::Save { directory } => host.save(directory.into()).await,
        CheckpointRequest::Restore {
            directory,
            weight_version,
        } => host.restore(directory.into(), weight_version).await,
        CheckpointRequest::SaveInBackground { directory } => {
            match host.save_in_background(directory.clone().into()).await {
                Ok(written) => {
                    writes.insert(directory, written);
                    Ok(())
                }
                Err(err) => Err(err),
            }
        }
        CheckpointRequest::Written { directory } => {
            let Some(written) = writes.remove(&directory) else {
                let _ = responder.fail(
                    call,
                    format!("no checkpoint is being written to {directory}"),
                );
                return;
            };
            let responder = responder.clone();
            let waiting = async move { answer(&responder, call, written.await.map(|()| Done {})) };
            tokio::spawn(waiting.in_current_span());
            return;
        }
    };
    answer(responder, call, done.map(|()| Done {}));
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
