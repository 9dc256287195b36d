#![allow(clippy::unwrap_used)]

use super::*;
use crate::roles::{DropReason, DroppedGroup, GroupRecord, ReplaceReason, ReplacedGroup};

const MINUTE: Duration = Duration::from_secs(60);

fn group(step: u64, index: u32) -> GroupRef {
    GroupRef { step, index }
}

fn lease(ledger: &mut Ledger, g: GroupRef, worker: &str) -> u64 {
    ledger.lease(g, worker, 1, Instant::now(), MINUTE).unwrap()
}

/// Leases `g` and accepts its answer.
fn answer(ledger: &mut Ledger, g: GroupRef) {
    let id = lease(ledger, g, "w");
    assert!(ledger.complete(id, Instant::now()).unwrap());
}

/// Groups `indices` trained, each with record `10 + index`.
fn trained(indices: &[u32]) -> StepGroups {
    StepGroups {
        trained: indices
            .iter()
            .map(|&group| GroupRecord {
                group,
                record: 10 + u64::from(group),
            })
            .collect(),
        ..StepGroups::default()
    }
}

fn journal(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("ledger.jsonl")
}

#[test]
fn a_revoked_lease_is_leased_again_and_its_late_answer_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = journal(&dir);
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
    ledger.trained(1, &trained(&[0, 1])).unwrap();
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
    let path = journal(&dir);
    let mut ledger = Ledger::new(Some(&path));
    answer(&mut ledger, group(1, 0));
    ledger.trained(1, &trained(&[0])).unwrap();
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
fn a_group_is_not_completed_twice_into_a_step_nor_trained_twice() {
    let mut ledger = Ledger::new(None);
    let a = lease(&mut ledger, group(2, 0), "w0");
    ledger.revoke(a, "slow").unwrap();
    let b = lease(&mut ledger, group(2, 0), "w1");
    let c = lease(&mut ledger, group(2, 0), "w2");
    assert!(ledger.complete(b, Instant::now()).unwrap());
    assert!(!ledger.complete(c, Instant::now()).unwrap());
    ledger.trained(2, &trained(&[0])).unwrap();
    let twice = ledger.trained(2, &trained(&[0])).unwrap_err();
    assert!(matches!(
        twice,
        LedgerError::TrainedTwice { step: 2, index: 0 }
    ));
}

#[test]
fn the_audit_finds_lost_and_duplicated_groups_and_honours_rollbacks() {
    let dir = tempfile::tempdir().unwrap();
    let path = journal(&dir);
    let mut ledger = Ledger::new(Some(&path));
    for step in 1..=2 {
        for index in 0..2 {
            let id = lease(&mut ledger, group(step, index), "w");
            if (step, index) != (2, 1) {
                ledger.complete(id, Instant::now()).unwrap();
            }
        }
        // Step 2's group 1 was never answered, and the controller said nothing of it.
        let answered: &[u32] = if step == 1 { &[0, 1] } else { &[0] };
        ledger.trained(step, &trained(answered)).unwrap();
    }
    let audited = audit(&path).unwrap();
    assert_eq!((audited.groups_trained, audited.groups_lost), (3, 1));

    // A restart from the checkpoint of step 1 undoes step 2; training it again is fine.
    let mut restarted = Ledger::new(Some(&path));
    restarted.rolled_back(1).unwrap();
    for index in 0..2 {
        answer(&mut restarted, group(2, index));
    }
    restarted.trained(2, &trained(&[0, 1])).unwrap();
    let audited = audit(&path).unwrap();
    assert_eq!(audited.groups_trained, 4);
    assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
    assert_eq!(audited.rollbacks, 1);

    // Without the rollback, the same journal would show step 2 trained twice.
    let text: String = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter(|line| !line.contains("rolled_back"))
        .map(|line| format!("{line}\n"))
        .collect();
    std::fs::write(&path, text).unwrap();
    assert_eq!(audit(&path).unwrap().groups_duplicated, 1);
}

