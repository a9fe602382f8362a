"""Run model-written Python in a sandbox: `run_python(code, *, timeout_s, memory_mb) -> PythonResult`.

What is guaranteed depends on the platform; the level is probed once per process (by running a trivial
program) and reported in `PythonResult.isolation` and `sandbox_platform()`.

"namespaces" — Linux >= 5.12 (`mount_setattr`), the caller is root, util-linux `unshare` is on PATH and
an interpreter that any uid may execute exists (the caller's, else /usr/bin/python3). The program runs as
`python -I -` reading `code` from stdin, and:
  network      is in a fresh network namespace with no interface up, loopback included (abstract unix
               sockets are per-namespace too); /run is hidden under an empty read-only tmpfs, so host
               daemons' unix sockets there are out of reach.
  filesystem   sees, in a private mount namespace, every mount read-only and nosuid (one recursive
               `mount_setattr`, invisible to the host). It can write only to the scratch dir /tmp (its cwd
               and $HOME): a fresh tmpfs owned by its uid, at most `scratch_mb`, gone when the call returns —
               and to device nodes such as /dev/null, which a read-only mount does not cover.
  identity     runs as a throwaway uid/gid with no supplementary groups, a different one for each
               concurrent call (`sandbox_uids()`), owning no file on the host, with `no_new_privs`: it
               reads only world-readable files (not /etc/shadow) and cannot signal or ptrace host processes.
  environment  gets only PATH, HOME, TMPDIR and LANG; /proc is its own (fresh pid namespace), so the
               parent's environment and command line are not visible. /sys stays visible, read-only.
  lifetime     is pid 1 of a fresh pid namespace: when it exits or is killed the kernel kills every
               process in the namespace, and `run_python` returns only after that. SysV IPC objects live in
               a private IPC namespace and vanish with it. It dies with its caller too: every process of
               the chain (`unshare`, the launcher, the program) has a parent-death signal (SIGKILL), so a
               caller killed mid-call (kill -9, a preempted VM) leaves nothing running.
  resources    per-process rlimits: address space and data segment (`memory_mb`), CPU seconds
               (ceil(timeout_s) + 1), processes and threads (`max_processes`; the count is per uid, hence the
               per-call uid), 64 open files, file size (`scratch_mb`), no core dumps; a wall-clock timeout
               (`timed_out`); stdout and stderr each kept up to `max_output_bytes` — a program that writes
               more is killed there (`output_truncated`), so the caller's memory stays bounded.
"rlimits" — any other Linux (not root, no `unshare`, old kernel): the same rlimits, timeout and output cap,
  an empty environment, a fresh scratch directory as cwd (deleted afterwards), a kill of the process
  group, and the program's own parent-death signal (it dies with its caller; processes it starts do
  not). NOT guaranteed at this level: network isolation, file-system isolation (the code runs as the
  caller's user and can write wherever the caller can), hiding the parent's /proc entries, killing
  descendants that leave the process group with setsid(), and — when the caller is root — the process
  limit (root is exempt from RLIMIT_NPROC).
At no level: protection against kernel exploits (there is no seccomp filter), CPU contention on the host
during the timeout, side channels; total memory is bounded by `max_processes × memory_mb + scratch_mb`
(rlimits, not a cgroup). Other operating systems: `SandboxUnavailableError`.

Run as a script (`python -I -S python_tool.py SPEC_JSON`) this file is the in-sandbox launcher: it sets up
the mounts, rlimits and uid from inside the new namespaces, then execs the sandboxed interpreter; as
`python -I -S python_tool.py --die-with PID COMMAND...` it arms its parent-death signal (if its parent is
still PID) and execs COMMAND, which keeps it (`dying_with_this_process`: `unshare`, and the math verifier's
workers). It therefore imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pwd
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

NAMESPACES = "namespaces"
RLIMITS = "rlimits"

# The child's whole environment; nothing is inherited from the parent.
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# Throwaway uids for sandboxes, one per concurrent call (see sandbox_uids).
_UID_BASE = 0x70000000
_UIDS_PER_PROCESS = 64
_SETUP_ERROR_PREFIX = "sao-sandbox-setup-error: "
_SETUP_ERROR_EXIT = 125
_MAX_CODE_BYTES = 256 * 1024
_READ_CHUNK = 65536
# This file run as the launcher (module docstring): -S, as it imports only the standard library.
_THIS_FILE = [sys.executable, "-I", "-S", os.path.abspath(__file__)]


class SandboxUnavailableError(RuntimeError):
    """The requested isolation cannot be provided on this platform."""


class SandboxSetupError(RuntimeError):
    """The sandbox could not be set up for this call (a platform problem, not the program's fault)."""


@dataclasses.dataclass(frozen=True)
class PythonResult:
    """What a sandboxed run produced.

    exit_code         the interpreter's exit status; negative = killed by that signal (timeouts and
                      output overflow are SIGKILL, -9)
    timed_out         the wall-clock limit `timeout_s` was hit and the sandbox was killed
    output_truncated  stdout or stderr exceeded `max_output_bytes`; the sandbox was killed there
    stdout_bytes, stderr_bytes  bytes the program wrote before it ended (at most cap + one read chunk)
    isolation         "namespaces" or "rlimits": which guarantees of the module docstring applied
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    output_truncated: bool
    stdout_bytes: int
    stderr_bytes: int
    wall_s: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output_bytes: int = 64 * 1024,
    max_processes: int = 16,
    scratch_mb: int = 16,
    isolation: str | None = None,
) -> PythonResult:
    """Run `code` with `python -I` in a sandbox and return its captured output (see module docstring).

    `isolation=None` picks the strongest level this platform supports; naming a level that is not
    available raises `SandboxUnavailableError`. Safe to call from several threads at once.
    """
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be str, got {type(code).__name__}")
    source = code.encode("utf-8")
    if len(source) > _MAX_CODE_BYTES:
        raise ValueError(f"run_python: code is {len(source)} bytes, more than the {_MAX_CODE_BYTES} allowed")
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes),
                        ("max_processes", max_processes), ("scratch_mb", scratch_mb)):
        if not value > 0:
            raise ValueError(f"run_python: {name} must be > 0 (got {value})")
    platform = sandbox_platform()
    level = platform["isolation"] if isolation is None else isolation
    if level == NAMESPACES and platform["isolation"] != NAMESPACES:
        raise SandboxUnavailableError(f"namespaces isolation unavailable: {platform['reason']}")
    if level not in (NAMESPACES, RLIMITS):
        raise ValueError(f"run_python: isolation must be {NAMESPACES!r}, {RLIMITS!r} or None (got {level!r})")
    limits = _Limits(timeout_s, memory_mb, max_output_bytes, max_processes, scratch_mb)
    return _run(source, limits, level, platform["python"] if level == NAMESPACES else sys.executable)


@dataclasses.dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_mb: int
    max_output_bytes: int
    max_processes: int
    scratch_mb: int


_platform_lock = threading.Lock()
_platform: dict[str, str] | None = None


def sandbox_platform() -> dict[str, str]:
    """`{"isolation", "python", "reason"}`: the strongest level here, the interpreter the sandbox runs
    and why "namespaces" is unavailable (empty when it is). Probed once per process."""
    global _platform
    with _platform_lock:
        if _platform is None:
            _platform = _probe_platform()
        return dict(_platform)


def _probe_platform() -> dict[str, str]:
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        raise SandboxUnavailableError(f"run_python needs Linux >= 5.3 (pidfd); this is {sys.platform}")
    fallback = {"isolation": RLIMITS, "python": sys.executable}
    if os.geteuid() != 0:
        return {**fallback, "reason": "not running as root: cannot create namespaces or change uid"}
    if shutil.which("unshare") is None:
        return {**fallback, "reason": "util-linux `unshare` is not on PATH"}
    candidates = [p for p in dict.fromkeys([os.path.realpath(sys.executable), "/usr/bin/python3",
                                            "/usr/local/bin/python3"]) if _others_can_execute(p)]
    if not candidates:
        return {**fallback, "reason": "no Python interpreter that an unprivileged uid may execute "
                                      f"({sys.executable} sits in a directory closed to others)"}
    limits = _Limits(timeout_s=20.0, memory_mb=256, max_output_bytes=4096, max_processes=4, scratch_mb=1)
    failures = []
    for python in candidates:
        try:
            probe = _run(b"print(6 * 7)", limits, NAMESPACES, python)
        except SandboxSetupError as e:
            failures.append(f"{python}: {e}")
            continue
        if probe.ok and probe.stdout == "42\n":
            return {"isolation": NAMESPACES, "python": python, "reason": ""}
        failures.append(f"{python}: probe exited {probe.exit_code}: {probe.stderr.strip()[-300:]}")
    return {**fallback, "reason": "namespace probe failed: " + "; ".join(failures)}


def _others_can_execute(path: str) -> bool:
    """True when a uid with no relation to the file's owner may execute `path` (every directory above it
    searchable by others, the file executable by others)."""
    if not os.path.isfile(path):
        return False
    if not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    parent = os.path.dirname(path)
    while True:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
        if parent == os.path.dirname(parent):
            return True
        parent = os.path.dirname(parent)


def sandbox_uids() -> range:
    """The throwaway uids this process's sandboxes run as: 64 per process, distinct between live processes.

    uid = 0x70000000 + pid·64 + slot, inside the 0x70000000–0x7FFFFFFF block that systemd's uid map
    leaves unused (pids are < 2^22, so the block is never left).
    """
    first = _UID_BASE + (os.getpid() << 6)
    return range(first, first + _UIDS_PER_PROCESS)


class _UidPool:
    """Hands out distinct uids to concurrent calls: RLIMIT_NPROC counts processes per uid, so a fork bomb
    in one sandbox must not starve another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_use: set[int] = set()

    def acquire(self) -> int:
        with self._lock:
            for uid in sandbox_uids():
                if uid in self._in_use:
                    continue
                try:
                    pwd.getpwuid(uid)
                    continue  # a real account: never borrow it
                except KeyError:
                    self._in_use.add(uid)
                    return uid
        raise SandboxSetupError(f"all {_UIDS_PER_PROCESS} sandbox uids of this process are in use "
                                "(too many concurrent run_python calls)")

    def release(self, uid: int) -> None:
        with self._lock:
            self._in_use.discard(uid)


