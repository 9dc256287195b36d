"""The code-execution reward against honest completions and code that attacks the machine.

Every completion that attacks the machine must score 0, quickly, and leave this process
unharmed; completions that attack the score itself are in ``test_hostile_completions.py``.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from python_plugins.code_checks import UnverifiableTest
from python_plugins.code_reward import HarnessFailure, PythonTests, extract_code
from rollout_sdk import ConfigError, Sample, load_plugin
from rollout_sdk.isolation import IsolationError, Sandbox

TESTS = ["assert add(1, 2) == 3", "assert add(1, 1) == 2", "assert add(0, 3) == 3"]
GOOD = "def add(a, b):\n    return a + b\n"
TIMEOUT = 2.0
# The hostile program may take the wall-clock timeout, plus start-up and clean-up.
BOUND = TIMEOUT + 3.0


@pytest.fixture(scope="module")
def reward() -> PythonTests:
    return load_plugin("python_plugins.code_reward:PythonTests", {"timeout_seconds": TIMEOUT}, PythonTests)


def score(reward: PythonTests, completion: str, tests: list[str] = TESTS) -> tuple[float, float]:
    started = time.monotonic()
    (value,) = reward.score([Sample(prompt="", completion=completion, record={"tests": tests})])
    return value, time.monotonic() - started


def test_correct_code_passes_every_test(reward: PythonTests) -> None:
    assert score(reward, f"Here you go:\n```python\n{GOOD}```\nDone.")[0] == 1.0


def test_partly_correct_code_scores_the_fraction_passed(reward: PythonTests) -> None:
    assert score(reward, "def add(a, b):\n    return 3\n")[0] == pytest.approx(2 / 3)


def test_code_may_use_the_standard_library_and_its_directory(reward: PythonTests) -> None:
    code = (
        "import collections, heapq, math\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "def add(a, b):\n"
        "    assert open('scratch.txt').read() == 'ok'\n"
        "    return math.floor(sum(heapq.nsmallest(2, collections.Counter([a, b]).elements()) or [0]))\n"
    )
    assert score(reward, code, ["assert add(1, 2) == 3"])[0] == 1.0


def uses(statement: str) -> str:
    """A correct ``add`` that first runs ``statement``: it passes only if ``statement`` works."""
    return f"def add(a, b):\n    {statement}\n    return a + b\n"


HOSTILE = {
    "infinite loop": "while True:\n    pass\n" + GOOD,
    "sleep forever": "import time\ntime.sleep(3600)\n" + GOOD,
    "fork bomb": "import os\nwhile True:\n    os.fork()\n" + GOOD,
    "posix fork bomb": "import posix\n" + uses("posix.fork()"),
    "thread bomb": "import _thread\n" + uses("_thread.start_new_thread(print, ())"),
    "huge allocation": "hog = bytearray(1 << 40)\n" + GOOD,
    "growing allocation": "hog = []\nwhile True:\n    hog.append(bytearray(1 << 24))\n" + GOOD,
    "read /etc/passwd": uses("assert 'root' in open('/etc/passwd').read()"),
    "read /etc/shadow": uses("assert open('/etc/shadow').read()"),
    "see the host's root": "import os\n" + uses("assert 'home' in os.listdir('/')"),
    "subprocess": "import os\n" + uses("assert os.system('true') == 0"),
    "ctypes": GOOD + "import ctypes\nctypes.string_at(0)\n",
    "exit early": "import os\nos._exit(0)\n" + GOOD,
    "sys.exit": "import sys\nsys.exit(0)\n" + GOOD,
    "huge file": GOOD + "open('big', 'wb').write(b'x' * (64 << 20))\n",
    "forged result": GOOD + 'print(\'RESULT 0000 {"passed": 3, "total": 3}\')\nraise SystemExit\n',
    "read the host's files": uses("assert open('/root/.bashrc').read() or open('/home').read()"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_code_scores_zero_quickly(reward: PythonTests, name: str) -> None:
    value, seconds = score(reward, HOSTILE[name])
    assert value == 0.0, name
    assert seconds < BOUND, f"{name} took {seconds:.1f} s"


def test_a_secret_outside_the_directory_stays_secret(reward: PythonTests, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o600)
    code = uses(f"assert open({str(secret)!r}).read() == 'hunter2'")
    assert score(reward, code)[0] == 0.0
    assert secret.read_text() == "hunter2"


def test_the_environment_is_not_inherited(reward: PythonTests, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_TEST_TOKEN", "hunter2")
    code = "import os\n" + uses("assert os.environ['ROLLOUT_TEST_TOKEN'] == 'hunter2'")
    assert score(reward, code)[0] == 0.0
    honest = "import os\n" + uses("assert 'ROLLOUT_TEST_TOKEN' not in os.environ")
    assert score(reward, honest)[0] == 1.0


def test_no_network_even_to_a_listening_local_port(reward: PythonTests) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = "import socket\n" + uses(f"socket.create_connection(('127.0.0.1', {port}), timeout=1).close()")
        assert score(reward, code)[0] == 0.0


def test_this_process_is_unharmed(reward: PythonTests) -> None:
    children_before = _children()
    for name in ("fork bomb", "infinite loop", "huge allocation"):
        score(reward, HOSTILE[name])
    assert _children() == children_before
    assert score(reward, GOOD)[0] == 1.0


def test_extract_code_takes_the_last_fenced_block() -> None:
    text = "```python\nfirst = 1\n```\nthen\n```py\nsecond = 2\n```"
    assert extract_code(text) == "second = 2\n"
    assert extract_code("plain = 3") == "plain = 3"


def test_a_record_without_tests_is_an_error(reward: PythonTests) -> None:
    with pytest.raises(KeyError, match="tests"):
        reward.score([Sample(prompt="", completion=GOOD, record={})])


def test_a_test_whose_verdict_would_be_the_codes_is_an_error(reward: PythonTests) -> None:
    with pytest.raises(UnverifiableTest, match="test 1"):
        score(reward, GOOD, ["assert add(1, 2) == 3", "total = add(1, 2)\nassert total == 3"])


def test_comparisons_chains_and_truth_are_judged_outside(reward: PythonTests) -> None:
    code = GOOD + "def halves(n):\n    return [n / 2, (n, n)]\ndef even(n):\n    return n % 2 == 0\n"
    tests = [
        "assert 2 < add(1, 2) <= 3",
        "assert halves(3) == [1.5, (3, 3)]",
        "assert halves(3) != [1.5, [3, 3]]",
        "assert 4 in halves(8)",
        "assert even(4)",
        "assert not even(3)",
        "assert add(1, 2) is None",
    ]
    assert score(reward, code, tests)[0] == pytest.approx(6 / 7)


def test_without_a_sandbox_the_reward_refuses_to_load_unless_opted_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollout_sdk import isolation

    isolation._bubblewrap.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(IsolationError, match=r"bubblewrap .* not installed.*rlimits-only"):
        load_plugin("python_plugins.code_reward:PythonTests", {}, PythonTests)
    weaker = load_plugin("python_plugins.code_reward:PythonTests", {"isolation": "rlimits-only"}, PythonTests)
    assert weaker.sandbox.kind == "rlimits-only"
    assert score(weaker, GOOD)[0] == 1.0
    isolation._bubblewrap.cache_clear()


def test_a_harness_that_cannot_start_fails_the_sample(
    reward: PythonTests, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = Sandbox(kind="bubblewrap", program="/bin/false", version="broken")
    monkeypatch.setattr(reward, "sandbox", broken)
    with pytest.raises(HarnessFailure, match="did not start"):
        score(reward, GOOD)


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigError):
        load_plugin("python_plugins.code_reward:PythonTests", {"memory_mb": 1}, PythonTests)
    with pytest.raises(ConfigError):
        load_plugin("python_plugins.code_reward:PythonTests", {"isolation": "none"}, PythonTests)


def _children() -> set[int]:
    """Live child processes of this one."""
    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                found.add(int(entry.name))
    return found
