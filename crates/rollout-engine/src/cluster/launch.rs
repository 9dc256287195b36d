//! `rollout launch`: the whole run on one machine, every role its own OS process.

use std::net::SocketAddr;
use std::process::ExitStatus;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::process::{Child, Command};

use super::{ClusterError, SECRET_ENV};
use crate::config::ClusterConfig;

/// The role processes `rollout launch` started; killed (by pid) if dropped while running.
pub struct Children {
    children: Vec<(String, Child)>,
}

/// A free TCP port on loopback for the trainers' torch.distributed rendezvous.
fn free_port() -> Result<u16, ClusterError> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").map_err(ClusterError::Io)?;
    Ok(socket.local_addr().map_err(ClusterError::Io)?.port())
}

/// Starts `cluster.workers` generation workers and `cluster.trainers` trainer ranks of this
/// same binary, connecting to `controller` with `secret`.
pub fn spawn_roles(
    cluster: &ClusterConfig,
    controller: SocketAddr,
    secret: &str,
    verbose: bool,
) -> Result<Children, ClusterError> {
    let exe = std::env::current_exe().map_err(ClusterError::Io)?;
    let master_port = std::env::var("MASTER_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .map_or_else(free_port, Ok)?;
    let mut roles: Vec<(String, Vec<String>)> = (0..cluster.workers)
        .map(|index| {
            let name = format!("worker-{index}");
            (name.clone(), vec!["worker".into(), "--name".into(), name])
        })
        .collect();
    for rank in 0..cluster.trainers {
        let name = format!("trainer-{rank}");
        roles.push((
            name.clone(),
            vec![
                "trainer".into(),
                "--name".into(),
                name,
                "--rank".into(),
                rank.to_string(),
                "--world-size".into(),
                cluster.trainers.to_string(),
            ],
        ));
    }
    let mut children = Vec::with_capacity(roles.len());
    for (name, mut args) in roles {
        let mut command = Command::new(&exe);
        if verbose {
            command.arg("--verbose");
        }
        if cluster.tls {
            args.push("--tls".into());
        }
        command
            .args(&args)
            .arg("--connect")
            .arg(controller.to_string())
            .env(SECRET_ENV, secret)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", master_port.to_string())
            // Their own process group: Ctrl-C reaches the controller alone, which finishes
            // the step, checkpoints and then shuts the roles down.
            .process_group(0)
            .kill_on_drop(true);
        let child = command.spawn().map_err(|err| {
            ClusterError::Protocol(format!("cannot start {name} ({}): {err}", exe.display()))
        })?;
        tracing::info!("started {name} (pid {})", child.id().unwrap_or(0));
        children.push((name, child));
    }
    Ok(Children { children })
}

impl Children {
    /// Resolves when a role process exits, with its name and status.
    pub async fn first_exit(&mut self) -> Option<(String, std::io::Result<ExitStatus>)> {
        let mut waits: FuturesUnordered<_> = self
            .children
            .iter_mut()
            .map(|(name, child)| async move { (name.clone(), child.wait().await) })
            .collect();
        waits.next().await
    }

    /// Waits for every role to exit after the controller shut it down; kills (by pid) what
    /// is still running after `grace`.
    pub async fn reap(mut self, grace: Duration) {
        for (name, child) in &mut self.children {
            match tokio::time::timeout(grace, child.wait()).await {
                Ok(Ok(status)) if status.success() => {}
                Ok(Ok(status)) => tracing::warn!("{name} exited with {status}"),
                Ok(Err(err)) => tracing::warn!("{name}: {err}"),
                Err(_) => {
                    tracing::warn!("{name} did not exit in {grace:?}; killing it");
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                }
            }
        }
    }
}
