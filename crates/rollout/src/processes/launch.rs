//! `rollout launch`: the controller in this process, the roles as child processes, and
//! the trainer ranks started again from the last checkpoint when one is lost (with one
//! fewer while `cluster.min_trainers` allows, the replacement joining at the next
//! checkpoint), the generation workers kept.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use std::path::Path;

use rollout_core::config;
use rollout_core::telemetry;
use rollout_core::train::{CheckpointStore, Start};
use tokio::net::TcpListener;

use crate::interrupt::watch_ctrl_c;
use rollout_net::ClusterKey;

use super::children::{Children, Exited};
use super::secret::{self, RoleSecret, SECRET_ENV};
use super::threads::ThreadShares;
use crate::processes::ClusterError;
use crate::session::format_summary;

/// `rollout launch`: the controller in this process and, unless `external_roles`, every
/// role as a child process of this one.
pub(crate) async fn launch(
    loaded: config::LoadedConfig,
    start: Start,
    external_roles: bool,
) -> anyhow::Result<()> {
    let cluster_config = &loaded.config.cluster;
    let (key, secret) = run_secret(cluster_config.secret_file.as_deref(), external_roles)?;
    // Roles started elsewhere are placed by whatever starts them (deploy/).
    let devices = if external_roles {
        None
    } else {
        config::assign_devices(&loaded, &config::VisibleDevices::detect())?
    };
    let interrupted = watch_ctrl_c();
    // One server for every attempt: the series go on across restarts of the roles.
    let metrics = telemetry::start(&loaded.config.metrics).await?;
    let telemetry = metrics.as_ref().map(telemetry::MetricsServer::telemetry);
    let listener = rollout_net::link::listen(&cluster_config.listen).await?;
    let address = listener.local_addr()?;
    let children = match &secret {
        Some(secret) => {
            let verbose = tracing::enabled!(tracing::Level::DEBUG);
            let started = Children::start(
                cluster_config,
                devices.as_ref(),
                ThreadShares::for_local_roles(&loaded.config),
                address,
                &secret.file,
                verbose,
            )?;
            Some(started)
        }
        None => None,
    };
    let runs = Attempts {
        loaded: &loaded,
        key,
        telemetry,
        interrupted,
        children,
        ranks: TrainerRanks::new(cluster_config),
        checkpoints: CheckpointStore::new(
            loaded.config.run.output_dir.join("checkpoints"),
            loaded.config.checkpoint.keep,
        ),
        restarts: 0,
    };
    runs.run(listener, start).await
}

/// The attempts of one `rollout launch`: each a controller and a set of trainer ranks, over
/// the same generation workers.
struct Attempts<'a> {
    loaded: &'a config::LoadedConfig,
    key: ClusterKey,
    telemetry: Option<&'a telemetry::Telemetry>,
    interrupted: Arc<AtomicBool>,
    /// `None`: the roles are started elsewhere.
    children: Option<Children>,
    ranks: TrainerRanks,
    checkpoints: CheckpointStore,
    restarts: u32,
}

impl Attempts<'_> {
    /// Runs attempts until the run finishes or cannot go on. Every attempt listens on the
    /// first one's address: workers that keep running while the trainer ranks start again
    /// connect to it again.
    async fn run(mut self, listener: TcpListener, mut start: Start) -> anyhow::Result<()> {
        let address = listener.local_addr()?;
        let mut listener = Some(listener);
        loop {
            let listener = match listener.take() {
                Some(listener) => listener,
                None => listen_again(address).await?,
            };
            let mut attempt_config = self.loaded.clone();
            attempt_config.config.cluster.trainers = self.ranks.count();
            let attempt = Attempt {
                loaded: &attempt_config,
                start,
                key: &self.key,
                telemetry: self.telemetry,
                interrupted: &self.interrupted,
                // After ranks were left out, the replacements join at the next checkpoint.
                rejoin_after: self
                    .ranks
                    .is_short()
                    .then(|| (&self.checkpoints, self.checkpoints.latest_step())),
            };
            match attempt.run(listener, self.children.as_mut()).await {
                Outcome::Finished(result) => {
                    self.reap().await;
                    let summary = result?;
                    println!("{}", format_summary(&summary));
                    return Ok(());
                }
                Outcome::CheckpointForRejoin(step) => {
                    self.ranks.rejoin();
                    tracing::warn!(
                        "checkpoint of step {step} committed: the trainer ranks start again, \
                         {} of them, from it",
                        self.ranks.count()
                    );
                }
                Outcome::RoleLost { failure, slot } => self.after_loss(failure, slot).await?,
            }
            if let Some(children) = self.children.as_mut() {
                children.restart_trainers(self.ranks.slots()).await?;
            }
            start = Start::Resume;
        }
    }

    /// Decides how many trainer ranks go on after a loss, or stops the run when it was
    /// restarted `max_run_restarts` times already or Ctrl-C was pressed.
    async fn after_loss(
        &mut self,
        failure: anyhow::Error,
        slot: Option<usize>,
    ) -> anyhow::Result<()> {
        let limit = self.loaded.config.cluster.max_run_restarts;
        let restarts = self.restarts;
        if restarts >= limit || self.interrupted.load(Ordering::SeqCst) {
            self.reap().await;
            return Err(failure.context(format!(
                "the run was restarted {restarts} times already (cluster.max_run_restarts = {limit})"
            )));
        }
        self.restarts += 1;
        let left_out = self.ranks.after_loss(slot);
        tracing::warn!(
            "{failure:#}; {} from the last checkpoint on {} trainer ranks, the generation \
             workers kept ({} of {limit})",
            if left_out { "going on" } else { "restarting" },
            self.ranks.count(),
            self.restarts
        );
        Ok(())
    }

    async fn reap(&mut self) {
        if let Some(children) = self.children.take() {
            children.reap(std::time::Duration::from_secs(30)).await;
        }
    }
}

