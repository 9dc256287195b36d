"""rollout_sdk.startup: Triton is held back on hosts without a GPU driver, and only there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def probe(tmp_path: Path, driver_nodes: list[str], environ: dict[str, str]) -> str:
    """In a fresh interpreter: hold_back_triton's answer, then whether transformers' import of
    torch._dynamo loaded Triton and whether torch thinks it has Triton."""
    script = f"""
import sys
from rollout_sdk.startup import hold_back_triton
held = hold_back_triton({driver_nodes!r}, {environ!r})
from transformers import LlamaForCausalLM  # imports torch._dynamo, which looks for Triton
from torch.utils._triton import has_triton_package
print(held, sys.modules.get("triton") is not None, has_triton_package())
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.split("\n")[-2]


def test_without_a_gpu_driver_triton_is_not_loaded(tmp_path: Path) -> None:
    assert probe(tmp_path, [str(tmp_path / "no-such-node")], {}) == "True False False"


def test_a_gpu_driver_or_the_variable_loads_triton(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    node = tmp_path / "nvidiactl"
    node.touch()
    assert probe(tmp_path, [str(node)], {}) == "False True True"
    assert probe(tmp_path, [str(tmp_path / "no-such-node")], {"ROLLOUT_TRITON": "1"}) == "False True True"


def test_held_back_triton_looks_not_installed(tmp_path: Path) -> None:
    script = f"""
import importlib.util
from rollout_sdk.startup import hold_back_triton
assert hold_back_triton({[str(tmp_path / "none")]!r}, {{}})
assert hold_back_triton({[str(tmp_path / "none")]!r}, {{}}), "a second call undid it"
assert importlib.util.find_spec("triton") is None
try:
    import triton
except ModuleNotFoundError as err:
    print(err.name)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "triton"
