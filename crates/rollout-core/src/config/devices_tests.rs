//! Which process gets which devices: explicit lists, `"auto"`, colocation, and the config
//! errors (with their file:line:column) for settings that cannot run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use super::*;

const BASE: &str = "[policy]\nplugin = \"p:P\"\n[data]\nplugin = \"d:D\"\n\
                    [[rewards]]\nplugin = \"r:R\"\n";

fn load(cluster: &str) -> Result<LoadedConfig, ConfigError> {
    crate::config::load_text(Path::new("run.toml"), format!("{BASE}{cluster}"), &[])
}

fn gpus(n: usize) -> VisibleDevices {
    VisibleDevices::parse(None, n)
}

/// `cluster` (TOML after `[cluster]`) assigned among `visible`.
fn assigned(cluster: &str, visible: &VisibleDevices) -> Result<Option<DeviceAssignment>, String> {
    let loaded = load(&format!("[cluster]\n{cluster}")).map_err(|err| err.to_string())?;
    assign_devices(&loaded, visible).map_err(|err| err.to_string())
}

fn devices(processes: &[ProcessDevices]) -> Vec<String> {
    processes.iter().map(|p| p.devices.join(",")).collect()
}

#[test]
fn visible_devices_read_cuda_visible_devices_as_cuda_does() {
    assert_eq!(VisibleDevices::parse(None, 2).0, ["0", "1"]);
    assert_eq!(VisibleDevices::parse(Some("4, 6"), 8).0, ["4", "6"]);
    assert_eq!(
        VisibleDevices::parse(Some("GPU-a1,MIG-b2"), 0).0,
        ["GPU-a1", "MIG-b2"]
    );
    assert!(VisibleDevices::parse(Some(""), 8).0.is_empty());
    assert!(VisibleDevices::parse(Some("-1"), 8).0.is_empty());
    // CUDA stops at the first invalid entry.
    assert_eq!(VisibleDevices::parse(Some("3,-1,5"), 8).0, ["3"]);
}

#[test]
fn disaggregated_lists_map_onto_the_launchers_visible_devices() {
    let visible = VisibleDevices::parse(Some("4,5,6,7"), 8);
    let cluster = "workers = 2\ntrainers = 2\n[cluster.devices]\ntrainers = [0, 1]\n\
                   workers = [2, 3]\n";
    let assignment = assigned(cluster, &visible).unwrap().unwrap();
    assert_eq!(devices(&assignment.trainers), ["4", "5"]);
    assert_eq!(devices(&assignment.workers), ["6", "7"]);
    assert_eq!(
        assignment.trainers[1].environment(),
        [
            ("CUDA_VISIBLE_DEVICES", "5".to_owned()),
            ("LOCAL_RANK", "1".to_owned())
        ]
    );
    assert_eq!(assignment.workers[0].local_rank, 0);
    assert_eq!(assignment.workers[1].indices, [3]);
}

#[test]
fn a_process_may_take_several_devices() {
    let cluster = "workers = 1\ntrainers = 2\n[cluster.devices]\ntrainers = [0, 1]\n\
                   workers = [[2, 3]]\n";
    let assignment = assigned(cluster, &gpus(4)).unwrap().unwrap();
    assert_eq!(devices(&assignment.workers), ["2,3"]);
}

#[test]
fn auto_gives_trainers_the_first_devices_and_workers_the_next() {
    let cluster = "workers = 2\ntrainers = 2\n[cluster.devices]\n";
    let assignment = assigned(cluster, &gpus(4)).unwrap().unwrap();
    assert_eq!(devices(&assignment.trainers), ["0", "1"]);
    assert_eq!(devices(&assignment.workers), ["2", "3"]);
    // Against an explicit list of the other role, auto takes what it leaves.
    let cluster = "workers = 1\ntrainers = 2\n[cluster.devices]\nworkers = [0]\n";
    let assignment = assigned(cluster, &gpus(3)).unwrap().unwrap();
    assert_eq!(devices(&assignment.trainers), ["1", "2"]);
    assert_eq!(devices(&assignment.workers), ["0"]);
}

#[test]
fn auto_colocated_puts_worker_i_on_trainer_rank_is_device() {
    let cluster = "workers = 2\ntrainers = 2\n[cluster.devices]\ncolocate = true\n";
    let assignment = assigned(cluster, &gpus(2)).unwrap().unwrap();
    assert_eq!(devices(&assignment.trainers), ["0", "1"]);
    assert_eq!(devices(&assignment.workers), ["0", "1"]);
    let cluster = "workers = 1\ntrainers = 1\n[cluster.devices]\ntrainers = [0]\nworkers = [0]\n\
                   colocate = true\n";
    let assignment = assigned(cluster, &gpus(1)).unwrap().unwrap();
    assert_eq!(devices(&assignment.workers), ["0"]);
}