/// Listens on `address` again once the last attempt's listener, closed with its
/// controller, has let go of it.
async fn listen_again(address: std::net::SocketAddr) -> Result<TcpListener, rollout_net::NetError> {
    let mut tries = 0;
    loop {
        match rollout_net::link::listen(&address.to_string()).await {
            Err(_) if tries < 50 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            result => return result,
        }
    }
}

/// Which trainer ranks `rollout launch` runs, by slot (their index in `[cluster.devices]
/// trainers`), as ranks are lost and their replacements join.
#[derive(Debug)]
struct TrainerRanks {
    slots: Vec<usize>,
    configured: usize,
    /// `cluster.min_trainers`: `None` never leaves a rank out.
    fewest: Option<usize>,
}

impl TrainerRanks {
    fn new(cluster: &config::ClusterConfig) -> Self {
        TrainerRanks {
            slots: (0..cluster.trainers as usize).collect(),
            configured: cluster.trainers as usize,
            fewest: cluster.min_trainers.map(|fewest| fewest as usize),
        }
    }

    fn slots(&self) -> &[usize] {
        &self.slots
    }

    fn count(&self) -> u32 {
        u32::try_from(self.slots.len()).unwrap_or(u32::MAX)
    }

    /// Fewer ranks than configured run.
    fn is_short(&self) -> bool {
        self.slots.len() < self.configured
    }

    /// After the rank in `lost` (`None`: unknown) was lost: leaves it out while more than
    /// `min_trainers` ranks would remain and returns true; otherwise every configured rank
    /// starts again.
    fn after_loss(&mut self, lost: Option<usize>) -> bool {
        let remaining = self.slots.len().saturating_sub(1);
        match (lost, self.fewest) {
            (Some(lost), Some(fewest)) if remaining >= fewest && self.slots.contains(&lost) => {
                self.slots.retain(|slot| *slot != lost);
                true
            }
            _ => {
                self.rejoin();
                false
            }
        }
    }

    /// Every configured rank again.
    fn rejoin(&mut self) {
        self.slots = (0..self.configured).collect();
    }
}

/// The run's key and, unless the roles are started elsewhere, the file they read it from:
/// `[cluster] secret_file`, else a private copy of `ROLLOUT_CLUSTER_SECRET` or of a random
/// secret.
fn run_secret(
    configured: Option<&Path>,
    external_roles: bool,
) -> Result<(ClusterKey, Option<RoleSecret>), ClusterError> {
    if let Some(path) = configured {
        let key = ClusterKey::from_secret(&secret::read_file(path)?)?;
        return Ok((
            key,
            (!external_roles).then(|| RoleSecret::configured(path.to_owned())),
        ));
    }
    let text = match secret::from_environment() {
        Some(text) => text.to_owned(),
        None if !external_roles => ClusterKey::random_secret(),
        None => {
            return Err(ClusterError::Secret(format!(
                "roles started elsewhere must prove a shared secret: set [cluster] secret_file \
                 or {SECRET_ENV}"
            )));
        }
    };
    let key = ClusterKey::from_secret(text.as_bytes())?;
    let file = if external_roles {
        None
    } else {
        Some(RoleSecret::private(&text)?)
    };
    Ok((key, file))
}

/// How one attempt (one controller, one set of trainer ranks) ended.
enum Outcome {
    Finished(anyhow::Result<rollout_core::train::Summary>),
    /// A trainer rank (in `slot`, when known), or every generation worker, was lost: the
    /// run can go on from its last checkpoint.
    RoleLost {
        failure: anyhow::Error,
        slot: Option<usize>,
    },
    /// The checkpoint of this step committed while ranks were left out: their
    /// replacements can join from it.
    CheckpointForRejoin(u64),
}

