//! Episodes played on the embedded interpreter: one environment instance per episode, kept
//! by id between calls. The single-policy environment and the multi-agent one share this.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rollout_core::roles::{EpisodeStart, RoleError};

use crate::interpreter::PythonWorker;
use crate::plugins::{Episode, EpisodePlugin, PluginError};

pub struct LiveEpisodes<P> {
    plugin: Arc<P>,
    /// Live episodes by id; their Python objects are dropped inside `finish`, on the worker.
    live: Arc<Mutex<HashMap<u64, Episode>>>,
}

impl<P: EpisodePlugin> LiveEpisodes<P> {
    pub fn new(plugin: P) -> Self {
        LiveEpisodes {
            plugin: Arc::new(plugin),
            live: Arc::default(),
        }
    }

    /// Starts episodes `first_id..`; a call that raises fails them all.
    pub async fn start(
        &self,
        worker: &PythonWorker,
        first_id: u64,
        starts: Vec<EpisodeStart>,
    ) -> Result<Vec<P::Start>, RoleError> {
        let (plugin, live) = (self.plugin.clone(), self.live.clone());
        Ok(worker
            .run(move |py| {
                let mut firsts = Vec::with_capacity(starts.len());
                for (offset, start) in starts.into_iter().enumerate() {
                    let episode = plugin.new_episode(py)?;
                    firsts.push(plugin.reset(py, &episode, &start.record, start.seed)?);
                    if let Ok(mut live) = live.lock() {
                        live.insert(first_id.wrapping_add(offset as u64), episode);
                    }
                }
                Ok::<_, PluginError>(firsts)
            })
            .await??)
    }

    /// One outcome per `(episode id, action)`, in order.
    pub async fn step(
        &self,
        worker: &PythonWorker,
        actions: Vec<(u64, String)>,
    ) -> Result<Vec<P::Outcome>, RoleError> {
        let (plugin, live) = (self.plugin.clone(), self.live.clone());
        worker
            .run(move |py| {
                let live = live
                    .lock()
                    .map_err(|_| RoleError::Protocol("the episode table is poisoned".into()))?;
                let mut outcomes = Vec::with_capacity(actions.len());
                for (id, action) in &actions {
                    let Some(episode) = live.get(id) else {
                        return Err(RoleError::Protocol(format!("episode {id} is not running")));
                    };
                    outcomes.push(plugin.step(py, episode, action)?);
                }
                Ok(outcomes)
            })
            .await?
    }

    pub async fn finish(&self, worker: &PythonWorker, ids: Vec<u64>) -> Result<(), RoleError> {
        let live = self.live.clone();
        worker
            .run(move |_py| {
                if let Ok(mut live) = live.lock() {
                    for id in ids {
                        live.remove(&id);
                    }
                }
            })
            .await?;
        Ok(())
    }
}
