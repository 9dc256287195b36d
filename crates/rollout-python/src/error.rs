//! Why a role could not be hosted on the embedded interpreter.

use rollout_core::roles::RoleError;

use crate::interpreter::PythonError;
use crate::plugins::{PluginError, PluginLoadError};

impl From<PluginError> for RoleError {
    fn from(err: PluginError) -> Self {
        RoleError::Plugin(err.to_string())
    }
}

impl From<PythonError> for RoleError {
    fn from(err: PythonError) -> Self {
        RoleError::Runtime(err.to_string())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error(transparent)]
    Load(#[from] PluginLoadError),
    #[error(transparent)]
    Python(#[from] PythonError),
    #[error(transparent)]
    Role(#[from] RoleError),
}
