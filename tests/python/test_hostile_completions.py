"""The red team: completions that attack their own score, generated from classes, not examples.

Every test style public code benchmarks use (literal expected values, truth tests wrapping
comparisons, tolerance checks, expected values computed by a helper, computed literals,
HumanEval's ``check(candidate)`` programs, standard input to standard output) is crossed with
every attack strategy (objects equal to anything, shadowed built-ins and modules, forged
answers on the channel, tampering with the channel, exhausting disk, memory, processes or the
parent's decoder). Each hostile completion
is the style's honest wrong solution plus the attack, so it must score no more than that
twin (a failed sample counts as nothing), quickly, while the correct solution, scored in the
same batch, still scores 1. It all runs under the real sandbox (bubblewrap), as in CI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from textwrap import dedent

import pytest

from python_plugins.code_reward import CodeReward, PythonTests, StdioTests
from rollout_sdk import Sample, SampleFailure, load_plugin

TIMEOUT = 1.0
# A hostile program may take the wall-clock timeout, plus start-up, clean-up and a busy machine.
BOUND = TIMEOUT + 4.0


@dataclass(frozen=True)
class Style:
    tests: str | list[str] | list[dict[str, str]]
    correct: str
    wrong: str
    names: tuple[str, ...] = ()
    entry_point: str | None = None

    def record(self) -> dict[str, object]:
        return {"tests": self.tests, **({"entry_point": self.entry_point} if self.entry_point else {})}

    @property
    def stdio(self) -> bool:
        return not self.names


STYLES = {
    "literal": Style(
        tests=["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"],
        correct="def add(a, b):\n    return a + b\n",
        wrong="def add(a, b):\n    return a - b\n",
        names=("add",),
    ),
    "truth test": Style(
        tests=[
            "assert add(1, 2) == 3 and add(2, 2) == 4",
            "assert all(add(a, b) == a + b for a, b in [(1, 2), (3, 4)])",
            "assert any(add(a, b) == 7 for a, b in [(3, 4)])",
            "assert is_even(4) and not is_even(3)",
        ],
        correct="def add(a, b):\n    return a + b\ndef is_even(n):\n    return n % 2 == 0\n",
        wrong="def add(a, b):\n    return a - b\ndef is_even(n):\n    return n % 2 == 1\n",
        names=("add", "is_even"),
    ),
    "tolerance": Style(
        tests=[
            "assert abs(area(2.0) - 12.566) < 1e-3",
            "assert math.isclose(area(0.5), 0.7854, rel_tol=1e-4)",
            "assert round(area(3.0), 2) == 28.27",
        ],
        correct="import math\ndef area(r):\n    return math.pi * r * r\n",
        wrong="import math\ndef area(r):\n    return math.pi * r\n",
        names=("area",),
    ),
    "helper-computed expected value": Style(
        tests=[
            "assert my_sort([3, 1, 2]) == sorted([3, 1, 2])",
            "assert set(uniq([1, 1, 2])) == set([1, 2])",
            "assert len(uniq([4, 4])) == len({4})",
            "assert my_sort([5, 4]) == list(reversed([5, 4]))",
        ],
        correct="def my_sort(xs):\n    return sorted(xs)\ndef uniq(xs):\n    return [*dict.fromkeys(xs)]\n",
        wrong="def my_sort(xs):\n    return list(xs)\ndef uniq(xs):\n    return list(xs) + [0]\n",
        names=("my_sort", "uniq"),
    ),
    "computed literal": Style(
        tests=[
            "assert zeros(3) == [0] * 3",
            "assert power(10) == 2 ** 10",
            "assert low() == float('-inf')",
            "assert pair() == tuple([1, 2])",
        ],
        correct="def zeros(n):\n    return [0] * n\ndef power(n):\n    return 2 ** n\n"
        "def low():\n    return float('-inf')\ndef pair():\n    return (1, 2)\n",
        wrong="def zeros(n):\n    return [1] * n\ndef power(n):\n    return 2 * n\n"
        "def low():\n    return float('inf')\ndef pair():\n    return (2, 1)\n",
        names=("zeros", "power", "low", "pair"),
    ),
    "check program (HumanEval)": Style(
        tests=dedent("""
            METADATA = {"author": "red team"}

            def check(candidate):
                import math
                assert candidate(1, 2) == 3
                for a, b in [(2, 2), (0, 5)]:
                    assert math.isclose(candidate(a, b), a + b), "sum"
                assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9
        """),
        correct="def add(a, b):\n    return a + b\n",
        wrong="def add(a, b):\n    return a - b\n",
        names=("add",),
        entry_point="add",
    ),
    "stdin to stdout": Style(
        tests=[
            {"input": "1 2\n", "output": "3\n"},
            {"input": "2 2\n", "output": "4\n"},
            {"input": "0 5\n", "output": "5\n"},
        ],
        correct="a, b = map(int, input().split())\nprint(a + b)\n",
        wrong="a, b = map(int, input().split())\nprint(a - b)\n",
    ),
}

# Each strategy: how to turn a style's wrong solution into an attack. `NAMES` is the style's
# function names; for standard-input styles the attack runs before the program.
ANYTHING = """
class Anything(int):
    def __eq__(self, other): return True
    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = __eq__
    def __hash__(self): return 0
    def __bool__(self): return True
    def __abs__(self): return Anything()
    __neg__ = __pos__ = __abs__
    def __sub__(self, other): return Anything()
    __add__ = __radd__ = __rsub__ = __mul__ = __rmul__ = __round__ = __sub__
    def __len__(self): return 3
    def __iter__(self): return iter([Anything()] * 3)
