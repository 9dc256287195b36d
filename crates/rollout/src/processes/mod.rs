//! A run whose roles are separate processes: the controller ([`controller`]), generation
//! workers ([`worker`]) and trainer ranks ([`trainer`]), which join it alike ([`joining`]),
//! connected by authenticated `rollout_net` links, with weight versions relayed along the
//! workers (`rollout_core::cluster::weights`). [`launch`] starts all of them on one machine
//! ([`children`]).

pub mod children;
pub mod controller;
pub mod joining;
pub mod launch;
pub mod secret;
pub mod threads;
pub mod trainer;
pub mod worker;

use rollout_net::{AuthError, NetError};

use rollout_core::cluster::weights;
use rollout_core::config::ConfigError;
use rollout_core::roles::RoleError;
use rollout_core::train::RunError;
use rollout_python::HostError;
use rollout_python::interpreter::PythonError;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Net(NetError),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Python(#[from] PythonError),
    #[error(transparent)]
    Local(#[from] HostError),
    #[error(transparent)]
    Role(#[from] RoleError),
    #[error(transparent)]
    Run(#[from] RunError),
    #[error(transparent)]
    Session(#[from] crate::session::SessionError),
    #[error(transparent)]
    Weights(#[from] weights::WeightsError),
    #[error(transparent)]
    Tls(#[from] rollout_net::tls::TlsError),
    #[error("lost the controller: {0}")]
    ControllerLost(String),
    #[error("the run is over: the controller takes no more roles")]
    RunOver,
    #[error("{0}")]
    Protocol(String),
    #[error("{0}")]
    Secret(String),
    #[error("{0}")]
    Io(std::io::Error),
}
