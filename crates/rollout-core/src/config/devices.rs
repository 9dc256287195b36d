//! `[cluster.devices]`: which GPUs each process that `rollout launch` starts may use, and
//! whether generation workers share them with the trainer ranks (colocated).
//!
//! Indices count the GPUs the launcher sees (its `CUDA_VISIBLE_DEVICES` if set, else every
//! GPU the NVIDIA driver lists). Each process is given its devices as its own
//! `CUDA_VISIBLE_DEVICES`, so inside it the first of them is `cuda:0`.

use serde::{Deserialize, Serialize};

use super::{ConfigError, KeyPath, LoadedConfig};

/// `[cluster.devices]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DevicesConfig {
    /// The trainer ranks' devices: `"auto"`, or one entry per rank (a device index, or a
    /// list of indices).
    pub trainers: DeviceSpec,
    /// The generation workers' devices, as `trainers`.
    pub workers: DeviceSpec,
    /// Workers share the trainers' devices: they release their KV cache and move their
    /// weights to the host while the trainers step, and take them back before generating.
    pub colocate: bool,
}

impl Default for DevicesConfig {
    fn default() -> Self {
        Self {
            trainers: DeviceSpec::Named("auto".into()),
            workers: DeviceSpec::Named("auto".into()),
            colocate: false,
        }
    }
}

impl super::ClusterConfig {
    /// Whether generation workers share the trainers' devices (`[cluster.devices] colocate`).
    pub fn colocated(&self) -> bool {
        self.devices
            .as_ref()
            .is_some_and(|devices| devices.colocate)
    }
}

/// `"auto"` (checked by validation), or one entry per process.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum DeviceSpec {
    Named(String),
    List(Vec<DeviceEntry>),
}

/// One process's devices: one index, or several.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum DeviceEntry {
    One(u32),
    Many(Vec<u32>),
}

impl DeviceEntry {
    fn indices(&self) -> Vec<u32> {
        match self {
            DeviceEntry::One(index) => vec![*index],
            DeviceEntry::Many(indices) => indices.clone(),
        }
    }
}

/// The GPUs the launcher sees, as the names its children's `CUDA_VISIBLE_DEVICES` takes
/// (indices, UUIDs or MIG names: whatever the launcher's own variable held).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VisibleDevices(pub Vec<String>);

/// Where the NVIDIA driver lists one directory per GPU.
const DRIVER_GPUS: &str = "/proc/driver/nvidia/gpus";

impl VisibleDevices {
    /// `cuda_visible_devices` as CUDA reads it (entries up to the first empty or negative
    /// one; `""` or `"-1"`: none), else `driver_gpus` GPUs numbered from 0.
    pub fn parse(cuda_visible_devices: Option<&str>, driver_gpus: usize) -> Self {
        match cuda_visible_devices {
            Some(list) => VisibleDevices(
                list.split(',')
                    .map(str::trim)
                    .take_while(|entry| !entry.is_empty() && !entry.starts_with('-'))
                    .map(str::to_owned)
                    .collect(),
            ),
            None => VisibleDevices((0..driver_gpus).map(|i| i.to_string()).collect()),
        }
    }

    /// The GPUs this process sees: `CUDA_VISIBLE_DEVICES`, else the driver's list.
    pub fn detect() -> Self {
        let listed = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let driver_gpus = std::fs::read_dir(DRIVER_GPUS).map_or(0, |entries| entries.count());
        Self::parse(listed.as_deref(), driver_gpus)
    }

    fn describe(&self) -> String {
        match self.0.len() {
            0 => "no GPU is visible".to_owned(),
            1 => "1 GPU is visible (index 0)".to_owned(),
            n => format!("{n} GPUs are visible (indices 0 to {})", n - 1),
        }
    }
}

/// One process's devices and its `LOCAL_RANK`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessDevices {
    /// The devices as indices among those the launcher sees (what the config lists).
    pub indices: Vec<u32>,
    /// The launcher's names of the devices, in order: the first is the process's `cuda:0`.
    pub devices: Vec<String>,
    /// Its index among the processes of its role on this machine (a trainer's rank).
    pub local_rank: u32,
}