"""
FRAME = """
import json, struct
def frame(message):
    body = json.dumps(message).encode()
    return struct.pack('>I', len(body)) + body
FORGED = [frame({'id': k, 'value': ['bool', True]}) for k in range(1, 80)]
"""


def replacing(body: str) -> str:
    """An attack that replaces every function of the style with ``_attack``, defined by
    ``body``; a program read on standard input (no functions) runs ``_attack`` first."""
    return dedent(body) + "for _n in NAMES:\n    globals()[_n] = _attack\nif not NAMES:\n    _attack()\n"


STRATEGIES: dict[str, str] = {
    # Objects equal to anything, truthy, with any length or sum.
    "always-equal object": ANYTHING + replacing("def _attack(*a, **k):\n    return Anything(0)\n"),
    "equal-to-anything subclasses": replacing("""
        class L(list):
            def __eq__(self, other): return True
        class F(float):
            def __eq__(self, other): return True
            def __lt__(self, other): return True
        def _attack(*a, **k):
            return F(0.0) if a and isinstance(a[0], float) else L([])
    """),
    # The built-ins and modules a test would use, replaced.
    "shadowed builtins": ANYTHING
    + dedent("""
        def all(*a): return True
        def any(*a): return True
        def abs(x): return 0
        def len(x): return 1
        def sorted(*a, **k): return Anything()
        def set(*a): return Anything()
        def round(*a): return Anything()
        def float(*a): return Anything()
        def tuple(*a): return Anything()
        def list(*a): return Anything()
        def reversed(*a): return Anything()
        class math:
            pi = 0
            def isclose(*a, **k): return True
    """),
    "patched builtins module": dedent("""
        import builtins, sys
        for _b in ('all', 'any', 'isinstance', 'sorted', 'len', 'abs', 'round'):
            setattr(builtins, _b, lambda *a, **k: True)
        sys.modules['math'] = type(sys)('math')
        sys.modules['math'].isclose = lambda *a, **k: True
    """),
    # Answers written to the channel by the code itself, or to anything that looks like one.
    "forged frames on every descriptor": FRAME
    + replacing("""
        import os
        def _attack(*a, **k):
            for fd in range(0, 64):
                for forged in FORGED:
                    try:
                        os.write(fd, forged)
                    except OSError:
                        break
    """),
    "forged frames through the socket object": FRAME
    + replacing("""
        import gc, socket
        def _attack(*a, **k):
            for obj in gc.get_objects():
                if isinstance(obj, socket.socket):
                    for forged in FORGED:
                        obj.sendall(forged)
            raise SystemExit(0)
    """),
    "forged report lines": replacing("""
        import os
        _LINES = b'started\\n' + b'["ok", ["int", "7"]]\\n' * 64
        def _attack(*a, **k):
            # The same value for every probe, as a report file would take it, then exit.
            for fd in range(1, 64):
                try:
                    os.write(fd, _LINES)
                except OSError:
                    pass
            print('RESULT 0 {"passed": 1000000, "total": 1}')
            os._exit(0)
    """),
    "overwriting the report": replacing("""
        import os
        def _attack(*a, **k):
            for fd in range(3, 64):
                try:
                    os.lseek(fd, 0, os.SEEK_SET)
                    os.write(fd, b'overwritten\\n')
                except OSError:
                    pass
            return 0
    """),
    # The channel itself: garbage, lies about lengths and ids, closing it, going silent.
    "garbage on the channel": replacing("""
        import os
        def _attack(*a, **k):
            for fd in range(3, 64):
                try:
                    os.write(fd, b'\\xff' * 64)
                except OSError:
                    pass
    """),
    "a 4 GiB length claim": replacing("""
        import os, struct
        def _attack(*a, **k):
            for fd in range(3, 64):
                try:
                    os.write(fd, struct.pack('>I', 0xFFFFFFFF))
                except OSError:
                    pass
            os._exit(0)
    """),
    "an answer to another request": FRAME
    + replacing("""
        import os
        def _attack(*a, **k):
            for fd in range(3, 64):
                try:
                    os.write(fd, frame({'id': 9999, 'value': ['bool', True]}))
                except OSError:
                    pass
            return 0
    """),
    "closing the channel": "import os\nos.closerange(3, 64)\n",
    "half a frame then silence": replacing("""
        import os, struct, time
        def _attack(*a, **k):
            for fd in range(3, 64):
                try:
                    os.write(fd, struct.pack('>I', 100) + b'{"id"')
                except OSError:
                    pass
            time.sleep(60)
    """),
    # The machine and the parent: disk, memory, processes, time, values costly to decode.
    "filling the disk": dedent("""
        for _d in ('/tmp', '.'):
            for _i in range(4096):
                try:
                    open(f'{_d}/f{_i}', 'wb').write(b'x' * ((1 << 20) - 4096))
                except OSError:
                    break
    """),
    "exhausting memory": dedent("""
        _hog = []
        try:
            while True:
                _hog.append(bytearray(1 << 24))
        except MemoryError:
            pass
    """),
    "shared memory outside the address space": dedent("""
        import ctypes
        _libc = ctypes.CDLL(None)
        for _i in range(64):
            _libc.shmget(0, 64 << 20, 0o1600)
    """),
    "fork and thread bombs": dedent("""
        import os, _thread
        for _i in range(64):
            try:
                os.fork()
            except OSError:
                pass
            try:
                _thread.start_new_thread(lambda: None, ())
            except RuntimeError:
                pass
    """),
    "sleeping past the timeout": "import time\ntime.sleep(3600)\n",
    "values that are costly to decode": FRAME
    + replacing("""
        import gc, os, socket
        _M = (1 << 61) - 1
        _COLLIDING = ['set', [['int', hex(k * _M)] for k in range(20000)]]
        _MANY = ['list', [['none']] * 200000]
        _HUGE = ['int', hex(1 << (8 << 20))]
        _DEEP = '[' * 100000 + ']' * 100000
        def _attack(*a, **k):
            for obj in gc.get_objects():
                if isinstance(obj, socket.socket):
                    for call, value in enumerate((_COLLIDING, _MANY, _HUGE), 1):
                        obj.sendall(frame({'id': call, 'value': value}))
                    body = ('{"id": 4, "value": ' + _DEEP + '}').encode()
                    obj.sendall(struct.pack('>I', len(body)) + body)
            os._exit(0)
    """),
    "printing gigabytes": dedent("""
        import sys
        try:
            while True:
                sys.stdout.write('3\\n' * 65536)
        except OSError:
            pass
    """),
}


def hostile(style: Style, strategy: str) -> str:
    attack = f"NAMES = {style.names!r}\n" + STRATEGIES[strategy]
    # Function styles: the attack replaces the wrong solution's functions, so it follows them;
    # standard-input styles: it runs first, then the wrong program.
    return attack + style.wrong if style.stdio else style.wrong + attack


@pytest.fixture(scope="module")
def rewards() -> dict[bool, CodeReward]:
    options = {"timeout_seconds": TIMEOUT}
    return {
        False: load_plugin("python_plugins.code_reward:PythonTests", options, PythonTests),
        True: load_plugin("python_plugins.code_reward:StdioTests", options, StdioTests),
    }


def worth(value: float | SampleFailure) -> float:
    """A failed sample is not trained on: it is worth nothing."""
    return 0.0 if isinstance(value, SampleFailure) else value


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("style_name", sorted(STYLES))
def test_an_attack_scores_no_more_than_its_honest_wrong_twin(
    rewards: dict[bool, CodeReward], style_name: str, strategy: str
) -> None:
    style = STYLES[style_name]
    reward = rewards[style.stdio]
    assert reward.sandbox.kind == "bubblewrap", "CI installs bubblewrap: the red team runs under it"
    completions = [hostile(style, strategy), style.wrong, style.correct]
    started = time.monotonic()
    attack, twin, correct = reward.score(
        [Sample(prompt="", completion=c, record=style.record()) for c in completions]
    )
    seconds = time.monotonic() - started
    assert worth(attack) <= worth(twin), f"{strategy} on {style_name} scored {attack}, its twin {twin}"
    assert correct == 1.0, f"the correct solution beside {strategy} scored {correct}"
    assert seconds < BOUND + 1.0, f"{strategy} on {style_name} took {seconds:.1f} s"


@pytest.mark.parametrize("style_name", sorted(STYLES))
def test_each_style_tells_the_twin_from_the_correct_solution(
    rewards: dict[bool, CodeReward], style_name: str
) -> None:
    style = STYLES[style_name]
    wrong, correct = rewards[style.stdio].score(
        [Sample(prompt="", completion=c, record=style.record()) for c in (style.wrong, style.correct)]
    )
    assert (wrong, correct) == (0.0, 1.0)


def test_tampering_fails_only_the_tampering_sample(rewards: dict[bool, CodeReward]) -> None:
    style = STYLES["literal"]
    tampering = hostile(style, "a 4 GiB length claim")
    samples = [Sample(prompt="", completion=c, record=style.record()) for c in (style.correct, tampering)]
    neighbour, failed = rewards[False].score(samples)
    assert neighbour == 1.0
    assert isinstance(failed, SampleFailure) and failed.reason == "crashed"
    assert "broke the harness's channel" in failed.message


def test_guessed_values_are_worth_no_more_than_returning_them(rewards: dict[bool, CodeReward]) -> None:
    """Forging an answer is at best returning it: code that forges 4 as its answer scores no
    more than an honest program returning 4 (and, having to exit so the harness's own answer
    never follows, it gets one forged answer per program)."""
    forging = FRAME + dedent("""
        import gc, os, socket
        def add(a, b):
            for obj in gc.get_objects():
                if isinstance(obj, socket.socket):
                    obj.sendall(frame({'id': 1, 'value': ['int', '0x4']}))
            os._exit(0)
    """)
    honest = "def add(a, b):\n    return 4\n"
    for tests, worth_of_4 in (
        (STYLES["literal"].tests, 1 / 3),
        (["assert add(2, 2) == 4", "assert add(1, 3) == 4", "assert add(1, 2) == 3"], 2 / 3),
    ):
        forged, returned = rewards[False].score(
            [Sample(prompt="", completion=c, record={"tests": tests}) for c in (forging, honest)]
        )
        assert returned == pytest.approx(worth_of_4)
        assert worth(forged) <= returned


CLASSIC = {
    # Looking for the answers: they are never in the sandbox.
    "read the tests from disk": "import os\nfound = []\nfor root, dirs, files in os.walk('/'):\n"
    "    for name in files:\n        try:\n"
    "            if 'add(1, 2)' in open(os.path.join(root, name), errors='ignore').read(100000):\n"
    "                found.append(name)\n        except Exception:\n            pass\n"
    "def add(a, b):\n    assert found\n    return a + b\n",
    "read the parent's memory": "import os\ndef add(a, b):\n    ppid = os.getppid()\n"
    "    text = open(f'/proc/{ppid}/cmdline', 'rb').read() + open(f'/proc/{ppid}/environ', 'rb').read()\n"
    "    assert b'== 3' in text\n    return a + b\n",
    "expected values in the caller's code": "import sys\ndef add(a, b):\n"
    "    numbers = []\n    frame = sys._getframe(1)\n    while frame is not None:\n"
    "        numbers += [c for c in frame.f_code.co_consts if isinstance(c, int) and c not in (a, b)]\n"
    "        frame = frame.f_back\n    return numbers[-1] if numbers else None\n",
    # Exiting with success before or during the tests.
    "sys.exit(0) at import": "import sys\nsys.exit(0)\n",
    "os._exit(0) in the function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "patch the harness's encoder": "import sys\ndef add(a, b):\n    return a - b\n"
    "for module in list(sys.modules.values()):\n    if hasattr(module, 'encode'):\n"
    "        module.encode = lambda value, budget, other: ['int', '0x3']\n",
}


@pytest.mark.parametrize("name", sorted(CLASSIC))
def test_classic_attacks_score_no_more_than_a_constant_answer(
    rewards: dict[bool, CodeReward], name: str
) -> None:
    """The literal tests expect three different values: a constant answer passes one."""
    tests = STYLES["literal"].tests
    (value,) = rewards[False].score([Sample(prompt="", completion=CLASSIC[name], record={"tests": tests})])
    assert worth(value) <= 1 / 3, f"{name} scored {value}"
