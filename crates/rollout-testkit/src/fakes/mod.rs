//! Fakes of every role, with no Python and no model, so the controller's logic is tested
//! against known numbers: a policy that generates predictable completions ([`FakePolicy`]),
//! rewards given by a rule ([`FakeRewards`]), a learner whose weights are its version number
//! and that records what it was asked to train ([`FakeLearner`]), multi-turn and multi-agent
//! environments ([`FakeEnvironment`], [`Relay`]), an observer that records the run
//! ([`RecordingObserver`]) and a generation worker that answers over a real authenticated
//! link ([`worker`]).

mod environment;
mod learner;
mod observer;
mod policy;
mod rewards;
pub mod worker;

use std::sync::{Mutex, MutexGuard, PoisonError};

use rollout_core::config::Config;
use rollout_core::roles::Record;

pub use environment::{FakeEnvironment, Relay};
pub use learner::FakeLearner;
pub use observer::RecordingObserver;
pub use policy::FakePolicy;
pub use rewards::{FakeRewards, Score};

/// `count` addition records: prompt `"{i}+{i}="`, answer `2i`.
pub fn records(count: usize) -> Vec<Record> {
    (0..count)
        .map(|i| {
            let prompt = format!("{i}+{i}=");
            Record {
                fields: serde_json::json!({ "prompt": prompt, "answer": (2 * i).to_string() }),
                prompt,
            }
        })
        .collect()
}

/// A config from TOML text `base` with the tables of `overrides` merged in (key by key),
/// without the range checks of `rollout check` (tests set what they exercise). Panics on a
/// config that does not parse: a test bug.
pub fn config(base: &str, overrides: &str) -> Config {
    let parse = |text: &str| match text.parse::<toml::Table>() {
        Ok(table) => table,
        Err(err) => panic!("bad test config: {err}\n{text}"),
    };
    let mut table = parse(base);
    merge(&mut table, parse(overrides));
    match toml::Value::Table(table).try_into() {
        Ok(config) => config,
        Err(err) => panic!("bad test config: {err}\n{base}\n{overrides}"),
    }
}

fn merge(base: &mut toml::Table, overrides: toml::Table) {
    for (key, value) in overrides {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(inner)), toml::Value::Table(more)) => merge(inner, more),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// Locks `mutex`, whatever a panicking holder left (fakes record; they do not protect
/// invariants).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
