//! One sandbox process: started in its own process group, fed one request at a time over
//! stdin, answered over stdout, killed (with its whole group) on failure or drop.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use rollout_net::messages::{FailureReason, ScoreSample};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use super::SandboxError;
use super::protocol::{Answer, RaisedKind, Request};

/// The longest line a worker may answer (a traceback, mostly).
const MAX_LINE: u64 = 16 << 20;
/// How long a killed worker may take to be reaped.
const REAP: Duration = Duration::from_secs(5);

/// How to start a worker process. It starts from an empty environment: `env`, plus the
/// variables named in `inherit` that this process has.
#[derive(Debug, Clone)]
pub struct Launch {
    pub program: std::path::PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub inherit: Vec<String>,
}

/// The variables every worker inherits: locale, paths, and what selects devices, threads
/// and local caches. Tokens (`HF_TOKEN`, cloud keys) and the cluster secret stay behind
/// unless `[sandbox] pass_environment` names them.
pub const INHERITED_ENVIRONMENT: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TORCH_HOME",
    "XDG_CACHE_HOME",
];

/// [`INHERITED_ENVIRONMENT`] and the `extra` names.
pub fn inherited_environment(extra: &[String]) -> Vec<String> {
    let mut names: Vec<String> = INHERITED_ENVIRONMENT
        .iter()
        .map(|&name| name.into())
        .collect();
    names.extend(
        extra
            .iter()
            .filter(|name| !names.contains(name))
            .cloned()
            .collect::<Vec<_>>(),
    );
    names
}

/// A sample a worker could not score, or an environment call that failed.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleFailure {
    pub reason: FailureReason,
    pub message: String,
    /// Index of the reward that failed, when the worker said.
    pub reward: Option<usize>,
    pub traceback: Option<String>,
}

/// What one scoring call came to.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// One score per reward.
    Scored(Vec<f64>),
    /// The sample failed; `replace` says the worker is gone or must not be trusted again.
    Failed {
        failure: SampleFailure,
        replace: bool,
    },
}

pub struct SandboxWorker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    next_id: u64,
}

impl SandboxWorker {
    /// Starts a worker and sends it `init` (a JSON line); waits for it to be ready.
    pub async fn start(
        launch: &Launch,
        init: &str,
        timeout: Duration,
    ) -> Result<Self, SandboxError> {
        let mut worker = Self::spawn(launch)?;
        match tokio::time::timeout(timeout, worker.exchange(init)).await {
            Err(_) => {
                worker.kill().await;
                Err(SandboxError::StartTimeout {
                    seconds: timeout.as_secs_f64(),
                })
            }
            Ok(Ok(Answer::Ready { pid })) => {
                tracing::debug!(pid = ?pid, "reward sandbox worker ready");
                Ok(worker)
            }
            Ok(Ok(Answer::LoadFailed {
                reward,
                key,
                message,
                traceback,
            })) => Err(SandboxError::LoadFailed {
                reward,
                key,
                message,
                traceback,
            }),
            Ok(Ok(other)) => Err(SandboxError::Protocol(format!(
                "expected `ready` from a starting worker, got {other:?}"
            ))),
            Ok(Err(_)) => {
                let status = worker.reap().await;
                Err(SandboxError::DiedAtStart {
                    status: describe_exit(status),
                })
            }
        }
    }

    /// The worker's process, in its own process group, with only the environment `launch`
    /// passes on.
    fn spawn(launch: &Launch) -> Result<Self, SandboxError> {
        let inherited = launch
            .inherit
            .iter()
            .filter_map(|name| std::env::var_os(name).map(|value| (name, value)));
        let mut child = Command::new(&launch.program)
            .args(&launch.args)
            .env_clear()
            .envs(inherited)
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| SandboxError::Spawn {
                program: launch.program.display().to_string(),
                source,
            })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(SandboxError::Protocol(
                "the worker has no stdin/stdout".into(),
            ));
        };
        Ok(SandboxWorker {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            next_id: 0,
        })
    }

    /// Scores `sample` with every reward, within `timeout`.
    pub async fn score(&mut self, sample: &ScoreSample, timeout: Duration) -> Outcome {
        match self.call(|id| Request::Score { id, sample }, timeout).await {
            Ok(Answer::Scored { scores, .. }) => Outcome::Scored(scores),
            Ok(other) => unexpected(&other).into(),
            Err(failure) => failure.into(),
        }
    }

    /// Sends the request `make` builds for the next call id and reads its answer, within
    /// `timeout`. A `failed` answer, a timeout, a dead worker or a protocol violation is a
    /// [`CallFailure`]; it says whether the worker must be replaced.
    pub async fn call<'r>(
        &mut self,
        make: impl FnOnce(u64) -> Request<'r>,
        timeout: Duration,
    ) -> Result<Answer, CallFailure> {
        self.next_id += 1;
        let id = self.next_id;
        let line = match serde_json::to_string(&make(id)) {
            Ok(line) => line,
            Err(err) => {
                return Err(broken(
                    FailureReason::Crashed,
                    format!("cannot encode: {err}"),
                ));
            }
        };
        match tokio::time::timeout(timeout, self.exchange(&line)).await {
            Err(_) => Err(broken(
                FailureReason::Timeout,
                format!(
                    "timed out after {} s (sandbox.timeout_seconds)",
                    timeout.as_secs_f64()
                ),
            )),
            Ok(Ok(answer)) => checked(id, answer),
            Ok(Err(SandboxError::Closed | SandboxError::Io(_))) => {
                let (reason, message) = classify_exit(self.reap().await);
                Err(broken(reason, message))
            }
            Ok(Err(err)) => {
                self.kill_group();
                Err(broken(FailureReason::Crashed, err.to_string()))
            }
        }
    }

    /// Writes one request line and reads one answer line.
    async fn exchange(&mut self, line: &str) -> Result<Answer, SandboxError> {
        self.stdin.write_all(line.as_bytes()).await?;
        self.stdin.write_all(b"\n").await?;
        self.stdin.flush().await?;
        let mut buffer = Vec::new();
        let read = (&mut self.stdout)
            .take(MAX_LINE)
            .read_until(b'\n', &mut buffer)
            .await?;
        if read == 0 {
            return Err(SandboxError::Closed);
        }
        if buffer.last() != Some(&b'\n') {
            return Err(SandboxError::Protocol(format!(
                "an answer line longer than {MAX_LINE} bytes"
            )));
        }
        serde_json::from_slice(&buffer)
            .map_err(|err| SandboxError::Protocol(format!("unreadable answer: {err}")))
    }

    /// Kills the worker's process group and reaps it.
    pub async fn kill(mut self) {
        self.kill_group();
        let _ = tokio::time::timeout(REAP, self.child.wait()).await;
    }

    /// Waits briefly for a worker whose output closed; kills it if it lingers.
    async fn reap(&mut self) -> Option<ExitStatus> {
        match tokio::time::timeout(REAP, self.child.wait()).await {
            Ok(Ok(status)) => Some(status),
            _ => {
                self.kill_group();
                None
            }
        }
    }

    fn kill_group(&mut self) {
        let group = self
            .child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(rustix::process::Pid::from_raw);
        if let Some(group) = group {
            // The group may already be gone; nothing to report then.
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
        let _ = self.child.start_kill();
    }
}

