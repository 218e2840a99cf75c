"""Fault injection for tests and lesson 08: a hook `train(config, fault=...)` calls at two moments.

    fault("step", step, rank)   when optimizer step `step` (1-based) begins on `rank`
    fault("save", step, rank)   while `rank` writes the checkpoint of step `step` (after it
                                gathered its state dict, before its shard is on disk)

`KillRank` kills one rank with SIGKILL, as a preempted machine or the kernel's out-of-memory
killer would: no exception, no clean-up, no goodbye to the other ranks. A hook can do anything
else (raise, sleep, corrupt a file); train() itself knows nothing about faults. No tensors, no
communication: a killed rank's peers find out through their next collective.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field


class InjectedFault(RuntimeError):
    """Raised instead of a SIGKILL in the process that created the hook (a notebook's own kernel)."""


@dataclass(frozen=True)
class KillRank:
    rank: int
    at_step: int
    during_save: bool = False  # False: when the step begins; True: while writing its checkpoint
    creator_pid: int = field(default_factory=os.getpid, repr=False)

    def __call__(self, event: str, step: int, rank: int) -> None:
        if rank != self.rank or step != self.at_step or event != ("save" if self.during_save else "step"):
            return
        if os.getpid() == self.creator_pid:  # never kill the caller's own process (a notebook kernel)
            raise InjectedFault(f"fault injection: rank {rank} stopped at step {step} (in the process that "
                                "created the hook a SIGKILL would end it, so this raises instead)")
        os.kill(os.getpid(), signal.SIGKILL)
