"""How a run stops: on Ctrl-C, SIGTERM or a dead peer every process of the run exits.

Lightning turns Ctrl-C into a graceful shutdown (the callbacks' ``on_exception``, e.g. the stop
checkpoint, then ``exit(1)``) and ignores any further Ctrl-C. Under DDP that shutdown can block for
good: a rank waits in a collective (gloo and NCCL wait 30 minutes by default) for a peer that is
stopping differently, or is dead. The entry points run inside :func:`guarded`, which adds:

* a SIGINT handler (and, unless the caller set one, the same for SIGTERM) that raises
  ``KeyboardInterrupt`` like Python's own, except inside a
  *critical section* (:func:`enter_critical` / :func:`leave_critical`: from a model update to the
  step counter that records it, where a stop checkpoint could not be resumed exactly); there the
  interrupt is raised when the section ends. A caller that ignores SIGINT keeps ignoring it (a
  shell starts a background job, ``nohup python train.py … &`` in a script, with SIGINT ignored so
  that a Ctrl-C meant for the foreground does not stop it);
* a watcher thread that sees every SIGINT / SIGTERM through the signal wake-up fd, also while the
  main thread is blocked in a collective: if the process is still alive ``grace`` seconds after
  the first (``SHIFT_LIGHTNING_STOP_GRACE``, default 60), it exits by force (status 130 / 143);
  a second Ctrl-C exits at once;
* under DDP, SIGTERM taken back from Lightning once a Trainer runs (:class:`SigtermAsInterrupt`,
  added by :func:`with_signal_guard`): Lightning's own SIGTERM handler runs a collective inside the
  handler, and when the signal reaches every rank (``kill -TERM`` to the group, a scheduler) the
  ranks run unmatched collectives and hang; SIGTERM then stops the run like Ctrl-C. In a predict
  pass (calibration statistics, selection, evaluation) it is taken back in one process too: there
  Lightning only notes it;
* in a process launched as rank > 0: a parent watch. Lightning launches ranks 1..N-1 as children
  of rank 0; when rank 0 dies (SIGKILL, the OOM killer) they exit within seconds instead of
  waiting in the rendezvous or a collective. Rank 0 records its pid for them
  (``SHIFT_LIGHTNING_RANK0_PID``, inherited at launch), so a child that starts after rank 0 died
  notices too. (Rank 0 watches its children already: Lightning's process observer ends the group
  when one of them dies.)
* in rank 0, once a stop signal is seen: Lightning's process observer no longer SIGKILLs the group
  when a rank ends non-zero. Every rank is stopping then: one that stopped first (130 / 143), or
  that Lightning's own interrupt handling killed (-9), would otherwise get rank 0 killed in the
  middle of its orderly stop (exit -9, its last lines lost). The grace timer still bounds rank 0.
* on a stop, the loggers' writers closed with a bounded wait before Lightning's own finalize
  (:class:`LoggersCloseOnStop`), so that a writer that does not close cannot hold the process.

Forced exits write one line to stderr saying why; when the grace runs out, every thread's stack
follows it (where the run was stuck, for a bug report).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
from typing import Iterator

GRACE_ENV = "SHIFT_LIGHTNING_STOP_GRACE"
RANK0_ENV = "SHIFT_LIGHTNING_RANK0_PID"
DEFAULT_GRACE = 60.0


class _State:
    def __init__(self):
        self.active = False
        self.signals: list[int] = []  # SIGINT / SIGTERM seen by the watcher, in order
        self.critical = 0
        self.pending = False
        self.handled: int | None = None  # the signal the main thread took first
        self.timer: threading.Timer | None = None
        self.sigint_ignored = False  # the caller ignores SIGINT: leave it so
        self.launcher = None  # the DDP launcher of a running Trainer (rank 0: its children are the other ranks)


_state = _State()


def interrupted() -> bool:
    """Whether this process got SIGINT or SIGTERM while guarded."""
    return bool(_state.signals) or _state.pending or _state.handled is not None


def stop_signal() -> int | None:
    """The signal that stopped this process (SIGINT or SIGTERM), or None."""
    if _state.signals:
        return _state.signals[0]
    return _state.handled if _state.handled is not None else (signal.SIGINT if _state.pending else None)


#: How gloo and NCCL say that a peer process is gone (a collective or a rendezvous with a dead rank).
_PEER_GONE = re.compile(r"Connection (reset|closed) by peer|Broken pipe|NCCL communicator was aborted|"
                        r"ProcessGroupNCCL.*(watchdog|abort)|Socket Timeout|connectFullMesh failed")


def lost_peer(e: BaseException) -> str | None:
    """When ``e`` is a collective failing because another process of the run is gone: one line saying which rank
    ended and how (rank 0 knows its children, the other ranks: the launcher's); None for any other error."""
    if not isinstance(e, RuntimeError) or not _PEER_GONE.search(str(e)):
        return None
    dead = []
    for i, proc in enumerate(getattr(_state.launcher, "procs", None) or []):
        rc = proc.poll()
        if rc is not None and rc != 0:
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
            dead.append(f"rank {i + 1} ({how})")
    if not dead and _child_rank() > 0 and os.environ.get(RANK0_ENV, "").isdigit():
        try:
            os.kill(int(os.environ[RANK0_ENV]), 0)
        except ProcessLookupError:
            dead.append("rank 0")
    who = " and ".join(dead) if dead else "another process of the run"
    return (f"{who} ended while rank {_child_rank()} waited for it in a collective: the run stopped "
            "(resume a training run with --ckpt_path last)")


def _child_rank() -> int:
    for key in ("LOCAL_RANK", "RANK"):
        v = os.environ.get(key, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    return 0


def _say(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _force_exit(code: int, why: str, where: bool = False) -> None:
    _say(f"error: {why}")
    if where:  # where the run was stuck: every thread's stack, for a bug report
        try:
            import faulthandler

            _say("  the threads' stacks when the grace ran out (most recent call first):")
            faulthandler.dump_traceback(file=2, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            pass
    os._exit(code)


def _grace() -> float:
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, DEFAULT_GRACE)))
    except ValueError:
        return DEFAULT_GRACE


# --------------------------------------------------------------------------------------------
# Ctrl-C in the main thread
# --------------------------------------------------------------------------------------------
def _on_sigint(signum, frame):
    if _state.handled is None:
        _state.handled = signum
    if _state.critical > 0:
        _state.pending = True
        return
    raise KeyboardInterrupt


def enter_critical() -> None:
    """From here until :func:`leave_critical`, Ctrl-C is held back (see the module docstring)."""
    _state.critical += 1


def leave_critical() -> None:
    """End a critical section; a Ctrl-C that came during it is raised now."""
    _state.critical = max(0, _state.critical - 1)
    if _state.critical == 0 and _state.pending:
        _state.pending = False
        raise KeyboardInterrupt


def reset_critical() -> None:
    _state.critical, _state.pending = 0, False


def disarm() -> None:
    """Cancel a pending forced exit (a process that goes on after a guarded run, e.g. a test)."""
    if _state.timer is not None:
        _state.timer.cancel()


def armed() -> bool:
    """Whether a forced exit is pending (a signal was seen)."""
    return _state.timer is not None and _state.timer.is_alive()


def rearm() -> None:
    """Take Ctrl-C again (Lightning ignores it during its shutdown): a second one then exits at once."""
    if _state.active and not _state.sigint_ignored and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)


