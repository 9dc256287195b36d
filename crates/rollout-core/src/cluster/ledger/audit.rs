//! What a ledger journal proves about a run: for every standing update (not rolled back),
//! exactly which groups went into it, which were replaced (and by which group) and which
//! were dropped; that every group leased for it is accounted for once; and what became of
//! the records of dropped groups.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::BufRead;
use std::path::Path;

use rollout_net::messages::GroupRef;
use serde::Serialize;

use super::{Entry, LedgerError, LedgerEvent};

/// What a journal proves about a run.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct Audit {
    /// Groups whose samples went into a standing update, once each: the groups of
    /// `samples.jsonl` (when it logs every sample).
    pub groups_trained: u64,
    /// Groups generated for a standing update that another group of the step replaced
    /// (generated past the staleness bound, or without reward spread).
    pub groups_replaced: u64,
    /// Groups left out of a standing update, in all and by reason: still stale after the
    /// last round of regeneration, or no answer after their last lease.
    pub groups_dropped: u64,
    pub groups_dropped_stale: u64,
    pub groups_dropped_attempts: u64,
    /// Dropped groups whose record went back to the data queue for a later step.
    pub groups_requeued: u64,
    /// Groups of standing updates that carry a requeued record.
    pub groups_redrawn: u64,
    /// Requeued records not drawn again when the journal ends (the run ended first).
    pub requeued_pending: u64,
    /// Dropped groups whose record was not requeued (`cluster.dropped_groups = "skip"`, or
    /// a journal of an earlier version): prompts the run did not train.
    pub prompts_lost: u64,
    /// Groups accounted for more than once in standing updates: trained twice, trained and
    /// also replaced or dropped, or a requeued record drawn again twice.
    pub groups_duplicated: u64,
    /// Groups leased for a standing update but neither trained, replaced nor dropped.
    pub groups_lost: u64,
    pub leases: u64,
    pub leases_revoked: u64,
    pub answers_rejected: u64,
    pub rollbacks: u64,
    /// `rollout audit --groups`: what each standing update holds, step by step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<StepAudit>>,
}

