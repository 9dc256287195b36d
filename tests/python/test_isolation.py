"""The OS sandbox code rewards run completions in: what it binds, what it refuses to trust, and
the limits that keep one program from exhausting the host (sized tmpfs, cgroups, seccomp)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from python_plugins.code_reward import PythonTests
from python_plugins.code_session import Program
from rollout_sdk import Sample, load_plugin
from rollout_sdk import isolation as isolation_module
from rollout_sdk.cgroups import CgroupError, find_cgroups
from rollout_sdk.isolation import (
    IsolationError,
    Sandbox,
    find_sandbox,
    interpreter,
    interpreter_paths,
    prove_isolation,
)
from rollout_sdk.seccomp import deny_filter
from tests.python.host_memory import FILL, memory_fall

SCRATCH_MB = 64


@pytest.fixture(scope="module")
def reward() -> PythonTests:
    return load_plugin(
        "python_plugins.code_reward:PythonTests",
        {"timeout_seconds": 8, "scratch_mb": SCRATCH_MB},
        PythonTests,
    )


def holds(reward: PythonTests, code: str, test: str) -> bool:
    """Whether ``test`` (one assert) holds for ``code``."""
    (score,) = reward.score([Sample(prompt="", completion=code, record={"tests": [test]})])
    assert isinstance(score, float), score
    return score == 1.0


def test_the_sandbox_is_real_bubblewrap_from_a_system_path(reward: PythonTests) -> None:
    assert reward.sandbox.kind == "bubblewrap", "CI installs bubblewrap: these tests must run under it"
    assert reward.sandbox.program in isolation_module.BWRAP_PATHS


def test_a_bwrap_on_path_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    impostor = tmp_path / "bwrap"
    impostor.write_text(UNISOLATED)
    impostor.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    isolation_module._bubblewrap.cache_clear()
    try:
        assert find_sandbox("bubblewrap").program != str(impostor)
    finally:
        isolation_module._bubblewrap.cache_clear()


def test_the_probe_refuses_a_wrapper_that_runs_the_code_unisolated() -> None:
    """A `bwrap` that exits 0 and runs the command (as a broken install or a shim would) shows a
    PID, network interfaces and files of the host: isolation is refused, never assumed."""
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o755)  # started as `nobody` when the tests run as root
        impostor = Path(directory, "bwrap")
        impostor.write_text(UNISOLATED)
        impostor.chmod(0o755)
        refused = _refusal(impostor)
    assert "PID namespace" in refused
    assert "outside the sandbox is readable" in refused


UNISOLATED = '#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n'


def _refusal(program: Path) -> str:
    with pytest.raises(IsolationError, match="does not isolate") as refused:
        prove_isolation(Sandbox(kind="bubblewrap", program=str(program), version="fake"))
    return str(refused.value)


def test_a_bwrap_others_can_write_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loose = tmp_path / "bwrap"
    loose.write_bytes(Path(isolation_module.BWRAP_PATHS[0]).read_bytes())
    loose.chmod(0o777)
    monkeypatch.setattr(isolation_module, "BWRAP_PATHS", (str(loose),))
    isolation_module._bubblewrap.cache_clear()
    try:
        with pytest.raises(IsolationError, match="not a root-owned file that only root can write"):
            find_sandbox("bubblewrap")
    finally:
        isolation_module._bubblewrap.cache_clear()


def test_only_the_interpreter_and_system_libraries_are_bound() -> None:
    paths = interpreter_paths(interpreter())
    homes = {"/", "/root", "/home", "/usr", os.path.expanduser("~")}
    assert not homes & set(paths), paths
    assert all(not path.startswith(("/home/", "/etc/")) or path == "/etc/ld.so.cache" for path in paths)
    for broad in ("/", os.path.expanduser("~")):
        with pytest.raises(IsolationError, match="root or a home directory"):
            isolation_module._refuse_broad(broad)


def test_every_writable_mount_is_sized_and_the_root_is_read_only(reward: PythonTests) -> None:
    command = reward.sandbox.command([interpreter(), "-c", "pass"], SCRATCH_MB << 20)
    mounts = [index for index, word in enumerate(command) if word == "--tmpfs"]
    assert len(mounts) >= 2
    for index in mounts:
        assert "--size" in command[index - 4 : index], command[index - 4 : index + 2]
    assert command[command.index("--remount-ro") : command.index("--remount-ro") + 4] == [
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
    ]
    binds = {command[index + 1] for index, word in enumerate(command) if word == "--ro-bind"}
    assert "/usr" not in binds and "/" not in binds


def test_the_code_sees_no_more_than_it_needs(reward: PythonTests) -> None:
    code = (
        "import os\n"
        "def seen():\n"
        "    found = []\n"
        "    hidden = ('/etc/passwd', '/usr/share', '/usr/bin/sh', '/usr/local', '/home', '/root')\n"
        "    return [os.path.exists(path) for path in hidden]\n"
        "def processes():\n"
        "    return len([name for name in os.listdir('/proc') if name.isdigit()])\n"
        "def writable():\n"
        "    ok = []\n"
        "    for path in ('/x', '/dev/x', '/dev/shm/x', '/usr/x', '/tmp/x', '/work/x'):\n"
        "        try:\n"
        "            open(path, 'w').close()\n"
        "            ok.append(path)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return ok\n"
    )
    assert holds(reward, code, "assert seen() == [False] * 6")
    assert holds(reward, code, "assert processes() <= 3")
    assert holds(reward, code, "assert writable() == ['/tmp/x', '/work/x']")


def test_a_completion_filling_its_disk_is_stopped_at_the_limit(reward: PythonTests) -> None:
    """It tries to write 4 GiB of files just under the per-file limit; the tmpfs mounts stop
    it at `scratch_mb`, and the host's available memory never falls by much more."""
    limit = SCRATCH_MB << 20
    stopped, fell = memory_fall(lambda: holds(reward, FILL, f"assert {limit // 2} < fill() <= {limit}"))
    assert stopped
    # The files themselves plus the interpreter; other processes' noise stays well under
    # the gigabytes the same completion took before the tmpfs mounts were sized.
    assert fell < limit + (160 << 20), f"the host's available memory fell by {fell >> 20} MiB"