/// Step 1 of four groups: group 1 came back stale and was replaced by group 4, which was
/// still stale after the last round and dropped; group 3 got no answer after its leases.
fn step_with_a_replacement_and_drops(ledger: &mut Ledger, requeued: bool) -> StepGroups {
    for index in [0, 1, 2, 4] {
        answer(ledger, group(1, index));
    }
    let id = lease(ledger, group(1, 3), "w");
    ledger.revoke(id, "lost").unwrap();
    ledger
        .abandoned(group(1, 3), "no answer after 1 leases")
        .unwrap();
    StepGroups {
        replaced: vec![ReplacedGroup {
            group: 1,
            by: 4,
            reason: ReplaceReason::Stale,
        }],
        dropped: vec![
            DroppedGroup {
                group: 3,
                record: 13,
                reason: DropReason::Attempts,
                requeued,
            },
            DroppedGroup {
                group: 4,
                record: 11,
                reason: DropReason::Stale,
                requeued,
            },
        ],
        ..trained(&[0, 2])
    }
}

#[test]
fn replaced_and_dropped_groups_are_counted_apart_from_the_trained_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = journal(&dir);
    let mut ledger = Ledger::new(Some(&path));
    let groups = step_with_a_replacement_and_drops(&mut ledger, true);
    ledger.trained(1, &groups).unwrap();
    let audited = audit(&path).unwrap();
    assert_eq!(
        (
            audited.groups_trained,
            audited.groups_replaced,
            audited.groups_dropped
        ),
        (2, 1, 2),
        "{audited:?}"
    );
    assert_eq!(
        (
            audited.groups_dropped_stale,
            audited.groups_dropped_attempts
        ),
        (1, 1)
    );
    assert_eq!((audited.groups_requeued, audited.requeued_pending), (2, 2));
    assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
    assert_eq!(audited.prompts_lost, 0);

    // Step 2 draws one of the requeued records again (as its group 0) and trains it.
    answer(&mut ledger, group(2, 0));
    let redrawn = StepGroups {
        redrawn: vec![(0, group(1, 3))],
        ..trained(&[0])
    };
    ledger.trained(2, &redrawn).unwrap();
    let audited = audit_with_steps(&path, true).unwrap();
    assert_eq!((audited.groups_redrawn, audited.requeued_pending), (1, 1));
    assert_eq!(audited.groups_trained, 3);
    let steps = audited.steps.unwrap();
    let first = &steps[0];
    let groups: Vec<(u32, Option<u64>)> =
        first.trained.iter().map(|t| (t.group, t.record)).collect();
    assert_eq!(groups, [(0, Some(10)), (2, Some(12))]);
    assert_eq!((first.replaced[0].group, first.replaced[0].by), (1, 4));
    let dropped: Vec<(u32, &str)> = first
        .dropped
        .iter()
        .map(|d| (d.group, d.reason.as_str()))
        .collect();
    assert_eq!(dropped, [(3, "attempts"), (4, "stale")]);
    assert_eq!(steps[1].redrawn[0].from, group(1, 3));
}

#[test]
fn with_strict_data_order_dropped_prompts_are_reported_lost_never_trained() {
    let dir = tempfile::tempdir().unwrap();
    let path = journal(&dir);
    let mut ledger = Ledger::new(Some(&path));
    let groups = step_with_a_replacement_and_drops(&mut ledger, false);
    ledger.trained(1, &groups).unwrap();
    let audited = audit(&path).unwrap();
    assert_eq!((audited.groups_trained, audited.groups_dropped), (2, 2));
    assert_eq!((audited.groups_requeued, audited.prompts_lost), (0, 2));
    assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
}

