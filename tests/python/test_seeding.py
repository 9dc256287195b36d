"""`seed_everything`: every global generator seeded, torch without being imported for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def torch_draws(seed: int) -> list[float]:
    """What torch's global generator draws first after ``torch.manual_seed(seed)``."""
    return run_python(
        f"import json, torch\ntorch.manual_seed({seed})\n"
        "print(json.dumps({'torch': torch.rand(4).tolist()}))"
    )["torch"]


def test_torch_is_seeded_when_first_imported_and_not_imported_for_it() -> None:
    seen = run_python(
        "import json, random, sys\n"
        "import numpy as np\n"
        "from rollout_sdk.seeding import seed_everything\n"
        "seed_everything(5)\n"
        "seed_everything(7)\n"
        "imported_by_seeding = 'torch' in sys.modules\n"
        "draws = (random.random(), float(np.random.random()))\n"
        "import torch\n"
        "print(json.dumps({'imported_by_seeding': imported_by_seeding, 'draws': draws,\n"
        "    'torch': torch.rand(4).tolist(), 'loader': type(torch.__loader__).__name__,\n"
        "    'finders': [type(f).__name__ for f in sys.meta_path]}))"
    )
    assert seen["imported_by_seeding"] is False
    # The last call's seed wins, as it does for the generators seeded at once.
    assert seen["torch"] == torch_draws(7)
    assert seen["torch"] != torch_draws(5)
    reference = run_python(
        "import json, random; import numpy as np\n"
        "random.seed(7); np.random.seed(7)\n"
        "print(json.dumps({'draws': (random.random(), float(np.random.random()))}))"
    )
    assert seen["draws"] == reference["draws"]
    # torch ran its own __init__ with its own loader, and the hook left the import system.
    assert seen["loader"] == "SourceFileLoader"
    assert "_SeedTorchOnImport" not in seen["finders"]


def test_an_imported_torch_is_seeded_at_once() -> None:
    seen = run_python(
        "import json, torch\n"
        "from rollout_sdk.seeding import seed_everything\n"
        "seed_everything(11)\n"
        "print(json.dumps({'torch': torch.rand(4).tolist()}))"
    )
    assert seen["torch"] == torch_draws(11)


def test_the_distributed_controllers_plugins_leave_torch_unloaded() -> None:
    """configs/distributed.toml's controller hosts these plugins: without torch it stays at
    about 50 MiB instead of about 500 (docs/memory.md)."""
    seen = run_python(
        "import json, sys\n"
        "from rollout_sdk.seeding import seed_everything\n"
        "seed_everything(0)\n"
        "import python_plugins.callbacks, python_plugins.data, python_plugins.rewards\n"
        "print(json.dumps({'loaded': sorted(m for m in ('torch', 'transformers') if m in sys.modules)}))"
    )
    assert seen["loaded"] == []
