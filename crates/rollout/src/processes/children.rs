//! `rollout launch`: the whole run on one machine, every role its own OS process.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::ExitStatus;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use rollout_core::config::{ClusterConfig, DeviceAssignment, ProcessDevices};
use rollout_core::threads::THREADS_VARIABLE;
use tokio::process::{Child, Command};

use super::ClusterError;
use super::threads::ThreadShares;

/// One role process `rollout launch` started, and how to start it again.
struct Role {
    name: String,
    command: std::process::Command,
    child: Option<Child>,
    restarts: u32,
    /// A trainer rank: its index in `[cluster.devices] trainers` (its slot), which it keeps
    /// whatever rank it is given after others are lost.
    trainer_slot: Option<usize>,
}

/// The role processes `rollout launch` started; killed (by pid) if dropped while running.
/// Generation workers that die are started again (up to `cluster.max_worker_restarts`
/// times each): they rejoin the running pool. The trainer ranks are started again, as a
/// group of any size, when one is lost; the workers keep running.
pub struct Children {
    roles: Vec<Role>,
    max_restarts: u32,
    commands: RoleCommands,
}

/// What `rollout launch` does about a role process that exited.
pub enum Exited {
    /// The generation worker of this name died and was started again.
    Restarted(String),
    /// A generation worker left on its own (drained) or ran out of restarts (the run goes on
    /// with the others), or a trainer rank the controller shut down.
    Left,
    /// The trainer rank in this slot exited: the ranks cannot go on as they are.
    TrainerLost { slot: usize, reason: String },
    /// A role process could not be started again: the run cannot go on.
    Fatal(String),
}

/// A free TCP port on loopback for the trainers' torch.distributed rendezvous.
fn free_port() -> Result<u16, ClusterError> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0").map_err(ClusterError::Io)?;
    Ok(socket.local_addr().map_err(ClusterError::Io)?.port())
}

/// How `rollout launch` starts role processes of this same binary.
struct RoleCommands {
    exe: std::path::PathBuf,
    controller: SocketAddr,
    secret_file: std::path::PathBuf,
    verbose: bool,
    tls: Option<bool>,
    /// Each process's devices; `None`: each inherits this process's environment.
    devices: Option<DeviceAssignment>,
    /// Each process's torch threads; `None`: each inherits this process's environment.
    threads: Option<ThreadShares>,
}

impl RoleCommands {
    /// The command of the role `name`, with `args`, on the devices `placed` gives it, with
    /// `torch_threads` threads.
    fn command(
        &self,
        name: &str,
        args: &[String],
        placed: Option<&ProcessDevices>,
        torch_threads: Option<usize>,
    ) -> std::process::Command {
        let mut command = std::process::Command::new(&self.exe);
        if self.verbose {
            command.arg("--verbose");
        }
        command.args(args);
        match self.tls {
            Some(true) => command.arg("--tls"),
            Some(false) => command.arg("--no-tls"),
            None => &mut command,
        };
        command
            .arg("--connect")
            .arg(self.controller.to_string())
            // A worker whose connection breaks connects again; if the launcher itself is
            // gone, it gives up soon.
            .args(["--connect-retry", "10"])
            .arg("--secret-file")
            .arg(&self.secret_file)
            // Their own process group: Ctrl-C reaches the controller alone, which finishes
            // the step, checkpoints and then shuts the roles down.
            .process_group(0);
        if let Some(placed) = placed {
            tracing::info!("{name} gets CUDA devices {}", placed.devices.join(","));
            command.envs(placed.environment());
        }
        if let Some(threads) = torch_threads {
            command.env(THREADS_VARIABLE, threads.to_string());
        }
        command
    }
}