def test_each_program_runs_in_its_own_limited_cgroup(reward: PythonTests) -> None:
    cgroups = reward.sandbox.cgroups
    if cgroups is None:
        pytest.skip(
            "this machine offers no cgroup memory controller to this process (the fallback is tested above)"
        )
    with Program(reward.sandbox, reward.limits, "functions", "x = 1\n") as program:
        cgroup = program.running.cgroup
        assert cgroup is not None
        memory = cgroup.directories[0]
        expected = (reward.limits.memory_mb + reward.limits.scratch_mb) << 20
        limit_file = "memory.max" if cgroup.version == 2 else "memory.limit_in_bytes"
        assert int((memory / limit_file).read_text()) == expected
        pids_dir = cgroup.directories[-1]
        assert (pids_dir / "pids.max").read_text().strip() == "8"
        assert str(program.running.proc.pid) in (memory / "cgroup.procs").read_text().split()
    assert not any(directory.exists() for directory in cgroup.directories), "the cgroup outlived its program"


def test_memory_outside_the_address_space_is_denied(reward: PythonTests) -> None:
    """System V shared memory outlives any mapping of it, so RLIMIT_AS would not hold it: the
    seccomp filter refuses it (EPERM), with or without a cgroup."""
    code = (
        "import ctypes\n"
        "def shm():\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    return [libc.shmget(0, 1 << 20, 0o1600), ctypes.get_errno()]\n"
    )
    assert holds(reward, code, "assert shm() == [-1, 1]")


def test_the_seccomp_filter_is_known_for_common_machines() -> None:
    for machine in ("x86_64", "aarch64"):
        program = deny_filter(machine)
        assert program is not None and len(program) % 8 == 0
    assert deny_filter("riscv64") is None


def fake_cgroup_host(root: Path, v1: bool, controllers: str = "memory pids") -> None:
    (root / "proc/self").mkdir(parents=True)
    if v1:
        mounts = [
            "30 25 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory",
            "31 25 0:27 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids",
        ]
        (root / "proc/self/cgroup").write_text("4:memory:/job\n8:pids:/job\n0::/\n")
        for controller in ("memory", "pids"):
            (root / "sys/fs/cgroup" / controller / "job").mkdir(parents=True)
    else:
        mounts = ["29 25 0:25 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw"]
        (root / "proc/self/cgroup").write_text("0::/job\n")
        own = root / "sys/fs/cgroup/job"
        own.mkdir(parents=True)
        (own / "cgroup.controllers").write_text(controllers + "\n")
    (root / "proc/self/mountinfo").write_text("\n".join(mounts) + "\n")


@pytest.mark.parametrize("v1", [False, True], ids=["v2", "v1"])
def test_cgroups_are_found_and_limit_each_program(tmp_path: Path, v1: bool) -> None:
    fake_cgroup_host(tmp_path, v1)
    cgroups = find_cgroups("auto", str(tmp_path))
    assert cgroups is not None and cgroups.version == (1 if v1 else 2)
    program = cgroups.limit(pid=4242, memory_bytes=300 << 20)
    memory = program.directories[0]
    assert (memory / "cgroup.procs").read_text() == "4242"
    limit = (memory / ("memory.limit_in_bytes" if v1 else "memory.max")).read_text()
    assert int(limit) == 300 << 20
    assert (program.directories[-1] / "pids.max").read_text() == "8"


def test_cgroups_left_by_a_killed_process_are_removed_by_the_next(tmp_path: Path) -> None:
    fake_cgroup_host(tmp_path, v1=False, controllers="memory pids")
    own = tmp_path / "sys/fs/cgroup/job"
    gone, alive = own / "rollout-sandbox-999999999", own / f"rollout-sandbox-{os.getppid()}"
    (gone / "program-3").mkdir(parents=True)
    alive.mkdir()
    assert find_cgroups("auto", str(tmp_path)) is not None
    assert not gone.exists() and alive.exists()


def test_no_cgroup_without_the_controllers_and_a_named_one_must_be_usable(tmp_path: Path) -> None:
    fake_cgroup_host(tmp_path, v1=False, controllers="cpu io")
    assert find_cgroups("auto", str(tmp_path)) is None
    assert find_cgroups("off", str(tmp_path)) is None
    with pytest.raises(CgroupError, match="not a cgroup v2 directory"):
        find_cgroups(str(tmp_path / "sys/fs/cgroup/job"), str(tmp_path))


def test_the_work_directory_is_private_to_each_program(reward: PythonTests) -> None:
    writer = "open('note', 'w').write('left behind')\ndef found():\n    return True\n"
    reader = "import os\ndef found():\n    return os.path.exists('note') or os.path.exists('/tmp/note')\n"
    assert holds(reward, writer, "assert found()")
    assert holds(reward, reader, "assert not found()")


def test_the_harness_files_are_read_only_inside(reward: PythonTests) -> None:
    code = (
        "def patch():\n"
        "    try:\n"
        "        open('/harness/code_wire.py', 'a').write('# patched')\n"
        "        return 'patched'\n"
        "    except OSError:\n"
        "        return 'refused'\n"
    )
    assert holds(reward, code, "assert patch() == 'refused'")
    assert stat.S_IMODE(os.stat(Path(__file__).parents[2] / "python_plugins/code_wire.py").st_mode) & 0o200