_uids = _UidPool()


def _run(source: bytes, limits: _Limits, level: str, python: str) -> PythonResult:
    uid = _uids.acquire() if level == NAMESPACES else None
    host_scratch = None if level == NAMESPACES else tempfile.mkdtemp(prefix="sao_sandbox_")
    try:
        return _start_and_collect(source, limits, level, python, uid, host_scratch)
    finally:
        if uid is not None:
            _uids.release(uid)
        if host_scratch is not None:
            shutil.rmtree(host_scratch, ignore_errors=True)


def _start_and_collect(source: bytes, limits: _Limits, level: str, python: str, uid: int | None,
                       host_scratch: str | None) -> PythonResult:
    # The program's stderr travels on its own pipe (moved onto fd 2 just before exec); the launcher's
    # and unshare's own stderr is a separate diagnostics pipe, so their messages never mix with it.
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    spec = {
        "namespaces": level == NAMESPACES,
        "uid": uid,
        "python": python,
        "scratch": "/tmp" if level == NAMESPACES else host_scratch,
        "stderr_fd": stderr_w,
        "memory_bytes": limits.memory_mb * 2**20,
        "cpu_s": math.ceil(limits.timeout_s) + 1,
        "max_processes": limits.max_processes,
        "scratch_bytes": limits.scratch_mb * 2**20,
    }
    spec["parent_pid"] = os.getpid()  # the launcher dies with this process (`_die_with`)
    launcher = [*_THIS_FILE, json.dumps(spec)]
    if level == NAMESPACES:  # unshare dies with this process too: its parent-death signal survives the exec
        launcher = dying_with_this_process([shutil.which("unshare"), "--net", "--mount", "--pid", "--ipc", "--fork",
                                            "--kill-child=SIGKILL", "--mount-proc", *launcher])  # fmt: skip
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            launcher, stdin=stdin_r, stdout=stdout_w, stderr=subprocess.PIPE, pass_fds=(stderr_w,),
            env={"PATH": _SANDBOX_PATH}, cwd=host_scratch or "/", start_new_session=True,
        )
    except BaseException:
        for fd in (stdin_w, stdout_r, stderr_r):
            os.close(fd)
        raise
    finally:
        for fd in (stdin_r, stdout_w, stderr_w):
            os.close(fd)
    stdout, stderr, timed_out = _communicate(proc, level == NAMESPACES, source, stdin_w, stdout_r, stderr_r,
                                             limits, deadline=started + limits.timeout_s)
    wall_s = time.monotonic() - started
    with proc.stderr:
        diagnostics = proc.stderr.read().decode("utf-8", "replace")
    if proc.returncode == _SETUP_ERROR_EXIT and diagnostics.startswith(_SETUP_ERROR_PREFIX):
        raise SandboxSetupError(diagnostics[len(_SETUP_ERROR_PREFIX):].strip())
    truncated = stdout.overflowed or stderr.overflowed
    exit_code = proc.returncode
    if timed_out or truncated or "sigprocmask unblock failed" in diagnostics:
        # We killed it, or (the last case) unshare saw its child die of SIGKILL and, unable to re-raise
        # SIGKILL on itself, exited 1 with that message (util-linux 2.38).
        exit_code = -signal.SIGKILL
    return PythonResult(
        stdout=stdout.text(), stderr=stderr.text(), exit_code=exit_code, timed_out=timed_out,
        output_truncated=truncated, stdout_bytes=stdout.total, stderr_bytes=stderr.total,
        wall_s=wall_s, isolation=level,
    )


