//! The JSON-lines protocol between the pools and `python -m rollout_sdk.sandbox`: one JSON
//! object per line each way, one request at a time (see `rollout_sdk/sandbox.py`). A
//! worker either scores samples with rewards or hosts episodes of an environment.

use rollout_net::messages::ScoreSample;
use serde::{Deserialize, Serialize};

/// One reward to load in a worker.
#[derive(Debug, Clone, Serialize)]
pub struct RewardSpec {
    pub plugin: String,
    pub options: serde_json::Value,
}

/// The environment a worker hosts episodes of (a worker for rewards loads none).
#[derive(Debug, Clone, Serialize)]
pub struct EnvironmentSpec {
    pub plugin: String,
    pub options: serde_json::Value,
}

#[derive(Debug, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request<'a> {
    Init {
        rewards: &'a [RewardSpec],
        #[serde(skip_serializing_if = "Option::is_none")]
        environment: Option<&'a EnvironmentSpec>,
        /// Seeds the worker's global random generators before the plugins load.
        #[serde(skip_serializing_if = "Option::is_none")]
        seed: Option<u64>,
        memory_mb: u64,
        cpu_seconds: u64,
    },
    Score {
        id: u64,
        sample: &'a ScoreSample,
    },
    /// A fresh environment instance for `episode`, reset with the record and seed.
    Reset {
        id: u64,
        episode: u64,
        record: &'a serde_json::Value,
        seed: u64,
    },
    Step {
        id: u64,
        episode: u64,
        action: &'a str,
    },
    /// Drops the instances of `episodes`.
    Finish {
        id: u64,
        episodes: &'a [u64],
    },
}

/// Why a worker could not score a sample while staying alive (or, for `Memory`, about to be
/// replaced).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RaisedKind {
    Raised,
    Memory,
    Invalid,
    /// A reward's `SampleFailure`: the sample's own process broke (the worker is fine).
    Crashed,
    /// A reward's `SampleFailure`: the sample ran out of time (the worker is fine).
    Timeout,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Answer {
    Ready {
        #[serde(default)]
        pid: Option<u32>,
    },
    /// `reward` is `None` when the environment failed to load.
    LoadFailed {
        #[serde(default)]
        reward: Option<usize>,
        #[serde(default)]
        key: Option<Vec<String>>,
        message: String,
        #[serde(default)]
        traceback: String,
    },
    Scored {
        #[serde(default)]
        id: Option<u64>,
        scores: Vec<f64>,
    },
    /// The call failed in the plugin; `reward` names the reward (none for an environment).
    Failed {
        #[serde(default)]
        id: Option<u64>,
        #[serde(default)]
        reward: Option<usize>,
        reason: RaisedKind,
        message: String,
        #[serde(default)]
        traceback: String,
    },
    /// An episode's first prompt.
    Started {
        #[serde(default)]
        id: Option<u64>,
        prompt: String,
    },
    Stepped {
        #[serde(default)]
        id: Option<u64>,
        observation: String,
        reward: f64,
        done: bool,
    },
    Finished {
        #[serde(default)]
        id: Option<u64>,
    },
    ProtocolError {
        message: String,
    },
}

impl Answer {
    /// The call id the answer names, if any (a worker may leave it out).
    pub fn id(&self) -> Option<u64> {
        match self {
            Answer::Scored { id, .. }
            | Answer::Failed { id, .. }
            | Answer::Started { id, .. }
            | Answer::Stepped { id, .. }
            | Answer::Finished { id } => *id,
            _ => None,
        }
    }
}

/// A plugin's TOML options as JSON, the way `tomllib` reads them (datetimes as strings).
pub fn toml_to_json(value: &toml::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        toml::Value::String(s) => Value::String(s.clone()),
        toml::Value::Integer(i) => Value::from(*i),
        toml::Value::Float(f) => {
            serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number)
        }
        toml::Value::Boolean(b) => Value::Bool(*b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(items) => Value::Array(items.iter().map(toml_to_json).collect()),
        toml::Value::Table(table) => table_to_json(table),
    }
}

pub fn table_to_json(table: &toml::Table) -> serde_json::Value {
    serde_json::Value::Object(
        table
            .iter()
            .map(|(key, value)| (key.clone(), toml_to_json(value)))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn answers_parse_with_and_without_ids() {
        let scored: Answer = serde_json::from_str(r#"{"op":"scored","scores":[1.0]}"#).unwrap();
        assert!(matches!(scored, Answer::Scored { id: None, .. }));
        let failed: Answer = serde_json::from_str(
            r#"{"op":"failed","id":3,"reward":1,"reason":"memory","message":"MemoryError"}"#,
        )
        .unwrap();
        assert_eq!(failed.id(), Some(3));
        assert!(matches!(
            failed,
            Answer::Failed {
                reason: RaisedKind::Memory,
                reward: Some(1),
                ..
            }
        ));
    }

    #[test]
    fn environment_requests_and_answers_have_their_shape() {
        let record = serde_json::json!({"secret": 3});
        let reset = Request::Reset {
            id: 4,
            episode: u64::MAX,
            record: &record,
            seed: 7,
        };
        assert_eq!(
            serde_json::to_value(&reset).unwrap(),
            serde_json::json!({"op": "reset", "id": 4, "episode": u64::MAX,
                               "record": {"secret": 3}, "seed": 7})
        );
        let init = Request::Init {
            rewards: &[],
            environment: None,
            seed: None,
            memory_mb: 0,
            cpu_seconds: 0,
        };
        let text = serde_json::to_string(&init).unwrap();
        assert!(
            !text.contains("environment") && !text.contains("seed"),
            "{text}"
        );
        let stepped: Answer = serde_json::from_str(
            r#"{"op":"stepped","id":2,"observation":"o","reward":0.5,"done":true}"#,
        )
        .unwrap();
        assert_eq!(stepped.id(), Some(2));
        let failed: Answer = serde_json::from_str(
            r#"{"op":"failed","id":5,"reason":"raised","message":"ValueError"}"#,
        )
        .unwrap();
        assert!(matches!(failed, Answer::Failed { reward: None, .. }));
    }

    #[test]
    fn options_become_json_like_tomllib_reads_them() {
        let table: toml::Table =
            toml::from_str("a = 1\nb = [true, 2.5]\nc = { d = \"x\" }\nwhen = 1979-05-27").unwrap();
        let json = table_to_json(&table);
        assert_eq!(
            json,
            serde_json::json!({"a": 1, "b": [true, 2.5], "c": {"d": "x"}, "when": "1979-05-27"})
        );
    }
}
