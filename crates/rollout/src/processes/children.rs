//! `rollout launch`: the whole run on one machine, every role its own OS process.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::ExitStatus;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use rollout_core::config::{ClusterConfig, DeviceAssignment, ProcessDevices};
use tokio::process::{Child, Command};

use super::ClusterError;

/// One role process `rollout launch` started, and how to start it again.
struct Role {
    name: String,
    command: std::process::Command,
    child: Option<Child>,
    restarts: u32,
}

/// The role processes `rollout launch` started; killed (by pid) if dropped while running.
/// Generation workers that die are started again (up to `cluster.max_worker_restarts`
/// times each): they rejoin the running pool.
pub struct Children {
    roles: Vec<Role>,
    max_restarts: u32,
}

/// What `rollout launch` does about a role process that exited.
pub enum Exited {
    /// The generation worker of this name died and was started again.
    Restarted(String),
    /// A generation worker left on its own (drained) or ran out of restarts; the run goes
    /// on with the others.
    Left,
    /// A trainer rank exited: the run cannot go on.
    Fatal(String),
}

/// A free TCP port on loopback for the trainers' torch.distributed rendezvous.
fn free_port() -> Result<u16, ClusterError> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").map_err(ClusterError::Io)?;
    Ok(socket.local_addr().map_err(ClusterError::Io)?.port())
}

/// Starts `cluster.workers` generation workers and `cluster.trainers` trainer ranks of this
/// same binary, connecting to `controller` with the secret in `secret_file`, each on the
/// devices `devices` gives it (`None`: each inherits this process's environment).
pub fn spawn_roles(
    cluster: &ClusterConfig,
    devices: Option<&DeviceAssignment>,
    controller: SocketAddr,
    secret_file: &std::path::Path,
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
    let placed: Vec<Option<&ProcessDevices>> = match devices {
        Some(devices) => devices
            .workers
            .iter()
            .chain(&devices.trainers)
            .map(Some)
            .collect(),
        None => vec![None; roles.len()],
    };
    let mut started = Vec::with_capacity(roles.len());
    for ((name, mut args), placed) in roles.into_iter().zip(placed) {
        let mut command = std::process::Command::new(&exe);
        if verbose {
            command.arg("--verbose");
        }
        match cluster.tls {
            Some(true) => args.push("--tls".into()),
            Some(false) => args.push("--no-tls".into()),
            None => {}
        }
        command
            .args(&args)
            .arg("--connect")
            .arg(controller.to_string())
            // A worker whose connection breaks connects again; if the launcher itself is
            // gone, it gives up soon.
            .args(["--connect-retry", "10"])
            .arg("--secret-file")
            .arg(secret_file)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", master_port.to_string())
            // Their own process group: Ctrl-C reaches the controller alone, which finishes
            // the step, checkpoints and then shuts the roles down.
            .process_group(0);
        if let Some(placed) = placed {
            tracing::info!("{name} gets CUDA devices {}", placed.devices.join(","));
            command.envs(placed.environment());
        }
        let mut role = Role {
            name,
            command,
            child: None,
            restarts: 0,
        };
        role.start()?;
        started.push(role);
    }
    Ok(Children {
        roles: started,
        max_restarts: cluster.max_worker_restarts,
    })
}

impl Role {
    fn start(&mut self) -> Result<(), ClusterError> {
        let mut command = Command::from(clone_command(&self.command));
        // Each start writes a trace of its own, merged into the launcher's at its exit.
        if let Some(trace) = crate::trace::child_path(&self.name) {
            command.arg("--trace").arg(trace);
        }
        command.kill_on_drop(true);
        let child = command.spawn().map_err(|err| {
            ClusterError::Protocol(format!(
                "cannot start {} ({}): {err}",
                self.name,
                self.command.get_program().to_string_lossy()
            ))
        })?;
        tracing::info!("started {} (pid {})", self.name, child.id().unwrap_or(0));
        self.child = Some(child);
        Ok(())
    }

    fn is_worker(&self) -> bool {
        self.name.starts_with("worker-")
    }
}

/// A copy of `command` (std's `Command` is not `Clone`).
fn clone_command(command: &std::process::Command) -> std::process::Command {
    let mut copy = std::process::Command::new(command.get_program());
    copy.args(command.get_args());
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => copy.env(key, value),
            None => copy.env_remove(key),
        };
    }
    copy.process_group(0);
    copy
}

impl Children {
    /// Resolves when a role process exits, with its index and status.
    async fn first_exit(&mut self) -> Option<(usize, std::io::Result<ExitStatus>)> {
        let mut waits: FuturesUnordered<_> = self
            .roles
            .iter_mut()
            .enumerate()
            .filter_map(|(index, role)| role.child.as_mut().map(|child| (index, child)))
            .map(|(index, child)| async move { (index, child.wait().await) })
            .collect();
        waits.next().await
    }

    /// Waits for the next role process to exit and deals with it.
    pub async fn next_exit(&mut self) -> Option<Exited> {
        let (index, status) = self.first_exit().await?;
        let max_restarts = self.max_restarts;
        let role = &mut self.roles[index];
        role.child = None;
        let status = match status {
            Ok(status) => status,
            Err(err) => return Some(Exited::Fatal(format!("{}: {err}", role.name))),
        };
        if !role.is_worker() {
            return Some(Exited::Fatal(format!(
                "{} exited with {status}; the run cannot go on",
                role.name
            )));
        }
        if status.success() {
            tracing::info!("{} left the run", role.name);
            return Some(Exited::Left);
        }
        if role.restarts >= max_restarts {
            tracing::warn!(
                "{} exited with {status} and was restarted {} times already                  (cluster.max_worker_restarts); the run goes on without it",
                role.name,
                role.restarts
            );
            return Some(Exited::Left);
        }
        role.restarts += 1;
        tracing::warn!("{} exited with {status}; starting it again", role.name);
        Some(match role.start() {
            Ok(()) => Exited::Restarted(role.name.clone()),
            Err(err) => Exited::Fatal(err.to_string()),
        })
    }

    /// Waits for every role to exit after the controller shut it down; kills (by pid) what
    /// is still running after `grace`.
    pub async fn reap(mut self, grace: Duration) {
        for role in &mut self.roles {
            let Some(child) = role.child.as_mut() else {
                continue;
            };
            let name = &role.name;
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
