"""Run untrusted Python in a sandbox: one fresh subprocess per candidate, never in this process.

    res = run_python("print(sum(range(10)))", timeout_s=5)   # ExecResult(status="passed", ...)
    results = run_many(programs, timeout_s=3, workers=2)

Each candidate runs as ``python -I -S -c RUNNER`` in a new session (process group) with its own
temporary working directory (deleted afterwards). Before the candidate's code runs, the runner
(1) sets resource limits on itself — address space (``memory_mb``), CPU seconds, file size, no
core dumps, no more than 64 open files; (2) moves itself into a fresh network namespace
(``unshare(CLONE_NEWNET)``, with a user namespace when not root) where it exists, so there is no
network at all; (3) installs a ``sys.addaudithook`` hook that refuses — with ``PermissionError``,
before the action happens — every write, create, delete, rename, chmod or link of a path outside
the temporary directory, every socket, every subprocess / exec / fork / kill, and ``ctypes``. The
parent kills the whole process group at ``timeout_s`` (wall clock). stdout/stderr go to files in
the temporary directory (capped by the file-size limit) and come back truncated to ``max_output``.

Statuses: ``passed`` (exit 0), ``failed`` (non-zero exit, an exception, a resource limit),
``timeout`` (killed), ``blocked`` (the audit hook refused something — the candidate is also
counted as not passing). This is defence in depth for model-written code, not a security boundary
against an adversary (see docs/post_training.md, Notes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from pallasite.errors import InputError

BLOCK_MARK = "__PALLASITE_SANDBOX_BLOCKED__"
ISOLATION_MARK = "__PALLASITE_SANDBOX_ISOLATION__"

# The runner executed by the child interpreter. It reads its settings from argv[1] (JSON) and the
# candidate from ``prog.py`` in its working directory. Kept dependency-free (runs with -I -S).
RUNNER = r"""
import json, os, sys
cfg = json.loads(sys.argv[1])
TMP = os.path.realpath(os.getcwd())
import resource
def _lim(what, v):
    try:
        resource.setrlimit(what, (v, v))
    except (ValueError, OSError):
        pass
_lim(resource.RLIMIT_AS, cfg["memory_bytes"])
_lim(resource.RLIMIT_CPU, cfg["cpu_s"])
_lim(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
_lim(resource.RLIMIT_CORE, 0)
_lim(resource.RLIMIT_NOFILE, 64)
isolation = ["rlimits", "audit"]
try:
    import ctypes
    _libc = ctypes.CDLL(None, use_errno=True)
    _NEWNET, _NEWUSER = 0x40000000, 0x10000000
    if _libc.unshare(_NEWNET if os.geteuid() == 0 else _NEWNET | _NEWUSER) == 0:
        isolation.append("netns")
    del _libc
except Exception:
    pass
os.write(2, ("%s %s\n" % (cfg["isolation_mark"], ",".join(isolation))).encode())
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_PATH_EVENTS = {
    "os.remove": (0,), "os.rename": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,),
    "os.symlink": (0, 1), "os.link": (0, 1), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "shutil.move": (0, 1),
    "shutil.copyfile": (1,), "shutil.copytree": (1,), "os.mkfifo": (0,), "os.mknod": (0,)}
_DENY = (
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
    "os.forkpty", "os.kill", "os.killpg", "os.chroot", "os.setuid", "socket.__new__",
    "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
    "socket.sendto", "ctypes.", "pty.spawn", "os.startfile", "sys.setprofile", "sys.settrace",
    "os.unshare", "os.setns")
_MARK = cfg["block_mark"]
_realpath, _fsdecode, _write, _sep = os.path.realpath, os.fsdecode, os.write, os.sep
_str, _int, _bytes, _PathLike = str, int, bytes, os.PathLike
def _inside(p):
    try:
        rp = _realpath(_fsdecode(p))
    except Exception:
        return False
    return rp == TMP or rp.startswith(TMP + _sep)
