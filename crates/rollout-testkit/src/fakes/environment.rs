//! Environments: multi-turn episodes of one policy, and a multi-agent relay.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use rollout_core::roles::{
    AgentTurn, Environments, EpisodeFailure, EpisodeResult, EpisodeStart, JointOutcome,
    MultiAgentEnvironments, RoleFuture, StepResult,
};
use rollout_net::messages::FailureReason;

use super::lock;

/// Episodes of `turns` turns. The first prompt is `"?"`, each observation `"!"`; the last
/// turn of an odd episode id is rewarded 1 (episodes of a group have consecutive ids, so
/// every group has a spread). With `failing_every = n`, every n-th episode started fails in
/// its second turn (its environment raised).
pub struct FakeEnvironment {
    turns: u32,
    failing_every: u64,
    started: Mutex<u64>,
    /// Live episodes: turns taken, and whether the episode fails.
    live: Mutex<HashMap<u64, (u32, bool)>>,
    finished: Mutex<Vec<u64>>,
}

impl FakeEnvironment {
    pub fn new(turns: u32) -> Self {
        FakeEnvironment {
            turns,
            failing_every: 0,
            started: Mutex::default(),
            live: Mutex::default(),
            finished: Mutex::default(),
        }
    }

    pub fn failing_every(self, n: u64) -> Self {
        FakeEnvironment {
            failing_every: n,
            ..self
        }
    }

    /// The episodes released, in order.
    pub fn finished(&self) -> Vec<u64> {
        lock(&self.finished).clone()
    }
}

impl Environments for FakeEnvironment {
    fn start(
        &self,
        first_id: u64,
        episodes: Vec<EpisodeStart>,
    ) -> RoleFuture<'_, Vec<EpisodeResult<String>>> {
        let mut started = lock(&self.started);
        let mut live = lock(&self.live);
        let prompts = (0..episodes.len() as u64)
            .map(|offset| {
                *started += 1;
                let fails = self.failing_every > 0 && *started % self.failing_every == 0;
                live.insert(first_id.wrapping_add(offset), (0, fails));
                Ok("?".to_owned())
            })
            .collect();
        Box::pin(async move { Ok(prompts) })
    }

    fn step(&self, actions: Vec<(u64, String)>) -> RoleFuture<'_, Vec<EpisodeResult<StepResult>>> {
        let mut live = lock(&self.live);
        let outcomes = actions
            .iter()
            .map(|(id, _)| {
                let (turn, fails) = live.entry(*id).or_insert((0, false));
                *turn += 1;
                if *fails && *turn == 2 {
                    return Err(EpisodeFailure {
                        hook: "step",
                        reason: FailureReason::Raised,
                        message: "ValueError: the fake environment fails here".into(),
                        traceback: None,
                    });
                }
                let done = *turn >= self.turns;
                Ok(StepResult {
                    observation: if done { String::new() } else { "!".into() },
                    reward: if done && id % 2 == 1 { 1.0 } else { 0.0 },
                    done,
                })
            })
            .collect();
        Box::pin(async move { Ok(outcomes) })
    }

    fn finish(&self, ids: Vec<u64>) -> RoleFuture<'_, ()> {
        let mut live = lock(&self.live);
        for id in &ids {
            live.remove(id);
        }
        lock(&self.finished).extend(ids);
        Box::pin(async { Ok(()) })
    }
}

/// A multi-agent relay: `first` acts, then `second`. Odd episode ids reward `first`, so its
/// groups have a spread; `second` always gets 1 (no spread: nothing to learn) and its turn
/// also gives `first` 0.5. With `stranger`, the second turn goes to an agent the run does
/// not have.
#[derive(Default)]
pub struct Relay {
    stranger: bool,
    turns: Mutex<HashMap<u64, u32>>,
    finished: Mutex<Vec<u64>>,
}

impl Relay {
    /// Hands the second turn to `third`, an agent the run does not have.
    pub fn with_stranger() -> Self {
        Relay {
            stranger: true,
            ..Relay::default()
        }
    }

    /// The episodes released, in order.
    pub fn finished(&self) -> Vec<u64> {
        lock(&self.finished).clone()
    }
}

impl MultiAgentEnvironments for Relay {
    fn start(&self, first_id: u64, episodes: Vec<EpisodeStart>) -> RoleFuture<'_, Vec<AgentTurn>> {
        let mut turns = lock(&self.turns);
        let first = (0..episodes.len() as u64)
            .map(|offset| {
                turns.insert(first_id.wrapping_add(offset), 0);
                AgentTurn {
                    agent: "first".into(),
                    prompt: "go".into(),
                }
            })
            .collect();
        Box::pin(async move { Ok(first) })
    }

    fn step(&self, actions: Vec<(u64, String)>) -> RoleFuture<'_, Vec<JointOutcome>> {
        let mut turns = lock(&self.turns);
        let outcomes = actions
            .iter()
            .map(|(id, _)| {
                let turn = turns.entry(*id).or_insert(0);
                *turn += 1;
                let odd = f64::from(u8::from(id % 2 == 1));
                if *turn == 1 {
                    let next = if self.stranger { "third" } else { "second" };
                    JointOutcome {
                        rewards: BTreeMap::from([("first".into(), odd)]),
                        next: Some(AgentTurn {
                            agent: next.into(),
                            prompt: "answer".into(),
                        }),
                    }
                } else {
                    JointOutcome {
                        rewards: BTreeMap::from([("second".into(), 1.0), ("first".into(), 0.5)]),
                        next: None,
                    }
                }
            })
            .collect();
        Box::pin(async move { Ok(outcomes) })
    }

    fn finish(&self, ids: Vec<u64>) -> RoleFuture<'_, ()> {
        lock(&self.finished).extend(ids);
        Box::pin(async { Ok(()) })
    }
}
