//! The JSON-lines protocol between the pool and `python -m rollout_sdk.sandbox`: one JSON
//! object per line each way, one request at a time (see `rollout_sdk/sandbox.py`).

use rollout_net::messages::ScoreSample;
use serde::{Deserialize, Serialize};

/// One reward to load in a worker.
#[derive(Debug, Clone, Serialize)]
pub struct RewardSpec {
    pub plugin: String,
    pub options: serde_json::Value,
}

#[derive(Debug, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request<'a> {
    Init {
        rewards: &'a [RewardSpec],
        memory_mb: u64,
        cpu_seconds: u64,
    },
    Score {
        id: u64,
        sample: &'a ScoreSample,
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
}

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Answer {
    Ready {
        #[serde(default)]
        pid: Option<u32>,
    },
    LoadFailed {
        reward: usize,
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
    Failed {
        #[serde(default)]
        id: Option<u64>,
        reward: usize,
        reason: RaisedKind,
        message: String,
        #[serde(default)]
        traceback: String,
    },
    ProtocolError {
        message: String,
    },
}

impl Answer {
    /// The call id the answer names, if any (a worker may leave it out).
    pub fn id(&self) -> Option<u64> {
        match self {
            Answer::Scored { id, .. } | Answer::Failed { id, .. } => *id,
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
                reward: 1,
                ..
            }
        ));
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