/// One standing update, group by group.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct StepAudit {
    pub step: u64,
    /// The groups whose samples went into it.
    pub trained: Vec<TrainedGroup>,
    pub replaced: Vec<ReplacedGroup>,
    pub dropped: Vec<DroppedGroup>,
    pub redrawn: Vec<RedrawnGroup>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrainedGroup {
    pub group: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplacedGroup {
    pub group: u32,
    pub by: u32,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DroppedGroup {
    pub group: u32,
    pub reason: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record: Option<u64>,
    pub requeued: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RedrawnGroup {
    pub group: u32,
    pub from: GroupRef,
}

/// What the journal holds about one step since the last rollback past it.
#[derive(Default)]
struct StepLog {
    leased: BTreeSet<u32>,
    answered: BTreeSet<u32>,
    abandoned: BTreeSet<u32>,
    /// Trained groups: how many updates held each, and its record.
    trained: BTreeMap<u32, (u64, Option<u64>)>,
    replaced: BTreeMap<u32, ReplacedGroup>,
    dropped: BTreeMap<u32, DroppedGroup>,
    redrawn: Vec<RedrawnGroup>,
    /// Groups replaced or dropped more than once.
    recorded_twice: BTreeSet<u32>,
    /// A `trained` event stands for it.
    standing: bool,
    per_turn: bool,
}

impl StepLog {
    fn replaced(&mut self, replaced: ReplacedGroup) {
        let group = replaced.group;
        if self.replaced.insert(group, replaced).is_some() {
            self.recorded_twice.insert(group);
        }
    }

    fn dropped(&mut self, dropped: DroppedGroup) {
        let group = dropped.group;
        if self.dropped.insert(group, dropped).is_some() {
            self.recorded_twice.insert(group);
        }
    }
}

/// The journal read back: each step's log and the lease counts.
#[derive(Default)]
struct Journal {
    steps: BTreeMap<u64, StepLog>,
    leases: HashMap<u64, GroupRef>,
    counts: Audit,
}

/// Reads a journal back and checks that every group of every standing update was trained,
/// replaced or dropped, exactly once.
pub fn audit(path: &Path) -> Result<Audit, LedgerError> {
    audit_with_steps(path, false)
}

/// [`audit`], with each standing update's groups listed when `steps` is set.
pub fn audit_with_steps(path: &Path, steps: bool) -> Result<Audit, LedgerError> {
    let file = std::fs::File::open(path).map_err(|source| LedgerError::Journal {
        path: path.to_owned(),
        source,
    })?;
    let mut journal = Journal::default();
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
        journal.read(entry.event);
    }
    Ok(journal.summary(steps))
}

impl Journal {
    fn step(&mut self, step: u64) -> &mut StepLog {
        self.steps.entry(step).or_default()
    }

    fn read(&mut self, event: LedgerEvent) {
        match event {
            LedgerEvent::Leased { lease, group, .. } => {
                self.counts.leases += 1;
                self.leases.insert(lease, group);
                self.step(group.step).leased.insert(group.index);
            }
            LedgerEvent::Completed { lease } => {
                if let Some(group) = self.leases.get(&lease).copied() {
                    self.step(group.step).answered.insert(group.index);
                }
            }
            LedgerEvent::Revoked { .. } => self.counts.leases_revoked += 1,
            LedgerEvent::Rejected { .. } => self.counts.answers_rejected += 1,
            LedgerEvent::Abandoned { group, .. } => {
                self.step(group.step).abandoned.insert(group.index);
            }
            LedgerEvent::Replaced {
                step,
                group,
                by,
                reason,
            } => self
                .step(step)
                .replaced(ReplacedGroup { group, by, reason }),
            LedgerEvent::Dropped {
                group,
                reason,
                record,
                requeued,
            } => self.step(group.step).dropped(DroppedGroup {
                group: group.index,
                reason,
                record,
                requeued,
            }),
            LedgerEvent::Redrawn { step, group, from } => {
                self.step(step).redrawn.push(RedrawnGroup { group, from });
            }
            LedgerEvent::Trained {
                step,
                groups,
                records,
                per_turn,
            } => self.trained(step, &groups, &records, per_turn),
            LedgerEvent::RolledBack { step } => {
                self.counts.rollbacks += 1;
                // What was journaled for later steps belongs to updates that were undone.
                self.steps.retain(|&s, _| s <= step);
            }
        }
    }

    fn trained(&mut self, step: u64, groups: &[u32], records: &[u64], per_turn: bool) {
        let log = self.step(step);
        log.standing = true;
        log.per_turn = per_turn;
        for (position, &group) in groups.iter().enumerate() {
            let trained = log.trained.entry(group).or_default();
            trained.0 += 1;
            trained.1 = records.get(position).copied();
        }
    }

    fn summary(mut self, with_steps: bool) -> Audit {
        let mut audit = std::mem::take(&mut self.counts);
        let standing: Vec<(u64, StepLog)> = std::mem::take(&mut self.steps)
            .into_iter()
            .filter(|(_, log)| log.standing)
            .collect();
        let mut requeued = BTreeSet::new();
        let mut drawn_again: BTreeMap<GroupRef, u64> = BTreeMap::new();
        for (step, log) in &standing {
            count_step(&mut audit, log);
            for dropped in log.dropped.values().filter(|d| d.requeued) {
                requeued.insert(GroupRef {
                    step: *step,
                    index: dropped.group,
                });
            }
            for redrawn in &log.redrawn {
                *drawn_again.entry(redrawn.from).or_default() += 1;
            }
        }
        audit.groups_redrawn = drawn_again.values().sum();
        audit.groups_duplicated += drawn_again.values().filter(|&&n| n > 1).count() as u64;
        audit.requeued_pending = requeued
            .iter()
            .filter(|from| !drawn_again.contains_key(from))
            .count() as u64;
        if with_steps {
            audit.steps = Some(standing.into_iter().map(step_audit).collect());
        }
        audit
    }
}

/// Adds one standing update's groups to `audit`.
fn count_step(audit: &mut Audit, log: &StepLog) {
    audit.groups_trained += log.trained.len() as u64;
    audit.groups_replaced += log.replaced.len() as u64;
    audit.groups_dropped += log.dropped.len() as u64;
    for dropped in log.dropped.values() {
        if dropped.reason == "stale" {
            audit.groups_dropped_stale += 1;
        } else {
            audit.groups_dropped_attempts += 1;
        }
        if dropped.requeued {
            audit.groups_requeued += 1;
        } else {
            audit.prompts_lost += 1;
        }
    }
    let accounted: BTreeSet<u32> = log
        .trained
        .keys()
        .chain(log.replaced.keys())
        .chain(log.dropped.keys())
        .copied()
        .collect();
    audit.groups_duplicated += accounted
        .iter()
        .filter(|group| {
            let trained = log.trained.get(group).map_or(0, |&(times, _)| times);
            let others = u64::from(log.replaced.contains_key(group))
                + u64::from(log.dropped.contains_key(group))
                + u64::from(log.recorded_twice.contains(group));
            trained + others > 1
        })
        .count() as u64;
    // A multi-turn run leases episode turns, not groups: each leased turn must have been
    // answered or abandoned. Otherwise each leased group must be accounted for.
    let lost = if log.per_turn {
        log.leased
            .iter()
            .filter(|unit| !log.answered.contains(unit) && !log.abandoned.contains(unit))
            .count()
    } else {
        log.leased
            .union(&log.abandoned)
            .filter(|group| !accounted.contains(group))
            .count()
    };
    audit.groups_lost += lost as u64;
}

fn step_audit((step, log): (u64, StepLog)) -> StepAudit {
    StepAudit {
        step,
        trained: log
            .trained
            .into_iter()
            .map(|(group, (_, record))| TrainedGroup { group, record })
            .collect(),
        replaced: log.replaced.into_values().collect(),
        dropped: log.dropped.into_values().collect(),
        redrawn: log.redrawn,
    }
}