#[test]
fn auto_without_a_gpu_runs_on_the_cpu_and_no_table_sets_nothing() {
    assert_eq!(
        assigned("workers = 2\n[cluster.devices]\n", &gpus(0)),
        Ok(None)
    );
    assert_eq!(
        assigned(
            "workers = 2\n[cluster.devices]\ncolocate = true\n",
            &gpus(0)
        ),
        Ok(None)
    );
    assert_eq!(assigned("workers = 2\n", &gpus(8)), Ok(None));
}

#[test]
fn a_device_beyond_the_visible_ones_is_a_located_error() {
    let cluster =
        "workers = 1\ntrainers = 2\n[cluster.devices]\ntrainers = [0, 3]\nworkers = [1]\n";
    let err = assigned(cluster, &gpus(2)).unwrap_err();
    assert_eq!(
        err,
        "run.toml:11:1: `cluster.devices.trainers[1]`: device 3 is not visible: 2 GPUs are \
         visible (indices 0 to 1)"
    );
    let err = assigned(cluster, &gpus(0)).unwrap_err();
    assert!(
        err.ends_with("`cluster.devices.trainers[0]`: device 0 is not visible: no GPU is visible"),
        "{err}"
    );
}

#[test]
fn too_few_gpus_for_auto_suggests_colocation() {
    let err = assigned("workers = 2\ntrainers = 2\n[cluster.devices]\n", &gpus(3)).unwrap_err();
    assert!(err.starts_with("run.toml"), "{err}");
    assert!(
        err.contains(
            "`cluster.devices.workers`: \"auto\" gives each of the 2 workers a GPU of its \
                      own, but 3 GPUs are visible (indices 0 to 2), 2 of them given to the other \
                      role: set `colocate = true`"
        ),
        "{err}"
    );
    let colocated = "workers = 3\ntrainers = 1\n[cluster.devices]\ncolocate = true\n";
    let err = assigned(colocated, &gpus(2)).unwrap_err();
    assert!(
        err.ends_with("2 GPUs are visible (indices 0 to 1): start fewer processes"),
        "{err}"
    );
}

/// Errors found by validation, before anything runs: no GPU needed.
fn invalid(cluster: &str) -> String {
    load(&format!("[cluster]\n{cluster}"))
        .unwrap_err()
        .to_string()
}

#[test]
fn overlapping_lists_need_colocation() {
    let err = invalid(
        "workers = 2\ntrainers = 2\n[cluster.devices]\ntrainers = [0, 1]\nworkers = [2, 1]\n",
    );
    assert_eq!(
        err,
        "run.toml:12:1: `cluster.devices.workers[1]`: device 1 is also a trainer rank's: set \
         `colocate = true` to share devices between workers and trainers, or give the workers \
         others"
    );
    let colocated = "workers = 2\ntrainers = 2\nmax_staleness = 0\n[cluster.devices]\n\
                     trainers = [0, 1]\nworkers = [0, 1]\ncolocate = true\n";
    load(&format!("[cluster]\n{colocated}")).unwrap();
}

#[test]
fn counts_must_match_the_processes() {
    let err = invalid("workers = 2\n[cluster.devices]\nworkers = [0]\ntrainers = [1]\n");
    assert_eq!(
        err,
        "run.toml:10:1: `cluster.devices.workers`: lists 1 entries for cluster.workers = 2: \
         give one per process (an index, or a list of indices)"
    );
}

#[test]
fn one_device_twice_within_a_role_or_an_empty_entry_is_refused() {
    let err = invalid("trainers = 2\n[cluster.devices]\ntrainers = [0, [1, 0]]\nworkers = [2]\n");
    assert!(
        err.ends_with("`cluster.devices.trainers[1]`: device 0 is given to two trainers processes"),
        "{err}"
    );
    let err = invalid("[cluster.devices]\ntrainers = [[]]\nworkers = [1]\n");
    assert!(
        err.ends_with("`cluster.devices.trainers[0]`: names no device"),
        "{err}"
    );
    // Colocated, a role still takes each device once.
    let err = invalid(
        "workers = 2\n[cluster.devices]\nworkers = [0, 0]\ntrainers = [0]\ncolocate = true\n",
    );
    assert!(
        err.contains("device 0 is given to two workers processes"),
        "{err}"
    );
}

#[test]
fn names_other_than_auto_and_colocation_with_staleness_are_refused() {
    let err = invalid("[cluster.devices]\ntrainers = \"all\"\n");
    assert_eq!(
        err,
        "run.toml:9:1: `cluster.devices.trainers`: must be \"auto\" or a list of device \
         indices, not \"all\""
    );
    let err = invalid("max_staleness = 1\n[cluster.devices]\ncolocate = true\n");
    assert!(
        err.starts_with("run.toml:10:1: `cluster.devices.colocate`: colocated workers sleep"),
        "{err}"
    );
    let err = invalid("[cluster.devices]\ngpus = [0]\n");
    assert!(err.contains("gpus"), "{err}");
}
