"""The red team's matrix (every test style x every attack strategy, from
tests/python/test_hostile_completions.py) scored by the code reward before and after a change,
side by side: each attack's score, its honest wrong twin's, the correct solution's.

    .venv/bin/python bench/red_team.py [--before a6bed52]

Writes bench/results/red_team.json. "Before" is the code reward of the given revision
(`python_plugins/` and `rollout_sdk/` taken with `git archive`), scored in a child process so
the two implementations never share a module. A batch the reward could not score at all is
recorded as what it raised (in-process, that ends the run); a style the revision cannot
express (no such reward, a test form it refuses) as what it said.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from io import BytesIO
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "red_team.json"


def cases() -> list[dict[str, Any]]:
    """Every (style, strategy) with its three completions and its record."""
    sys.path.insert(0, str(REPO))
    from tests.python.test_hostile_completions import STRATEGIES, STYLES, TIMEOUT, hostile

    found = []
    for style_name, style in STYLES.items():
        for strategy in STRATEGIES:
            found.append(
                {
                    "style": style_name,
                    "strategy": strategy,
                    "stdio": style.stdio,
                    "record": style.record(),
                    "completions": [hostile(style, strategy), style.wrong, style.correct],
                    "timeout": TIMEOUT,
                }
            )
    return found


def score_with(tree: Path, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs in the child: scores each case with the code rewards of ``tree``."""
    sys.path[:0] = [str(tree), str(REPO)]  # the tree's reward, the repository's test helpers
    from python_plugins import code_reward
    from rollout_sdk import Sample, load_plugin

    rewards: dict[bool, Any] = {}
    for stdio, name in ((False, "PythonTests"), (True, "StdioTests")):
        if hasattr(code_reward, name):
            options = {"timeout_seconds": batch[0]["timeout"]}
            rewards[stdio] = load_plugin(
                f"python_plugins.code_reward:{name}", options, getattr(code_reward, name)
            )
    results: list[dict[str, Any]] = [host_memory_taken(rewards[False])]
    for case in batch:
        reward = rewards.get(case["stdio"])
        if reward is None:
            results.append({"outcome": "no such reward"})
            continue
        samples = [Sample(prompt="", completion=c, record=case["record"]) for c in case["completions"]]
        started = time.monotonic()
        try:
            scores = reward.score(samples)
        except Exception as err:  # the revision's reward raised for the batch
            results.append({"outcome": f"raised {type(err).__name__}: {str(err)[:160]}"})
            continue
        attack, twin, correct = (s if isinstance(s, float) else f"failed ({s.reason})" for s in scores)
        results.append(
            {
                "outcome": "scored",
                "attack": attack,
                "twin": twin,
                "correct": correct,
                "seconds": round(time.monotonic() - started, 2),
            }
        )
    return results


def host_memory_taken(reward: Any) -> dict[str, float]:
    """How far the host's available memory falls while one completion fills its disk."""
    from rollout_sdk import Sample
    from tests.python.host_memory import FILL, memory_fall

    sample = Sample(prompt="", completion=FILL, record={"tests": ["assert fill() == 0"]})
    started = time.monotonic()
    _, fell = memory_fall(lambda: reward.score([sample]))
    return {"fell_mib": round(fell / 2**20), "seconds": round(time.monotonic() - started, 2)}


def run_child(tree: Path, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, __file__, "--score-with", str(tree)],
        input=json.dumps(batch),
        capture_output=True,
        text=True,
        check=False,
        cwd=tree,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scoring with {tree} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def checkout(revision: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "archive", revision, "python_plugins", "rollout_sdk"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


def forged(result: dict[str, Any]) -> bool:
    """The attack scored more than its honest wrong twin."""
    if result["outcome"] != "scored":
        return False
    worth = [value if isinstance(value, float) else 0.0 for value in (result["attack"], result["twin"])]
    return worth[0] > worth[1]


def summary(results: list[dict[str, Any]], batch: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "forged_above_twin": sum(forged(r) for r in results),
        "batch_raised": sum(r["outcome"].startswith("raised") for r in results),
        "not_expressible": sum(r["outcome"] == "no such reward" for r in results),
        "correct_not_1": sum(r["outcome"] == "scored" and r["correct"] != 1.0 for r in results),
        "cases": len(batch),
    }


def table(report: dict[str, Any]) -> str:
    """Per attack strategy: the most it scored over its twin, and the batches that raised or
    could not be expressed, before and after (the section in docs/benchmarks.md)."""
    lines = [
        "| attack strategy | before: styles forged above the twin (best attack / twin) | before: "
        "batches raised / styles not expressible | after: forged | after: samples failed alone |",
        "|---|---|---|---|---|",
    ]
    by_strategy: dict[str, list[dict[str, Any]]] = {}
    for row in report["cases"]:
        by_strategy.setdefault(row["strategy"], []).append(row)
    for strategy, rows in by_strategy.items():
        before = [row["before"] for row in rows]
        after = [row["after"] for row in rows]
        beaten = [(r["attack"], r["twin"]) for r in before if forged(r)]
        best = f" ({max(beaten)[0]:.2f} / {max(beaten)[1]:.2f})" if beaten else ""
        raised = sum(
            r["outcome"].startswith("raised") and "UnverifiableTest" not in r["outcome"] for r in before
        )
        inexpressible = sum(
            r["outcome"] == "no such reward" or "UnverifiableTest" in r["outcome"] for r in before
        )
        failed = sum(r["outcome"] == "scored" and isinstance(r["attack"], str) for r in after)
        lines.append(
            f"| {strategy} | {len(beaten)} of {len(rows)}{best} | {raised} / {inexpressible} | "
            f"{sum(forged(r) for r in after)} of {len(rows)} | {failed} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", default="a6bed52", help="the revision to compare with")
    parser.add_argument("--score-with", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--table", action="store_true", help="print the committed results as a table")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(RESULTS.read_text())))
        return
    if args.score_with:
        print(json.dumps(score_with(args.score_with, json.loads(sys.stdin.read()))))
        return
    batch = cases()
    with tempfile.TemporaryDirectory(prefix="rollout-red-team-") as directory:
        checkout(args.before, Path(directory))
        fill_before, *before = run_child(Path(directory), batch)
    fill_after, *after = run_child(REPO, batch)
    rows = [
        {"style": case["style"], "strategy": case["strategy"], "before": b, "after": a}
        for case, b, a in zip(batch, before, after, strict=True)
    ]
    report = {
        "command": "bench/red_team.py --before " + args.before,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "before": {"revision": args.before, **summary(before, batch), "disk_fill": fill_before},
        "after": {"revision": "working tree", **summary(after, batch), "disk_fill": fill_after},
        "cases": rows,
    }
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"before": report["before"], "after": report["after"]}, indent=1))


if __name__ == "__main__":
    main()
