//! The cluster secret: read from a file whose mode is checked, or taken out of the
//! environment as the process starts, so that nothing this process starts (roles, plugin
//! subprocesses, sandbox workers) inherits it. `rollout launch` hands it to its roles in a
//! file only its user can read.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rollout_net::ClusterKey;

use super::ClusterError;

/// The environment variable a secret may come in (a file is preferred).
pub const SECRET_ENV: &str = "ROLLOUT_CLUSTER_SECRET";

static FROM_ENVIRONMENT: OnceLock<Option<String>> = OnceLock::new();

/// Takes `ROLLOUT_CLUSTER_SECRET` out of the environment, keeping it for
/// [`from_environment`]. Call it first in `main`, while the process has one thread.
#[allow(unsafe_code)]
pub fn take_from_environment() {
    let secret = std::env::var(SECRET_ENV).ok();
    if std::env::var_os(SECRET_ENV).is_some() {
        // SAFETY: `main` calls this before the runtime, the logger or anything else has
        // started a thread, so nothing reads the environment concurrently.
        unsafe { std::env::remove_var(SECRET_ENV) };
    }
    let _ = FROM_ENVIRONMENT.set(secret);
}

/// The secret `ROLLOUT_CLUSTER_SECRET` held when the process started.
pub fn from_environment() -> Option<&'static str> {
    FROM_ENVIRONMENT.get().and_then(Option::as_deref)
}

/// The secret in `path`, refused when every user of the machine may read it.
pub fn read_file(path: &Path) -> Result<Vec<u8>, ClusterError> {
    let cannot = |err: std::io::Error| {
        ClusterError::Secret(format!(
            "cannot read the cluster secret {}: {err}",
            path.display()
        ))
    };
    let mode = std::fs::metadata(path)
        .map_err(cannot)?
        .permissions()
        .mode();
    if mode & 0o007 != 0 {
        return Err(ClusterError::Secret(format!(
            "the cluster secret {} is open to every user of this machine (mode {:o}): \
             `chmod 600` it (or 640 for a group that needs it)",
            path.display(),
            mode & 0o777
        )));
    }
    std::fs::read(path).map_err(cannot)
}

/// The cluster key from `secret_file`, else from `ROLLOUT_CLUSTER_SECRET`.
pub fn cluster_key(secret_file: Option<&Path>) -> Result<ClusterKey, ClusterError> {
    let secret = match secret_file {
        Some(path) => read_file(path)?,
        None => from_environment()
            .ok_or_else(|| {
                ClusterError::Secret(format!(
                    "no cluster secret: pass --secret-file (or set {SECRET_ENV}); every process \
                     of a run must know the same secret"
                ))
            })?
            .as_bytes()
            .to_vec(),
    };
    Ok(ClusterKey::from_secret(&secret)?)
}

/// The secret `rollout launch` gives its roles: the config's `secret_file` itself, or a copy
/// (of the environment's secret, or a random one) in a private temporary directory removed
/// when this is dropped.
pub struct RoleSecret {
    pub file: PathBuf,
    _directory: Option<tempfile::TempDir>,
}

impl RoleSecret {
    /// The config's `secret_file` as it is.
    pub fn configured(file: PathBuf) -> Self {
        Self {
            file,
            _directory: None,
        }
    }

    /// `secret` written to a file only this user can read.
    pub fn private(secret: &str) -> Result<Self, ClusterError> {
        let directory = tempfile::Builder::new()
            .prefix("rollout-secret-")
            .tempdir()
            .map_err(ClusterError::Io)?;
        std::fs::set_permissions(directory.path(), std::fs::Permissions::from_mode(0o700))
            .map_err(ClusterError::Io)?;
        let file = directory.path().join("cluster-secret");
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&file)
            .and_then(|mut out| out.write_all(secret.as_bytes()))
            .map_err(ClusterError::Io)?;
        Ok(Self {
            file,
            _directory: Some(directory),
        })
    }
}
