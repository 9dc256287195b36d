//! The controller's record of every prompt group handed to a generation worker.
//!
//! A group handed out is a lease (id, worker, attempt, deadline). A worker that is lost or
//! misses a deadline loses its leases and their groups are leased again; an answer under a
//! lease that is no longer held is rejected, so no group is generated into a step twice. A
//! group whose attempts run out is dropped, with the reason. When a step's update is
//! trained the ledger records which groups went into it; every event is appended to a
//! journal (JSON lines) that is fsynced at step boundaries, and [`audit`] reads it back.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rollout_net::messages::GroupRef;
use serde::{Deserialize, Serialize};

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
    /// The group's attempts ran out: its step trains without it.
    Dropped {
        group: GroupRef,
        reason: String,
    },
    /// These groups of `step` went into the update of `step`.
    Trained {
        step: u64,
        groups: Vec<u32>,
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

    /// `group` will not be generated: its step trains without it.
    pub fn dropped(&mut self, group: GroupRef, reason: &str) -> Result<(), LedgerError> {
        self.record(LedgerEvent::Dropped {
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

    /// Records that the groups answered for `step` went into its update, and makes the
    /// journal durable.
    pub fn trained(&mut self, step: u64) -> Result<Vec<u32>, LedgerError> {
        let groups: Vec<u32> = self
            .completed
            .remove(&step)
            .unwrap_or_default()
            .into_iter()
            .collect();
        for &index in &groups {
            if !self.trained.insert(GroupRef { step, index }) {
                return Err(LedgerError::TrainedTwice { step, index });
            }
        }
        self.record(LedgerEvent::Trained {
            step,
            groups: groups.clone(),
        })?;
        self.sync()?;
        Ok(groups)
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

/// What a journal proves about a run.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct Audit {
    /// Groups whose update stands (not rolled back), once each.
    pub groups_trained: u64,
    /// Groups in a standing update more than once.
    pub groups_duplicated: u64,
    /// Groups leased for a step whose update stands, but neither trained nor dropped.
    pub groups_lost: u64,
    pub groups_dropped: u64,
    pub leases: u64,
    pub leases_revoked: u64,
    pub answers_rejected: u64,
    pub rollbacks: u64,
}

/// Reads a journal back and checks that every group of every standing update was trained
/// exactly once (or dropped with a reason).
pub fn audit(path: &Path) -> Result<Audit, LedgerError> {
    let file = std::fs::File::open(path).map_err(|source| LedgerError::Journal {
        path: path.to_owned(),
        source,
    })?;
    let mut audit = Audit::default();
    let mut leased: BTreeSet<GroupRef> = BTreeSet::new();
    let mut dropped: BTreeSet<GroupRef> = BTreeSet::new();
    let mut trained: BTreeMap<GroupRef, u64> = BTreeMap::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| LedgerError::Journal {
            path: path.to_owned(),
            source,
        })?;
        let entry: Entry = serde_json::from_str(&line).map_err(|err| LedgerError::Corrupt {
            path: path.to_owned(),
            line: number + 1,
            reason: err.to_string(),
        })?;
        match entry.event {
            LedgerEvent::Leased { group, .. } => {
                audit.leases += 1;
                leased.insert(group);
            }
            LedgerEvent::Revoked { .. } => audit.leases_revoked += 1,
            LedgerEvent::Rejected { .. } => audit.answers_rejected += 1,
            LedgerEvent::Dropped { group, .. } => {
                dropped.insert(group);
            }
            LedgerEvent::Trained { step, groups } => {
                for index in groups {
                    *trained.entry(GroupRef { step, index }).or_default() += 1;
                }
            }
            LedgerEvent::RolledBack { step } => {
                audit.rollbacks += 1;
                trained.retain(|group, _| group.step <= step);
            }
            LedgerEvent::Completed { .. } => {}
        }
    }
    let standing: BTreeSet<u64> = trained.keys().map(|group| group.step).collect();
    audit.groups_trained = trained.len() as u64;
    audit.groups_duplicated = trained.values().filter(|&&times| times > 1).count() as u64;
    audit.groups_dropped = dropped.len() as u64;
    audit.groups_lost = leased
        .iter()
        .filter(|group| standing.contains(&group.step))
        .filter(|group| !trained.contains_key(group) && !dropped.contains(group))
        .count() as u64;
    Ok(audit)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn group(step: u64, index: u32) -> GroupRef {
        GroupRef { step, index }
    }

    fn lease(ledger: &mut Ledger, g: GroupRef, worker: &str) -> u64 {
        ledger.lease(g, worker, 1, Instant::now(), MINUTE).unwrap()
    }

    #[test]
    fn a_revoked_lease_is_leased_again_and_its_late_answer_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.jsonl");
        let mut ledger = Ledger::new(Some(&path));
        let first = lease(&mut ledger, group(1, 0), "worker-0");
        let other = lease(&mut ledger, group(1, 1), "worker-1");
        assert_eq!(
            ledger.revoke(first, "lost").unwrap(),
            Some(group(1, 0)),
            "revoking gives the group back"
        );
        let second = lease(&mut ledger, group(1, 0), "worker-1");
        assert!(!ledger.complete(first, Instant::now()).unwrap());
        assert!(ledger.complete(second, Instant::now()).unwrap());
        assert!(ledger.complete(other, Instant::now()).unwrap());
        assert_eq!(ledger.trained(1).unwrap(), vec![0, 1]);
        let counts = ledger.take_counts();
        assert_eq!((counts.leased, counts.revoked, counts.rejected), (3, 1, 1));

        let audit = audit(&path).unwrap();
        assert_eq!(audit.groups_trained, 2);
        assert_eq!((audit.groups_lost, audit.groups_duplicated), (0, 0));
        assert_eq!(
            (audit.leases, audit.leases_revoked, audit.answers_rejected),
            (3, 1, 1)
        );
    }

    #[test]
    fn a_torn_last_line_is_cut_before_appending() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.jsonl");
        let mut ledger = Ledger::new(Some(&path));
        let id = lease(&mut ledger, group(1, 0), "w");
        ledger.complete(id, Instant::now()).unwrap();
        ledger.trained(1).unwrap();
        drop(ledger);
        let mut text = std::fs::read(&path).unwrap();
        text.extend_from_slice(br#"{"at":1.0,"event":"lea"#);
        std::fs::write(&path, text).unwrap();
        let mut restarted = Ledger::new(Some(&path));
        restarted.rolled_back(1).unwrap();
        let audited = audit(&path).unwrap();
        assert_eq!((audited.groups_trained, audited.rollbacks), (1, 1));
    }

    #[test]
    fn an_answer_after_the_deadline_is_rejected() {
        let mut ledger = Ledger::new(None);
        let start = Instant::now();
        let id = ledger
            .lease(group(1, 0), "w", 1, start, Duration::from_millis(10))
            .unwrap();
        assert!(!ledger.complete(id, start + Duration::from_secs(1)).unwrap());
    }

    #[test]
    fn a_group_is_not_completed_twice_into_a_step() {
        let mut ledger = Ledger::new(None);
        let a = lease(&mut ledger, group(2, 0), "w0");
        ledger.revoke(a, "slow").unwrap();
        let b = lease(&mut ledger, group(2, 0), "w1");
        let c = lease(&mut ledger, group(2, 0), "w2");
        assert!(ledger.complete(b, Instant::now()).unwrap());
        assert!(!ledger.complete(c, Instant::now()).unwrap());
        assert_eq!(ledger.trained(2).unwrap(), vec![0]);
    }

    #[test]
    fn the_audit_finds_lost_and_duplicated_groups_and_honours_rollbacks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.jsonl");
        let mut ledger = Ledger::new(Some(&path));
        for step in 1..=2 {
            for index in 0..2 {
                let id = lease(&mut ledger, group(step, index), "w");
                if (step, index) != (2, 1) {
                    ledger.complete(id, Instant::now()).unwrap();
                }
            }
            if step == 1 {
                ledger
                    .dropped(group(1, 2), "no answer after 3 leases")
                    .unwrap();
            }
            ledger.trained(step).unwrap();
        }
        let audited = audit(&path).unwrap();
        assert_eq!((audited.groups_trained, audited.groups_lost), (3, 1));
        assert_eq!(audited.groups_dropped, 1);

        // A restart from the checkpoint of step 1 undoes step 2; training it again is fine.
        let mut restarted = Ledger::new(Some(&path));
        restarted.rolled_back(1).unwrap();
        for index in 0..2 {
            let id = lease(&mut restarted, group(2, index), "w");
            restarted.complete(id, Instant::now()).unwrap();
        }
        restarted.trained(2).unwrap();
        let audited = audit(&path).unwrap();
        assert_eq!(audited.groups_trained, 4);
        assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
        assert_eq!(audited.rollbacks, 1);

        // Without the rollback, the same journal would show step 2 trained twice.
        let mut text = std::fs::read_to_string(&path).unwrap();
        text = text
            .lines()
            .filter(|line| !line.contains("rolled_back"))
            .map(|line| format!("{line}\n"))
            .collect();
        std::fs::write(&path, text).unwrap();
        assert_eq!(audit(&path).unwrap().groups_duplicated, 1);
    }
}