/// One attempt: the controller, run until the run ends or a role it cannot do without is
/// lost, over the role processes `rollout launch` started (if it did).
struct Attempt<'a> {
    loaded: &'a config::LoadedConfig,
    start: Start,
    key: &'a ClusterKey,
    /// Where `/metrics` shows the roles' health, when it is served.
    telemetry: Option<&'a telemetry::Telemetry>,
    interrupted: &'a Arc<AtomicBool>,
    /// Ranks are left out: the attempt ends once a checkpoint newer than this step commits.
    rejoin_after: Option<(&'a CheckpointStore, Option<u64>)>,
}

impl Attempt<'_> {
    async fn run(self, listener: TcpListener, children: Option<&mut Children>) -> Outcome {
        tracing::info!(
            "{}",
            super::controller::describe_listener(&listener, &self.loaded.path)
        );
        let run = super::controller::run(
            self.loaded,
            listener,
            self.key.clone(),
            self.start,
            self.interrupted.clone(),
            self.telemetry,
        );
        let mut run = std::pin::pin!(run);
        let mut poll = tokio::time::interval(REJOIN_POLL);
        // A trainer rank that exits before the controller shuts it down ends this attempt at
        // once (its connection would otherwise only be missed after the heartbeat timeout); a
        // generation worker that dies is started again and rejoins.
        let result = match children {
            None => run.await,
            Some(roles) => loop {
                tokio::select! {
                    result = &mut run => break result,
                    Some(exited) = roles.next_exit() => match exited {
                        Exited::TrainerLost { slot, reason } => {
                            let failure = anyhow::anyhow!(reason);
                            return Outcome::RoleLost { failure, slot: Some(slot) };
                        }
                        Exited::Fatal(reason) => {
                            return Outcome::Finished(Err(anyhow::anyhow!(reason)));
                        }
                        Exited::Restarted(name) => report_restart(self.telemetry, &name),
                        Exited::Left => {}
                    },
                    _ = poll.tick(), if self.rejoin_after.is_some() => {
                        if let Some(step) = self.newer_checkpoint() {
                            return Outcome::CheckpointForRejoin(step);
                        }
                    }
                }
            },
        };
        match result {
            Err(err) if super::controller::is_role_loss(&err) => Outcome::RoleLost {
                failure: err.into(),
                slot: None,
            },
            result => Outcome::Finished(result.map_err(Into::into)),
        }
    }

    fn newer_checkpoint(&self) -> Option<u64> {
        let (store, resumed) = self.rejoin_after?;
        store.latest_step().filter(|step| Some(*step) > resumed)
    }
}

/// How often a run with ranks left out looks for the checkpoint their replacements join at.
const REJOIN_POLL: std::time::Duration = std::time::Duration::from_millis(200);

/// Counts a restart of the generation worker `name` in `/metrics`, when it is served.
fn report_restart(telemetry: Option<&telemetry::Telemetry>, name: &str) {
    if let Some(telemetry) = telemetry {
        telemetry
            .health()
            .restarted(telemetry::RoleKind::Worker, name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(trainers: u32, min_trainers: Option<u32>) -> TrainerRanks {
        TrainerRanks::new(&config::ClusterConfig {
            trainers,
            min_trainers,
            ..config::ClusterConfig::default()
        })
    }

    #[test]
    fn a_lost_rank_is_left_out_down_to_min_trainers_then_all_start_again() {
        let mut ranks = ranks(4, Some(2));
        assert!(ranks.after_loss(Some(1)));
        assert_eq!(ranks.slots(), [0, 2, 3]);
        assert!(ranks.is_short());
        assert!(ranks.after_loss(Some(3)));
        assert_eq!(ranks.slots(), [0, 2]);
        // Two ranks is the floor: the next loss starts every configured rank again.
        assert!(!ranks.after_loss(Some(0)));
        assert_eq!(ranks.slots(), [0, 1, 2, 3]);
        assert!(!ranks.is_short());
    }

    #[test]
    fn without_min_trainers_or_a_known_rank_every_rank_starts_again() {
        let mut unset = ranks(2, None);
        assert!(!unset.after_loss(Some(1)));
        assert_eq!(unset.slots(), [0, 1]);
        let mut unknown = ranks(2, Some(1));
        assert!(!unknown.after_loss(None));
        assert_eq!(unknown.count(), 2);
    }

    #[test]
    fn replacements_rejoin_in_their_own_slots() {
        let mut ranks = ranks(3, Some(1));
        ranks.after_loss(Some(0));
        assert_eq!(ranks.slots(), [1, 2]);
        assert_eq!(ranks.count(), 2);
        ranks.rejoin();
        assert_eq!(ranks.slots(), [0, 1, 2]);
    }
}
