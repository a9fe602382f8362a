"""The verified math reward of the TIR setting: r = 1 when the final answer equals the gold answer, else 0.

    final answer  = the content of the last top-level \\boxed{...} (or \\fbox{...}) of the response
    r(response)   = 1  if math-verify judges that answer equivalent to the gold answer,  0 otherwise

`verify(answer_text, gold, *, timeout_s)` returns a `Verdict` whose `status` says why:
    "correct"     equivalent
    "wrong"       both parsed, not equivalent
    "unparsable"  a box was found but math-verify could not parse its content ("", "1 +", "\\frac{1}")
    "no_answer"   the response has no complete \\boxed{...}
    "timeout"     the check took longer than `timeout_s` (a pathological answer such as 9^{9^{9}})

Equivalence is math-verify 0.9.0's (strict mode, its defaults): both sides are parsed from LaTeX to
SymPy (units such as "\\text{ cm}", "^\\circ", "\\$", thousands separators and "x =" are stripped) and
compared exactly (symbolic simplification; sets ignore order, tuples and intervals do not), except that a
decimal is compared with a non-integer gold after rounding both to 6 decimal places: 0.142857 counts as
1/7, 0.333 does not count as 1/3; an integer gold needs the exact value (10.0, not 9.9999999). Known
disagreements with mathematics (tests/envs/test_math_reward.py): a percentage's number alone is accepted
("50" for gold "50\\%"), a pair or interval "(1,2)" for the set {1,2}, and degrees are dropped, not
converted ("30^\\circ" is 30, not pi/6).

Why a worker process. math-verify bounds its own time with `signal.alarm`, which works only in the main
thread, and the agent loop calls environments from worker threads. A thread cannot be stopped, and a
runaway SymPy evaluation would keep the CPU (and the GIL) after its caller gave up. So every check runs in
a long-lived worker process (math-verify's signal timeout off) and the caller waits on its pipe with a
deadline; a worker that misses it is SIGKILLed and replaced. Workers are pooled (at most `max_workers`
busy at once), so a check costs one pipe round trip beyond math-verify itself (~0.1-0.4 ms measured);
starting a worker (importing SymPy, ~0.9 s) is paid once per worker and after each timeout, and is not
counted against `timeout_s`. A worker has an address-space limit (`memory_mb`) and a CPU limit per check
(ceil(timeout_s) + 1 s), and dies with the process that uses the pool, mid-check too (kill -9 and
preemption included): it is started through the sandbox's launcher (`python_tool.dying_with_this_process`,
a parent-death SIGKILL), from one thread that lives as long as the process, since that signal fires when
the starting *thread* ends and the threads that call `verify` come and go.

Run as a script (`python -I math_reward.py --serve MEMORY_MB`) this file is the worker; it therefore
imports only the standard library at module level.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import queue
import re
import selectors
import subprocess
import sys
import threading
import time

STATUSES = ("correct", "wrong", "unparsable", "no_answer", "timeout")
STARTUP_TIMEOUT_S = 60.0
_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BAD_GOLD = "bad_gold"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one check: `correct` (the reward is `float(correct)`) and `status` (one of STATUSES)."""

    correct: bool
    status: str

    @property
    def reward(self) -> float:
        return float(self.correct)


def extract_final_answer(text: str) -> str | None:
    """Content of the last top-level `\\boxed{...}` / `\\fbox{...}` in `text`, None when there is none.

    Braces nest (`\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`); escaped braces `\\{ \\}` do not count, so
    `\\boxed{\\{1,2\\}}` -> `\\{1,2\\}`. A box inside another box is part of the outer one's content. A box
    left open at the end (a cut-off response) is not an answer: if the last box is unclosed, None.
    """
    answer, position = None, 0
    while (start := _BOX_START.search(text, position)) is not None:
        end = _closing_brace(text, start.end())
        if end is None:
            return None
        answer, position = text[start.end(): end], end + 1
    return answer


