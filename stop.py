"""Stopping a run cleanly: Ctrl-C and SIGTERM, a dead engine, non-finite numbers.

    handle_signals()                   # SIGINT/SIGTERM are remembered; a second Ctrl-C exits at once
    allow_interrupt(True)              # start-up: a signal ends the run at once (nothing to save yet)
    with interruptible():              # a wait on the engine (generation) is cut short by a signal
        outputs = engine.generate(...)
    if (signum := agreed_signal()):    # every rank, at the same places: did any rank get a signal?
        stop_run(signum, step, sampler.state_dict(), engine=engine, ...)  # engine down, a checkpoint, exit 128 + n
    watch = EngineWatch(engine, phase=lambda: mem.current)   # an engine that fails ends the run, naming the phase
    stop_engine(engine, watch)         # on purpose (also at exit, whatever way the trainer exits)
    nonfinite = NonFinite(limit=3)     # K steps in a row with a NaN/inf loss or gradient: stop, naming the likely causes

A signal never lands in the middle of an update, a weight sync or a save: outside `interruptible()`
it is only remembered, and the loop stops at its next check, between phases. Generation is the one
long wait, and a signal cuts it short (it changes no training state).
"""

import atexit
import os
import signal
import sys
import threading

import torch.distributed as dist
from tqdm import tqdm

from common import InputError, handle_signals, print0
from memory import sleep
from preflight import tell_torchrun
from rollout import kill, stop_engine


def stop_run(
    signum: int,
    done: int,
    sampler_state: dict,
    *,
    engine,
    watch: "EngineWatch",
    phases: dict,
    device,
    checkpoints,
    save: bool,
    mem,
    log,
    clock,
    eval_line: list[tuple],
    resume: bool,
):
    """Every rank, after agreeing on signal `signum` (agreed_signal) with `done` steps finished: the engine down, the
    training state back on the device (memory.sleep with no engine, `phases` as the step's), a checkpoint of the
    finished steps not yet saved (`save`: --save-on-signal; checkpoint.Checkpoints, at data position `sampler_state`),
    the run's record closed (the memory log `mem`, runlog.RunLog `log`: metrics and curves, runlog.StepClock `clock`:
    the closing lines, the last held-out `eval_line`), a line on how to go on, then exit 128 + signum."""
    stop_engine(engine, watch)
    sleep(None, device=device, **phases)  # offloaded training state back
    if save and checkpoints.every >= 0 and done > checkpoints.last:
        checkpoints.save(done, sampler_state)
    launcher = f"torchrun --nproc_per_node={dist.get_world_size()}" if "RANK" in os.environ else "python"
    again = f"{launcher} {' '.join(sys.argv)}{'' if resume else ' --resume'}"  # no checkpoint: from step 0 (checkpoint_to_resume)
    mem.close()
    log.finish()  # curves.png too
    clock.summary(checkpoints.run_dir, eval_line, stopped=True)
    print0(
        f"stopped by {signal.Signals(signum).name} after step {done}; continue from step {checkpoints.last} with: {again}"
    )
    dist.destroy_process_group()
    raise SystemExit(128 + signum)


# ----------------------------------------------------------------------------------------------
# A dead engine


class EngineWatch:
    """Ends the run when the engine fails, which the trainer would otherwise wait on forever: one of
    its processes dies (killed, out of memory, a crash), or its scheduler reports an error (SGLang's
    scheduler prints its traceback, then sends this process SIGQUIT). It names the process and the
    phase, stops the engine's processes and exits with code 1; `--resume` continues from the last
    checkpoint. Whatever way the trainer exits, stop_engine runs (atexit).

    PLUMBING: SGLang's Engine brings its own ways to end this process, and they are replaced here:
    its subprocess watchdog (a dead child -> SIGQUIT -> SIGKILL of the whole process tree, no word on
    the phase) and the signal handlers of its event loop (SIGTERM: drain the requests, then kill the
    process tree without a checkpoint; SIGQUIT: kill the process tree). Attribute names: SGLang 0.5.16.
    """

    def __init__(self, engine, phase, interval: float = 2.0):
        self.processes, self.phase, self._done = getattr(engine, "processes", []), phase, threading.Event()
        self.names = {p.pid: p.name for p in self.processes}
        if engine is None:
            return
        # tqdm's default lock is a multiprocessing semaphore; once SGLang has made "spawn" the start
        # method, multiprocessing's resource tracker warns about it at every exit that skips clean-up
        # (a dead engine, a second Ctrl-C, SIGKILL; in SGLang's processes, which stop_engine SIGKILLs,
        # the CUDA-graph capture bar's). A thread lock serves the progress bars as well.
        tqdm.set_lock(threading.RLock())
        manager = getattr(engine, "tokenizer_manager", None)  # SGLang's; the HF stand-in has none
        if manager is not None:
            manager.auto_create_handle_loop()  # its event loop and handlers now, not at the first request
            for s in (signal.SIGTERM, signal.SIGQUIT):
                manager.event_loop.remove_signal_handler(s)
            sglang_watch = manager._subprocess_watchdog
            if sglang_watch is not None:
                sglang_watch.stop()
                self.names.update({p.pid: name for p, name in zip(sglang_watch._processes, sglang_watch._names)})
            signal.signal(
                signal.SIGQUIT,
                lambda signum, frame: self.fail("the rollout engine reported an error (its traceback is above)"),
            )
            handle_signals()
        if self.processes:
            threading.Thread(target=self._watch, args=(interval,), daemon=True).start()
        atexit.unregister(engine.shutdown)  # see stop_engine
        atexit.register(stop_engine, engine, self)

    def _watch(self, interval: float):
        while not self._done.wait(interval):
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                p = dead[0]
                self.fail(
                    f"the rollout engine's process {self.names[p.pid]} (pid {p.pid}) died with exit code {p.exitcode}"
                )

    def fail(self, what: str):
        """Say what failed and in which phase, stop the engine's processes, exit 1 (from any thread)."""
        if self._done.is_set():  # stopping the engine on purpose
            return
        self._done.set()
        message = (
            f"{what} during {self.phase()}: stopping (out of GPU or host memory? killed?); "
            f"--resume continues from the last checkpoint"
        )
        tell_torchrun(message)
        os.write(2, f"\n{message}\n".encode())
        kill(self.processes)
        os._exit(1)

    def close(self):
        self._done.set()


# ----------------------------------------------------------------------------------------------
# Non-finite numbers


class NonFinite:
    """Counts steps whose update was skipped for a NaN/inf loss or gradient norm (a NaN/inf reward
    never makes one: reward.score scores it 0.0); `limit` such steps in a row stop the run."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def after_step(self, step: int, skipped: int, total: int) -> str | None:
        """A console line if this step skipped updates; raises after `limit` bad steps in a row."""
        if not skipped:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise InputError(
                f"steps {step - self.limit + 1}-{step} each skipped updates for a NaN/inf loss or gradient "
                f"(the skipped updates never reached the weights).\n  Likely causes: a learning rate too "
                f"high (--lr), a model that overflows in bf16; --max-nonfinite-steps sets how many in a row "
                f"are tolerated"
            )
        return (
            f"step {step}: {skipped} of {total} updates skipped for a NaN/inf loss or gradient (the weights are "
            f"unchanged; {self.limit - self.in_a_row} more such steps in a row stop the run)"
        )
