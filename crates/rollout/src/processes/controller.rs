//! The controller of a distributed run: it accepts the role processes (authenticated before
//! anything they send is parsed), sends each the run's config, and drives the same training
//! loop as `rollout run` through remote roles.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use bytes::Bytes;
use rollout_core::cluster::ledger::Ledger;
use rollout_core::cluster::pool::{PoolSettings, RemoteWorkers};
use rollout_core::cluster::remote::RemoteTrainers;
use rollout_core::config::{ClusterConfig, LoadedConfig};
use rollout_core::roles::RoleError;
use rollout_core::telemetry::{Observed, RoleKind, Telemetry, WorkerHealth};
use rollout_core::train::{Controller, PolicyRoles, Roles, RunError, Start, Summary, Trainees};
use rollout_net::ClusterKey;
use rollout_net::gate::Gate;
use rollout_net::heard::HeardClock;
use rollout_net::link::{Link, LinkLimits};
use rollout_net::messages::{Hello, Loaded, Welcome};
use rollout_net::rpc::RpcClient;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use super::ClusterError;
use crate::session::open_services;

/// The connection settings of a run's cluster section.
pub fn link_limits(cluster: &ClusterConfig) -> Result<LinkLimits, ClusterError> {
    Ok(LinkLimits {
        heartbeat: Duration::from_secs_f64(cluster.heartbeat_seconds),
        peer_timeout: Duration::from_secs_f64(cluster.peer_timeout_seconds),
        encryption: rollout_net::Encryption::from_setting(cluster.tls)?,
        ..LinkLimits::default()
    })
}

fn controller_hello() -> Hello {
    Hello {
        role: "controller".into(),
        name: "controller".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        credits: 64,
        info: serde_json::Value::Null,
    }
}

/// Accepts connections until the [`Accepting`] is dropped, through a [`Gate`] that bounds
/// unauthenticated ones. Authenticated links are handed to `joined` while it is open.
fn accept_roles(
    listener: TcpListener,
    key: ClusterKey,
    limits: LinkLimits,
) -> (mpsc::Receiver<Link>, Accepting) {
    let (joined, links) = mpsc::channel(64);
    let serving = Gate::new(key, controller_hello(), limits, "").serve(listener, move |link| {
        let joined = joined.clone();
        async move {
            let who = link.describe();
            if joined.send(link).await.is_err() {
                tracing::warn!("{who} connected, but the run is over");
            }
        }
    });
    (links, Accepting(serving))
}

/// The controller's accept loop; dropped with the controller, it closes the listener, so
/// that `rollout launch` can listen on the same address for its next attempt.
struct Accepting(tokio::task::JoinHandle<()>);

