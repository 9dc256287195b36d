//! `rollout launch`: the controller in this process, the roles as child processes, and
//! restarts from the last checkpoint when a role is lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use std::path::Path;

use rollout_core::config;
use rollout_core::roles::RoleError;
use rollout_core::telemetry;
use rollout_core::train::{RunError, Start};

use crate::interrupt::watch_ctrl_c;
use rollout_net::ClusterKey;

use super::secret::{self, RoleSecret, SECRET_ENV};
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
    let mut start = start;
    let mut restarts = 0;
    loop {
        let roles = Launched {
            key: &key,
            devices: devices.as_ref(),
            secret: secret.as_ref().map(|secret| secret.file.as_path()),
            telemetry,
        };
        let attempt = launch_once(&loaded, start, roles, &interrupted);
        let failure = match attempt.await {
            Attempt::Finished(result) => {
                let summary = result?;
                println!("{}", format_summary(&summary));
                return Ok(());
            }
            Attempt::RoleLost(failure) => failure,
        };
        let limit = cluster_config.max_run_restarts;
        if restarts >= limit || interrupted.load(Ordering::SeqCst) {
            return Err(failure.context(format!(
                "the run was restarted {restarts} times already (cluster.max_run_restarts = {limit})"
            )));
        }
        restarts += 1;
        tracing::warn!(
            "{failure:#}; restarting every role from the last checkpoint ({restarts} of {limit})"
        );
        start = Start::Resume;
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

/// How one launch of a run's processes ended.
enum Attempt {
    Finished(anyhow::Result<rollout_core::train::Summary>),
    /// A trainer rank (or every generation worker) was lost: the run can restart from its
    /// last checkpoint.
    RoleLost(anyhow::Error),
}

/// Whether `err` is a role lost or silent (the run can restart from its last checkpoint),
/// rather than a failure that would happen again (plugin error, bad config).
fn is_role_loss(err: &ClusterError) -> bool {
    matches!(
        err,
        ClusterError::Role(RoleError::WorkerLost { .. } | RoleError::TimedOut { .. })
            | ClusterError::Run(RunError::Role(
                RoleError::WorkerLost { .. } | RoleError::TimedOut { .. }
            ))
    )
}

/// How `rollout launch` connects and watches the role processes of each attempt.
#[derive(Clone, Copy)]
struct Launched<'a> {
    key: &'a rollout_net::ClusterKey,
    /// The file the roles read the secret from; `None` when the roles are started elsewhere.
    secret: Option<&'a Path>,
    /// The devices of every role started here; `None`: they inherit this environment.
    devices: Option<&'a config::DeviceAssignment>,
    /// Where `/metrics` shows the roles' health, when it is served.
    telemetry: Option<&'a telemetry::Telemetry>,
}

/// Listens, starts the roles (unless `external_roles`) and runs the controller until the
/// run ends or a role it cannot do without is lost.
async fn launch_once(
    loaded: &config::LoadedConfig,
    start: Start,
    launched: Launched<'_>,
    interrupted: &Arc<AtomicBool>,
) -> Attempt {
    use super::children::{Exited, spawn_roles};
    let cluster_config = &loaded.config.cluster;
    let listener = match rollout_net::link::listen(&cluster_config.listen).await {
        Ok(listener) => listener,
        Err(err) => return Attempt::Finished(Err(err.into())),
    };
    tracing::info!(
        "{}",
        super::controller::describe_listener(&listener, &loaded.path)
    );
    let mut children = if let Some(secret) = launched.secret {
        let Ok(address) = listener.local_addr() else {
            return Attempt::Finished(Err(anyhow::anyhow!("the listener has no address")));
        };
        let debug = tracing::enabled!(tracing::Level::DEBUG);
        match spawn_roles(cluster_config, launched.devices, address, secret, debug) {
            Ok(children) => Some(children),
            Err(err) => return Attempt::Finished(Err(err.into())),
        }
    } else {
        None
    };
    let key = launched.key.clone();
    let telemetry = launched.telemetry;
    let run = super::controller::run(loaded, listener, key, start, interrupted.clone(), telemetry);
    let mut run = std::pin::pin!(run);
    // A trainer rank that exits before the controller shuts it down ends this attempt at
    // once (its connection would otherwise only be missed after the heartbeat timeout); a
    // generation worker that dies is started again and rejoins.
    let result = match children.as_mut() {
        None => run.await,
        Some(roles) => loop {
            tokio::select! {
                result = &mut run => break result,
                Some(exited) = roles.next_exit() => match exited {
                    Exited::Fatal(reason) => return Attempt::RoleLost(anyhow::anyhow!(reason)),
                    Exited::Restarted(name) => report_restart(telemetry, &name),
                    Exited::Left => {}
                },
            }
        },
    };
    if let Some(children) = children {
        children.reap(std::time::Duration::from_secs(30)).await;
    }
    match result {
        Err(err) if is_role_loss(&err) => Attempt::RoleLost(err.into()),
        result => Attempt::Finished(result.map_err(Into::into)),
    }
}

/// Counts a restart of the generation worker `name` in `/metrics`, when it is served.
fn report_restart(telemetry: Option<&telemetry::Telemetry>, name: &str) {
    if let Some(telemetry) = telemetry {
        telemetry
            .health()
            .restarted(telemetry::RoleKind::Worker, name);
    }
}
