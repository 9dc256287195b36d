//! The threads that run jobs on the embedded interpreter.
//!
//! A dedicated OS thread attaches to Python once and runs jobs (`FnOnce(Python)`) sent
//! over a channel, detaching while it waits, so tokio threads never block on the GIL. Python
//! objects are created, used and dropped inside jobs on these threads; handles held elsewhere
//! (`Py<T>`) are only cloned or dropped, which PyO3 defers to an attached thread.

use std::path::Path;

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::PythonError;
use super::env::PythonSetup;

type Job = Box<dyn for<'py> FnOnce(Python<'py>) + Send>;

pub struct PythonWorker {
    jobs: Option<crossbeam_channel::Sender<Job>>,
    /// Told when the queue is closed and every job has run.
    idle: crossbeam_channel::Receiver<()>,
}

impl PythonWorker {
    /// Starts the interpreter on its own thread and prepares `sys.path` from `setup`.
    pub fn start(setup: PythonSetup) -> Result<Self, PythonError> {
        Self::spawn("python", move |py| prepare(py, &setup))
    }

    /// A second thread on this worker's interpreter, with its own queue: its jobs run while
    /// this worker's wait on the GIL, which torch releases inside its operators.
    pub fn sibling(&self, name: &str) -> Result<Self, PythonError> {
        Self::spawn(name, |_| Ok(()))
    }

    fn spawn<P>(name: &str, prepare: P) -> Result<Self, PythonError>
    where
        P: for<'py> FnOnce(Python<'py>) -> Result<(), PythonError> + Send + 'static,
    {
        let (jobs, queue) = crossbeam_channel::unbounded::<Job>();
        let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
        let (idle_tx, idle_rx) = crossbeam_channel::bounded(1);
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                Python::attach(|py| {
                    let ready = prepare(py);
                    let ok = ready.is_ok();
                    let _ = ready_tx.send(ready);
                    if !ok {
                        return;
                    }
                    while let Ok(job) = py.detach(|| queue.recv()) {
                        job(py);
                    }
                    let _ = idle_tx.send(());
                    // The thread never ends: torch keeps Python objects in thread-local
                    // storage (FSDP2's hooks, for one) whose destructors would run at the
                    // thread's exit without the GIL and abort the process. It waits, not
                    // holding the GIL, for the process to end.
                    py.detach(|| {
                        loop {
                            std::thread::park();
                        }
                    })
                });
            })
            .map_err(|err| PythonError::Setup(format!("cannot start the Python thread: {err}")))?;
        ready_rx.recv().map_err(|_| PythonError::WorkerGone)??;
        Ok(PythonWorker {
            jobs: Some(jobs),
            idle: idle_rx,
        })
    }

    /// Runs `job` on the Python thread and awaits its result without blocking the caller's
    /// thread.
    pub async fn run<R, F>(&self, job: F) -> Result<R, PythonError>
    where
        F: for<'py> FnOnce(Python<'py>) -> R + Send + 'static,
        R: Send + 'static,
    {
        let (reply, result) = tokio::sync::oneshot::channel();
        self.submit(Box::new(move |py| {
            let _ = reply.send(job(py));
        }))?;
        result.await.map_err(|_| PythonError::WorkerGone)
    }

    /// Queues `job` on the Python thread without waiting for it (it reports what it has to
    /// say itself, e.g. on a channel, possibly before it ends).
    pub fn run_detached<F>(&self, job: F) -> Result<(), PythonError>
    where
        F: for<'py> FnOnce(Python<'py>) + Send + 'static,
    {
        self.submit(Box::new(job))
    }

    /// Like [`PythonWorker::run`] for callers outside an async context.
    pub fn run_blocking<R, F>(&self, job: F) -> Result<R, PythonError>
    where
        F: for<'py> FnOnce(Python<'py>) -> R + Send + 'static,
        R: Send + 'static,
    {
        let (reply, result) = crossbeam_channel::bounded(1);
        self.submit(Box::new(move |py| {
            let _ = reply.send(job(py));
        }))?;
        result.recv().map_err(|_| PythonError::WorkerGone)
    }

    fn submit(&self, job: Job) -> Result<(), PythonError> {
        self.jobs
            .as_ref()
            .ok_or(PythonError::WorkerGone)?
            .send(job)
            .map_err(|_| PythonError::WorkerGone)
    }
}

impl Drop for PythonWorker {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop once queued jobs have run.
        drop(self.jobs.take());
        let _ = self.idle.recv();
    }
}

fn prepare(py: Python<'_>, setup: &PythonSetup) -> Result<(), PythonError> {
    let version = py.version_info();
    let site_packages = setup.site_packages(version.major, version.minor)?;
    let wrap = |err: PyErr| PythonError::from_py(py, &err);
    let sys = py.import("sys").map_err(wrap)?;
    let path = sys
        .getattr("path")
        .map_err(wrap)?
        .cast_into::<PyList>()
        .map_err(|e| wrap(e.into()))?;
    for (index, dir) in setup.paths.iter().enumerate() {
        path.insert(index, dir.to_string_lossy().as_ref())
            .map_err(wrap)?;
    }
    if let (Some(venv), Some(site_packages)) = (&setup.venv, &site_packages) {
        let site = py.import("site").map_err(wrap)?;
        if !setup.system_site_packages {
            // The interpreter started with its base prefix; a venv hides the base packages.
            let base: Vec<String> = site
                .call_method0("getsitepackages")
                .and_then(|p| p.extract())
                .map_err(wrap)?;
            for dir in base {
                while path.call_method1("remove", (&dir,)).is_ok() {}
            }
        }
        site.call_method1("addsitedir", (site_packages.to_string_lossy().as_ref(),))
            .map_err(wrap)?;
        sys.setattr("prefix", venv.to_string_lossy().as_ref())
            .map_err(wrap)?;
        sys.setattr("exec_prefix", venv.to_string_lossy().as_ref())
            .map_err(wrap)?;
        let python = venv.join("bin/python");
        if python.exists() {
            sys.setattr("executable", python.to_string_lossy().as_ref())
                .map_err(wrap)?;
        }
    }
    tracing::debug!(
        prefix = %sys.getattr("prefix").map(|p| p.to_string()).unwrap_or_default(),
        path = %path.to_string(),
        "embedded Python ready"
    );
    py.import("rollout_sdk").map_err(|err| {
        PythonError::Setup(format!(
            "cannot import rollout_sdk ({}); searched {}: run the setup in the README or set \
             ROLLOUT_VENV/ROLLOUT_HOME",
            PythonError::from_py(py, &err).summary(),
            describe_search(setup.venv.as_deref(), &setup.paths),
        ))
    })?;
    py.import("rollout_sdk.startup")
        .and_then(|startup| startup.call_method0("prepare_process"))
        .map_err(wrap)?;
    Ok(())
}

fn describe_search(venv: Option<&Path>, paths: &[std::path::PathBuf]) -> String {
    let mut parts: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    match venv {
        Some(venv) => parts.push(format!("venv {}", venv.display())),
        None => parts.push("no virtual environment found".into()),
    }
    parts.join(", ")
}