# --------------------------------------------------------------------------------------------
# Watchers
# --------------------------------------------------------------------------------------------
_OBSERVER = "child-process-observer"  # lightning.fabric.strategies.launchers.subprocess_script


def spare_stopping_group(observer) -> None:
    """Make Lightning's child-process ``observer`` leave a stopping group alone (see the module docstring)."""
    if hasattr(observer, "_terminate_all"):
        observer._terminate_all = lambda: None


def _spare_on_stop() -> None:
    for t in threading.enumerate():
        if t.name == _OBSERVER:
            spare_stopping_group(t)


def spare_rank0_on_lost_peer(e: BaseException) -> None:
    """Rank 0, a collective failed because another rank is gone (:func:`lost_peer`): Lightning's process observer
    SIGKILLs rank 0 within its 5 s poll of the dead child, which on a busy machine lands in the middle of the stop
    checkpoint and before the one line naming the rank. Leave rank 0 to end itself, bounded by the grace timer."""
    why = lost_peer(e) if _child_rank() == 0 else None
    if why is not None:
        _spare_on_stop()
        _arm_grace(1, f"{why}; the stop did not finish within {{grace}}")


def _arm_grace(code: int, why: str) -> None:
    """Once per process: exit with ``code`` and ``why`` (``{grace}`` filled in, the knob named) if the stop outlasts
    the grace."""
    if _state.timer is None:
        grace = _grace()
        why = f"{why.format(grace=f'{grace:g} s')} ({GRACE_ENV})"
        _state.timer = threading.Timer(grace, _force_exit, (code, why, True))
        _state.timer.daemon = True
        _state.timer.start()


