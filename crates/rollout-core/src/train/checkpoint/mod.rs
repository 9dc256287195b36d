//! Writing checkpoints from the controller: in the background (the learner copies its
//! state, training goes on while the files are written and committed, one at a time) or in
//! the foreground.

use std::path::PathBuf;
use std::time::Instant;

use tracing::Instrument;

use super::{Controller, RunError, io_error};
use crate::roles::RoleError;

mod snapshot;
mod store;

pub use snapshot::{SnapshotFile, SnapshotFiles, write_files};
pub use store::{Checkpoint, CheckpointError, CheckpointStore, verify};

/// A checkpoint whose state was copied and whose files are being written and committed.
pub(super) struct CheckpointWrite {
    step: u64,
    started: Instant,
    commit: tokio::task::JoinHandle<Result<PathBuf, RunError>>,
}

/// How long checkpoints held training up, and how long they took to reach the disk.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CheckpointTimes {
    pub written: u64,
    pub blocked_seconds: f64,
    pub write_seconds: f64,
}

impl Controller<'_> {
    /// Checkpoints the current step. In the background (the default), the learner copies its
    /// state and training goes on while the files are written and committed; the previous
    /// background checkpoint is waited for first, so at most one is in flight.
    pub(super) async fn checkpoint(&mut self) -> Result<(), RunError> {
        let background = self.config.checkpoint.background;
        let span = tracing::info_span!("checkpoint", step = self.state.step, background);
        self.checkpoint_now(background).instrument(span).await
    }

    /// The run's last checkpoint. Nothing trains after it, so it is written in the
    /// foreground, from the learner's state as it is: no in-memory copy of the whole state
    /// raises the run's peak memory at its very end.
    pub(super) async fn final_checkpoint(&mut self) -> Result<(), RunError> {
        let span = tracing::info_span!("checkpoint", step = self.state.step, background = false);
        self.checkpoint_now(false).instrument(span).await
    }

    async fn checkpoint_now(&mut self, background: bool) -> Result<(), RunError> {
        self.checkpoint_settled().await?;
        let started = Instant::now();
        let step = self.state.step;
        let pending = self.store.begin(step)?;
        let mut directories = Vec::new();
        for (agent, learner) in self.learners() {
            let directory = match agent {
                None => pending.policy_dir(),
                Some(agent) => {
                    let directory = pending.policy_dir().join(agent);
                    std::fs::create_dir_all(&directory)
                        .map_err(|source| io_error("cannot create", &directory, source))?;
                    directory
                }
            };
            directories.push((learner, directory));
        }
        if !background {
            for (learner, directory) in directories {
                learner.save(directory).await?;
            }
            let dir = self.store.commit(pending, &self.state)?;
            self.checkpoint_times.blocked_seconds += started.elapsed().as_secs_f64();
            self.checkpoint_committed(step, started, dir).await;
            return Ok(());
        }
        let mut writes = Vec::new();
        for (learner, directory) in directories {
            writes.push(learner.save_in_background(directory).await?);
        }
        let (store, state) = (self.store.clone(), self.state.clone());
        // Its own top-level span: the write goes on while later steps train.
        let writing = tracing::info_span!(parent: None, "checkpoint.write", step);
        let commit = tokio::spawn(
            async move {
                futures_util::future::try_join_all(writes).await?;
                tokio::task::spawn_blocking(move || store.commit(pending, &state))
                    .await
                    .map_err(|err| {
                        RoleError::Runtime(format!("the checkpoint commit stopped: {err}"))
                    })?
                    .map_err(RunError::from)
            }
            .instrument(writing),
        );
        self.checkpoint_times.blocked_seconds += started.elapsed().as_secs_f64();
        self.writing = Some(CheckpointWrite {
            step,
            started,
            commit,
        });
        Ok(())
    }

    /// Waits for the checkpoint being written in the background, if any.
    pub(super) async fn checkpoint_settled(&mut self) -> Result<(), RunError> {
        let Some(writing) = self.writing.take() else {
            return Ok(());
        };
        let dir = writing
            .commit
            .await
            .map_err(|err| RoleError::Runtime(format!("the checkpoint writer stopped: {err}")))??;
        self.checkpoint_committed(writing.step, writing.started, dir)
            .await;
        Ok(())
    }

    /// Settles a background checkpoint that already finished, without waiting.
    pub(super) async fn reap_checkpoint(&mut self) -> Result<(), RunError> {
        if self
            .writing
            .as_ref()
            .is_some_and(|w| w.commit.is_finished())
        {
            self.checkpoint_settled().await?;
        }
        Ok(())
    }

    async fn checkpoint_committed(&mut self, step: u64, started: Instant, dir: PathBuf) {
        let seconds = started.elapsed().as_secs_f64();
        self.checkpoint_times.written += 1;
        self.checkpoint_times.write_seconds += seconds;
        tracing::info!("checkpoint written in {seconds:.2} s: {}", dir.display());
        self.observer.checkpoint_written(step, dir.clone()).await;
        self.last_checkpoint = Some(dir);
    }
}
