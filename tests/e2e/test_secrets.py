"""The cluster secret stays put: taken out of the environment as `rollout` starts, handed to
the roles `rollout launch` starts in a private file, and never written to a file of the run.
Sandbox workers start from an allowlisted environment, so tokens such as `HF_TOKEN` stay
behind too."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from harness import LAUNCH_TIMEOUT, cluster, finish, launch, start, write_config

STEPS = 3


def descendants(root: int) -> list[int]:
    """The pids of every living descendant of `root`."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # The parent is the 4th field, after the parenthesised command (which may hold spaces).
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended meanwhile
        return b""


def test_the_secret_reaches_no_child_process_and_no_file(tmp_path: Path, artifacts: Path) -> None:
    secret = f"cluster-secret-{secrets.token_hex(16)}"
    token = f"hf_{secrets.token_hex(16)}"
    sections = cluster(1, 2, 1), {"sandbox": {"processes": 1}}
    config = write_config(tmp_path, artifacts, *sections, steps=STEPS)
    trace = tmp_path / "trace.json"
    environment = {**os.environ, "ROLLOUT_CLUSTER_SECRET": secret, "HF_TOKEN": token}
    process, log = start("launch", config, "--verbose", "--trace", str(trace), env=environment)
    commands: dict[int, str] = {}
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        while process.poll() is None and time.monotonic() < deadline:
            for pid in descendants(process.pid):
                proc = Path("/proc", str(pid))
                environ, command = read(proc / "environ"), read(proc / "cmdline").replace(b"\0", b" ")
                assert secret.encode() not in environ, f"pid {pid} ({command!r}) inherited the secret"
                if b"rollout_sdk.sandbox" in command:
                    assert token.encode() not in environ, "a sandbox worker inherited HF_TOKEN"
                if command:
                    commands[pid] = command.decode("utf-8", "replace")
            time.sleep(0.1)
    except BaseException:
        process.kill()
        process.wait()
        raise
    finish(process, log, STEPS)
    roles = list(commands.values())
    assert sum(" worker " in c for c in roles) >= 1, roles
    assert sum(" trainer " in c for c in roles) >= 2, roles
    assert any("rollout_sdk.sandbox" in c for c in roles), roles
    assert trace.exists()
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(written) > 10
    for path in written:
        assert secret.encode() not in path.read_bytes(), f"{path} holds the cluster secret"


def test_a_secret_file_every_user_can_read_is_refused(tmp_path: Path, artifacts: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o644)
    config = write_config(tmp_path, artifacts, cluster(1, 1, 0, secret_file=secret), steps=1)
    result = launch(config, check=False)
    assert result.returncode != 0
    assert "open to every user of this machine (mode 644)" in result.stderr
    assert "chmod 600" in result.stderr
