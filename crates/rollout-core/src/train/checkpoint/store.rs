//! Atomic, verifiable checkpoints.
//!
//! A checkpoint is written into `step-NNNNNNNN.partial/`, every file is hashed into
//! `manifest.json`, files and directories are synced, and only then is the directory renamed
//! to `step-NNNNNNNN/` and the `latest` pointer replaced (write-then-rename). A crash at any
//! moment leaves the previous checkpoint and pointer intact; resume verifies sizes and hashes
//! and falls back to the newest checkpoint that verifies.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::train::state::{RunState, STATE_FORMAT};

const MANIFEST: &str = "manifest.json";
const STATE: &str = "state.json";
const LATEST: &str = "latest";
const PARTIAL_SUFFIX: &str = ".partial";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint I/O on {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint {} is invalid: {reason}", path.display())]
    Invalid { path: PathBuf, reason: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    step: u64,
    files: Vec<ManifestFile>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ManifestFile {
    path: String,
    bytes: u64,
    blake3: String,
}

/// The `checkpoints/` directory of a run.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    root: PathBuf,
    keep: usize,
}

/// A checkpoint being written; invisible to resume until [`PendingCheckpoint::commit`].
#[derive(Debug)]
pub struct PendingCheckpoint {
    partial: PathBuf,
    step: u64,
}

impl PendingCheckpoint {
    /// Where the policy writes its files.
    pub fn policy_dir(&self) -> PathBuf {
        self.partial.join("policy")
    }
}

/// A checkpoint that verified.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub state: RunState,
}

impl Checkpoint {
    pub fn policy_dir(&self) -> PathBuf {
        self.dir.join("policy")
    }
}

impl CheckpointStore {
    pub fn new(root: PathBuf, keep: usize) -> Self {
        CheckpointStore {
            root,
            keep: keep.max(1),
        }
    }

