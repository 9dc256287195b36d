//! The controller's record of every prompt group handed to a generation worker, and of what
//! became of it.
//!
//! A group handed out is a lease (id, worker, attempt, deadline). A worker that is lost or
//! misses a deadline loses its leases and their groups are leased again; an answer under a
//! lease that is no longer held is rejected, so no group is generated into a step twice. A
//! group whose attempts run out is abandoned, with the reason. When a step's update is
//! trained the controller tells the ledger exactly which groups went into it, which were
//! replaced (and by which group) and which were dropped (and whether their record went back
//! to the data queue). Every event is appended to a journal (JSON lines) that is fsynced at
//! step boundaries, and [`audit`] reads it back.

mod audit;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rollout_net::messages::GroupRef;
use serde::{Deserialize, Serialize};

use crate::roles::StepGroups;

pub use audit::{Audit, StepAudit, audit, audit_with_steps};

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("cannot write the ledger journal {path}: {source}")]
    Journal {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the ledger journal {path} line {line} is not a ledger event: {reason}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("step {step} group {index} would be trained a second time")]
    TrainedTwice { step: u64, index: u32 },
}

/// What happened to a lease or a group, as the journal records it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum LedgerEvent {
    Leased {
        lease: u64,
        group: GroupRef,
        worker: String,
        attempt: u32,
    },
    Completed {
        lease: u64,
    },
    /// The worker holding it was lost or missed the deadline; the group is leased again.
    Revoked {
        lease: u64,
        reason: String,
    },
    /// An answer arrived under a lease no longer held, and was thrown away.
    Rejected {
        lease: u64,
    },
    /// No answer after the group's last lease: the pool gives up on it (the controller then
    /// records the group as dropped).
    Abandoned {
        group: GroupRef,
        reason: String,
    },
    /// Group `group` of `step` was generated but not trained: group `by` of the same step
    /// took its place (`reason`: "stale" or "flat").
    Replaced {
        step: u64,
        group: u32,
        by: u32,
        reason: String,
    },
    /// The group was left out of its step's update (`reason`: "stale" or "attempts"); with
    /// `requeued`, its record went back to the data queue for a later step. (Journals of
    /// earlier versions hold the pool's drops here, with the reason in words.)
    Dropped {
        group: GroupRef,
        reason: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        record: Option<u64>,
        #[serde(default)]
        requeued: bool,
    },
    /// Group `group` of `step` carries the record of group `from`, dropped and requeued.
    Redrawn {
        step: u64,
        group: u32,
        from: GroupRef,
    },
    /// Exactly these groups of `step` (with their records) went into the update of `step`.
    Trained {
        step: u64,
        groups: Vec<u32>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        records: Vec<u64>,
        /// Leases were per episode turn: lease indices are not group indices.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        per_turn: bool,
    },
    /// The learner's weights hold the updates up to `step` and no later ones (a resume
    /// from a checkpoint of `step`): what was trained after it was undone.
    RolledBack {
        step: u64,
    },
}

/// A journal line: the event and when it was recorded (seconds since the Unix epoch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub at: f64,
    #[serde(flatten)]
    pub event: LedgerEvent,
}

struct Lease {
    group: GroupRef,
    worker: String,
    deadline: Instant,
}

/// Append-only JSON lines, fsynced by [`Journal::sync`]; the file is created by the first
/// event, once the run's output directory has been checked.
struct Journal {
    path: PathBuf,
    file: Option<std::io::BufWriter<std::fs::File>>,
}

impl Journal {
    fn fail(&self, source: std::io::Error) -> LedgerError {
        LedgerError::Journal {
            path: self.path.clone(),
            source,
        }
    }

    fn append(&mut self, event: &LedgerEvent) -> Result<(), LedgerError> {
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |since| since.as_secs_f64());
        let entry = Entry {
            at,
            event: event.clone(),
        };
        let line = serde_json::to_string(&entry).map_err(|err| self.fail(err.into()))?;
        if self.file.is_none() {
            let file = open_without_torn_tail(&self.path).map_err(|err| self.fail(err))?;
            self.file = Some(std::io::BufWriter::new(file));
        }
        let written = match &mut self.file {
            Some(file) => writeln!(file, "{line}"),
            None => Ok(()),
        };
        written.map_err(|err| self.fail(err))
    }

    fn sync(&mut self) -> Result<(), LedgerError> {
        let Some(file) = &mut self.file else {
            return Ok(());
        };
        let synced = file.flush().and_then(|()| file.get_ref().sync_data());
        synced.map_err(|err| self.fail(err))
    }
}

/// Opens the journal for appending. A controller killed mid-write can leave half a line at
/// the end; it is cut off (only whole lines were ever synced as events).
fn open_without_torn_tail(path: &Path) -> std::io::Result<std::fs::File> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(path)?;
    let length = file.metadata()?.len();
    let mut tail = Vec::new();
    let from = length.saturating_sub(64 * 1024);
    file.seek(SeekFrom::Start(from))?;
    file.read_to_end(&mut tail)?;
    if tail.last().is_some_and(|&byte| byte != b'\n') {
        let keep = match tail.iter().rposition(|&byte| byte == b'\n') {
            Some(newline) => from + newline as u64 + 1,
            None if from == 0 => 0,
            None => return Ok(file),
        };
        file.set_len(keep)?;
    }
    Ok(file)
}

/// Counts since the last [`Ledger::take_counts`], for the step's metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LedgerCounts {
    pub leased: u64,
    pub revoked: u64,
    pub rejected: u64,
}

