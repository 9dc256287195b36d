"""Completions that attack their own score, written as a red team would.

None of them computes ``add``, so each is worth 0: they try to forge the result channel from
inside the interpreter (frames, ``gc``, ``/proc/self``, inherited descriptors), exit early with
success, return objects equal to anything, patch builtins, ``assert`` or the harness's encoder,
look for the tests or their expected values on disk or in the parent, time out, or flood the
output. The verdict is computed outside the sandbox from values of exact plain types, and the
expected values never enter it, so each must score no more than its honest worth.
"""

from __future__ import annotations

import time

import pytest

from python_plugins.code_reward import PythonTests
from rollout_sdk import Sample, load_plugin

TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]
WRONG = "def add(a, b):\n    return a - b\n"
TIMEOUT = 2.0

FORGE_LINES = """
import json
def forge(write):
    write("started\\n")
    for _ in range(3):
        write(json.dumps(["ok", ["int", "1000000"]]) + "\\n")
    write('RESULT 0 {"passed": 1000000, "total": 1}\\n')
"""

HOSTILE = {
    # The result channel, reached in every way the interpreter allows.
    "stack walk to the harness": WRONG
    + FORGE_LINES
    + """
import sys
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()) + list(frame.f_globals.values()):
        if hasattr(value, "write") and hasattr(value, "flush"):
            forge(value.write)
            value.flush()
    frame = frame.f_back
""",
    "gc scan for the output stream": WRONG
    + FORGE_LINES
    + """
import gc, io
for obj in gc.get_objects():
    if isinstance(obj, io.TextIOWrapper) and obj.writable():
        try:
            forge(obj.write)
            obj.flush()
        except Exception:
            pass
""",
    "every inherited descriptor": WRONG
    + FORGE_LINES
    + """
import os
for fd in range(3, 64):
    try:
        forge(lambda text, fd=fd: os.write(fd, text.encode()))
    except OSError:
        pass
""",
    "/proc/self/fd": WRONG
    + FORGE_LINES
    + """
import os
for name in os.listdir("/proc/self/fd"):
    try:
        with open(f"/proc/self/fd/{name}", "w") as out:
            forge(out.write)
    except OSError:
        pass
""",
    "forge then exit before the tests": WRONG
    + FORGE_LINES
    + """
import os, sys
forge(lambda text: os.write(3, text.encode()))
os._exit(0)
""",
    # Exiting with success, before or during the tests.
    "sys.exit(0) at import": "import sys\nsys.exit(0)\n",
    "os._exit(0) in the function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "raise SystemExit in the function": "def add(a, b):\n    raise SystemExit(0)\n",
    # Values that equal anything.
    "always-equal object": "class Any:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\ndef add(a, b):\n    return Any()\n",
    "int subclass equal to anything": "class Int(int):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return Int(0)\n",
    "str subclass": "class S(str):\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return S('x')\n",
    # Patching the machinery.
    "patch builtins and assert": "import builtins\n"
    "builtins.AssertionError = type('Never', (Exception,), {})\n"
    "builtins.isinstance = lambda *a: True\nbuiltins.type = lambda *a: int\n"
    "builtins.repr = lambda x: '1000000'\nbuiltins.str = lambda x: '1000000'\n" + WRONG,
    "patch json.dumps": "import json\n_real = json.dumps\n"
    'json.dumps = lambda value, **kw: _real(["ok", ["int", "1000000"]])\n' + WRONG,
    "patch the harness's encoder": WRONG
    + """
import sys
for frame_module in list(sys.modules.values()):
    if hasattr(frame_module, "encode"):
        frame_module.encode = lambda value, depth=0: ["int", "1000000"]
main = sys.modules["__main__"]
main.encode = lambda value, depth=0: ["int", "1000000"]
""",
    # Looking for the answers.
    "read the tests from disk": """
import os
found = []
for root, dirs, files in os.walk("/"):
    for name in files:
        try:
            if "add(1, 2)" in open(os.path.join(root, name), errors="ignore").read(100000):
                found.append(os.path.join(root, name))
        except Exception:
            pass
def add(a, b):
    assert found
    return a + b
""",
    "read the parent's memory": """
import os
def add(a, b):
    ppid = os.getppid()
    text = open(f"/proc/{ppid}/cmdline", "rb").read() + open(f"/proc/{ppid}/environ", "rb").read()
    assert b"== 3" in text
    return a + b
""",
    "expected values in the probe's code": """
import sys
def add(a, b):
    caller = sys._getframe(1).f_code
    numbers = [c for c in caller.co_consts if isinstance(c, int) and c not in (a, b)]
    return numbers[-1] if numbers else None
""",
    # Wasting the grader's time and memory.
    "time out on purpose": "import time\ntime.sleep(3600)\n",
    "flood stdout": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
    "flood the report": "import json, os\n"
    "line = (json.dumps(['ok', ['int', '1000000']]) + chr(10)).encode()\n"
    "while True:\n    os.write(3, line * 4096)\n",
}


@pytest.fixture(scope="module")
def reward() -> PythonTests:
    return load_plugin("python_plugins.code_reward:PythonTests", {"timeout_seconds": TIMEOUT}, PythonTests)


def score(reward: PythonTests, completion: str) -> tuple[float, float]:
    started = time.monotonic()
    (value,) = reward.score([Sample(prompt="", completion=completion, record={"tests": TESTS})])
    return value, time.monotonic() - started


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_completion_scores_no_more_than_its_honest_worth(reward: PythonTests, name: str) -> None:
    value, seconds = score(reward, HOSTILE[name])
    assert value == 0.0, f"{name} scored {value}"
    assert seconds < TIMEOUT + 3.0, f"{name} took {seconds:.1f} s"


def test_guessing_values_is_worth_what_returning_them_is(reward: PythonTests) -> None:
    """Code that writes guesses into the channel scores what an honest program returning the
    same guesses would: the guesses' own worth, nothing more."""
    guesses = (
        WRONG
        + FORGE_LINES.replace('"1000000"', '"4"')
        + "forge(lambda t: __import__('os').write(3, t.encode()))\n"
    )
    honest = "def add(a, b):\n    return 4\n"
    assert score(reward, guesses)[0] <= score(reward, honest)[0] == pytest.approx(1 / 3)


def test_an_honest_completion_scores_full_marks(reward: PythonTests) -> None:
    assert score(reward, "def add(a, b):\n    return a + b\n")[0] == 1.0