    fn step_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!("step-{step:08}"))
    }

    /// Keep in sync with [`partial_step`].
    fn partial_dir(&self, step: u64) -> PathBuf {
        self.root.join(format!("step-{step:08}{PARTIAL_SUFFIX}"))
    }

    /// Starts a checkpoint for `step`, first discarding every partial checkpoint a crash or a
    /// failed write (e.g. a full disk) left behind, whatever its step.
    pub fn begin(&self, step: u64) -> Result<PendingCheckpoint, CheckpointError> {
        fs::create_dir_all(&self.root).map_err(io(&self.root))?;
        self.remove_stale_partials()?;
        let partial = self.partial_dir(step);
        fs::create_dir_all(partial.join("policy")).map_err(io(&partial))?;
        Ok(PendingCheckpoint { partial, step })
    }

    /// Removes the `step-NNNNNNNN.partial/` directories in this store: checkpoints that were
    /// never committed and that resume never reads. Only directories whose name the store
    /// itself produces are touched; anything else in the directory is left alone. Returns what
    /// was removed.
    pub fn remove_stale_partials(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => return Err(io(&self.root)(err)),
        };
        let mut stale = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io(&self.root))?;
            // `DirEntry::file_type` does not follow symlinks: a link is never removed.
            let is_dir = entry.file_type().map_err(io(&entry.path()))?.is_dir();
            let is_partial = entry.file_name().to_str().and_then(partial_step).is_some();
            if is_dir && is_partial {
                stale.push(entry.path());
            }
        }
        stale.sort();
        for dir in &stale {
            fs::remove_dir_all(dir).map_err(io(dir))?;
            tracing::warn!(
                "removed the partial checkpoint {} left by an earlier write that did not complete",
                dir.display()
            );
        }
        if !stale.is_empty() {
            sync_dir(&self.root)?;
        }
        Ok(stale)
    }

    /// Seals `pending` with `state`, makes it the latest and prunes old checkpoints.
    pub fn commit(
        &self,
        pending: PendingCheckpoint,
        state: &RunState,
    ) -> Result<PathBuf, CheckpointError> {
        let state_path = pending.partial.join(STATE);
        write_synced(&state_path, &to_json(state, &state_path)?)?;
        let mut files = Vec::new();
        collect_files(&pending.partial, &pending.partial, &mut files)?;
        files.sort_by(|a, b| a.path.cmp(&b.path));
        let manifest = Manifest {
            format: STATE_FORMAT,
            step: pending.step,
            files,
        };
        let manifest_path = pending.partial.join(MANIFEST);
        write_synced(&manifest_path, &to_json(&manifest, &manifest_path)?)?;
        sync_tree(&pending.partial)?;

        let final_dir = self.step_dir(pending.step);
        if final_dir.exists() {
            // Re-checkpointing a step (e.g. after a resume): retire the old copy first. The
            // `latest` pointer may name it, which resume tolerates by falling back.
            let retired = self.root.join(format!("step-{:08}.retired", pending.step));
            if retired.exists() {
                fs::remove_dir_all(&retired).map_err(io(&retired))?;
            }
            fs::rename(&final_dir, &retired).map_err(io(&final_dir))?;
            fs::rename(&pending.partial, &final_dir).map_err(io(&pending.partial))?;
            fs::remove_dir_all(&retired).map_err(io(&retired))?;
        } else {
            fs::rename(&pending.partial, &final_dir).map_err(io(&pending.partial))?;
        }
        sync_dir(&self.root)?;

        let latest_tmp = self.root.join(format!("{LATEST}.tmp"));
        let name = final_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        write_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
        let latest = self.root.join(LATEST);
        fs::rename(&latest_tmp, &latest).map_err(io(&latest))?;
        sync_dir(&self.root)?;
        self.prune()?;
        Ok(final_dir)
    }

    /// The step of the last committed checkpoint, as the `latest` pointer names it; reads
    /// only, so it may run while a checkpoint is being written.
    pub fn latest_step(&self) -> Option<u64> {
        let name = fs::read_to_string(self.root.join(LATEST)).ok()?;
        name.trim().strip_prefix("step-")?.parse().ok()
    }

    /// The newest checkpoint that verifies: the one `latest` names, else the highest step.
    /// Invalid ones are reported and skipped. Resume calls this, so it also clears partial
    /// checkpoints left by an earlier run (a failure to do so is reported, not fatal: `begin`
    /// tries again and fails if it still cannot).
    pub fn latest_valid(&self) -> Result<Option<Checkpoint>, CheckpointError> {
        if let Err(err) = self.remove_stale_partials() {
            tracing::warn!("cannot clear partial checkpoints: {err}");
        }
        let mut candidates = self.complete_steps()?;
        candidates.reverse();
        if let Ok(name) = fs::read_to_string(self.root.join(LATEST)) {
            let named = self.root.join(name.trim());
            candidates.retain(|dir| dir != &named);
            candidates.insert(0, named);
        }
        for dir in candidates {
            match verify(&dir) {
                Ok(state) => return Ok(Some(Checkpoint { dir, state })),
                Err(err) => tracing::warn!("skipping checkpoint: {err}"),
            }
        }
        Ok(None)
    }

    /// Complete checkpoint directories, oldest first.
    fn complete_steps(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => return Err(io(&self.root)(err)),
        };
        let mut steps: Vec<(u64, PathBuf)> = entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
                Some((step, entry.path()))
            })
            .collect();
        steps.sort();
        Ok(steps.into_iter().map(|(_, path)| path).collect())
    }

    fn prune(&self) -> Result<(), CheckpointError> {
        let steps = self.complete_steps()?;
        let excess = steps.len().saturating_sub(self.keep);
        for dir in steps.into_iter().take(excess) {
            fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        Ok(())
    }
}

/// The step of `name` if it is exactly the name [`CheckpointStore::begin`] gives the partial
/// directory of that step (`step-00000003.partial`, not `step-3.partial`).
fn partial_step(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?.strip_suffix(PARTIAL_SUFFIX)?;
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let step: u64 = digits.parse().ok()?;
    (format!("step-{step:08}{PARTIAL_SUFFIX}") == name).then_some(step)
}

/// Checks every file of the manifest (size and hash) and reads the run state.
pub fn verify(dir: &Path) -> Result<RunState, CheckpointError> {
    let invalid = |reason: String| CheckpointError::Invalid {
        path: dir.to_path_buf(),
        reason,
    };
    let manifest_path = dir.join(MANIFEST);
    let manifest: Manifest =
        serde_json::from_slice(&fs::read(&manifest_path).map_err(io(&manifest_path))?)
            .map_err(|err| invalid(format!("unreadable manifest: {err}")))?;
    for file in &manifest.files {
        let path = dir.join(&file.path);
        let (bytes, hash) =
            hash_file(&path).map_err(|err| invalid(format!("{}: {err}", file.path)))?;
        if bytes != file.bytes || hash != file.blake3 {
            return Err(invalid(format!(
                "{} does not match its manifest entry",
                file.path
            )));
        }
    }
    if !manifest.files.iter().any(|f| f.path == STATE) {
        return Err(invalid("the manifest does not cover state.json".into()));
    }
    let state: RunState = serde_json::from_slice(&fs::read(dir.join(STATE)).map_err(io(dir))?)
        .map_err(|err| invalid(format!("unreadable state.json: {err}")))?;
    if state.format != STATE_FORMAT {
        return Err(invalid(format!(
            "state format {} is not the supported {STATE_FORMAT}",
            state.format
        )));
    }
    Ok(state)
}

