"""Chaos campaign: kill, stop and restart Rollout's processes mid-run, then audit the ledger.

Writes bench/results/chaos.json. Run `bench/chaos` (it sets up the environment).

- Worker kills, twice: with configs/distributed.toml's cluster settings (asynchronous,
  `max_staleness = 1`, two data-parallel trainer ranks: what users run) and synchronously
  (`max_staleness = 0`, one trainer). `rollout launch` with 3 generation workers; every
  `--kill-interval` seconds a random live worker is killed with SIGKILL (the launcher
  restarts it), so kills land in every phase (generation, weight sync, a restarted worker's
  warm start). Afterwards the ledger is audited (groups lost, trained twice), recovery is
  measured from the ledger (kill -> the killed worker's groups leased again) and the log
  (kill -> worker rejoined), and throughput is compared with the same run without kills.
- A stopped worker (SIGSTOP): found by its silence, its groups leased again.
- Controller restarts: the launcher is killed with SIGKILL and started again with `--resume`;
  the learning metrics must equal an uninterrupted run's (1 worker, staleness 0).
- A trainer rank killed: the run restarts from its checkpoint, metrics equal again.
- Fuzzing the frame decoder and the handshake (examples/fuzz_campaign.rs).

`--engine vllm` runs the worker kills at the shipped settings once with vLLM generation
workers (configs/vllm.toml's `[engine]`) and writes bench/results/chaos_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tomllib

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.e2e.runs import write_toml  # noqa: E402
from python_plugins.quickstart import create_tiny_model, write_addition_splits  # noqa: E402

RESULTS = REPO / "bench" / "results" / "chaos.json"
VLLM_RESULTS = REPO / "bench" / "results" / "chaos_vllm.json"
VLLM_ENGINE = tomllib.loads((REPO / "configs" / "vllm.toml").read_text())["engine"]
ROLLOUT = REPO / "target" / "release" / "rollout"
PROMPTS_PER_STEP = 8
# Metrics that describe the pool or wall time, not what was learned.
NOT_LEARNING = ("seconds", "per_second", "overhead_fraction", "engine/kv", "worker")
POOL = {"leases", "leases_revoked", "answers_rejected", "answers_malformed", "groups_dropped"}
# The cluster settings users run: configs/distributed.toml's.
SHIPPED_CLUSTER = tomllib.loads((REPO / "configs" / "distributed.toml").read_text())["cluster"]
KILL_SETTINGS = {
    "distributed": {**SHIPPED_CLUSTER, "workers": 3},
    "synchronous": {"workers": 3, "trainers": 1, "max_staleness": 0},
}


def config(
    work: Path, name: str, model: Path, data: Path, steps: int, engine: dict | None = None, **cluster: Any
) -> Path:
    path = work / f"{name}.toml"
    write_toml(
        path,
        {
            "engine": engine or {},
            "run": {
                "name": name,
                "seed": 0,
                "steps": steps,
                "output_dir": str(work / name),
                "log_samples": 0,
            },
            "policy": {
                "plugin": "python_plugins.hf_policy:HFCausalLM",
                "options": {"model_path": str(model), "torch_threads": 1},
            },
            "data": {
                "plugin": "python_plugins.data:JsonlPrompts",
                "options": {"path": str(data), "template": "{question}"},
            },
            "[]rewards": {"plugin": "python_plugins.rewards:ExactMatch"},
            "rollout": {"prompts_per_step": PROMPTS_PER_STEP, "group_size": 4, "max_new_tokens": 16},
            "train": {"learning_rate": 1e-3, "micro_batch_tokens": 512},
            "checkpoint": {"every": 5},
            "cluster": {"trainers": 1, "max_staleness": 0, **cluster},
        },
    )
    return path


class Launch:
    """A `rollout launch` process and its log."""

    def __init__(self, path: Path, *args: str) -> None:
        self.log = path.with_suffix(".log")
        self.process = subprocess.Popen(
            [str(ROLLOUT), "launch", str(path), *args],
            stdout=subprocess.PIPE,
            stderr=self.log.open("a"),
            text=True,
            cwd=REPO,
        )

    def text(self) -> str:
        return self.log.read_text()

    def pids(self, role: str) -> list[int]:
        return [int(pid) for pid in re.findall(rf"started {role} \(pid (\d+)\)", self.text())]

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float = 1800) -> None:
        self.process.communicate(timeout=timeout)
        if self.process.returncode != 0:
            raise RuntimeError(f"rollout launch exited {self.process.returncode}:\n{self.text()[-3000:]}")


def wait_until(predicate: Callable[[], bool], launch: Launch, what: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if not launch.running() or time.monotonic() > deadline:
            raise RuntimeError(f"no {what}:\n{launch.text()[-3000:]}")
        time.sleep(0.05)


def steps_done(output: Path) -> int:
    path = output / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def metrics(output: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def learning(output: Path) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in line.items() if k not in POOL and not any(w in k for w in NOT_LEARNING)}
        for line in metrics(output)
    ]


def audit(output: Path) -> dict[str, Any]:
    result = subprocess.run([str(ROLLOUT), "audit", str(output)], capture_output=True, text=True, check=False)
    return json.loads(result.stdout)


def journal(output: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output / "ledger.jsonl").read_text().splitlines()]


def log_time(line: str) -> float:
    return datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()


def recoveries(entries: list[dict[str, Any]], kills: list[tuple[float, str]]) -> list[float]:
    """Seconds from each kill to the moment every group the killed worker held was leased
    again (kills of a worker that held no lease are left out)."""
    leased = {e["lease"]: e for e in entries if e["event"] == "leased"}
    seconds = []
    for number, (at, worker) in enumerate(kills):
        until = next((t for t, w in kills[number + 1 :] if w == worker), math.inf)
        revoked = [
            e
            for e in entries
            if e["event"] == "revoked" and at <= e["at"] < until and e["reason"].startswith(f"{worker}:")
        ]
        again = []
        for revocation in revoked:
            group = leased[revocation["lease"]]["group"]
            # A group answered meanwhile (by an earlier lease) is not leased again.
            later = [
                e["at"]
                for e in entries
                if e["event"] == "leased" and e["group"] == group and e["at"] >= revocation["at"]
            ]
            again += later[:1]
        if again:
            seconds.append(max(again) - at)
    return seconds


def rejoin_seconds(log: str, kills: list[tuple[float, str]]) -> list[float]:
    joins = [
        (log_time(line), re.search(r"(worker-\d+) joined", line).group(1))  # type: ignore[union-attr]
        for line in log.splitlines()
        if "joined the run's generation workers" in line
    ]
    seconds = []
    for at, worker in kills:
        later = [t for t, name in joins if name == worker and t >= at]
        if later:
            seconds.append(min(later) - at)
    return seconds


def worker_kills(
    work: Path,
    model: Path,
    data: Path,
    groups: int,
    interval: float,
    seed: int,
    name: str,
    cluster: dict[str, Any],
    engine: dict | None = None,
) -> dict[str, Any]:
    steps = math.ceil(groups / PROMPTS_PER_STEP)
    baseline_path = config(work, f"{name}-baseline", model, data, steps, engine, **cluster)
    started = time.monotonic()
    baseline = Launch(baseline_path)
    baseline.wait()
    baseline_seconds = time.monotonic() - started

    path = config(work, name, model, data, steps, engine, **cluster, max_worker_restarts=1000)
    output = work / name
    started = time.monotonic()
    launch = Launch(path)
    wait_until(lambda: steps_done(output) >= 1, launch, "first step")
    rng = random.Random(seed)
    kills: list[tuple[float, str]] = []
    while launch.running():
        time.sleep(interval)
        joins = re.findall(r"(worker-\d+) joined the run", launch.text())
        # Only a worker whose current process has joined (not one still starting again).
        killed = [name for _, name in kills]
        ready = [f"worker-{i}" for i in range(3) if joins.count(f"worker-{i}") >= killed.count(f"worker-{i}")]
        if not ready or not launch.running():
            continue
        victim = rng.choice(ready)
        try:
            os.kill(launch.pids(victim)[-1], signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append((time.time(), victim))
    launch.wait()
    chaos_seconds = time.monotonic() - started
    found = audit(output)
    recovered = recoveries(journal(output), kills)
    rejoined = rejoin_seconds(launch.text(), kills)
    lines = metrics(output)
    return {
        "cluster": cluster,
        "steps": len(lines),
        "completed": len(lines) == steps,
        "prompt_groups": found["groups_trained"],
        "stale_groups_regenerated": sum(line.get("stale_groups_regenerated", 0) for line in lines),
        "stale_groups_dropped": sum(line.get("stale_groups_dropped", 0) for line in lines),
        "staleness_max": max(line.get("staleness_max", 0) for line in lines),
        "kills": len(kills),
        "audit": found,
        "recovery_seconds": recovered,
        "rejoin_seconds": rejoined,
        "kills_holding_leases": len(recovered),
        "kill_log": [{"at": at, "worker": worker} for at, worker in kills],
        "seconds": chaos_seconds,
        "baseline_seconds": baseline_seconds,
        # The same work without kills over the same work with them (wall time, start to end).
        "throughput_fraction": baseline_seconds / chaos_seconds,
    }


def kill_summary(kills: dict[str, Any]) -> dict[str, Any]:
    recovery = kills["recovery_seconds"] or [0.0]
    return {
        "cluster": kills["cluster"],
        "completed": kills["completed"],
        "prompt_groups": kills["prompt_groups"],
        "kills": kills["kills"],
        "groups_lost": kills["audit"]["groups_lost"],
        "groups_duplicated": kills["audit"]["groups_duplicated"],
        # Apart from the groups trained: replaced by a regeneration, dropped, and requeued.
        "groups_replaced": kills["audit"].get("groups_replaced", 0),
        "groups_dropped": kills["audit"].get("groups_dropped", 0),
        "groups_requeued": kills["audit"].get("groups_requeued", 0),
        "stale_groups_regenerated": kills["stale_groups_regenerated"],
        "stale_groups_dropped": kills["stale_groups_dropped"],
        "staleness_max": kills["staleness_max"],
        "recovery_seconds_p50": statistics.median(recovery),
        "recovery_seconds_max": max(recovery),
        "rejoin_seconds_p50": statistics.median(kills["rejoin_seconds"] or [0.0]),
        "throughput_fraction_under_kills": kills["throughput_fraction"],
    }


OTHER_CASES = (
    "stopped_worker_detection_seconds",
    "controller_restarts",
    "controller_restart_exact",
    "trainer_restart_exact",
    "fuzz_inputs",
    "fuzz_panics",
)


def keep_other_cases(previous: dict[str, Any], results: dict[str, Any], details: dict[str, Any]) -> list[Any]:
    """With --only-kills: the other cases' results of the previous run, kept as they were
    (with their date); returns their audits."""
    results |= {key: previous[key] for key in OTHER_CASES if key in previous}
    earlier = {"measured": previous.get("measured"), **previous["details"]}
    earlier |= earlier.pop("kept_from_previous_run", None) or {}
    kept = {key: earlier[key] for key in ("measured", "stopped", "restarts", "fuzz") if key in earlier}
    details["kept_from_previous_run"] = kept
    audits = [kept["stopped"]["audit"]] if "stopped" in kept else []
    if "restarts" in kept:
        audits += [kept["restarts"]["controller"]["audit"], kept["restarts"]["trainer"]["audit"]]
    return audits


def stopped_worker(work: Path, model: Path, data: Path, steps: int) -> dict[str, Any]:
    path = config(
        work, "stopped", model, data, steps, workers=2, heartbeat_seconds=0.5, peer_timeout_seconds=3.0
    )
    output = work / "stopped"
    launch = Launch(path)
    wait_until(lambda: steps_done(output) >= 3, launch, "step 3")
    pid = launch.pids("worker-1")[-1]
    stopped_at = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: "worker-1 left the generation pool" in launch.text(), launch, "the stop noticed")
    finally:
        os.kill(pid, signal.SIGCONT)
    launch.wait()
    noticed = next(
        log_time(line) for line in launch.text().splitlines() if "worker-1 left the generation" in line
    )
    return {"audit": audit(output), "detection_seconds": noticed - stopped_at}


def wait_exit(pids: Sequence[int], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


def restarts(
    work: Path, model: Path, data: Path, steps: int, restarts_wanted: int, seed: int
) -> dict[str, Any]:
    """Controller killed and resumed `restarts_wanted` times; then a trainer killed once."""
    reference = config(work, "uninterrupted", model, data, steps, workers=1)
    Launch(reference).wait()
    expected = learning(work / "uninterrupted")

    rng = random.Random(seed)
    path = config(work, "controller", model, data, steps, workers=1)
    output = work / "controller"
    launch = Launch(path)
    done = 0
    for _ in range(restarts_wanted):
        target = steps_done(output) + rng.randint(3, 8)
        wait_until(lambda target=target: steps_done(output) >= target, launch, f"step {target}")
        roles = launch.pids("worker-0") + launch.pids("trainer-0")
        launch.process.kill()
        launch.process.wait()
        wait_exit(roles)
        done += 1
        launch = Launch(path, "--resume")
    launch.wait()
    controller = {"restarts": done, "audit": audit(output), "exact": learning(output) == expected}

    path = config(work, "trainer", model, data, steps, workers=1)
    output = work / "trainer"
    launch = Launch(path)
    wait_until(lambda: steps_done(output) >= steps // 2, launch, "half the run")
    os.kill(launch.pids("trainer-0")[-1], signal.SIGKILL)
    launch.wait()
    trainer = {"audit": audit(output), "exact": learning(output) == expected}
    return {"controller": controller, "trainer": trainer}


def fuzz(inputs: int) -> dict[str, Any]:
    env = {**os.environ, "PYO3_PYTHON": sys.executable}
    command = [
        "cargo",
        "run",
        "--release",
        "--quiet",
        "-p",
        "rollout-net",
        "--example",
        "fuzz_campaign",
        "--",
    ]
    result = subprocess.run(
        [*command, "--inputs", str(inputs), "--seed", "1"], capture_output=True, text=True, cwd=REPO, env=env
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=REPO / "bench" / ".work" / "chaos")
    parser.add_argument("--groups", type=int, default=2400, help="prompt groups in each worker-kill run")
    parser.add_argument(
        "--only-kills", action="store_true", help="the worker-kill campaigns only (no restarts, no fuzzing)"
    )
    parser.add_argument("--kill-interval", type=float, default=2.0, help="seconds between worker kills")
    parser.add_argument("--controller-restarts", type=int, default=2)
    parser.add_argument("--fuzz-inputs", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        choices=("rollout", "vllm"),
        default="rollout",
        help="vllm: worker kills with vLLM workers only",
    )
    args = parser.parse_args(argv)
    if args.engine == "vllm":
        return vllm_worker_kills(args)
    work: Path = args.work
    model, data = fresh_work(work, hidden_size=32)

    campaigns = {}
    for name, cluster in KILL_SETTINGS.items():
        print(f"worker kills ({name}: {cluster})", flush=True)
        campaigns[name] = worker_kills(
            work, model, data, args.groups, args.kill_interval, args.seed, f"kills-{name}", cluster
        )
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}, "measured": datetime.now().isoformat()}
    results["worker_kills"] = {name: kill_summary(kills) for name, kills in campaigns.items()}
    audits = [kills["audit"] for kills in campaigns.values()]
    details: dict[str, Any] = {"kills": campaigns}
    if not args.only_kills:
        print("a stopped worker", flush=True)
        stopped = stopped_worker(work, model, data, steps=30)
        print("controller and trainer restarts", flush=True)
        restarted = restarts(
            work, model, data, steps=40, restarts_wanted=args.controller_restarts, seed=args.seed
        )
        print("fuzzing", flush=True)
        fuzzed = fuzz(args.fuzz_inputs)
        audits += [stopped["audit"], restarted["controller"]["audit"], restarted["trainer"]["audit"]]
        results |= {
            "stopped_worker_detection_seconds": stopped["detection_seconds"],
            "controller_restarts": restarted["controller"]["restarts"],
            "controller_restart_exact": restarted["controller"]["exact"],
            "trainer_restart_exact": restarted["trainer"]["exact"],
            "fuzz_inputs": fuzzed["fuzz_inputs"],
            "fuzz_panics": fuzzed["fuzz_panics"],
        }
        details |= {"stopped": stopped, "restarts": restarted, "fuzz": fuzzed}
    elif RESULTS.exists():
        audits += keep_other_cases(json.loads(RESULTS.read_text()), results, details)
    results["groups_lost"] = sum(a["groups_lost"] for a in audits)
    results["groups_duplicated"] = sum(a["groups_duplicated"] for a in audits)
    results["details"] = details
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "details"}, indent=2))
    return 0


def fresh_work(work: Path, hidden_size: int) -> tuple[Path, Path]:
    """An empty `work` with the campaign's tiny model and addition data; (model, data)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_addition_splits(work / "data", train=2000, test=10, seed=0)
    model = work / "model"
    create_tiny_model(model, hidden_size=hidden_size, num_layers=2, num_heads=2, max_positions=64, seed=0)
    return model, work / "data" / "train.jsonl"


def vllm_worker_kills(args: argparse.Namespace) -> int:
    """The worker kills at the shipped settings with vLLM generation workers; a model whose
    attention heads vLLM's CPU kernels take (32 dimensions and more)."""
    work: Path = args.work / "vllm"
    model, data = fresh_work(work, hidden_size=64)
    kills = worker_kills(
        work,
        model,
        data,
        args.groups,
        args.kill_interval,
        args.seed,
        "kills-vllm",
        KILL_SETTINGS["distributed"],
        engine=VLLM_ENGINE,
    )
    results = {
        "machine": {"cpus": os.cpu_count()},
        "measured": datetime.now().isoformat(),
        "command": " ".join(["bench/chaos", *sys.argv[1:]]),
        "engine": VLLM_ENGINE,
        "worker_kills": kill_summary(kills),
        "groups_lost": kills["audit"]["groups_lost"],
        "groups_duplicated": kills["audit"]["groups_duplicated"],
        "details": kills,
    }
    VLLM_RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "details"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