class _Capture:
    """One output pipe read incrementally: the first `cap` bytes are kept, all bytes are counted."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap = fd, cap
        self.kept = bytearray()
        self.total = 0
        self.open = True
        os.set_blocking(fd, False)

    @property
    def overflowed(self) -> bool:
        return self.total > self.cap

    def read(self) -> bool:
        """Read what is there (one chunk); close at EOF. False when nothing was available."""
        if not self.open:
            return False
        try:
            data = os.read(self.fd, _READ_CHUNK)
        except BlockingIOError:
            return False
        if not data:
            self.close()
            return False
        self.kept += data[: max(0, self.cap - len(self.kept))]
        self.total += len(data)
        return True

    def close(self) -> None:
        if self.open:
            os.close(self.fd)
            self.open = False

    def text(self) -> str:
        return bytes(self.kept).decode("utf-8", "replace")


def _communicate(proc, namespaces: bool, source: bytes, stdin_fd: int, stdout_fd: int, stderr_fd: int,
                 limits: _Limits, deadline: float) -> tuple[_Capture, _Capture, bool]:
    """Feed `source` to the program's stdin and capture stdout/stderr until the sandbox exits, the
    deadline passes (-> timed_out) or an output passes its cap; then kill it and drain the pipes.

    The loop ends on process exit (a pidfd), not on EOF, so a descendant holding the pipes open cannot
    stretch the call.
    """
    outputs = [_Capture(stdout_fd, limits.max_output_bytes), _Capture(stderr_fd, limits.max_output_bytes)]
    pending = memoryview(source)
    stdin_open = True
    timed_out = False
    os.set_blocking(stdin_fd, False)
    selector = selectors.DefaultSelector()
    exited = os.pidfd_open(proc.pid)
    try:
        selector.register(exited, selectors.EVENT_READ)
        selector.register(stdin_fd, selectors.EVENT_WRITE)
        for output in outputs:
            selector.register(output.fd, selectors.EVENT_READ, output)
        while not any(output.overflowed for output in outputs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            events = selector.select(remaining)
            if any(key.fd == exited for key, _ in events):
                break
            for key, _ in events:
                if key.fd == stdin_fd:
                    pending = _feed(stdin_fd, pending)
                    if not pending:  # all written: EOF ends the program text
                        selector.unregister(stdin_fd)
                        os.close(stdin_fd)
                        stdin_open = False
                else:
                    key.data.read()
                    if not key.data.open:
                        selector.unregister(key.fd)
    finally:
        selector.close()
        os.close(exited)
        if stdin_open:
            os.close(stdin_fd)
        _kill_sandbox(proc, namespaces)
        for output in outputs:  # whatever is still buffered; in namespace mode every writer is dead
            while not output.overflowed and output.read():
                pass
            output.close()
    return outputs[0], outputs[1], timed_out


def _feed(stdin_fd: int, pending: memoryview) -> memoryview:
    """Write the next chunk of the program text; the rest is dropped if the program has gone."""
    try:
        return pending[os.write(stdin_fd, pending[:_READ_CHUNK]):]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        return pending[len(pending):]


def _kill_sandbox(proc: subprocess.Popen, namespaces: bool) -> None:
    """SIGKILL the sandbox and wait until nothing of it is left.

    In namespace mode the launcher's child is pid 1 of the sandbox's pid namespace: killing it makes the
    kernel kill every process inside, and `unshare` reaps it (and exits) only after they are all gone.
    In rlimits mode `proc` is the program's interpreter, the leader of its own process group: the whole
    group is killed while the leader is not yet reaped (so its id cannot name another group), then the
    leader is reaped. The process-group kill also stops a stuck `unshare`.
    """
    if proc.returncode is not None:
        return  # already reaped: its pid (and so the group id) may belong to someone else now
    if namespaces and _kill_children(proc.pid):
        try:
            proc.wait(timeout=10.0)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def dying_with_this_process(command: list[str]) -> list[str]:
    """`command` started through this file's launcher (`--die-with`): it gets SIGKILL when the thread
    that starts it ends, or the whole process (kill -9 included), and is never left running alone.
    The launcher execs `command`, which keeps the parent-death signal unless it is set-uid."""
    return [*_THIS_FILE, "--die-with", str(os.getpid()), *command]


def _kill_children(pid: int) -> bool:
    """SIGKILL the direct children of `pid` through pidfds (immune to pid reuse); True if any was sent."""
    sent = False
    for child in _children(pid):
        try:
            fd = os.pidfd_open(child)
        except ProcessLookupError:
            continue
        try:
            if child in _children(pid):  # the pidfd refers to our child, not to a recycled pid
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                sent = True
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return sent


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


# ---- in-sandbox launcher: everything below runs in the child, before the sandboxed interpreter ----

_MS_NOSUID, _MS_NODEV, _MS_RDONLY = 0x2, 0x4, 0x1
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID = 0x1, 0x2
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_SYS_MOUNT_SETATTR = 442  # the same number on every architecture but alpha
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38


def _die_with(parent_pid: int) -> None:
    """Arm this process's parent-death signal (SIGKILL), kept across exec of a program that is not
    set-uid; if the parent `parent_pid` is already gone, die now (it went before the signal was armed)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PDEATHSIG)")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _launch(spec: dict[str, Any]) -> None:
    """Set up the sandbox from inside it, then exec `python -I -` (reads the program from stdin)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    uid, scratch = spec["uid"], spec["scratch"]
    if not spec["namespaces"]:  # the caller's child: dies with it (under unshare, re-armed below)
        _die_with(spec["parent_pid"])
    if spec["namespaces"]:
        class MountAttr(ctypes.Structure):
            _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                        ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

        attr = MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID, 0, 0, 0)
        check(libc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(_AT_FDCWD), b"/", ctypes.c_uint(_AT_RECURSIVE),
                           ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
              "mount_setattr(/, recursive read-only)")
        tmpfs = f"size={spec['scratch_bytes']},nr_inodes=4096,mode=0700,uid={uid},gid={uid}".encode()
        check(libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, tmpfs), f"mount {scratch}")
        if os.path.isdir("/run"):
            check(libc.mount(b"tmpfs", b"/run", b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_RDONLY, b"size=4k,mode=0755"),
                  "mount /run")
    memory = spec["memory_bytes"]
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_DATA, memory),
                         (resource.RLIMIT_NPROC, spec["max_processes"]), (resource.RLIMIT_NOFILE, 64),
                         (resource.RLIMIT_FSIZE, spec["scratch_bytes"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    # Changing uid cleared unshare's parent-death signal: re-arm it so the sandbox dies with unshare.
    check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    os.chdir(scratch)
    if not os.access(spec["python"], os.X_OK):  # checked with the real (sandbox) uid, while errors still go to
        raise PermissionError(f"{spec['python']} is not executable by uid {os.getuid()}")  # the diagnostics pipe
    os.dup2(spec["stderr_fd"], 2)  # from here on fd 2 is the program's stderr (see _run)
    os.close(spec["stderr_fd"])
    env = {"PATH": _SANDBOX_PATH, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
    os.execve(spec["python"], [spec["python"], "-I", "-"], env)


if __name__ == "__main__":
    try:
        if sys.argv[1] == "--die-with":
            _die_with(int(sys.argv[2]))
            os.execv(sys.argv[3], sys.argv[3:])
        _launch(json.loads(sys.argv[1]))
    except BaseException as e:  # report setup failures distinctly from the program's own errors
        sys.stderr.write(f"{_SETUP_ERROR_PREFIX}{type(e).__name__}: {e}\n")
        sys.exit(_SETUP_ERROR_EXIT)