fn to_json<T: Serialize>(value: &T, path: &Path) -> Result<Vec<u8>, CheckpointError> {
    serde_json::to_vec_pretty(value).map_err(|err| CheckpointError::Invalid {
        path: path.to_path_buf(),
        reason: err.to_string(),
    })
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io(path))?;
    file.write_all(bytes).map_err(io(path))?;
    file.sync_all().map_err(io(path))
}

fn hash_file(path: &Path) -> std::io::Result<(u64, String)> {
    let mut hasher = blake3::Hasher::new();
    let bytes = std::io::copy(&mut File::open(path)?, &mut hasher)?;
    Ok((bytes, hasher.finalize().to_hex().to_string()))
}

fn collect_files(
    root: &Path,
    dir: &Path,
    out: &mut Vec<ManifestFile>,
) -> Result<(), CheckpointError> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.is_dir() {
            collect_files(root, &path, out)?;
            continue;
        }
        let (bytes, blake3) = hash_file(&path).map_err(io(&path))?;
        let relative = path.strip_prefix(root).unwrap_or(&path);
        out.push(ManifestFile {
            path: relative.to_string_lossy().replace('\\', "/"),
            bytes,
            blake3,
        });
    }
    Ok(())
}

fn sync_tree(dir: &Path) -> Result<(), CheckpointError> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io(&path))?;
        }
    }
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(io(dir))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn write_checkpoint(store: &CheckpointStore, step: u64, payload: &[u8]) -> PathBuf {
        let pending = store.begin(step).unwrap();
        fs::write(pending.policy_dir().join("weights.bin"), payload).unwrap();
        let mut state = RunState::new(7);
        state.step = step;
        store.commit(pending, &state).unwrap()
    }

    #[test]
    fn commit_then_resume_finds_latest() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(tmp.path().join("checkpoints"), 3);
        write_checkpoint(&store, 1, b"one");
        write_checkpoint(&store, 2, b"two");
        let latest = store.latest_valid().unwrap().unwrap();
        assert_eq!(latest.state.step, 2);
        assert_eq!(
            fs::read(latest.policy_dir().join("weights.bin")).unwrap(),
            b"two"
        );
        assert_eq!(store.latest_step(), Some(2));
    }

    #[test]
    fn latest_step_reads_only_committed_checkpoints() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(tmp.path().join("checkpoints"), 3);
        assert_eq!(store.latest_step(), None);
        write_checkpoint(&store, 4, b"four");
        let pending = store.begin(5).unwrap();
        assert_eq!(store.latest_step(), Some(4));
        assert!(
            pending.policy_dir().exists(),
            "reading must not clear a partial"
        );
    }

    #[test]
    fn crash_mid_write_leaves_previous_checkpoint_latest() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(tmp.path().join("checkpoints"), 3);
        write_checkpoint(&store, 1, b"one");
        // A crash after the policy wrote part of its files and before commit.
        let pending = store.begin(2).unwrap();
        fs::write(pending.policy_dir().join("weights.bin"), b"tw").unwrap();
        drop(pending);
        let latest = store.latest_valid().unwrap().unwrap();
        assert_eq!(latest.state.step, 1);
        // The next attempt at the same step cleans the partial directory up.
        write_checkpoint(&store, 2, b"two");
        assert_eq!(store.latest_valid().unwrap().unwrap().state.step, 2);
        assert!(
            !tmp.path()
                .join("checkpoints/step-00000002.partial")
                .exists()
        );
    }

    #[test]
    fn corrupted_file_is_detected_and_skipped() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(tmp.path().join("checkpoints"), 3);
        write_checkpoint(&store, 1, b"one");
        let second = write_checkpoint(&store, 2, b"two");
        fs::write(second.join("policy/weights.bin"), b"twx").unwrap();
        let err = verify(&second).unwrap_err();
        assert!(err.to_string().contains("policy/weights.bin"), "{err}");
        assert_eq!(store.latest_valid().unwrap().unwrap().state.step, 1);
    }

    #[test]
    fn truncated_state_is_detected() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(tmp.path().join("checkpoints"), 3);
        let dir = write_checkpoint(&store, 1, b"one");
        let state = fs::read(dir.join(STATE)).unwrap();
        fs::write(dir.join(STATE), &state[..state.len() / 2]).unwrap();
        assert!(verify(&dir).is_err());
        assert!(store.latest_valid().unwrap().is_none());
    }

    #[test]
    fn keeps_only_the_newest() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(tmp.path().join("checkpoints"), 2);
        for step in 1..=4 {
            write_checkpoint(&store, step, b"w");
        }
        let steps: Vec<String> = store
            .complete_steps()
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(steps, ["step-00000003", "step-00000004"]);
    }

    #[test]
    fn recommitting_a_step_replaces_it() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(tmp.path().join("checkpoints"), 2);
        write_checkpoint(&store, 3, b"old");
        let dir = write_checkpoint(&store, 3, b"new");
        assert_eq!(fs::read(dir.join("policy/weights.bin")).unwrap(), b"new");
        assert!(verify(&dir).is_ok());
    }

    #[test]
    fn stale_partial_of_another_step_is_removed_before_the_next_checkpoint() {
        // A checkpoint write for step 3 failed midway (e.g. disk full); the run later
        // checkpoints a different step, which must not leave step 3's files in place.
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("checkpoints");
        let stale = root.join("step-00000003.partial");
        fs::create_dir_all(stale.join("policy")).unwrap();
        fs::write(stale.join("policy/weights.bin"), b"half written").unwrap();
        let store = CheckpointStore::new(root.clone(), 3);
        let dir = write_checkpoint(&store, 5, b"five");
        assert!(!stale.exists(), "stale partial checkpoint survived");
        assert_eq!(verify(&dir).unwrap().step, 5);
        assert_eq!(store.latest_valid().unwrap().unwrap().state.step, 5);
    }

    #[test]
    fn resume_removes_stale_partials_and_keeps_everything_else() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("checkpoints");
        let store = CheckpointStore::new(root.clone(), 3);
        write_checkpoint(&store, 2, b"two");
        for stale in ["step-00000003.partial", "step-123456789.partial"] {
            fs::create_dir_all(root.join(stale).join("policy")).unwrap();
            fs::write(root.join(stale).join("policy/weights.bin"), b"x").unwrap();
        }
        // Not names the store gives its partial directories, or not directories.
        for foreign in [
            "step-3.partial",
            "notes.partial",
            "step-00000004.partial.bak",
        ] {
            fs::create_dir_all(root.join(foreign)).unwrap();
        }
        fs::write(root.join("step-00000005.partial"), b"a file").unwrap();
        // A link is not the store's own directory: neither it nor its target is touched.
        let outside = tmp.path().join("outside");
        fs::create_dir_all(&outside).unwrap();
        fs::write(outside.join("keep.bin"), b"k").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(&outside, root.join("step-00000006.partial")).unwrap();

        let latest = store.latest_valid().unwrap().unwrap();
        assert_eq!(latest.state.step, 2);
        assert!(!root.join("step-00000003.partial").exists());
        assert!(!root.join("step-123456789.partial").exists());
        for kept in [
            "step-3.partial",
            "notes.partial",
            "step-00000004.partial.bak",
            "step-00000005.partial",
            "step-00000002",
        ] {
            assert!(root.join(kept).exists(), "{kept} was removed");
        }
        assert!(outside.join("keep.bin").exists());
        #[cfg(unix)]
        assert!(root.join("step-00000006.partial").is_symlink());
        assert!(store.remove_stale_partials().unwrap().is_empty());
    }

    #[test]
    fn partial_names_round_trip() {
        assert_eq!(partial_step("step-00000003.partial"), Some(3));
        assert_eq!(partial_step("step-123456789.partial"), Some(123_456_789));
        assert_eq!(partial_step("step-3.partial"), None);
        assert_eq!(partial_step("step-+0000003.partial"), None);
        assert_eq!(partial_step("step-.partial"), None);
        assert_eq!(partial_step("step-00000003"), None);
        assert_eq!(partial_step("step-00000003.retired"), None);
        let store = CheckpointStore::new(PathBuf::from("c"), 1);
        let name = store.partial_dir(42).file_name().unwrap().to_owned();
        assert_eq!(partial_step(name.to_str().unwrap()), Some(42));
    }

    #[test]
    fn missing_directory_means_no_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(tmp.path().join("nothing"), 2);
        assert!(store.latest_valid().unwrap().is_none());
    }
}
