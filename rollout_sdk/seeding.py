"""Seeding a plugin process's global random number generators from ``run.seed``."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import random
import sys
from collections.abc import Sequence
from types import ModuleType

import numpy as np

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators.

    The engine calls this once per process, before it instantiates any plugin, so plugins
    that draw from the global generators (weight initialisation, dropout, data shuffles)
    are reproducible for a given ``run.seed``. torch is seeded now if it is already
    imported, otherwise the moment it is first imported: a process whose plugins never use
    torch (a distributed run's controller scoring in plain Python) does not pay for loading
    it, seconds and some 400 MiB of resident memory.
    """
    seed = int(seed) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
        return
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _SeedTorchOnImport)]
    sys.meta_path.insert(0, _SeedTorchOnImport(seed))


class _SeedTorchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it hands torch's own spec back with a loader that seeds torch's
    global generator once torch has run its ``__init__``, then leaves ``sys.meta_path``."""

    def __init__(self, seed: int) -> None:
        self._seed = seed

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _SeedingLoader(spec.loader, self._seed)
        return spec


class _SeedingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, seed: int) -> None:
        self._loader = loader
        self._seed = seed

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # torch runs its __init__ seeing its own loader, as in a process nobody seeded.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        module.manual_seed(self._seed)