def _closing_brace(text: str, i: int) -> int | None:
    """Index of the "}" that closes the group opened just before position `i`, None if it never closes."""
    depth = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # an escaped character (\{, \}, \\) never opens or closes a group
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return i
        i += 1
    return None


def verify(answer_text: str, gold: str, *, timeout_s: float = 5.0, pool: VerifierPool | None = None) -> Verdict:
    """Check the final answer of `answer_text` (a model response; its last \\boxed{} is the answer) against
    `gold` (LaTeX or plain text of the gold answer, without \\boxed). Thread-safe; the time limit holds
    from any thread (module docstring). `pool` defaults to a process-wide one. A gold answer that
    math-verify cannot parse is a data error: ValueError."""
    answer = extract_final_answer(answer_text)
    if answer is None:
        return Verdict(False, "no_answer")
    return (pool or default_pool()).check(answer, gold, timeout_s=timeout_s)


class WorkerError(RuntimeError):
    """A verifier worker failed to start or died (not the answer's fault)."""


class VerifierPool:
    """Worker processes that run math-verify, each check under a deadline (module docstring)."""

    def __init__(self, *, max_workers: int = 4, memory_mb: int = 1024) -> None:
        if max_workers < 1:
            raise ValueError(f"VerifierPool: max_workers must be >= 1 (got {max_workers})")
        if memory_mb < 256:
            raise ValueError(f"VerifierPool: memory_mb must be >= 256 (got {memory_mb}); a worker maps ~65 MB")
        self.memory_mb = memory_mb
        self._slots = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._closed = False

    def check(self, answer: str, gold: str, *, timeout_s: float) -> Verdict:
        """Verdict for `answer` (the box's content) against `gold`, within `timeout_s` of checking."""
        if not timeout_s > 0:
            raise ValueError(f"verify: timeout_s must be > 0 (got {timeout_s})")
        with self._slots:
            worker = self._take_worker()
            try:
                reply = worker.ask({"answer": answer, "gold": gold, "cpu_s": math.ceil(timeout_s) + 1}, timeout_s)
            except BaseException:
                worker.kill()
                raise
            if reply is None:
                worker.kill()
                return Verdict(False, "timeout")
            self._return_worker(worker)
        if "error" in reply:
            raise WorkerError(f"verifier worker failed on answer {answer[:80]!r}: {reply['error']}")
        if reply["status"] == _BAD_GOLD:
            raise ValueError(f"verify: math-verify cannot parse the gold answer {gold!r}")
        return Verdict(reply["status"] == "correct", reply["status"])

    def close(self) -> None:
        """Stop the idle workers; later checks raise."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _take_worker(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool is closed")
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.kill()  # died while idle (e.g. killed from outside): reap it, use another
        return _Worker(self.memory_mb)

    def _return_worker(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()


_default_pool: VerifierPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> VerifierPool:
    """The process-wide pool `verify` uses (created on first use, closed at exit)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = VerifierPool(max_workers=min(8, os.cpu_count() or 1))
            atexit.register(_default_pool.close)
        return _default_pool


_spawn_requests: queue.SimpleQueue | None = None
_spawner_lock = threading.Lock()


def _start_worker_process(memory_mb: int) -> subprocess.Popen:
    """A worker process that dies with this one, started from the process's one spawning thread (module
    docstring: the parent-death signal follows the starting thread)."""
    from sao_jax.envs.python_tool import dying_with_this_process

    global _spawn_requests
    with _spawner_lock:
        if _spawn_requests is None:
            _spawn_requests = queue.SimpleQueue()
            threading.Thread(target=_spawn_forever, args=(_spawn_requests,), name="math-verify-spawner",
                             daemon=True).start()  # fmt: skip
    # -I: no script directory on sys.path (this folder's modules cannot shadow others), no PYTHON* env.
    command = dying_with_this_process([sys.executable, "-I", os.path.abspath(__file__), "--serve", str(memory_mb)])
    started: queue.SimpleQueue = queue.SimpleQueue()
    _spawn_requests.put((command, started))
    proc = started.get()
    if isinstance(proc, BaseException):
        raise proc
    return proc


