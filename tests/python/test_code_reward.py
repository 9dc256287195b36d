"""The code-execution reward against honest completions and code that attacks the machine.

Every completion that attacks the machine must score 0, quickly, and leave this process
unharmed; completions that attack the score itself are in ``test_hostile_completions.py``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from python_plugins.code_reward import PythonTests, StdioTests, extract_code
from python_plugins.code_stdio import matches
from rollout_sdk import ConfigError, Sample, SampleFailure, load_plugin
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


HUMANEVAL = """
METADATA = {'author': 'jt', 'dataset': 'test'}


def check(candidate):
    import math
    assert candidate(1, 2) == 3
    for a, b in [(2, 2), (0, 5)]:
        assert math.isclose(candidate(a, b), a + b), "the sum"
    assert True
"""


def test_humaneval_check_programs_are_run_here_with_the_entry_point(reward: PythonTests) -> None:
    record = {"tests": HUMANEVAL, "entry_point": "add"}
    wrong = "def add(a, b):\n    return 3\n"
    values = reward.score([Sample(prompt="", completion=c, record=record) for c in (GOOD, wrong)])
    assert values == [1.0, 0.0]
    (failure,) = reward.score([Sample(prompt="", completion=GOOD, record={"tests": HUMANEVAL})])
    assert isinstance(failure, SampleFailure) and failure.reason == "invalid"
    assert "names no entry point" in failure.message


def test_a_program_of_asserts_passes_when_every_assert_holds(reward: PythonTests) -> None:
    program = (
        "total = 0\nfor n in range(4):\n    total += add(n, 1)\nassert total == 10\nassert add(0, 0) == 0\n"
    )
    assert score(reward, GOOD, [program, "assert add(1, 1) == 2"])[0] == 1.0
    assert score(reward, "def add(a, b):\n    return a\n", [program, "assert add(1, 1) == 1"])[0] == 0.5


@pytest.mark.parametrize(
    ("test", "reason"),
    [
        ("class Spy:\n    pass\nassert add(1, 2) == 3", "ClassDef"),
        ("with open('x') as f:\n    assert f", "With"),
        ("import os\nassert add(1, 2) == 3", None),
    ],
)
def test_a_program_is_held_to_plain_statements_and_pure_modules(
    reward: PythonTests, test: str, reason: str | None
) -> None:
    (value,) = reward.score([Sample(prompt="", completion=GOOD, record={"tests": [test]})])
    if reason is None:  # `import os` is refused when it runs: the test fails
        assert value == 0.0
    else:
        assert isinstance(value, SampleFailure) and value.reason == "invalid" and reason in value.message


def test_a_loop_over_a_huge_returned_value_stops_at_the_deadline(reward: PythonTests) -> None:
    code = "def count(n):\n    return 10 ** 18\n"
    value, seconds = score(reward, code, ["assert all(i >= 0 for i in range(count(3)))"])
    assert value == 0.0
    assert seconds < BOUND


@pytest.mark.parametrize(
    "test",
    ["assert add.__globals__", "assert (x for x in [1]).gi_frame.f_back", "assert __import__('os')"],
)
def test_a_test_that_reaches_past_plain_values_is_refused(reward: PythonTests, test: str) -> None:
    (failure,) = reward.score([Sample(prompt="", completion=GOOD, record={"tests": [test]})])
    assert isinstance(failure, SampleFailure) and failure.reason == "invalid", failure


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


def test_every_public_benchmark_style_is_evaluated_here(reward: PythonTests) -> None:
    """The styles of HumanEval, MBPP and APPS' call-based tests, evaluated in this process."""
    code = (
        "import math\n"
        "def add(a, b):\n    return a + b\n"
        "def area(r):\n    return math.pi * r * r\n"
        "def my_sort(xs, key=None):\n    return sorted(xs, key=key)\n"
        "def zeros(n):\n    return [0] * n\n"
        "def big():\n    return 10 ** 5000\n"
        "def low():\n    return float('-inf')\n"
    )
    tests = [
        "assert add(1, 2) == 3 and add(2, 2) == 4",
        "assert all(add(a, b) == a + b for a, b in [(1, 2), (3, 4)])",
        "assert abs(area(2.0) - 12.566) < 1e-3",
        "assert math.isclose(area(2.0), 12.566, rel_tol=1e-3)",
        "assert my_sort([3, 1, 2]) == sorted([3, 1, 2])",
        "assert my_sort(['bb', 'a'], key=len) == ['a', 'bb']",
        "assert zeros(3) == [0] * 3",
        "assert set(my_sort([2, 2, 1])) == {1, 2}",
        "assert big() == 10 ** 5000",
        "assert low() == float('-inf')",
        "assert len(zeros(4)) == 4, 'four zeros'",
    ]
    assert score(reward, code, tests)[0] == 1.0


def test_objects_stay_in_the_sandbox_and_are_used_through_their_methods(reward: PythonTests) -> None:
    code = (
        "class Stack:\n"
        "    def __init__(self):\n        self.items = []\n        self.size = 0\n"
        "    def push(self, x):\n        self.items.append(x)\n        self.size += 1\n        return self\n"
        "    def pop(self):\n        self.size -= 1\n        return self.items.pop()\n"
        "def count(n):\n    yield from range(n)\n"
        "def twice(f, x):\n    return f(f(x))\n"
        "def inc(x):\n    return x + 1\n"
        "def make():\n    return object()\n"
    )
    tests = [
        "assert Stack().push(1).push(2).pop() == 2",
        "assert Stack().push(5).size == 1",
        "assert list(count(3)) == [0, 1, 2]",
        "assert sum(count(4)) == 6 and 2 in count(3)",
        "assert twice(inc, 1) == 3",
        "assert make() is not None",
        "assert make()",  # an object's truth is not decided outside the sandbox
        "assert make() == make()",
    ]
    assert score(reward, code, tests)[0] == pytest.approx(6 / 8)


