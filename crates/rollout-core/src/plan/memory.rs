//! How much memory this machine has for a run: the host's available memory (or the cgroup's
//! limit, whichever is lower), and whether a CUDA device is present at all.

use std::path::Path;

/// The host memory a new process can use, in bytes: `MemAvailable` from `/proc/meminfo`,
/// lowered to what the process's memory cgroup (v2 or v1) still allows. `None` when
/// neither can be read (not Linux).
pub fn host_available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(mem_available);
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|text| cgroup_headroom(Path::new("/sys/fs/cgroup"), &text));
    match (available, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix("MemAvailable:")?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        kib.checked_mul(1024)
    })
}

/// Limit minus usage of the memory cgroup named in `/proc/self/cgroup`'s text, under `root`
/// (normally `/sys/fs/cgroup`); `None` when unlimited or unreadable.
pub fn cgroup_headroom(root: &Path, proc_self_cgroup: &str) -> Option<u64> {
    let read = |path: &Path| -> Option<u64> {
        let text = std::fs::read_to_string(path).ok()?;
        text.trim().parse().ok()
    };
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let relative = path.trim_start_matches('/');
        if controllers.is_empty() {
            // cgroup v2: "0::/path"; "max" parses as no limit.
            let dir = root.join(relative);
            let limit = read(&dir.join("memory.max"))?;
            let usage = read(&dir.join("memory.current")).unwrap_or(0);
            return Some(limit.saturating_sub(usage));
        }
        if controllers.split(',').any(|c| c == "memory") {
            let dir = root.join("memory").join(relative);
            let limit = read(&dir.join("memory.limit_in_bytes"))?;
            // v1 reports "no limit" as a huge number near i64::MAX.
            if limit >= 1 << 60 {
                return None;
            }
            let usage = read(&dir.join("memory.usage_in_bytes")).unwrap_or(0);
            return Some(limit.saturating_sub(usage));
        }
    }
    None
}

/// Whether this machine has an NVIDIA GPU the driver exposes (for `device = "auto"`).
pub fn cuda_present() -> bool {
    Path::new("/proc/driver/nvidia/gpus").is_dir()
        && std::fs::read_dir("/proc/driver/nvidia/gpus").is_ok_and(|mut d| d.next().is_some())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_available_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(mem_available(text), Some(2048 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn cgroup_v2_limit_minus_usage() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("job");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "1000000\n").unwrap();
        std::fs::write(dir.join("memory.current"), "400000\n").unwrap();
        assert_eq!(cgroup_headroom(root.path(), "0::/job\n"), Some(600_000));
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_headroom(root.path(), "0::/job\n"), None);
    }

    #[test]
    fn cgroup_v1_memory_controller() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("memory/job");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.limit_in_bytes"), "5000").unwrap();
        std::fs::write(dir.join("memory.usage_in_bytes"), "1000").unwrap();
        let text = "3:cpu,cpuacct:/job\n2:memory:/job\n";
        assert_eq!(cgroup_headroom(root.path(), text), Some(4000));
        std::fs::write(dir.join("memory.limit_in_bytes"), "9223372036854771712").unwrap();
        assert_eq!(cgroup_headroom(root.path(), text), None);
        assert_eq!(cgroup_headroom(root.path(), "garbage"), None);
    }
}
