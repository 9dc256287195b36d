//! A config as loaded: the parsed values, and the text they came from to locate errors found
//! later (a range check, a plugin rejecting one of its options).

use std::path::PathBuf;

use super::location::{KeyPath, Location, find_span};
use super::schema::Config;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{location}: {message}")]
    Invalid { location: Location, message: String },
    #[error("{}: {message}", path.display())]
    InvalidUnlocated { path: PathBuf, message: String },
    #[error("--set {assignment}: {message}")]
    Override { assignment: String, message: String },
}

/// A parsed config and the text it came from, kept to locate later errors (e.g. a plugin
/// rejecting one of its options).
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    pub config: Config,
    pub path: PathBuf,
    text: String,
    overridden: Vec<KeyPath>,
}

impl LoadedConfig {
    /// `config`, read from `text` at `path`, with the keys `--set` overrides replaced.
    pub(super) fn new(
        config: Config,
        path: PathBuf,
        text: String,
        overridden: Vec<KeyPath>,
    ) -> Self {
        LoadedConfig {
            config,
            path,
            text,
            overridden,
        }
    }

    /// Where `key` is written: in the file, or in a `--set` override.
    pub fn describe_location(&self, key: &KeyPath) -> String {
        if self.overridden.iter().any(|o| key.0.starts_with(&o.0)) {
            return format!("--set {key}");
        }
        match find_span(&self.text, key) {
            Some(span) => Location::at_offset(&self.path, &self.text, span.start).to_string(),
            None => format!("{} ({key})", self.path.display()),
        }
    }

    /// An error about `key`, located in the file or in the override that set it.
    pub fn error_at(&self, key: &KeyPath, message: impl Into<String>) -> ConfigError {
        let message = message.into();
        if let Some(overridden) = self.overridden.iter().find(|o| key.0.starts_with(&o.0)) {
            return ConfigError::Override {
                assignment: overridden.to_string(),
                message,
            };
        }
        match find_span(&self.text, key) {
            Some(span) => ConfigError::Invalid {
                location: Location::at_offset(&self.path, &self.text, span.start),
                message: format!("`{key}`: {message}"),
            },
            None => ConfigError::InvalidUnlocated {
                path: self.path.clone(),
                message: format!("`{key}`: {message}"),
            },
        }
    }
}
