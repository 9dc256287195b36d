"""A seccomp filter for sandboxed code: the system calls that reach memory or processes
outside the program's own limits fail with ``EPERM``.

Denied: System V shared memory, semaphores and message queues (their memory outlives any
one mapping, so the address-space limit does not hold it), ``ptrace`` and
``process_vm_readv``/``writev``, the kernel keyring, ``perf_event_open``, ``bpf``,
``userfaultfd`` and ``io_uring``. A system call of another ABI (32-bit calls on x86-64, x32)
kills the program, so the numbers below cannot be bypassed.

:func:`deny_filter` returns the filter as the kernel takes it (``struct sock_filter[]``);
the sandboxed harness installs it on itself before the code runs.
"""

from __future__ import annotations

import platform
import struct

__all__ = ["deny_filter"]

_EPERM = 1
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_X32_BIT = 0x40000000

# Per machine: the audit architecture, whether the x32 bit must be refused, and the numbers.
_DENIED: dict[str, tuple[int, bool, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        True,
        {
            "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66,
            "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "ptrace": 101,
            "semtimedop": 220, "add_key": 248, "request_key": 249, "keyctl": 250,
            "perf_event_open": 298, "process_vm_readv": 310, "process_vm_writev": 311,
            "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
            "io_uring_register": 427,
        },
    ),
    "aarch64": (
        0xC00000B7,
        False,
        {
            "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190,
            "semctl": 191, "semtimedop": 192, "semop": 193, "shmget": 194, "shmctl": 195,
            "shmat": 196, "ptrace": 117, "add_key": 217, "request_key": 218, "keyctl": 219,
            "perf_event_open": 241, "process_vm_readv": 270, "process_vm_writev": 271,
            "bpf": 280, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
            "io_uring_register": 427,
        },
    ),
}  # fmt: skip


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def deny_filter(machine: str | None = None) -> bytes | None:
    """The filter for ``machine`` (default: this one), or ``None`` where its system call
    numbers are not known here."""
    spec = _DENIED.get(machine or platform.machine())
    if spec is None:
        return None
    arch, refuse_x32, numbers = spec
    program = [
        _instruction(_LD_W_ABS, 4),  # seccomp_data.arch
        _instruction(_JEQ_K, arch, jt=1),
        _instruction(_RET_K, _RET_KILL_PROCESS),
        _instruction(_LD_W_ABS, 0),  # seccomp_data.nr
    ]
    if refuse_x32:
        program += [_instruction(_JGE_K, _X32_BIT, jf=1), _instruction(_RET_K, _RET_KILL_PROCESS)]
    for number in sorted(numbers.values()):
        program += [_instruction(_JEQ_K, number, jf=1), _instruction(_RET_K, _RET_ERRNO | _EPERM)]
    program.append(_instruction(_RET_K, _RET_ALLOW))
    return b"".join(program)