def test_a_function_of_the_test_cannot_be_passed_into_the_sandbox(reward: PythonTests) -> None:
    code = "def apply(f, x):\n    return f(x)\n"
    (failure,) = reward.score(
        [Sample(prompt="", completion=code, record={"tests": ["assert apply(lambda v: v + 1, 1) == 2"]})]
    )
    assert isinstance(failure, SampleFailure) and failure.reason == "invalid"
    assert "test 0" in failure.message and "function" in failure.message


def test_the_record_names_the_function_under_test_when_it_shadows_a_builtin(reward: PythonTests) -> None:
    code = "def sorted(xs):\n    return list(reversed(xs))\n"
    record = {"tests": ["assert sorted([1, 2]) == [2, 1]"]}
    (shadowed,) = reward.score([Sample(prompt="", completion=code, record=record)])
    assert shadowed == 0.0, "without entry_point the test's own sorted is used"
    (named,) = reward.score([Sample(prompt="", completion=code, record={**record, "entry_point": "sorted"})])
    assert named == 1.0


def test_without_a_sandbox_the_reward_refuses_to_load_unless_opted_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollout_sdk import isolation

    isolation._bubblewrap.cache_clear()
    monkeypatch.setattr(isolation, "BWRAP_PATHS", ("/nonexistent/bwrap",))
    with pytest.raises(IsolationError, match=r"bubblewrap .* not installed.*rlimits-only"):
        load_plugin("python_plugins.code_reward:PythonTests", {}, PythonTests)
    weaker = load_plugin("python_plugins.code_reward:PythonTests", {"isolation": "rlimits-only"}, PythonTests)
    assert weaker.sandbox.kind == "rlimits-only"
    assert score(weaker, GOOD)[0] == 1.0
    isolation._bubblewrap.cache_clear()


def test_a_harness_that_cannot_start_fails_only_its_sample(
    reward: PythonTests, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = Sandbox(kind="bubblewrap", program="/bin/false", version="broken")
    monkeypatch.setattr(reward, "sandbox", broken)
    (failure,) = reward.score([Sample(prompt="", completion=GOOD, record={"tests": TESTS})])
    assert isinstance(failure, SampleFailure) and failure.reason == "crashed"
    assert "did not start" in failure.message


def test_limits_are_checked() -> None:
    for options in ({"memory_mb": 1}, {"isolation": "none"}, {"scratch_mb": 0}, {"max_value_bytes": 10}):
        with pytest.raises(ConfigError):
            load_plugin("python_plugins.code_reward:PythonTests", options, PythonTests)
    with pytest.raises(ConfigError):
        load_plugin("python_plugins.code_reward:StdioTests", {"compare": "fuzzy"}, StdioTests)


STDIO_CASES = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "5 7\n", "output": "12"},
    {"input": "-3 3\n", "output": "0\n"},
]


@pytest.fixture(scope="module")
def stdio() -> StdioTests:
    return load_plugin("python_plugins.code_reward:StdioTests", {"timeout_seconds": TIMEOUT}, StdioTests)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("a, b = map(int, input().split())\nprint(a + b)\n", 1.0),
        (
            "import sys, os\na, b = map(int, sys.stdin.buffer.read().split())\nos.write(1, b'%d' % (a+b))\n",
            1.0,
        ),
        ("a, b = map(int, open(0).read().split())\nprint(a + b)\nexit()\n", 1.0),
        ("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1 if a == 5 else 0)\n", 2 / 3),
        ("a, b = map(int, input().split())\nprint(a - b)\n", 0.0),
        ("print(3)\nprint(12)\nprint(0)\n", 0.0),
        ("import time\nif input() == '5 7':\n    time.sleep(60)\nprint(3)\n", 1 / 3),
    ],
    ids=[
        "input",
        "buffers and fds",
        "open(0) and exit",
        "non-zero exit fails",
        "wrong",
        "every answer",
        "timeout",
    ],
)
def test_stdio_programs_are_compared_here(stdio: StdioTests, code: str, expected: float) -> None:
    (value,) = stdio.score([Sample(prompt="", completion=code, record={"tests": STDIO_CASES})])
    assert value == pytest.approx(expected)


def test_stdio_tests_take_the_public_datasets_forms(stdio: StdioTests) -> None:
    code = "n = int(input())\nfor i in range(n):\n    print(i)\n"
    apps = json.dumps({"inputs": ["2\n", "3\n"], "outputs": ["0\n1\n", "0\n1\n2\n"]})
    contests = {"inputs": ["1\n"], "outputs": [["0"]]}
    values = stdio.score([Sample(prompt="", completion=code, record={"tests": t}) for t in (apps, contests)])
    assert values == [1.0, 1.0]
    with pytest.raises(KeyError, match="as many inputs as outputs"):
        stdio.score([Sample(prompt="", completion=code, record={"tests": {"inputs": ["1"], "outputs": []}})])


def test_stdio_comparisons() -> None:
    assert matches("1 2\n3", "1  2 3\n", "tokens") and not matches("1 2\n3", "1  2 3\n", "lines")
    assert matches("a  \nb\n\n", "a\nb", "lines") and not matches("a\nb\n", "a\nb", "exact")


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
