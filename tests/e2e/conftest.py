"""Fixtures shared by the end-to-end tests (their helpers are in harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from python_plugins.quickstart import create_tiny_model, write_addition_splits
from tests.e2e.harness import ROLLOUT


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local model (model/) and one-digit addition splits (data/) of the base config."""
    if not ROLLOUT.exists():
        pytest.fail(f"{ROLLOUT} is missing: run scripts/setup.sh (or set ROLLOUT_BIN)")
    root = tmp_path_factory.mktemp("tiny")
    create_tiny_model(root / "model", hidden_size=32, num_layers=2, num_heads=2, max_positions=512, seed=0)
    write_addition_splits(root / "data", train=64, test=16, seed=0, digits=1)
    return root
