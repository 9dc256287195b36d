//! Finding the Python environment the embedded interpreter should use.
//!
//! The interpreter is the `libpython` the binary links; a virtual environment only adds its
//! `site-packages`. Because the "executable" is `rollout`, CPython cannot discover a venv by
//! itself, so we locate one and add it with `site.addsitedir` (which also runs its `.pth`
//! files, e.g. editable installs).

use std::path::{Path, PathBuf};

use super::PythonError;

/// Environment variables that steer discovery, in the order they are consulted.
pub const VENV_VARIABLE: &str = "ROLLOUT_VENV";
pub const ACTIVE_VENV_VARIABLE: &str = "VIRTUAL_ENV";
/// Directory holding the built-in `python_plugins` and `rollout_sdk` packages.
pub const HOME_VARIABLE: &str = "ROLLOUT_HOME";

/// What the interpreter is set up with before any plugin is imported.
#[derive(Debug, Clone, Default)]
pub struct PythonSetup {
    pub venv: Option<PathBuf>,
    /// The venv was created with `--system-site-packages`.
    pub system_site_packages: bool,
    /// Put on `sys.path` before the venv: the built-in packages, the working directory and
    /// any configured paths.
    pub paths: Vec<PathBuf>,
}

impl PythonSetup {
    /// `configured` is `[python] venv`; `extra` is `[python] paths`.
    pub fn discover(configured: Option<&Path>, extra: &[PathBuf]) -> Result<Self, PythonError> {
        let venv = match configured {
            Some(path) => Some(require_venv(path, "[python] venv")?),
            None => discover_venv()?,
        };
        let mut paths = Vec::new();
        if let Some(home) = rollout_home() {
            paths.push(home);
        }
        if let Ok(cwd) = std::env::current_dir() {
            paths.push(cwd);
        }
        paths.extend(extra.iter().cloned());
        paths.dedup();
        let system_site_packages = venv.as_deref().is_some_and(includes_system_site_packages);
        Ok(PythonSetup {
            venv,
            system_site_packages,
            paths,
        })
    }

    /// `<venv>/lib/pythonX.Y/site-packages` for the linked interpreter's version.
    pub fn site_packages(&self, major: u8, minor: u8) -> Result<Option<PathBuf>, PythonError> {
        let Some(venv) = &self.venv else {
            return Ok(None);
        };
        let expected = venv.join(format!("lib/python{major}.{minor}/site-packages"));
        if expected.is_dir() {
            return Ok(Some(expected));
        }
        let found: Vec<String> = std::fs::read_dir(venv.join("lib"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("python"))
            .collect();
        Err(PythonError::Setup(format!(
            "the virtual environment {} is for {} but rollout embeds Python {major}.{minor}; \
             recreate it with python{major}.{minor} or rebuild rollout against its Python",
            venv.display(),
            if found.is_empty() {
                "no Python".to_owned()
            } else {
                found.join(", ")
            },
        )))
    }
}

fn includes_system_site_packages(venv: &Path) -> bool {
    std::fs::read_to_string(venv.join("pyvenv.cfg"))
        .map(|cfg| {
            cfg.lines().any(|line| {
                line.split_once('=').is_some_and(|(key, value)| {
                    key.trim() == "include-system-site-packages" && value.trim() == "true"
                })
            })
        })
        .unwrap_or(false)
}

fn require_venv(path: &Path, source: &str) -> Result<PathBuf, PythonError> {
    if path.join("pyvenv.cfg").is_file() {
        Ok(path.canonicalize().unwrap_or_else(|_| path.to_path_buf()))
    } else {
        Err(PythonError::Setup(format!(
            "{source} points at {}, which is not a virtual environment (no pyvenv.cfg)",
            path.display()
        )))
    }
}

fn discover_venv() -> Result<Option<PathBuf>, PythonError> {
    if let Some(value) = std::env::var_os(VENV_VARIABLE).filter(|v| !v.is_empty()) {
        return require_venv(Path::new(&value), &format!("${VENV_VARIABLE}")).map(Some);
    }
    // `pip install rollout-*.whl` puts the binary in `<venv>/bin`: it belongs to that venv,
    // which holds rollout_sdk and the built-in plugins, whether or not it is activated.
    if let Some(venv) = executable_dir().and_then(|dir| installed_venv(&dir)) {
        return Ok(Some(venv));
    }
    if let Some(value) = std::env::var_os(ACTIVE_VENV_VARIABLE).filter(|v| !v.is_empty()) {
        return require_venv(Path::new(&value), &format!("${ACTIVE_VENV_VARIABLE}")).map(Some);
    }
    let starts = [std::env::current_dir().ok(), executable_dir()];
    Ok(starts
        .into_iter()
        .flatten()
        .find_map(|start| find_upwards(&start, |dir| dir.join(".venv/pyvenv.cfg").is_file()))
        .map(|dir| dir.join(".venv")))
}

/// The virtual environment whose `bin` directory is `exe_dir`, if it is one.
fn installed_venv(exe_dir: &Path) -> Option<PathBuf> {
    let venv = exe_dir.parent()?;
    (exe_dir.file_name()? == "bin" && venv.join("pyvenv.cfg").is_file()).then(|| venv.to_path_buf())
}

/// `$ROLLOUT_HOME`, else the nearest directory above the executable (or the working
/// directory) that holds the `python_plugins` package.
pub fn rollout_home() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os(HOME_VARIABLE).filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(home));
    }
    let holds_plugins = |dir: &Path| dir.join("python_plugins/__init__.py").is_file();
    [executable_dir(), std::env::current_dir().ok()]
        .into_iter()
        .flatten()
        .find_map(|start| find_upwards(&start, holds_plugins))
}

fn executable_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    exe.canonicalize()
        .unwrap_or(exe)
        .parent()
        .map(Path::to_path_buf)
}

fn find_upwards(start: &Path, found: impl Fn(&Path) -> bool) -> Option<PathBuf> {
    start
        .ancestors()
        .find(|dir| found(dir))
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_binary_in_the_bin_directory_of_a_venv_belongs_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let venv = dir.path().join("env");
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        assert_eq!(installed_venv(&venv.join("bin")), None, "no pyvenv.cfg yet");
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        assert_eq!(installed_venv(&venv.join("bin")), Some(venv.clone()));
        // A development build (target/release/rollout) is in no venv.
        std::fs::create_dir_all(venv.join("release")).unwrap();
        assert_eq!(installed_venv(&venv.join("release")), None);
    }
}
