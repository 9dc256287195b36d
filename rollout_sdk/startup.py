"""What the `rollout` binary's interpreter sets up before it imports any plugin.

Triton compiles GPU kernels only, yet importing transformers loads it (through
``torch._dynamo``) with 50 MB of resident native code. On a host without a GPU driver, Triton
is held back: ``sys.modules["triton"]`` is ``None``, so ``import triton`` raises
``ModuleNotFoundError`` and ``importlib.util.find_spec("triton")`` answers ``None``, as if the
package were not installed, which torch and the libraries that use Triton when they can
already expect on such hosts. ``ROLLOUT_TRITON=1`` loads it anyway.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

# Device nodes of the GPU drivers Triton targets: NVIDIA, AMD (ROCm), and WSL's GPU bridge.
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
TRITON_VARIABLE = "ROLLOUT_TRITON"


def hold_back_triton(
    driver_nodes: Sequence[str] = GPU_DRIVER_NODES, environ: Mapping[str, str] = os.environ
) -> bool:
    """Hold Triton back unless a GPU driver is present, it is already loaded, or
    ``ROLLOUT_TRITON=1``; whether it is held back now."""
    if "triton" in sys.modules:
        return sys.modules["triton"] is None
    if environ.get(TRITON_VARIABLE) == "1" or any(os.path.exists(node) for node in driver_nodes):
        return False
    sys.modules["triton"] = None
    return True


def prepare_process() -> None:
    """Everything above, as the binary calls it once its `sys.path` is set."""
    hold_back_triton()