impl ProcessDevices {
    /// The variables to set in the process's environment.
    pub fn environment(&self) -> [(&'static str, String); 2] {
        [
            ("CUDA_VISIBLE_DEVICES", self.devices.join(",")),
            ("LOCAL_RANK", self.local_rank.to_string()),
        ]
    }
}

/// Which devices every worker and trainer rank gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAssignment {
    pub workers: Vec<ProcessDevices>,
    pub trainers: Vec<ProcessDevices>,
}

/// A device setting that cannot run, and the key it is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Misplaced {
    pub key: KeyPath,
    pub message: String,
}

fn key(role: &str) -> KeyPath {
    KeyPath::default().key("cluster").key("devices").key(role)
}

fn misplaced(key: KeyPath, message: impl Into<String>) -> Misplaced {
    Misplaced {
        key,
        message: message.into(),
    }
}

/// The explicit device lists of both roles, after the checks that need no GPU: `"auto"` is
/// the only name, one entry per process, no entry empty or repeating a device, and (unless
/// colocated) no device given to two processes. `None` for a role set to `"auto"`.
type Lists = (Option<Vec<Vec<u32>>>, Option<Vec<Vec<u32>>>);

fn checked_lists(devices: &DevicesConfig, workers: u32, trainers: u32) -> Result<Lists, Misplaced> {
    let trainer_lists = role_lists(&devices.trainers, "trainers", trainers)?;
    let worker_lists = role_lists(&devices.workers, "workers", workers)?;
    if !devices.colocate {
        let trainer_devices = flat(&trainer_lists);
        for (index, entry) in worker_lists.iter().flatten().enumerate() {
            if let Some(shared) = entry.iter().find(|d| trainer_devices.contains(d)) {
                return Err(misplaced(
                    key("workers").index(index),
                    format!(
                        "device {shared} is also a trainer rank's: set `colocate = true` to share \
                         devices between workers and trainers, or give the workers others"
                    ),
                ));
            }
        }
    }
    Ok((trainer_lists, worker_lists))
}

/// One role's explicit lists, checked on their own.
fn role_lists(
    spec: &DeviceSpec,
    role: &str,
    count: u32,
) -> Result<Option<Vec<Vec<u32>>>, Misplaced> {
    let entries = match spec {
        DeviceSpec::Named(name) if name == "auto" => return Ok(None),
        DeviceSpec::Named(name) => {
            return Err(misplaced(
                key(role),
                format!("must be \"auto\" or a list of device indices, not {name:?}"),
            ));
        }
        DeviceSpec::List(entries) => entries,
    };
    if entries.len() != count as usize {
        return Err(misplaced(
            key(role),
            format!(
                "lists {} entries for cluster.{role} = {count}: give one per process (an index, \
                 or a list of indices)",
                entries.len()
            ),
        ));
    }
    let lists: Vec<Vec<u32>> = entries.iter().map(DeviceEntry::indices).collect();
    let mut seen = Vec::new();
    for (index, list) in lists.iter().enumerate() {
        if list.is_empty() {
            return Err(misplaced(key(role).index(index), "names no device"));
        }
        for device in list {
            if seen.contains(device) {
                return Err(misplaced(
                    key(role).index(index),
                    format!("device {device} is given to two {role} processes"),
                ));
            }
            seen.push(*device);
        }
    }
    Ok(Some(lists))
}

/// Which devices each process gets among `visible`, or `None` when every role is `"auto"`
/// and no GPU is visible (the roles run on the CPU; no variable is set). `"auto"` gives
/// each process one device: colocated, worker `i` shares trainer rank `i`'s; otherwise the
/// trainers take the first visible devices the workers' list leaves, then the workers the
/// next ones.
pub fn assign(
    devices: &DevicesConfig,
    workers: u32,
    trainers: u32,
    visible: &VisibleDevices,
) -> Result<Option<DeviceAssignment>, Misplaced> {
    let (trainer_lists, worker_lists) = checked_lists(devices, workers, trainers)?;
    if trainer_lists.is_none() && worker_lists.is_none() && visible.0.is_empty() {
        return Ok(None);
    }
    check_visible(&trainer_lists, &worker_lists, visible)?;
    let trainer_lists = match trainer_lists {
        Some(lists) => lists,
        None => {
            let taken = if devices.colocate {
                Vec::new()
            } else {
                flat(&worker_lists)
            };
            automatic("trainers", trainers, &taken, visible, devices.colocate)?
        }
    };
    let worker_lists = match worker_lists {
        Some(lists) => lists,
        None => {
            let taken = if devices.colocate {
                Vec::new()
            } else {
                trainer_lists.iter().flatten().copied().collect()
            };
            automatic("workers", workers, &taken, visible, devices.colocate)?
        }
    };
    let named = |lists: Vec<Vec<u32>>| {
        (0..)
            .zip(lists)
            .map(|(local_rank, list)| ProcessDevices {
                devices: list
                    .iter()
                    .map(|&d| visible.0[d as usize].clone())
                    .collect(),
                indices: list,
                local_rank,
            })
            .collect()
    };
    Ok(Some(DeviceAssignment {
        workers: named(worker_lists),
        trainers: named(trainer_lists),
    }))
}

