"""Shared basics, in the manner of nanochat's common.py: printing on rank 0, sums over ranks, copies to the GPU, the
error types and the signal flags. It imports nothing of the project, so every module can use it without loading the
rest.

    print0(f"step {step} | reward {r:.3f}")      # rank 0 only
    total = all_reduce(local_sum)                 # over ranks, float64 on the CPU; the identity in a notebook
    x = to_device(x, device)                      # CPU -> GPU queued: the CPU does not wait for the GPU
    raise InputError("--lr -1 must be > 0")      # bad input: one line, exit 2 (preflight.friendly_errors)
    handle_signals()                              # SIGINT/SIGTERM are remembered; a second Ctrl-C exits at once
    with interruptible():                         # a wait on the engine (generation) is cut short by a signal
        outputs = engine.generate(...)
    if signum := agreed_signal():                 # every rank, at the same places: did any rank get a signal?
        break                                     # the loop stops between phases (stop.stop_run saves and exits)

A signal never lands in the middle of an update, a weight sync or a save: outside `interruptible()` it is only
remembered, and the loop stops at its next check, between phases. Generation is the one long wait, and a signal cuts
it short (it changes no training state).
"""

import contextlib
import os
import signal
import sys
import time

# torch is imported where it is used: `from common import exit_on_interrupt` runs before torch loads (~1.5 s)

# the tiny model's builder, which the errors about models and contexts offer for a CPU try-out
TINY_MODEL = os.path.relpath(os.path.join(os.path.dirname(__file__), "tests", "tiny_model.py"))

# ----------------------------------------------------------------------------------------------
# Rank 0 and the sums over ranks


def print0(*args, **kwargs):
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce(x, op=None):
    """Reduce a number or tensor over ranks (`op`: a torch.distributed.ReduceOp, SUM if None), in float64, back on the
    CPU (a CPU-GPU sync point on NCCL). Without a process group (a notebook) it is the identity."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return torch.as_tensor(x, dtype=torch.float64).clone().cpu()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.as_tensor(x, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op)
    return t.cpu()


def all_reduce_dict(sums: dict) -> dict:
    """Sum each tensor value over ranks, by name, in one collective. float64 on the CPU."""
    import torch

    return dict(zip(sums, all_reduce(torch.stack(list(sums.values())))))


def to_device(x, device):
    """Tensor `x` on `device`. From the CPU to a GPU the copy is queued behind the GPU's work and the CPU goes on: the
    bytes go through pinned memory (PyTorch's cached pinned buffers, kept until the copy is done), since a copy from
    ordinary memory may wait for the GPU to finish all it was given first."""
    import torch

    if torch.device(device).type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


# ----------------------------------------------------------------------------------------------
# The errors a run ends with (preflight.friendly_errors prints them in a line, without a traceback)


class InputError(ValueError):
    """Bad input (a flag, a file, a model folder), or a run that can't usefully go on: the message
    names the input and the fix."""


class RunFailed(Exception):
    """Not bad input: something the run needs failed (the rollout engine could not start, a rollout server
    died mid-run). The message says what, when, and what to try; exit code 1, no traceback."""


class EngineStartFailed(RunFailed):
    """SGLang failed while starting: friendly_errors adds which of the script's flags sets its memory."""


class Interrupted(BaseException):
    """A signal cut a wait short (start-up, generation, a weight sync that never ended); args[0] is the signal number,
    args[1] what it cut short where that is not start-up.
    A BaseException, like KeyboardInterrupt: library code that catches Exception (an optional import
    in SGLang's 20 s of imports, say) must not swallow it."""


# ----------------------------------------------------------------------------------------------
# The signal flags: Ctrl-C and SIGTERM are remembered, and the loop stops at its next check

_state = {"signum": 0, "interruptible": False, "first_at": 0.0}


def handle_signals():
    """Install the handlers (again after anything that may have replaced them)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(s) is not _on_signal:
            signal.signal(s, _on_signal)


def _on_signal(signum, frame):
    # A second Ctrl-C exits now, whatever is running. One within a second of the first is the same
    # Ctrl-C again: in a terminal the whole process group gets it, and torchrun forwards its own copy.
    if _state["signum"] and signum == signal.SIGINT and time.time() - _state["first_at"] > 1.0:
        os.write(2, b"\nsecond Ctrl-C: exiting now\n")
        os._exit(128 + signum)  # SGLang's child processes die with their parent (PR_SET_PDEATHSIG)
    first = not _state["signum"]
    if first:
        _state["first_at"] = time.time()
    _state["signum"] = max(_state["signum"], signum)  # SIGTERM after SIGINT (torchrun forwarding) wins
    if first and os.environ.get("RANK", "0") == "0":
        when = "now" if _state["interruptible"] else "at the next safe point"
        os.write(
            2,
            f"\n{signal.Signals(signum).name} received: stopping {when} (Ctrl-C again to exit at once, unsaved)\n".encode(),
        )
    if _state["interruptible"]:
        raise Interrupted(signum)


def requested() -> int:
    """The signal this rank got, 0 if none."""
    return _state["signum"]


def allow_interrupt(on: bool):
    """While on, a signal raises Interrupted wherever the main thread is: only for code whose
    interruption changes no training state (start-up, generation)."""
    if on and _state["signum"]:
        raise Interrupted(_state["signum"])
    _state["interruptible"] = on
    if not on:
        handle_signals()


@contextlib.contextmanager
def interruptible():
    allow_interrupt(True)
    try:
        yield
    finally:
        allow_interrupt(False)


def agreed_signal() -> int:
    """The signal any rank got (SIGTERM wins), 0 if none. A collective: every rank calls it at the
    same places, so all ranks stop together and can save together."""
    import torch.distributed as dist

    return int(all_reduce(_state["signum"], dist.ReduceOp.MAX)) if dist.is_initialized() else _state["signum"]


def exit_on_interrupt(script: str):
    """Called before the heavy imports (torch, transformers: ~1.5 s), where Python's own handler printed a
    KeyboardInterrupt traceback from inside `import torch`: Ctrl-C ends the process in one line, exit 130, until
    main installs its handlers (handle_signals; evaluate.py keeps this one). Only where `script` is the program run."""

    def stop(signum, frame):
        os.write(2, f"\n{script}: stopped by {signal.Signals(signum).name}\n".encode())  # not print: reentrant-safe
        raise SystemExit(128 + signum)

    if os.path.basename(sys.argv[0]) == script:
        signal.signal(signal.SIGINT, stop)
