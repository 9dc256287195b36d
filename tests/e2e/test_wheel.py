"""The `rollout` wheel (scripts/build-wheel.sh) installed in a fresh virtual environment runs
`rollout --version`, `rollout init-quickstart` and a short `rollout run` with no clone of the
repository on any path and no Rust toolchain on PATH.

The fresh venv gets the wheel itself (the binary, rollout_sdk and python_plugins) with
`--no-deps`; its dependencies (torch, transformers, ... about 5 GB) come from the test's own
environment through a .pth file that adds only that environment's site-packages, not the
repository. `ROLLOUT_WHEEL_FULL_DEPS=1` installs the wheel with its declared dependencies from
the package index instead (a large download). `ROLLOUT_WHEEL=PATH` tests a built wheel
instead of building one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.e2e.harness import REPO

SCRUBBED = {"PYTHONPATH", "VIRTUAL_ENV", "ROLLOUT_VENV", "ROLLOUT_HOME", "ROLLOUT_BIN", "PYO3_PYTHON"}
FULL_DEPS = os.environ.get("ROLLOUT_WHEEL_FULL_DEPS") == "1"

Installed = tuple[Path, dict[str, str]]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("maturin") is None and "ROLLOUT_WHEEL" not in os.environ,
        reason="maturin is not installed (it is in requirements.txt: pip install -r requirements.txt)",
    ),
]


def timed(label: str, command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    print(f"{label}: {time.monotonic() - start:.1f}s")
    assert result.returncode == 0, f"{label} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel() -> Path:
    if "ROLLOUT_WHEEL" in os.environ:
        return Path(os.environ["ROLLOUT_WHEEL"])
    built = timed(
        "build the wheel",
        [str(REPO / "scripts" / "build-wheel.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        timeout=3600,
    )
    path = Path(built.stdout.strip().splitlines()[-1])
    print(f"wheel {path.name}: {path.stat().st_size / 1e6:.1f} MB")
    return path


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A fresh venv (from the base Python the wheel is for) with the wheel, and a clean env."""
    root = tmp_path_factory.mktemp("wheel")
    venv = root / "env"
    timed("create the venv", [sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site_packages = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
        ).strip()
    )
    if FULL_DEPS:
        install = [sys.executable, "-m", "pip", "--python", str(python), "install", str(wheel)]
    else:
        # Only the dependencies' directory, not the repository (nor its editable install,
        # whose .pth file is not processed from a directory that a .pth file adds).
        (site_packages / "rollout-test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
        install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)]
    timed("install the wheel", install)
    env = {
        key: value
        for key, value in os.environ.items()
        if key
        not in {"PYTHONPATH", "VIRTUAL_ENV", "ROLLOUT_VENV", "ROLLOUT_HOME", "ROLLOUT_BIN", "PYO3_PYTHON"}
        and not key.startswith(("CARGO", "RUSTUP"))
    }
    # No cargo, no repository: the venv's bin and the system's.
    env["PATH"] = os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    return venv, env


def run_rollout(installed: Installed, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    _, env = installed
    return timed(
        f"rollout {args[0]}",
        ["rollout", *args],
        cwd=cwd,
        env={**env, "ROLLOUT_LOG": "rollout_python=debug"},
        timeout=900,
    )


def test_the_wheel_holds_the_binary_the_sdk_and_the_plugins(wheel: Path):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert any(name.endswith(".data/scripts/rollout") for name in names), names
    assert "rollout_sdk/__init__.py" in names
    assert "python_plugins/quickstart.py" in names
    assert not [name for name in names if "__pycache__" in name or name.startswith("tests/")]


def test_installed_rollout_runs_the_quickstart_without_the_repository(installed, tmp_path):
    venv, env = installed
    assert shutil.which("cargo", path=env["PATH"]) is None
    binary = venv / "bin" / "rollout"
    assert binary.is_file()
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    assert "libpython" in ldd.stdout and "not found" not in ldd.stdout, ldd.stdout

    imported = timed(
        "import the packages",
        [
            str(venv / "bin" / "python"),
            "-c",
            "import rollout_sdk, python_plugins.quickstart as q; print(rollout_sdk.__file__, q.__file__)",
        ],
        cwd=tmp_path,
        env=env,
    )
    for location in imported.stdout.split():
        assert Path(location).resolve().is_relative_to(venv.resolve()), imported.stdout

    version = run_rollout(installed, tmp_path, "--version")
    assert version.stdout.startswith("rollout "), version.stdout

    quickstart = tmp_path / "qs"
    created = run_rollout(installed, tmp_path, "init-quickstart", "--dir", str(quickstart))
    assert (quickstart / "model" / "model.safetensors").is_file()
    assert (quickstart / "data" / "train.jsonl").is_file()
    config = quickstart / "quickstart.toml"
    assert config.is_file()
    # The embedded interpreter uses the venv the binary is installed in (not activated here)
    # and has neither the repository nor the working directory's parents on sys.path.
    ready = [line for line in created.stderr.splitlines() if "embedded Python ready" in line]
    assert ready, created.stderr
    assert str(venv) in ready[0] and repr(str(REPO)) not in ready[0], ready[0]

    run = run_rollout(
        installed,
        tmp_path,
        "run",
        str(config),
        "--set",
        "run.steps=2",
        "--set",
        "sft.steps=2",
        "--set",
        "sft.batch_size=8",
        "--set",
        "rollout.prompts_per_step=4",
        "--set",
        "rollout.group_size=2",
        "--set",
        "policy.options.torch_threads=1",
    )
    assert "done: 2 steps" in run.stdout + run.stderr, run.stdout + run.stderr
    assert (tmp_path / "runs" / "quickstart").is_dir()
