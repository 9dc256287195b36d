//! `[cluster]`: a run whose roles are separate processes (`rollout launch`), how they find,
//! trust and wait for each other, and how weights and gradients travel between them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::DevicesConfig;

/// A run whose roles are separate processes, on one machine or many (`rollout launch`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Generation worker processes.
    pub workers: u32,
    /// Data-parallel trainer ranks (one torch.distributed process group).
    pub trainers: u32,
    /// Where the controller listens for roles. Loopback unless set otherwise; port 0 picks
    /// a free one (fine when `rollout launch` starts every role itself).
    pub listen: String,
    /// A file holding the cluster secret every connection must prove (at least 16 bytes).
    /// Without it, the `ROLLOUT_CLUSTER_SECRET` environment variable; `rollout launch` makes
    /// a random one for the processes it starts when neither is set.
    pub secret_file: Option<PathBuf>,
    /// How many policy versions behind the trainer a trained sample may have been generated.
    /// Generation for later steps overlaps training when > 0; 0 is synchronous. `rollout run`
    /// reads it too: above 0 a generation copy of the policy samples on its own thread.
    pub max_staleness: u64,
    /// Seconds between heartbeats on every connection.
    pub heartbeat_seconds: f64,
    /// A peer silent for this many seconds is lost.
    pub peer_timeout_seconds: f64,
    /// Seconds the controller waits for every role to connect and load (and, mid-run, for
    /// a generation worker when none is left).
    pub join_timeout_seconds: f64,
    /// A generation worker holding a prompt group this long without answering is treated
    /// as lost and the group is leased to another.
    pub lease_timeout_seconds: f64,
    /// Leases per prompt group before it is dropped from its step.
    pub max_attempts: u32,
    /// What becomes of the record of a prompt group dropped from its step (no answer after
    /// `max_attempts` leases, or still past `max_staleness` after regeneration): "requeue"
    /// (back to the data queue, trained by a later step) or "skip" (strict data order: not
    /// trained, and `rollout audit` reports it lost).
    pub dropped_groups: DroppedGroups,
    /// `rollout launch` starts a generation worker that died again, up to this many times
    /// per worker.
    pub max_worker_restarts: u32,
    /// `rollout launch` starts the trainer ranks again from the last checkpoint when one is
    /// lost (the generation workers keep running), up to this many times per run.
    pub max_run_restarts: u32,
    /// Fewest trainer ranks `rollout launch` goes on with: a lost rank is left out while
    /// more than this many remain (the others reshard the last checkpoint), and its
    /// replacement joins at the next checkpoint. Unset: the lost rank is started again.
    pub min_trainers: Option<u32>,
    /// Bytes per weight-sync bucket.
    pub weight_bucket_bytes: u64,
    /// torch.distributed backend of the trainers: "gloo", "nccl", or "auto" (NCCL when CUDA
    /// is available).
    pub backend: String,
    /// Gradient all-reduce: "none" (float32, exact), "fp16"/"bf16" (half the bytes) or
    /// "powersgd" (low-rank factors), all but "none" through torch's DDP hooks.
    pub gradient_compression: GradientCompression,
    /// Rank of PowerSGD's low-rank factors.
    pub powersgd_rank: u32,
    /// Updates all-reduced uncompressed before PowerSGD starts (torch's
    /// `start_powerSGD_iter`; at least 2).
    pub powersgd_warmup_updates: u32,
    /// TLS 1.3 on links (self-signed identities; the cluster secret proves who is who,
    /// bound to the TLS session). Unset: links with other machines are encrypted, loopback
    /// links are not. `true`: every link (roles started elsewhere need `--tls`). `false`: no
    /// link, an explicit and warned opt-out (roles started elsewhere need `--no-tls`).
    pub tls: Option<bool>,
    /// `[cluster.devices]`: the GPUs of each process `rollout launch` starts, and whether
    /// workers share them with the trainers. Absent: every process inherits the launcher's
    /// environment.
    pub devices: Option<DevicesConfig>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            workers: 1,
            trainers: 1,
            listen: "127.0.0.1:0".into(),
            secret_file: None,
            max_staleness: 0,
            heartbeat_seconds: 2.0,
            peer_timeout_seconds: 60.0,
            join_timeout_seconds: 300.0,
            lease_timeout_seconds: 600.0,
            max_attempts: 3,
            dropped_groups: DroppedGroups::Requeue,
            max_worker_restarts: 100,
            max_run_restarts: 3,
            min_trainers: None,
            weight_bucket_bytes: 8 << 20,
            backend: "auto".into(),
            gradient_compression: GradientCompression::None,
            powersgd_rank: 4,
            powersgd_warmup_updates: 10,
            tls: None,
            devices: None,
        }
    }
}

/// What becomes of the record of a prompt group dropped from its step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DroppedGroups {
    /// Back to the data queue: a later step draws it before fresh records.
    #[default]
    Requeue,
    /// Strict data order: the prompt is not trained (the audit counts it in `prompts_lost`).
    Skip,
}

/// How trainer ranks all-reduce gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GradientCompression {
    None,
    Fp16,
    Bf16,
    Powersgd,
}

impl GradientCompression {
    pub fn as_str(self) -> &'static str {
        match self {
            GradientCompression::None => "none",
            GradientCompression::Fp16 => "fp16",
            GradientCompression::Bf16 => "bf16",
            GradientCompression::Powersgd => "powersgd",
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::Path;

    use super::*;
    use crate::config::load_text;

    const BASE: &str = "[policy]\nplugin = \"p:P\"\n[data]\nplugin = \"d:D\"\n\
                        [[rewards]]\nplugin = \"r:R\"\n[cluster]\n";

    fn dropped_groups(line: &str) -> Result<DroppedGroups, String> {
        load_text(Path::new("run.toml"), format!("{BASE}{line}"), &[])
            .map(|loaded| loaded.config.cluster.dropped_groups)
            .map_err(|err| err.to_string())
    }

    #[test]
    fn dropped_groups_are_requeued_unless_the_data_order_is_strict() {
        assert_eq!(dropped_groups(""), Ok(DroppedGroups::Requeue));
        assert_eq!(
            dropped_groups("dropped_groups = \"skip\"\n"),
            Ok(DroppedGroups::Skip)
        );
        let err = dropped_groups("dropped_groups = \"requeu\"\n").unwrap_err();
        assert!(err.starts_with("run.toml:8:18"), "{err}");
        assert!(err.contains("did you mean `requeue`?"), "{err}");
        let err = dropped_groups("dropped_groups = true\n").unwrap_err();
        assert!(err.starts_with("run.toml:8:18"), "{err}");
    }
}