def _block(event, what):
    _write(2, ("%s %s %r\n" % (_MARK, event, what)).encode())
    raise PermissionError("sandbox: %s of %r is not allowed" % (event, what))
def _hook(event, args):
    if event == "open":
        p, mode, flags = args
        if p is None or isinstance(p, _int):
            return
        writing = mode is not None and any(c in _str(mode) for c in "wax+")
        if (writing or (flags or 0) & _WRITE) and not _inside(p):
            _block(event, p)
    elif event in _PATH_EVENTS:
        for i in _PATH_EVENTS[event]:
            p = args[i] if i < len(args) else None
            if isinstance(p, (_str, _bytes, _PathLike)) and not _inside(p):
                _block(event, p)
    elif event.startswith(_DENY):
        _block(event, args[0] if args else None)
sys.addaudithook(_hook)
del resource, json
with open("prog.py") as _f:
    _src = _f.read()
_code = compile(_src, "prog.py", "exec")
_g = {"__name__": "__main__", "__builtins__": __builtins__}
del _f, _src
exec(_code, _g)
"""


@dataclasses.dataclass(frozen=True)
class ExecResult:
    status: str  # passed | failed | timeout | blocked
    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    blocked: tuple = ()  # the refused actions ("event 'path'")
    isolation: tuple = ()  # what the child put in place: rlimits, audit, netns

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _read_capped(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_python(
    program: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_output: int = 65536,
    fsize_mb: int = 16,
    python: Optional[str] = None,
) -> ExecResult:
    """Execute ``program`` (Python source) in a fresh sandboxed subprocess (see the module doc)."""
    if not isinstance(program, str):
        raise TypeError(
            f"run_python: program must be a str of Python source, got {type(program).__name__}"
        )
    if timeout_s <= 0 or memory_mb <= 0:
        raise InputError(
            f"run_python: timeout_s ({timeout_s}) and memory_mb ({memory_mb}) must be positive"
        )
    tmp = tempfile.mkdtemp(prefix="pallasite_sandbox_")
    t0 = time.monotonic()
    try:
        with open(os.path.join(tmp, "prog.py"), "w") as f:
            f.write(program)
        cfg = {
            "memory_bytes": int(memory_mb) << 20,
            "cpu_s": int(timeout_s) + 1,
            "fsize_bytes": int(fsize_mb) << 20,
            "block_mark": BLOCK_MARK,
            "isolation_mark": ISOLATION_MARK,
        }
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": tmp,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
        }
        out_path, err_path = os.path.join(tmp, ".stdout"), os.path.join(tmp, ".stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [python or sys.executable, "-I", "-S", "-c", RUNNER, json.dumps(cfg)],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )
            try:
                rc = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # the whole session: the candidate may have left children behind
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if timed_out:
                rc = proc.wait()
        stdout, stderr = _read_capped(out_path, max_output), _read_capped(err_path, max_output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - t0
    blocked, isolation, kept = [], (), []
    for line in stderr.splitlines(keepends=True):
        if line.startswith(BLOCK_MARK):
            blocked.append(line[len(BLOCK_MARK) :].strip())
        elif line.startswith(ISOLATION_MARK):
            isolation = tuple(line[len(ISOLATION_MARK) :].strip().split(","))
        else:
            kept.append(line)
    if timed_out:
        status = "timeout"
    elif blocked:
        status = "blocked"
    else:
        status = "passed" if rc == 0 else "failed"
    return ExecResult(
        status, None if timed_out else rc, stdout, "".join(kept), wall, tuple(blocked), isolation
    )


def run_many(programs: Sequence[str], *, workers: int = 2, **kwargs) -> list[ExecResult]:
    """``run_python`` over many programs, ``workers`` subprocesses at a time (results in order)."""
    if workers <= 1 or len(programs) <= 1:
        return [run_python(p, **kwargs) for p in programs]
    with ThreadPoolExecutor(max_workers=int(workers)) as pool:
        return list(pool.map(lambda p: run_python(p, **kwargs), programs))


__all__ = ["ExecResult", "run_python", "run_many", "RUNNER"]