impl Drop for Accepting {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The role processes of a run, connected and loaded.
pub struct Joined {
    pub workers: RemoteWorkers,
    pub trainers: RemoteTrainers,
    /// Where the trainer ranks' health is reported (the pool reports the workers').
    health: WorkerHealth,
    /// Each trainer rank's name and connection clock.
    trainer_clocks: Vec<(String, HeardClock)>,
    /// Late generation workers join through it while the run lasts.
    _accepting: Accepting,
}

impl Drop for Joined {
    /// The run is over (or abandoned after a lost trainer rank): its processes are down
    /// until a new attempt's join.
    fn drop(&mut self) {
        for (name, heard) in &self.trainer_clocks {
            self.health.left(RoleKind::Trainer, name, heard);
        }
        // Workers still connected (the run was abandoned) connect again, to the next
        // attempt's controller; after a shutdown this closes nothing.
        self.workers.disconnect("the controller stopped");
    }
}

/// Waits until `cluster.workers` workers and `cluster.trainers` trainer ranks have joined,
/// then sends each the run's config and waits until every one has loaded its policy.
/// Generation workers that connect later join the running pool. Joins and losses are
/// reported to `health`.
pub async fn gather(
    listener: TcpListener,
    key: ClusterKey,
    loaded: &LoadedConfig,
    health: WorkerHealth,
) -> Result<Joined, ClusterError> {
    let cluster = &loaded.config.cluster;
    let limit = Duration::from_secs_f64(cluster.join_timeout_seconds);
    let limits = link_limits(cluster)?;
    match limits.encryption {
        rollout_net::Encryption::Never => tracing::warn!("{}", limits.encryption.describe()),
        _ => tracing::info!("{}", limits.encryption.describe()),
    }
    let (mut links, accepting) = accept_roles(listener, key, limits);
    let deadline = tokio::time::Instant::now() + limit;
    let (workers, ranks) = await_roles(&mut links, cluster, deadline, limit).await?;
    let config_toml = toml::to_string(&loaded.config)
        .map_err(|err| ClusterError::Protocol(format!("cannot serialise the config: {err}")))?;
    let workers: Vec<RpcClient> = workers.into_iter().map(Link::client).collect();
    let trainers: Vec<RpcClient> = ranks.into_iter().flatten().map(Link::client).collect();
    let vocabulary = welcome_all(&workers, &trainers, &config_toml, deadline).await?;
    tracing::info!(
        "the policy takes {vocabulary} token ids; every worker's are checked against it"
    );
    let journal = loaded.config.run.output_dir.join("ledger.jsonl");
    let settings = PoolSettings {
        lease_timeout: Duration::from_secs_f64(cluster.lease_timeout_seconds),
        join_timeout: limit,
        max_attempts: cluster.max_attempts,
        health: health.clone(),
        vocabulary: Some(vocabulary),
        colocated: cluster.colocated(),
    };
    let workers = RemoteWorkers::new(workers, Ledger::new(Some(&journal)), settings);
    workers.admit_late_workers(links, config_toml);
    let trainer_clocks = trainers_joined(&health, &trainers);
    Ok(Joined {
        workers,
        trainers: RemoteTrainers::new(trainers, loaded.config.train.sharding),
        health,
        trainer_clocks,
        _accepting: accepting,
    })
}

/// Takes the links of `cluster.workers` generation workers and of every one of
/// `cluster.trainers` trainer ranks, refusing any other; fails at `deadline`, `limit` after
/// the wait began. Returns the workers, and the ranks by rank.
async fn await_roles(
    links: &mut mpsc::Receiver<Link>,
    cluster: &ClusterConfig,
    deadline: tokio::time::Instant,
    limit: Duration,
) -> Result<(Vec<Link>, Vec<Option<Link>>), ClusterError> {
    let mut workers: Vec<Link> = Vec::new();
    let mut ranks: Vec<Option<Link>> = (0..cluster.trainers).map(|_| None).collect();
    while workers.len() < cluster.workers as usize || ranks.iter().any(Option::is_none) {
        let link = tokio::time::timeout_at(deadline, links.recv())
            .await
            .map_err(|_| {
                ClusterError::Protocol(format!(
                    "after {limit:?}, {} of {} generation workers and {} of {} trainer ranks \
                     had joined (cluster.join_timeout_seconds)",
                    workers.len(),
                    cluster.workers,
                    ranks.iter().filter(|r| r.is_some()).count(),
                    cluster.trainers
                ))
            })?
            .ok_or_else(|| ClusterError::Protocol("the listener stopped".into()))?;
        match link.peer.role.as_str() {
            "worker" if workers.len() < cluster.workers as usize => workers.push(link),
            "trainer" => take_rank(&mut ranks, link, cluster.trainers),
            _ => tracing::warn!(
                "refused {}: the run needs no more of that role",
                link.describe()
            ),
        }
    }
    tracing::info!(
        "{} generation workers and {} trainer ranks joined; loading the policy in each",
        workers.len(),
        ranks.len()
    );
    Ok((workers, ranks))
}

/// Puts a trainer rank's link in its slot of `ranks`, unless its rank or world size does
/// not fit the run's `trainers` ranks or the rank has already joined.
fn take_rank(ranks: &mut [Option<Link>], link: Link, trainers: u32) {
    let rank = link.peer.info["rank"].as_u64().unwrap_or(u64::MAX);
    let world = link.peer.info["world_size"].as_u64().unwrap_or(0);
    match ranks.get_mut(rank as usize) {
        Some(slot) if slot.is_none() && world == u64::from(trainers) => {
            *slot = Some(link);
        }
        _ => tracing::warn!(
            "refused {}: rank {rank} of {world} does not fit {trainers} trainer ranks",
            link.describe()
        ),
    }
}

/// Sends every role the run's config, then waits until each has loaded its policy or
/// `deadline` passes. Returns the policy's vocabulary size as the trainer ranks loaded it
/// (they hold the model that trains; a worker's word on it is not taken).
async fn welcome_all(
    workers: &[RpcClient],
    trainers: &[RpcClient],
    config_toml: &str,
    deadline: tokio::time::Instant,
) -> Result<u64, ClusterError> {
    let mut welcomes = Vec::new();
    for (index, client) in workers.iter().chain(trainers).enumerate() {
        let welcome = Welcome {
            config_toml: config_toml.to_owned(),
            assignment: serde_json::json!({ "index": index }),
        };
        welcomes.push((
            client.describe().to_owned(),
            client.call(&welcome, Bytes::new())?,
        ));
    }
    let mut vocabularies = Vec::new();
    for (index, (who, call)) in welcomes.into_iter().enumerate() {
        let (loaded, _) = tokio::time::timeout_at(deadline, call.answer::<Loaded>())
            .await
            .map_err(|_| ClusterError::Protocol(format!("{who} did not load in time")))?
            .map_err(|err| ClusterError::Protocol(format!("{who} could not start: {err}")))?;
        if index >= workers.len() {
            vocabularies.push((who, loaded.vocabulary));
        }
    }
    trainers_vocabulary(&vocabularies)
}

/// The vocabulary every trainer rank reported: ranks that disagree did not load the same
/// model, and the run does not start.
fn trainers_vocabulary(reported: &[(String, u64)]) -> Result<u64, ClusterError> {
    let Some((_, first)) = reported.first() else {
        return Err(ClusterError::Protocol(
            "no trainer rank reported the policy's vocabulary".into(),
        ));
    };
    match reported.iter().find(|(_, size)| size != first) {
        Some((who, size)) => Err(ClusterError::Protocol(format!(
            "the trainer ranks loaded different models: {who} takes {size} token ids, rank 0 \
             takes {first}"
        ))),
        None => Ok(*first),
    }
}

/// Reports the trainer ranks as joined; returns their names and connection clocks.
fn trainers_joined(health: &WorkerHealth, trainers: &[RpcClient]) -> Vec<(String, HeardClock)> {
    let joined = trainers.iter().map(|client| {
        let (name, heard) = (client.peer().name.clone(), client.heard());
        health.joined(RoleKind::Trainer, &name, heard.clone());
        (name, heard)
    });
    joined.collect()
}

/// Runs the controller: the run's data, rewards, environment and callbacks here, generation
/// and training in the joined role processes. Step metrics and the roles' health go to
/// `telemetry` too, when there is one (`/metrics`).
pub async fn run(
    loaded: &LoadedConfig,
    listener: TcpListener,
    key: ClusterKey,
    start: Start,
    interrupted: Arc<AtomicBool>,
    telemetry: Option<&Telemetry>,
) -> Result<Summary, ClusterError> {
    let services = async {
        let worker = rollout_python::interpreter::start(&loaded.config.python).await?;
        Ok::<_, ClusterError>(open_services(worker, loaded).await?)
    };
    let health = telemetry.map(Telemetry::health).unwrap_or_default();
    let (joined, services) = tokio::join!(gather(listener, key, loaded, health), services);
    let joined = joined?;
    let (services, records) = match services {
        Ok(services) => services,
        Err(err) => {
            shutdown(&joined, "the controller could not load its plugins").await;
            return Err(err);
        }
    };
    let observer = Observed::new(&services, telemetry);
    let roles = Roles {
        trainees: Trainees::Policy(PolicyRoles {
            generator: &joined.workers,
            learner: &joined.trainers,
            tokenizer: &joined.workers,
            scorer: &services,
            environments: services.has_environment().then_some(&services as _),
        }),
        observer: &observer,
    };
    let mut controller = Controller::new(&loaded.config, roles, records, interrupted);
    let result = controller.run(start).await;
    controller.finish(result.as_ref().ok()).await;
    let reason = match &result {
        Ok(_) => "the run finished".to_string(),
        Err(err) => format!("the run stopped: {err}"),
    };
    match &result {
        // `rollout launch` goes on from the last checkpoint: the workers, disconnected when
        // `joined` drops, join its next controller.
        Err(err) if lost_a_role(err) => shutdown_trainers(&joined, &reason).await,
        _ => shutdown(&joined, &reason).await,
    }
    Ok(result?)
}

/// Whether `err` is a role lost or silent (the run can go on from its last checkpoint),
/// rather than a failure that would happen again (plugin error, bad config).
pub fn is_role_loss(err: &ClusterError) -> bool {
    match err {
        ClusterError::Role(err) => is_lost(err),
        ClusterError::Run(err) => lost_a_role(err),
        _ => false,
    }
}

fn lost_a_role(err: &RunError) -> bool {
    matches!(err, RunError::Role(err) if is_lost(err))
}

fn is_lost(err: &RoleError) -> bool {
    matches!(
        err,
        RoleError::WorkerLost { .. } | RoleError::TimedOut { .. }
    )
}

async fn shutdown(joined: &Joined, reason: &str) {
    let limit = Duration::from_secs(30);
    let _ = tokio::time::timeout(limit, async {
        tokio::join!(
            joined.workers.shutdown(reason),
            joined.trainers.shutdown(reason)
        )
    })
    .await;
}

async fn shutdown_trainers(joined: &Joined, reason: &str) {
    let limit = Duration::from_secs(30);
    let _ = tokio::time::timeout(limit, joined.trainers.shutdown(reason)).await;
}

/// Where `rollout launch` shows the roles the controller listens on.
pub fn describe_listener(listener: &TcpListener, config: &Path) -> String {
    match listener.local_addr() {
        Ok(addr) => format!("controller for {} listening on {addr}", config.display()),
        Err(_) => format!("controller for {}", config.display()),
    }
}
