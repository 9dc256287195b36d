"""Model paths that are Hugging Face hub ids (``"org/name"``), resolved in the local cache.

Offline only: nothing is downloaded. A path that exists on disk is used as it is; an
``org/name`` that does not is looked up in the hub cache (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``) as ``models--org--name/snapshots/<commit>``, the commit read from
``models--org--name/refs/main`` (or ``org/name@revision``: a branch or tag in ``refs/``, or a
commit hash). The Rust planner (``crates/rollout-core/src/plan/hub_cache.rs``) resolves the
same way, so it sizes the model the policy loads. Fill the cache with
``hf download org/name`` (``huggingface-cli download`` in older releases) on a machine with
the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["HubCacheMiss", "hub_cache_dir", "is_hub_id", "resolve_model_path"]

_PART = r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]*"
HUB_ID = re.compile(rf"({_PART})/({_PART})(?:@([A-Za-z0-9_.\-]+))?")


class HubCacheMiss(FileNotFoundError):
    """A hub id that is neither a local path nor in the local cache."""


def is_hub_id(text: str) -> bool:
    """Whether ``text`` is shaped like ``org/name`` (or ``org/name@revision``)."""
    return HUB_ID.fullmatch(text) is not None


def hub_cache_dir() -> Path:
    """The hub cache directory the environment names (it need not exist)."""
    for name, suffix in (("HF_HUB_CACHE", ()), ("HF_HOME", ("hub",))):
        value = os.environ.get(name)
        if value:
            return Path(value, *suffix)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "huggingface", "hub")


def resolve_model_path(path: str | os.PathLike[str]) -> str:
    """A local directory for ``path``: itself when it exists or is not a hub id, else the
    cached snapshot of the hub id. Raises :class:`HubCacheMiss` (naming the cache it looked in)
    for a hub id that is not cached."""
    text = os.fspath(path)
    match = HUB_ID.fullmatch(text)
    if Path(text).exists() or match is None:
        return text
    org, name, revision = match.groups()
    cache = hub_cache_dir()
    model = cache / f"models--{org}--{name}"
    commit = _commit(model, revision or "main")
    snapshot = model / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise HubCacheMiss(
            f"`{text}` is neither a local directory nor in the Hugging Face cache at {cache} "
            f"(looked for {model}/refs/{revision or 'main'} and its snapshot; set HF_HUB_CACHE or "
            f"HF_HOME to use another cache). Nothing is downloaded during a run: fetch it once "
            f"with `hf download {org}/{name}`, or give the model's directory."
        )
    return str(snapshot)


def _commit(model: Path, revision: str) -> str | None:
    """The commit ``refs/<revision>`` names, or ``revision`` itself when it is a snapshot."""
    if revision.startswith("."):
        return None
    ref = model / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        return commit if re.fullmatch(r"[0-9A-Za-z]+", commit) else None
    return revision if (model / "snapshots" / revision).is_dir() else None