def _spawn_forever(requests: queue.SimpleQueue) -> None:
    """The spawning thread: start each requested command; answer with its Popen or the exception."""
    while True:
        command, started = requests.get()
        try:
            # A new session keeps a terminal's Ctrl-C away from the workers; they end with the parent instead.
            started.put(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        except Exception as e:  # noqa: BLE001 — handed to the caller, raised there
            started.put(e)


class _Worker:
    """One worker process, spoken to in JSON lines over its stdin/stdout."""

    def __init__(self, memory_mb: int) -> None:
        self._proc = _start_worker_process(memory_mb)
        self._received = b""
        try:
            ready = self._receive(time.monotonic() + STARTUP_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        if ready is None or "error" in ready:
            self.kill()
            why = "no reply" if ready is None else ready["error"]
            raise WorkerError(f"verifier worker did not start within {STARTUP_TIMEOUT_S:.0f} s: {why}")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def ask(self, request: dict, timeout_s: float) -> dict | None:
        """The worker's reply to `request`, or None when none came within `timeout_s`."""
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerError(f"verifier worker died (exit {self._proc.wait()})") from None
        return self._receive(time.monotonic() + timeout_s)

    def _receive(self, deadline: float) -> dict | None:
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._received:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if not selector.select(remaining):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise WorkerError(f"verifier worker died (exit {self._proc.wait()})")
                self._received += chunk
        line, _, self._received = self._received.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._proc.stdin.close()
        self._proc.stdout.close()


# ---- worker: everything below runs in the worker process -------------------------------------------------


def _serve(memory_mb: int) -> None:
    """Answer {"answer", "gold", "cpu_s"} lines with {"status"} lines until stdin closes (the parent is gone)."""
    try:
        import logging
        import resource

        import math_verify

        # Its once-per-process warning that its (signal) timeout is off: we time the checks from outside.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        limit = memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except BaseException as e:
        _send({"error": f"{type(e).__name__}: {e}"})
        return
    _send({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        # The CPU this check may use, as a kernel limit (SIGXCPU kills the worker): the parent's wall-clock
        # deadline fires first, so this only matters for a worker whose parent died mid-check — it cannot
        # see the EOF, and a Python watchdog thread would not get the GIL from a long big-integer operation.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        spent_s = math.ceil(usage.ru_utime + usage.ru_stime)
        resource.setrlimit(resource.RLIMIT_CPU, (spent_s + request["cpu_s"], resource.RLIM_INFINITY))
        try:
            _send({"status": _check(math_verify, request["answer"], request["gold"])})
        except Exception as e:  # math-verify catches its own errors; this is a bug worth surfacing
            _send({"error": f"{type(e).__name__}: {e}"})


def _check(math_verify, answer: str, gold: str) -> str:
    """math-verify's verdict on two box contents: parse both as boxed LaTeX, then compare (gold first: its
    comparison is not symmetric)."""

    def parse(latex: str) -> list:
        return math_verify.parse("\\boxed{" + latex + "}",
                                 extraction_config=[math_verify.LatexExtractionConfig(boxed_match_priority=0)],
                                 fallback_mode="no_fallback", parsing_timeout=None)

    gold_parsed = parse(gold)
    if not gold_parsed:
        return _BAD_GOLD
    answer_parsed = parse(answer)
    if not answer_parsed:
        return "unparsable"
    return "correct" if math_verify.verify(gold_parsed, answer_parsed, timeout_seconds=None) else "wrong"


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        sys.exit("usage: python -I math_reward.py --serve MEMORY_MB  (the verifier worker; see the docstring)")
    _serve(int(sys.argv[2]))