pub struct Ledger {
    next_lease: u64,
    leases: HashMap<u64, Lease>,
    /// Groups answered, by step, waiting for their step's update.
    completed: BTreeMap<u64, BTreeSet<u32>>,
    trained: BTreeSet<GroupRef>,
    counts: LedgerCounts,
    journal: Option<Journal>,
}

impl Ledger {
    /// A ledger journaled to `journal` (appended to, so a restarted controller continues
    /// the same journal).
    pub fn new(journal: Option<&Path>) -> Self {
        Self {
            next_lease: 1,
            leases: HashMap::new(),
            completed: BTreeMap::new(),
            trained: BTreeSet::new(),
            counts: LedgerCounts::default(),
            journal: journal.map(|path| Journal {
                path: path.to_owned(),
                file: None,
            }),
        }
    }

    fn record(&mut self, event: LedgerEvent) -> Result<(), LedgerError> {
        match &mut self.journal {
            Some(journal) => journal.append(&event),
            None => Ok(()),
        }
    }

    /// Hands `group` to `worker` (its `attempt`-th lease) until `timeout` from `now`.
    pub fn lease(
        &mut self,
        group: GroupRef,
        worker: &str,
        attempt: u32,
        now: Instant,
        timeout: Duration,
    ) -> Result<u64, LedgerError> {
        let lease = self.next_lease;
        self.next_lease += 1;
        self.leases.insert(
            lease,
            Lease {
                group,
                worker: worker.to_owned(),
                deadline: now + timeout,
            },
        );
        self.counts.leased += 1;
        self.record(LedgerEvent::Leased {
            lease,
            group,
            worker: worker.to_owned(),
            attempt,
        })?;
        Ok(lease)
    }

    /// `group` got no answer after its last lease: it will not be generated.
    pub fn abandoned(&mut self, group: GroupRef, reason: &str) -> Result<(), LedgerError> {
        self.record(LedgerEvent::Abandoned {
            group,
            reason: reason.to_owned(),
        })
    }

    /// Accepts the answer to `lease` if the lease is still held and in time; `false` means
    /// it was rejected and must be thrown away.
    pub fn complete(&mut self, lease: u64, now: Instant) -> Result<bool, LedgerError> {
        let held = self
            .leases
            .get(&lease)
            .is_some_and(|held| now <= held.deadline);
        let Some(held) = self.leases.remove(&lease).filter(|_| held) else {
            self.counts.rejected += 1;
            self.record(LedgerEvent::Rejected { lease })?;
            return Ok(false);
        };
        let fresh = self
            .completed
            .entry(held.group.step)
            .or_default()
            .insert(held.group.index);
        if !fresh {
            self.counts.rejected += 1;
            self.record(LedgerEvent::Rejected { lease })?;
            return Ok(false);
        }
        self.record(LedgerEvent::Completed { lease })?;
        Ok(true)
    }

    /// Takes back `lease` (its worker was lost or is too slow); its group may be leased again.
    pub fn revoke(&mut self, lease: u64, reason: &str) -> Result<Option<GroupRef>, LedgerError> {
        let Some(held) = self.leases.remove(&lease) else {
            return Ok(None);
        };
        self.counts.revoked += 1;
        self.record(LedgerEvent::Revoked {
            lease,
            reason: format!("{}: {reason}", held.worker),
        })?;
        Ok(Some(held.group))
    }

    /// Records what became of the groups of `step` (`groups`: exactly those whose samples
    /// went into its update, those replaced and those dropped), and makes the journal
    /// durable.
    pub fn trained(&mut self, step: u64, groups: &StepGroups) -> Result<(), LedgerError> {
        self.completed.remove(&step);
        for trained in &groups.trained {
            let group = GroupRef {
                step,
                index: trained.group,
            };
            if !self.trained.insert(group) {
                return Err(LedgerError::TrainedTwice {
                    step,
                    index: trained.group,
                });
            }
        }
        for event in step_events(step, groups) {
            self.record(event)?;
        }
        self.sync()
    }

    /// The learner restarted from the checkpoint of `step`: later updates are undone.
    pub fn rolled_back(&mut self, step: u64) -> Result<(), LedgerError> {
        self.trained.retain(|group| group.step <= step);
        self.completed.retain(|&s, _| s <= step);
        self.record(LedgerEvent::RolledBack { step })?;
        self.sync()
    }

    fn sync(&mut self) -> Result<(), LedgerError> {
        match &mut self.journal {
            Some(journal) => journal.sync(),
            None => Ok(()),
        }
    }

    pub fn take_counts(&mut self) -> LedgerCounts {
        std::mem::take(&mut self.counts)
    }
}

/// The journal events of what became of the groups of `step`, the update's last.
fn step_events(step: u64, groups: &StepGroups) -> Vec<LedgerEvent> {
    let redrawn = groups
        .redrawn
        .iter()
        .map(|&(group, from)| LedgerEvent::Redrawn { step, group, from });
    let replaced = groups.replaced.iter().map(|r| LedgerEvent::Replaced {
        step,
        group: r.group,
        by: r.by,
        reason: r.reason.as_str().to_owned(),
    });
    let dropped = groups.dropped.iter().map(|d| LedgerEvent::Dropped {
        group: GroupRef {
            step,
            index: d.group,
        },
        reason: d.reason.as_str().to_owned(),
        record: Some(d.record),
        requeued: d.requeued,
    });
    let trained = LedgerEvent::Trained {
        step,
        groups: groups.trained.iter().map(|t| t.group).collect(),
        records: groups.trained.iter().map(|t| t.record).collect(),
        per_turn: groups.per_turn,
    };
    redrawn
        .chain(replaced)
        .chain(dropped)
        .chain(std::iter::once(trained))
        .collect()
}

#[cfg(test)]
mod tests;
