"""Anyone who can reach the controller's port can open connections; none of them may cost the
run. A flood of unauthenticated connections (hundreds held open and idle from 16 other
addresses, more than the controller lets authenticate at once; thousands opened from the
roles' own address, sent garbage or a 4 GiB length claim and closed) against a waiting
controller keeps its CPU and memory bounded, and the roles started during the flood still
join and the run completes."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

from harness import ROLLOUT, cluster, finish, free_port, start, wait_for, write_config

SECRET = "the flood test's cluster secret"
HELD = 200
# The held connections come from 127.0.0.2 to 127.0.0.17 (all loopback on Linux): no one
# address may hold more than 16 of the controller's 128 handshakes, so 16 fill them.
HOLDERS = [f"127.0.0.{index}" for index in range(2, 18)]
CHURNED = 20_000
FLOOD_SECONDS = 10.0
CLAIMS_4_GIB = b"RLT\x01\x00\x04\x00\x00" + b"\x00" * 8 + b"\x00\x00\x00\x01\x00\x00\x00\x00"
GARBAGE = (CLAIMS_4_GIB, b"GET / HTTP/1.1\r\n\r\n")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def settled_rss(pid: int, limit: float = 90.0) -> int:
    """The resident size of `pid` once it stops growing: the controller loads its Python
    services while it listens, and that is not the flood's doing."""
    samples = [rss_bytes(pid)]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.5)
        samples.append(rss_bytes(pid))
        if len(samples) >= 5 and max(samples[-5:]) - min(samples[-5:]) < 2 << 20:
            return samples[-1]
    raise AssertionError(f"the controller's memory did not settle in {limit:.0f} s: {samples[-5:]}")


class Flood:
    """Holds up to `HELD` idle connections to `port` and opens, abuses and closes up to
    `CHURNED` more, until stopped."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.stop = threading.Event()
        self.opened = 0
        self.threads = [threading.Thread(target=self._hold), threading.Thread(target=self._churn)]

    def __enter__(self) -> Flood:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _connect(self, source: str = "127.0.0.1") -> socket.socket | None:
        try:
            address = ("127.0.0.1", self.port)
            connection = socket.create_connection(address, timeout=1, source_address=(source, 0))
        except OSError:
            return None
        self.opened += 1
        return connection

    def _hold(self) -> None:
        held: list[socket.socket] = []
        sources = itertools.cycle(HOLDERS)
        while not self.stop.is_set():
            while len(held) < HELD and not self.stop.is_set():
                connection = self._connect(next(sources))
                if connection is None:
                    break
                connection.setblocking(False)
                held.append(connection)
            for connection in list(held):
                try:
                    if connection.recv(4096) == b"":  # closed by the controller: open another
                        held.remove(connection)
                        connection.close()
                except BlockingIOError:
                    pass
                except OSError:
                    held.remove(connection)
                    connection.close()
            time.sleep(0.05)
        for connection in held:
            connection.close()

    def _churn(self) -> None:
        for index in range(CHURNED):
            if self.stop.is_set():
                return
            connection = self._connect()
            if connection is not None:
                try:
                    connection.sendall(GARBAGE[index % 2])
                except OSError:
                    pass
                connection.close()


def role(kind: str, address: str, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [str(ROLLOUT), kind, "--connect", address, "--name", f"{kind}-0"]
    command += ["--connect-retry", "60", *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def test_a_flood_of_unauthenticated_connections_keeps_no_role_out(tmp_path: Path, artifacts: Path) -> None:
    port = free_port()
    config = write_config(tmp_path, artifacts, cluster(1, 1, 0, listen=f"127.0.0.1:{port}"), steps=2)
    env = {**os.environ, "ROLLOUT_CLUSTER_SECRET": SECRET}
    controller, log = start("launch", config, "--external-roles", env=env)
    roles: list[subprocess.Popen[str]] = []
    try:
        wait_for(lambda: "listening on" in log.read_text(), controller, log, "the controller to listen")
        pid = controller.pid
        rss_before = settled_rss(pid)
        cpu_before = cpu_seconds(pid)
        with Flood(port) as flood:
            started = time.monotonic()
            peak = rss_before
            while time.monotonic() - started < FLOOD_SECONDS:
                peak = max(peak, rss_bytes(pid))
                time.sleep(0.1)
            cpu_flood = cpu_seconds(pid) - cpu_before
            opened = flood.opened
            trainer_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            address = f"127.0.0.1:{port}"
            roles.append(role("trainer", address, "--rank", "0", "--world-size", "1", env=trainer_env))
            roles.append(role("worker", address, env=env))
            joined = "1 generation workers and 1 trainer ranks joined"
            wait_for(lambda: joined in log.read_text(), controller, log, "the roles to join", 120)
        stderr = finish(controller, log, 2)
    finally:
        for process in [controller, *roles]:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert opened > 1000, f"the flood opened only {opened} connections"
    assert cpu_flood < 0.3 * FLOOD_SECONDS, f"the controller spent {cpu_flood:.1f} s of CPU on the flood"
    assert peak - rss_before < 64 << 20, f"the controller grew by {(peak - rss_before) >> 20} MiB"
    assert "refused a connection" in stderr
    assert "not logged one by one" in stderr
    assert len([line for line in stderr.splitlines() if "refused" in line]) < 200
