"""Seeding a plugin process's global random number generators from ``run.seed``."""

from __future__ import annotations

import importlib.util
import random

import numpy as np

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and (when installed) torch's global generators.

    The engine calls this once per process, before it instantiates any plugin, so plugins
    that draw from the global generators (weight initialisation, dropout, data shuffles)
    are reproducible for a given ``run.seed``.
    """
    seed = int(seed) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.manual_seed(seed)