impl Drop for SandboxWorker {
    fn drop(&mut self) {
        // `kill_on_drop` ends the worker itself; this also ends anything it started.
        self.kill_group();
    }
}

/// A call that failed; `replace` says the worker is gone or must not be trusted again.
#[derive(Debug, Clone, PartialEq)]
pub struct CallFailure {
    pub failure: SampleFailure,
    pub replace: bool,
}

impl From<CallFailure> for Outcome {
    fn from(CallFailure { failure, replace }: CallFailure) -> Self {
        Outcome::Failed { failure, replace }
    }
}

/// A failure after which the worker is replaced.
fn broken(reason: FailureReason, message: String) -> CallFailure {
    CallFailure {
        failure: SampleFailure {
            reason,
            message,
            reward: None,
            traceback: None,
        },
        replace: true,
    }
}

/// An answer the caller did not expect for its request: the worker is replaced.
pub fn unexpected(answer: &Answer) -> CallFailure {
    broken(
        FailureReason::Crashed,
        format!("protocol: unexpected answer {answer:?}"),
    )
}

/// The answer to call `id`, with a plugin's `failed` answer as a [`CallFailure`].
fn checked(id: u64, answer: Answer) -> Result<Answer, CallFailure> {
    if answer.id().is_some_and(|answered| answered != id) {
        return Err(broken(
            FailureReason::Crashed,
            format!("protocol: answer for call {:?}, expected {id}", answer.id()),
        ));
    }
    match answer {
        Answer::Failed {
            reward,
            reason,
            message,
            traceback,
            ..
        } => {
            let (reason, replace) = match reason {
                RaisedKind::Raised => (FailureReason::Raised, false),
                RaisedKind::Invalid => (FailureReason::Invalid, false),
                RaisedKind::Memory => (FailureReason::Memory, true),
                RaisedKind::Crashed => (FailureReason::Crashed, false),
                RaisedKind::Timeout => (FailureReason::Timeout, false),
            };
            Err(CallFailure {
                failure: SampleFailure {
                    reason,
                    message,
                    reward,
                    traceback: Some(traceback).filter(|t| !t.is_empty()),
                },
                replace,
            })
        }
        Answer::ProtocolError { message } => Err(broken(
            FailureReason::Crashed,
            format!("protocol: the worker refused the request: {message}"),
        )),
        other => Ok(other),
    }
}

const SIGKILL: i32 = 9;
const SIGXCPU: i32 = 24;

/// Why a worker that stopped answering died: a CPU-time limit is a timeout, SIGKILL (which
/// the kernel's out-of-memory killer sends) is memory, anything else a crash.
pub fn classify_exit(status: Option<ExitStatus>) -> (FailureReason, String) {
    use std::os::unix::process::ExitStatusExt;
    let text = describe_exit(status);
    match status.and_then(|s| s.signal()) {
        Some(SIGXCPU) => (
            FailureReason::Timeout,
            format!("{text}: CPU time limit (sandbox.cpu_seconds) exceeded"),
        ),
        Some(SIGKILL) => (
            FailureReason::Memory,
            format!("{text}, most likely by the out-of-memory killer"),
        ),
        _ => (FailureReason::Crashed, format!("the worker died: {text}")),
    }
}

fn describe_exit(status: Option<ExitStatus>) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status {
        None => "the worker stopped answering and was killed".into(),
        Some(status) => match (status.code(), status.signal()) {
            (Some(code), _) => format!("exited with status {code}"),
            (None, Some(signal)) => format!("killed by signal {signal} ({})", signal_name(signal)),
            (None, None) => status.to_string(),
        },
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        SIGKILL => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        SIGXCPU => "SIGXCPU",
        _ => "signal",
    }
}
