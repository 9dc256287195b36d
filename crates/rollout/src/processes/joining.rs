//! What the role processes (`rollout trainer`, `rollout worker`) share: finding the
//! controller, receiving the run's config (`Welcome`), loading the policy, and answering.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rollout_core::config::{LoadedConfig, load_text};
use rollout_core::roles::RoleError;
use rollout_core::threads::THREADS_VARIABLE;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{Done, Hello, Loaded, Message, MessageKind, Welcome};
use rollout_net::rpc::{Incoming, Responder, RpcServer};
use rollout_net::{ClusterKey, NetError};
use rollout_python::hosts::PolicyHost;
use tracing::Instrument;

use super::ClusterError;

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
    pub loaded: LoadedConfig,
}

impl Welcomed {
    /// Answers the welcome: loaded and ready (with the policy's vocabulary size), or why not.
    pub fn answer(&self, loaded: Result<u64, &ClusterError>) {
        let answered = match loaded {
            Ok(vocabulary) => Ok(Loaded { vocabulary }),
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
        "{role} `{}` connected to the controller at {} ({}){}",
        args.name,
        args.connect,
        if link.encrypted() {
            "TLS 1.3"
        } else {
            "not encrypted"
        },
        placement_seen()
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
    match load_text(path, welcome.config_toml, &[]) {
        Ok(loaded) => Ok(Welcomed {
            server,
            call: incoming.call,
            loaded,
        }),
        Err(err) => {
            let _ = server.responder.fail(incoming.call, err.to_string());
            Err(err.into())
        }
    }
}

/// The devices (`CUDA_VISIBLE_DEVICES`, `LOCAL_RANK`) and torch threads (`OMP_NUM_THREADS`)
/// this process was given, for its log.
fn placement_seen() -> String {
    let mut seen = String::new();
    if let Ok(devices) = std::env::var("CUDA_VISIBLE_DEVICES") {
        let local_rank = std::env::var("LOCAL_RANK").unwrap_or_else(|_| "unset".into());
        seen.push_str(&format!(
            "; CUDA_VISIBLE_DEVICES={devices}, LOCAL_RANK={local_rank}"
        ));
    }
    if let Ok(threads) = std::env::var(THREADS_VARIABLE) {
        seen.push_str(&format!("; {THREADS_VARIABLE}={threads}"));
    }
    seen
}

/// Connects, waits for the controller's `Welcome` and loads the policy from its config.
pub(super) async fn join(
    role: &str,
    args: &RoleArgs,
    info: serde_json::Value,
) -> Result<(RpcServer, LoadedConfig, Arc<PolicyHost>), ClusterError> {
    let welcomed = welcome(role, args, info).await?;
    match load_policy(&welcomed.loaded, Loads::Learner).await {
        Ok(host) => {
            welcomed.answer(Ok(host.vocabulary()));
            Ok((welcomed.server, welcomed.loaded, Arc::new(host)))
        }
        Err(err) => {
            welcomed.answer(Err(&err));
            Err(err)
        }
    }
}

/// What a role loads the policy for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Loads {
    /// To generate: with the run's generation backend.
    Generator,
    /// To train only.
    Learner,
}

pub(super) async fn load_policy(
    loaded: &LoadedConfig,
    loads: Loads,
) -> Result<PolicyHost, ClusterError> {
    let worker = rollout_python::interpreter::start(&loaded.config.python).await?;
    let host = async {
        match loads {
            Loads::Generator => PolicyHost::load(worker, loaded).await,
            Loads::Learner => PolicyHost::load_learner(worker, loaded).await,
        }
    };
    Ok(host.instrument(tracing::info_span!("policy.load")).await?)
}

impl From<NetError> for ClusterError {
    fn from(err: NetError) -> Self {
        ClusterError::Net(err)
    }
}