def _watch_signals(sock: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum not in (signal.SIGINT, signal.SIGTERM):
                continue
            _state.signals.append(signum)
            if _child_rank() == 0:
                _spare_on_stop()
            name = signal.Signals(signum).name
            code = 128 + signum
            if signum == signal.SIGINT and _state.signals.count(signal.SIGINT) >= 2:
                _force_exit(code, "second Ctrl-C: stopping now")
            _arm_grace(code, f"the run did not stop within {{grace}} of {name}; exiting by force")


def _watch_parent(parent: int, rank: int, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        if os.getppid() != parent:
            if stop.wait(2.0):  # rank 0 finished just before this rank did: a normal end
                return
            _force_exit(1, f"rank {rank}: the process that launched it (rank 0, pid {parent}) is gone; exiting")


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Run the body with the guards of the module docstring (main thread only; else a no-op)."""
    if _state.active or threading.current_thread() is not threading.main_thread():
        yield
        return
    rank = _child_rank()
    old_handler = signal.getsignal(signal.SIGINT)
    r, w = socket.socketpair()
    w.setblocking(False)
    old_fd = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
    _state.__init__()
    _state.sigint_ignored = old_handler is signal.SIG_IGN
    if not _state.sigint_ignored:
        signal.signal(signal.SIGINT, _on_sigint)
    old_term = signal.getsignal(signal.SIGTERM)
    if old_term is signal.SIG_DFL:  # SIGTERM outside a Trainer (loading, a plain evaluation loop) stops like Ctrl-C
        signal.signal(signal.SIGTERM, _on_sigint)
    _state.active = True
    stop = threading.Event()
    threading.Thread(target=_watch_signals, args=(r, stop), name="shift-signal-watch", daemon=True).start()
    old_env = os.environ.get(RANK0_ENV)
    if rank > 0:
        parent = int(old_env) if (old_env or "").isdigit() else os.getppid()
        if os.getppid() != parent:
            _force_exit(1, f"rank {rank}: the process that launched it (rank 0, pid {parent}) is gone; exiting")
        threading.Thread(target=_watch_parent, args=(parent, rank, stop), name="shift-parent-watch", daemon=True).start()
    else:
        os.environ[RANK0_ENV] = str(os.getpid())  # inherited by the ranks Lightning launches
    try:
        yield
    finally:
        stop.set()
        if _state.timer is not None and not _state.signals:
            _state.timer.cancel()
        _state.active = False
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGINT, old_handler if old_handler is not None else signal.SIG_DFL)
        signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)
        if rank == 0:
            if old_env is None:
                os.environ.pop(RANK0_ENV, None)
            else:
                os.environ[RANK0_ENV] = old_env
        w.close()
        r.close()
        sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# SIGTERM under DDP
# --------------------------------------------------------------------------------------------
import lightning as L  # noqa: E402  (the rest of the module is framework-free)


class SigtermAsInterrupt(L.Callback):
    """Once the Trainer has installed its signal handlers, SIGTERM raises ``KeyboardInterrupt`` (held
    back during the update, like Ctrl-C) instead of running Lightning's handler: under DDP (see the
    module docstring), and in every predict pass, where Lightning only notes the signal (its prediction
    loop never looks at it), so a one-process calibration, selection or evaluation ran on to the end of
    its pass and the work after it, until the grace timer ended it by force. Lightning restores the
    handler it replaced when the Trainer call ends."""

    def setup(self, trainer, pl_module, stage) -> None:
        _state.launcher = getattr(trainer.strategy, "launcher", None)  # which ranks it started (lost_peer)

    def _take(self, trainer, always: bool = False) -> None:
        if _state.active and (always or trainer.world_size > 1) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_sigint)

    def on_train_start(self, trainer, pl_module) -> None:
        self._take(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._take(trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._take(trainer, always=True)


class LoggersCloseOnStop(L.Callback):
    """When a Trainer call ends on an exception (Ctrl-C, SIGTERM, a crash), close the loggers' writers
    here, waiting at most ``timeout`` seconds, before Lightning's own ``finalize``: rank 0 was seen (under
    DDP, about one stop in five on a loaded 2-core machine) waiting for good in the TensorBoard writer's
    close (joining its worker thread, which did not take the shutdown item), after its stop checkpoint
    was written, until the grace timer ended it by force. The writer is closed in a helper thread; one
    that has not closed in time is left to the process exit (its last events may be missing, said in
    one line), and Lightning's ``finalize`` then finds no writer to close."""

    def __init__(self, timeout: float = 5.0):
        self.timeout = timeout

    def on_exception(self, trainer, pl_module, exception) -> None:
        for logger in trainer.loggers:
            writer = getattr(logger, "_experiment", None)
            if writer is None or not callable(getattr(writer, "close", None)):
                continue
            done = threading.Event()

            def close(w=writer, done=done):
                with contextlib.suppress(Exception):
                    w.flush()
                    w.close()
                done.set()

            threading.Thread(target=close, name="shift-logger-close", daemon=True).start()
            if not done.wait(self.timeout):
                _say(f"warning: the {type(logger).__name__}'s writer did not close within {self.timeout:g} s of "
                     "the stop; left to the process exit (its last events may be missing)")
            logger._experiment = None


def with_signal_guard(trainer_kwargs: dict) -> dict:
    """``Trainer`` keyword arguments with a :class:`SigtermAsInterrupt` and a :class:`LoggersCloseOnStop`
    in the callbacks."""
    callbacks = list(trainer_kwargs.get("callbacks") or [])
    for cls in (SigtermAsInterrupt, LoggersCloseOnStop):
        if not any(isinstance(c, cls) for c in callbacks):
            callbacks.append(cls())
    return {**trainer_kwargs, "callbacks": callbacks}