#[test]
fn a_group_both_trained_and_dropped_or_answered_and_unaccounted_fails_the_audit() {
    let dir = tempfile::tempdir().unwrap();
    let path = journal(&dir);
    let mut ledger = Ledger::new(Some(&path));
    let mut groups = step_with_a_replacement_and_drops(&mut ledger, true);
    // Counting the dropped group 4 as trained too (what the ledger did before).
    groups.trained.push(GroupRecord {
        group: 4,
        record: 11,
    });
    ledger.trained(1, &groups).unwrap();
    // Forgetting the replaced group 1 altogether.
    for index in 0..2 {
        answer(&mut ledger, group(2, index));
    }
    ledger.trained(2, &trained(&[1])).unwrap();
    let audited = audit(&path).unwrap();
    assert_eq!((audited.groups_duplicated, audited.groups_lost), (1, 1));
}

#[test]
fn a_rollback_puts_a_requeued_record_drawn_by_an_undone_update_back_in_the_queue() {
    let dir = tempfile::tempdir().unwrap();
    let path = journal(&dir);
    let mut ledger = Ledger::new(Some(&path));
    let groups = step_with_a_replacement_and_drops(&mut ledger, true);
    ledger.trained(1, &groups).unwrap();
    answer(&mut ledger, group(2, 0));
    let redrawn = StepGroups {
        redrawn: vec![(0, group(1, 3)), (1, group(1, 4))],
        ..trained(&[0])
    };
    let step_two = StepGroups {
        dropped: vec![DroppedGroup {
            group: 1,
            record: 11,
            reason: DropReason::Attempts,
            requeued: true,
        }],
        ..redrawn
    };
    let id = lease(&mut ledger, group(2, 1), "w");
    ledger.revoke(id, "lost").unwrap();
    ledger.abandoned(group(2, 1), "no answer").unwrap();
    ledger.trained(2, &step_two).unwrap();
    let audited = audit(&path).unwrap();
    assert_eq!((audited.groups_redrawn, audited.requeued_pending), (2, 1));
    assert_eq!((audited.groups_requeued, audited.groups_lost), (3, 0));

    let mut restarted = Ledger::new(Some(&path));
    restarted.rolled_back(1).unwrap();
    let audited = audit(&path).unwrap();
    assert_eq!((audited.groups_redrawn, audited.requeued_pending), (0, 2));
    assert_eq!((audited.groups_trained, audited.groups_requeued), (2, 2));
}

#[test]
fn a_multi_turn_step_accounts_for_its_turns_by_lease() {
    let dir = tempfile::tempdir().unwrap();
    let path = journal(&dir);
    let mut ledger = Ledger::new(Some(&path));
    // Two groups of one episode, two turns each: four leased units.
    for unit in 0..4 {
        answer(&mut ledger, group(1, unit));
    }
    let id = lease(&mut ledger, group(1, 4), "w");
    ledger.revoke(id, "lost").unwrap();
    let groups = StepGroups {
        per_turn: true,
        ..trained(&[0, 1])
    };
    ledger.trained(1, &groups).unwrap();
    let audited = audit(&path).unwrap();
    assert_eq!((audited.groups_trained, audited.groups_lost), (2, 1));
}

#[test]
fn a_journal_of_an_earlier_version_is_audited_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let path = journal(&dir);
    let lines = [
        r#"{"at":1.0,"event":"leased","lease":1,"group":{"step":1,"index":0},"worker":"w","attempt":1}"#,
        r#"{"at":1.0,"event":"leased","lease":2,"group":{"step":1,"index":1},"worker":"w","attempt":1}"#,
        r#"{"at":1.0,"event":"completed","lease":1}"#,
        r#"{"at":1.0,"event":"revoked","lease":2,"reason":"w: lost"}"#,
        r#"{"at":1.0,"event":"dropped","group":{"step":1,"index":1},"reason":"no answer after 1 leases"}"#,
        r#"{"at":1.0,"event":"trained","step":1,"groups":[0]}"#,
    ];
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let audited = audit(&path).unwrap();
    assert_eq!(
        (
            audited.groups_trained,
            audited.groups_dropped_attempts,
            audited.prompts_lost
        ),
        (1, 1, 1)
    );
    assert_eq!((audited.groups_lost, audited.groups_duplicated), (0, 0));
}
