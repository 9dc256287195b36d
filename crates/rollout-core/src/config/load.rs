//! Reading a config file, applying `--set` overrides and checking values, with errors that
//! point at `file:line:column` and suggest the key that was probably meant.

use std::path::Path;

use serde::Deserialize;

use super::loaded::{ConfigError, LoadedConfig};
use super::location::{KeyPath, Location, Segment};
use super::schema::Config;

/// Read `path`, apply `overrides` (`key.path=value`, the value in TOML syntax or a bare
/// string) and check every value.
pub fn load(path: &Path, overrides: &[String]) -> Result<LoadedConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    load_text(path, text, overrides)
}

/// Parses and validates config `text`; `path` names it in errors (e.g. the controller that
/// sent a role its run's resolved config).
pub fn load_text(
    path: &Path,
    text: String,
    overrides: &[String],
) -> Result<LoadedConfig, ConfigError> {
    let mut config: Config =
        toml::from_str(&text).map_err(|err| located_toml_error(path, &text, &err))?;
    let mut overridden = Vec::new();
    if !overrides.is_empty() {
        let mut table: toml::Table =
            toml::from_str(&text).map_err(|err| located_toml_error(path, &text, &err))?;
        for assignment in overrides {
            overridden.push(apply_override(&mut table, assignment)?);
        }
        config = Config::deserialize(table).map_err(|err| ConfigError::Override {
            assignment: overrides.join(" "),
            message: with_suggestion(err.message()),
        })?;
    }
    let loaded = LoadedConfig::new(config, path.to_path_buf(), text, overridden);
    super::validate::validate(&loaded)?;
    Ok(loaded)
}

fn located_toml_error(path: &Path, text: &str, err: &toml::de::Error) -> ConfigError {
    let message = with_suggestion(err.message());
    match err.span() {
        Some(span) => ConfigError::Invalid {
            location: Location::at_offset(path, text, span.start),
            message,
        },
        None => ConfigError::InvalidUnlocated {
            path: path.to_path_buf(),
            message,
        },
    }
}

fn apply_override(table: &mut toml::Table, assignment: &str) -> Result<KeyPath, ConfigError> {
    let fail = |message: String| ConfigError::Override {
        assignment: assignment.to_owned(),
        message,
    };
    let (key, raw_value) = assignment
        .split_once('=')
        .ok_or_else(|| fail("expected `key.path=value`".into()))?;
    let key_path = KeyPath::parse_dotted(key.trim());
    if key_path
        .0
        .iter()
        .any(|s| matches!(s, Segment::Key(k) if k.is_empty()))
    {
        return Err(fail("the key path has an empty segment".into()));
    }
    let mut root = toml::Value::Table(std::mem::take(table));
    let result = set_path(
        &mut root,
        &key_path.0,
        parse_override_value(raw_value.trim()),
    );
    if let toml::Value::Table(restored) = root {
        *table = restored;
    }
    result.map_err(fail)?;
    Ok(key_path)
}

fn set_path(node: &mut toml::Value, path: &[Segment], value: toml::Value) -> Result<(), String> {
    let Some((first, rest)) = path.split_first() else {
        *node = value;
        return Ok(());
    };
    let child = match (first, node) {
        (Segment::Key(key), toml::Value::Table(table)) => table
            .entry(key.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new())),
        (Segment::Index(index), toml::Value::Array(array)) => array
            .get_mut(*index)
            .ok_or_else(|| format!("index {index} is past the end of the array"))?,
        (Segment::Key(key), _) => return Err(format!("`{key}` is not inside a table")),
        (Segment::Index(index), _) => return Err(format!("[{index}] is not inside an array")),
    };
    set_path(child, rest, value)
}

/// TOML syntax when it parses (`3`, `true`, `[1, 2]`, `"x"`), else the raw text as a string:
/// how `--set` (and `rollout sweep --grid`) read a value.
pub fn parse_override_value(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("value = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("value"))
        .unwrap_or_else(|| toml::Value::String(raw.to_owned()))
}

/// Adds "did you mean `x`?" to serde's "unknown field `y`, expected one of ..." messages.
pub fn with_suggestion(message: &str) -> String {
    let message = message.trim_end();
    let Some(unknown) = backticked(message).next() else {
        return message.to_owned();
    };
    let is_unknown = message.starts_with("unknown field") || message.starts_with("unknown variant");
    let Some((_, expected)) = message.split_once("expected") else {
        return message.to_owned();
    };
    if !is_unknown {
        return message.to_owned();
    }
    match suggest(unknown, backticked(expected)) {
        Some(best) => format!("{message}; did you mean `{best}`?"),
        None => message.to_owned(),
    }
}

/// The closest candidate to `word`, if any is close enough to be a likely typo.
pub fn suggest<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .map(|candidate| (strsim::jaro_winkler(word, candidate), candidate))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, candidate)| candidate)
}

fn backticked(text: &str) -> impl Iterator<Item = &str> {
    text.split('`').skip(1).step_by(2)
}
