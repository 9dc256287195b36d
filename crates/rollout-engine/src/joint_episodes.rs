//! Multi-agent episodes on the embedded interpreter: one environment instance per episode,
//! kept by id between turns.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::plugins::{Episode, MultiAgentEnvironmentPlugin, PluginError};
use crate::python::PythonWorker;
use crate::roles::{AgentTurn, EpisodeStart, JointOutcome, RoleError};

pub struct JointEpisodes {
    plugin: Arc<MultiAgentEnvironmentPlugin>,
    /// Live episodes by id; their Python objects are dropped inside `finish`, on the worker.
    live: Arc<Mutex<HashMap<u64, Episode>>>,
}

impl JointEpisodes {
    pub fn new(plugin: MultiAgentEnvironmentPlugin) -> Self {
        JointEpisodes {
            plugin: Arc::new(plugin),
            live: Arc::default(),
        }
    }

    pub fn agents(&self) -> Vec<String> {
        self.plugin.agents().to_vec()
    }

    pub async fn start(
        &self,
        worker: &PythonWorker,
        first_id: u64,
        starts: Vec<EpisodeStart>,
    ) -> Result<Vec<AgentTurn>, RoleError> {
        let (plugin, live) = (self.plugin.clone(), self.live.clone());
        Ok(worker
            .run(move |py| {
                let mut turns = Vec::with_capacity(starts.len());
                for (offset, start) in starts.into_iter().enumerate() {
                    let episode = plugin.new_episode(py)?;
                    turns.push(plugin.reset(py, &episode, &start.record, start.seed)?);
                    if let Ok(mut live) = live.lock() {
                        live.insert(first_id.wrapping_add(offset as u64), episode);
                    }
                }
                Ok::<_, PluginError>(turns)
            })
            .await??)
    }

    pub async fn step(
        &self,
        worker: &PythonWorker,
        actions: Vec<(u64, String)>,
    ) -> Result<Vec<JointOutcome>, RoleError> {
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
