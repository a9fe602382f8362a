"""Stopping a run on SIGTERM or SIGINT without losing a step.

The first SIGTERM or SIGINT asks the run to stop: the trainer finishes the step in hand, saves it
(the same checkpoint, digests and all, as every save), waits for the save, flushes `metrics.jsonl`
and TensorBoard and raises `Interrupted`; `sao-train` prints it in one line and exits with
128 + the signal's number (143 after SIGTERM, 130 after SIGINT). During SFT or value pretraining,
which are not checkpointed, the run stops at the next SFT step or value-pretraining batch and
`--resume` starts from the beginning.

A second signal ends the process at once (the first restores the signals' default action). The whole
stop is bounded by `train.signal_grace_s` from the first signal: past it the process exits with the
same status whatever it is doing, so it is gone before the platform kills it (Cloud TPU and GCE Spot
VMs get SIGTERM about 30 s before they stop; GKE's default grace period is 30 s). A save cut off
there leaves no step that looks finished (Orbax renames a step's folder when it is complete), and
`--resume` continues from the newest checkpoint.

Every process of a multi-process run stops after the same step: `StopRequests.agreed()` — called by
every process at the same points, once per step — gathers each process's flags (a signal, a failed
save), so a signal that reaches only some hosts stops them all after the step in hand. (JAX's own preemption sync point,
`multihost_utils.reached_preemption_sync_point`, reads SIGTERM through a handler of its own, which
knows no second signal, no SIGINT and no bound; the gathered flag covers all three.)
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from types import FrameType

import jax
import numpy as np
from jax.experimental import multihost_utils

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """What `sao-train` exits with after stopping on `signum`: 128 + its number, as a shell reports a
    process the signal killed (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + signum


@dataclasses.dataclass(eq=False)
class Interrupted(Exception):
    """The run stopped on a signal. `step`: the RL step saved last (None: stopped before the first
    checkpoint, in `stage`); `dropped_prompts`: async mode's prompts in flight or finished but not yet
    trained on, which a resumed run does not replay."""

    signum: int
    step: int | None
    stage: str = "rl"
    dropped_prompts: int = 0

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        if self.step is None:
            return (f"interrupted by {name} during {self.stage}, before the first checkpoint; --resume starts from "
                    "the beginning")
        dropped = f"; {self.dropped_prompts} prompts queued or in flight dropped" if self.dropped_prompts else ""
        return f"interrupted by {name} at step {self.step}; saved{dropped}; resume with --resume"


class StopRequests:
    """The run's SIGTERM and SIGINT handlers while it is inside `with StopRequests(grace_s):` (in the
    main thread, for each signal not ignored; elsewhere no handler is installed and only `request`
    asks for a stop)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._deadline: threading.Timer | None = None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # a signal ignored (nohup, `&`) stays so
            self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS
                              if signal.getsignal(signum) is not signal.SIG_IGN}  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self._deadline is not None:
            self._deadline.cancel()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        for other in self._previous:  # a second signal ends the process at once
            signal.signal(other, signal.SIG_DFL)
        self.request(signum)

    def request(self, signum: int) -> None:
        """Ask for a stop as `signum` does, and start the `grace_s` bound."""
        if self.signum is not None:
            return
        self.signum = signum
        self._deadline = threading.Timer(self.grace_s, self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self) -> None:
        name = signal.Signals(self.signum).name
        print(f"interrupted by {name}: the stop took longer than train.signal_grace_s={self.grace_s:g} s; exiting "
              "without waiting further; --resume continues from the newest checkpoint",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(exit_status(self.signum))

    def agreed(self, save_failure: BaseException | None = None) -> tuple[bool, bool]:
        """(stop, a save failed): whether a signal reached this process or, in a multi-process run,
        any other, and whether a save failed on any (`save_failure`: this process's), each process's
        flags gathered. Every process must call this at the same points."""
        if jax.process_count() == 1:
            return self.signum is not None, save_failure is not None
        flags = np.asarray(multihost_utils.process_allgather(np.array([self.signum or 0, save_failure is not None],
                                                                      np.int32)))  # fmt: skip
        # The decision is the gathered flags' alone: a signal handled while the gather was in flight is
        # in this process's next gather, so no process stops (and saves, a collective) without the others.
        signum = int(flags[:, 0].max())
        if signum and self.signum is None:
            self.request(signum)
        return bool(signum), bool(flags[:, 1].any())