/// Every device the configured lists name is one of `visible`.
fn check_visible(
    trainer_lists: &Option<Vec<Vec<u32>>>,
    worker_lists: &Option<Vec<Vec<u32>>>,
    visible: &VisibleDevices,
) -> Result<(), Misplaced> {
    let count = visible.0.len() as u32;
    for (role, lists) in [("trainers", trainer_lists), ("workers", worker_lists)] {
        for (index, list) in lists.iter().flatten().enumerate() {
            if let Some(device) = list.iter().find(|&&d| d >= count) {
                return Err(misplaced(
                    key(role).index(index),
                    format!("device {device} is not visible: {}", visible.describe()),
                ));
            }
        }
    }
    Ok(())
}

fn flat(lists: &Option<Vec<Vec<u32>>>) -> Vec<u32> {
    lists.iter().flatten().flatten().copied().collect()
}

/// `"auto"`: one device each, the first visible ones not `taken`.
fn automatic(
    role: &str,
    count: u32,
    taken: &[u32],
    visible: &VisibleDevices,
    colocate: bool,
) -> Result<Vec<Vec<u32>>, Misplaced> {
    let free: Vec<u32> = (0..visible.0.len() as u32)
        .filter(|d| !taken.contains(d))
        .collect();
    if free.len() < count as usize {
        let others = if taken.is_empty() {
            String::new()
        } else {
            format!(", {} of them given to the other role", taken.len())
        };
        let remedy = if colocate {
            "start fewer processes"
        } else {
            "set `colocate = true` to share devices between workers and trainers, or start fewer \
             processes"
        };
        return Err(misplaced(
            key(role),
            format!(
                "\"auto\" gives each of the {count} {role} a GPU of its own, but {}{others}: \
                 {remedy}",
                visible.describe()
            ),
        ));
    }
    Ok(free[..count as usize].iter().map(|&d| vec![d]).collect())
}

/// The checks of `[cluster.devices]` that need no GPU (config validation).
pub(super) fn validate_devices(loaded: &LoadedConfig) -> Result<(), ConfigError> {
    let cluster = &loaded.config.cluster;
    let Some(devices) = &cluster.devices else {
        return Ok(());
    };
    checked_lists(devices, cluster.workers, cluster.trainers)
        .map_err(|bad| loaded.error_at(&bad.key, bad.message))?;
    if devices.colocate && cluster.max_staleness > 0 {
        return Err(loaded.error_at(
            &key("colocate"),
            "colocated workers sleep while the trainers step, so no sampling can overlap \
             training: set cluster.max_staleness = 0",
        ));
    }
    Ok(())
}

/// The devices of every process `rollout launch` starts, among `visible`: `None` without a
/// `[cluster.devices]` table (every process inherits the launcher's environment) or when
/// `"auto"` finds no GPU.
pub fn assign_devices(
    loaded: &LoadedConfig,
    visible: &VisibleDevices,
) -> Result<Option<DeviceAssignment>, ConfigError> {
    let cluster = &loaded.config.cluster;
    let Some(devices) = &cluster.devices else {
        return Ok(None);
    };
    assign(devices, cluster.workers, cluster.trainers, visible)
        .map_err(|bad| loaded.error_at(&bad.key, bad.message))
}

#[cfg(test)]
#[path = "devices_tests.rs"]
mod tests;