impl Children {
    /// Starts `cluster.workers` generation workers and one trainer rank per slot of
    /// `trainer_slots`, connecting to `controller` with the secret in `secret_file`, each on
    /// the devices `devices` gives it and with the torch threads `threads` gives it (`None`:
    /// each inherits this process's environment).
    pub fn start(
        cluster: &ClusterConfig,
        devices: Option<&DeviceAssignment>,
        threads: Option<ThreadShares>,
        controller: SocketAddr,
        secret_file: &std::path::Path,
        verbose: bool,
    ) -> Result<Children, ClusterError> {
        let commands = RoleCommands {
            exe: std::env::current_exe().map_err(ClusterError::Io)?,
            controller,
            secret_file: secret_file.to_owned(),
            verbose,
            tls: cluster.tls,
            devices: devices.cloned(),
            threads,
        };
        let mut children = Children {
            roles: Vec::new(),
            max_restarts: cluster.max_worker_restarts,
            commands,
        };
        for index in 0..cluster.workers as usize {
            let name = format!("worker-{index}");
            let args = ["worker".into(), "--name".into(), name.clone()];
            let placed = children
                .commands
                .devices
                .as_ref()
                .map(|d| &d.workers[index]);
            let threads = children.commands.threads.map(|shares| shares.worker);
            let command = children.commands.command(&name, &args, placed, threads);
            children.spawn(name, command, None)?;
        }
        let slots: Vec<usize> = (0..cluster.trainers as usize).collect();
        children.start_trainers(&slots)?;
        Ok(children)
    }

    /// Kills (by pid) the trainer ranks still running and starts one rank per slot of
    /// `slots`, as a new process group on a fresh rendezvous port. The workers keep running.
    pub async fn restart_trainers(&mut self, slots: &[usize]) -> Result<(), ClusterError> {
        for role in self
            .roles
            .iter_mut()
            .filter(|role| role.trainer_slot.is_some())
        {
            if let Some(child) = role.child.as_mut() {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        self.roles.retain(|role| role.trainer_slot.is_none());
        self.start_trainers(slots)
    }

    fn start_trainers(&mut self, slots: &[usize]) -> Result<(), ClusterError> {
        let master_port = std::env::var("MASTER_PORT")
            .ok()
            .and_then(|p| p.parse().ok())
            .map_or_else(free_port, Ok)?;
        for (rank, &slot) in slots.iter().enumerate() {
            let name = format!("trainer-{rank}");
            let args = [
                "trainer".into(),
                "--name".into(),
                name.clone(),
                "--rank".into(),
                rank.to_string(),
                "--world-size".into(),
                slots.len().to_string(),
            ];
            let placed = self.commands.devices.as_ref().map(|d| &d.trainers[slot]);
            let threads = self.commands.threads.map(|shares| shares.trainer);
            let mut command = self.commands.command(&name, &args, placed, threads);
            command
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", master_port.to_string());
            self.spawn(name, command, Some(slot))?;
        }
        Ok(())
    }

    fn spawn(
        &mut self,
        name: String,
        command: std::process::Command,
        trainer_slot: Option<usize>,
    ) -> Result<(), ClusterError> {
        let mut role = Role {
            name,
            command,
            child: None,
            restarts: 0,
            trainer_slot,
        };
        role.start()?;
        self.roles.push(role);
        Ok(())
    }
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
        let (success, status) = match status {
            Ok(status) => (status.success(), status.to_string()),
            Err(err) => (false, err.to_string()),
        };
        // A trainer rank exits successfully only when the controller shut it down: at the
        // end of the run, which may still be waiting for generation workers to leave.
        if let Some(slot) = role.trainer_slot.filter(|_| !success) {
            let reason = format!("{} exited with {status}", role.name);
            return Some(Exited::TrainerLost { slot, reason });
        }
        if success {
            tracing::info!("{} left the run", role.name);
            return Some(Exited::Left);
        }
        if role.restarts >= max_restarts {
            tracing::warn!(
                "{} exited with {status} and was restarted {} times already \
                 (cluster.max_worker_restarts); the run goes on without it",
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
