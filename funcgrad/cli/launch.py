"""``funcgrad launch -n N [--port P] -- COMMAND ...``: run COMMAND as N processes of one
``jax.distributed`` run on this machine, in the spirit of ``torchrun``.

Each process gets ``FUNCGRAD_PROCESS_ID`` (0 to N-1), ``FUNCGRAD_NUM_PROCESSES`` and
``FUNCGRAD_COORDINATOR`` (``127.0.0.1:P``, process 0 serves it; also
``JAX_COORDINATOR_ADDRESS``), which ``funcgrad.distributed_init()`` reads. Every line a
process prints comes out prefixed with its index (``[1] ...``), on the launcher's stdout or
stderr as the process wrote it. When a process fails (a non-zero status or a signal) the
launcher stops the others (SIGTERM, then SIGKILL after ``--grace`` seconds) and exits with
the failing status; SIGINT and SIGTERM sent to the launcher are passed on to every process,
and a process still running ``--signal-grace`` seconds later (default 30: time to save its
work) is killed (JAX's preemption notifier catches SIGTERM, and a process blocked in a
collective or at JAX's shutdown barrier does not see SIGINT; a second signal to the launcher
kills at once).
With ``--timeout S`` the whole run is stopped after S seconds (status 124), so a deadlock ends.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from funcgrad.cli._flags import _Parser, _positive

#: Exit status of a run stopped by --timeout (as coreutils' timeout).
TIMEOUT_STATUS = 124


def add_parser(sub: Any) -> _Parser:
    """Adds the ``launch`` command and its flags to `sub` (the top-level subparsers)."""
    lp = sub.add_parser(
        "launch", help="run a command as N processes of one jax.distributed run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run COMMAND as N local processes of one jax.distributed run (a coordinator on\n"
            "localhost). Each process finds its index, the count and the coordinator in the\n"
            "environment (FUNCGRAD_PROCESS_ID, FUNCGRAD_NUM_PROCESSES, FUNCGRAD_COORDINATOR)\n"
            "and calls funcgrad.distributed_init(). Output lines are prefixed with the\n"
            "process index; when one process fails the others are stopped and the launcher\n"
            "exits with its status."),
        epilog="example: funcgrad launch -n 2 -- python train.py --epochs 3")
    lp.add_argument("-n", "--nproc", type=_positive(int), required=True, metavar="N",
                    help="the number of processes")
    lp.add_argument("--port", type=_port, default=None, metavar="P",
                    help="the coordinator's port (default: a free one the OS picks)")
    lp.add_argument("--timeout", type=_positive(float), default=None, metavar="S",
                    help="stop every process after S seconds, exit status 124 (default: none)")
    lp.add_argument("--init-timeout", type=_positive(float), default=None, metavar="S",
                    help="seconds distributed_init waits for all processes to join "
                         "(FUNCGRAD_INIT_TIMEOUT; default: its own, 300)")
    lp.add_argument("--grace", type=_positive(float), default=5.0, metavar="S",
                    help="seconds between SIGTERM and SIGKILL when stopping processes after "
                         "one failed or the timeout (default: 5)")
    lp.add_argument("--signal-grace", type=_positive(float), default=30.0, metavar="S",
                    help="seconds a process has, after a SIGINT or SIGTERM the launcher passed "
                         "on, to save its work and exit before SIGKILL (default: 30)")
    lp.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                    help="the command each process runs")
    return lp


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in 1..65535, got {text!r}")
    return value


def run(parser: _Parser, args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``funcgrad launch`` with its parsed `args`; returns the exit status."""
    from funcgrad.parallel.distributed import free_port, port_in_use

    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("give the command to run after --, e.g. funcgrad launch -n 2 -- "
                     "python train.py")
    host = "127.0.0.1"
    if args.port is None:
        port = free_port()
    elif port_in_use(host, args.port):
        print(f"funcgrad launch: port {args.port} is in use on {host} (another program, or "
              "an earlier run still alive); pass another --port, or leave --port out to have "
              "a free one picked.", file=sys.stderr)
        return 2
    else:
        port = args.port
    return Launch(command, args.nproc, f"{host}:{port}", timeout=args.timeout,
                  init_timeout=args.init_timeout, grace=args.grace,
                  signal_grace=args.signal_grace).run()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGKILL when the launcher dies (even by SIGKILL), so no process
    of a run outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the launcher's own handling remains
        pass


class Launch:
    """One run of `command` as `n` processes (see the module's docstring)."""

    def __init__(self, command: list[str], n: int, coordinator: str, *,
                 timeout: float | None = None, init_timeout: float | None = None,
                 grace: float = 5.0, out: IO[str] | None = None, err: IO[str] | None = None,
                 signal_grace: float = 30.0):
        self.command, self.n, self.coordinator = command, n, coordinator
        self.timeout, self.init_timeout, self.grace = timeout, init_timeout, grace
        self.signal_grace = signal_grace
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.signalled: int | None = None
        self.signalled_at, self.killed = 0.0, False

    def _say(self, text: str) -> None:
        with self.lock:
            print(f"funcgrad launch: {text}", file=self.err, flush=True)

    def _pipe(self, index: int, stream: IO[bytes], sink: IO[str]) -> None:
        width = len(str(self.n - 1))
        prefix = f"[{index:>{width}}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self.lock:
                sink.write(prefix + line + "\n")
                sink.flush()
        stream.close()

    def _signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _stop_all(self) -> None:
        """SIGTERM to every live process, SIGKILL to those alive `grace` seconds later."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def _on_signal(self, sig: int, _frame: Any) -> None:
        if self.signalled is not None:  # a second Ctrl-C: no more patience
            self._signal_all(signal.SIGKILL)
            return
        self.signalled, self.signalled_at = sig, time.monotonic()
        self._signal_all(sig)

    def run(self) -> int:
        """Starts the processes, relays their output, and returns the run's exit status."""
        from funcgrad.parallel.distributed import run_environment

        threads = []
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        in_main = threading.current_thread() is threading.main_thread()
        try:
            if in_main:
                for s in old:
                    signal.signal(s, self._on_signal)
            for i in range(self.n):
                env = {**os.environ, **run_environment(i, self.n, self.coordinator,
                                                       self.init_timeout),
                       "PYTHONUNBUFFERED": "1"}
                try:
                    p = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform
                                         == "linux" else None)
                except OSError as error:
                    self._say(f"cannot start {self.command[0]!r}: {error.strerror or error}")
                    self._stop_all()
                    return 127
                self.procs.append(p)
                for stream, sink in ((p.stdout, self.out), (p.stderr, self.err)):
                    t = threading.Thread(target=self._pipe, args=(i, stream, sink), daemon=True)
                    t.start()
                    threads.append(t)
            status = self._watch()
        finally:
            if in_main:
                for s, handler in old.items():
                    signal.signal(s, handler)
        for t in threads:
            t.join(timeout=5)
        return status

    def _watch(self) -> int:
        start = time.monotonic()
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if self.signalled is not None and all(c is not None for c in codes):
                return 128 + self.signalled
            if (self.signalled is not None and not self.killed
                    and time.monotonic() - self.signalled_at > self.signal_grace):
                running = [i for i, c in enumerate(codes) if c is None]
                self._say(f"processes {running} still running {self.signal_grace:g} s after "
                          f"{signal.Signals(self.signalled).name} (ignored, or blocked in a "
                          "collective); killing them")
                self.killed = True
                self._signal_all(signal.SIGKILL)
            if failed and self.signalled is None:
                i, code = failed[0]
                alive = sum(c is None for c in codes)
                how = (f"was killed by signal {-code} ({signal.Signals(-code).name})"
                       if code < 0 else f"exited with status {code}")
                self._say(f"process {i} {how}" + (f"; stopping the other {alive}" if alive
                                                  else ""))
                self._stop_all()
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            if self.timeout is not None and time.monotonic() - start > self.timeout:
                running = [i for i, c in enumerate(codes) if c is None]
                self._say(f"timed out after {self.timeout:g} s with processes {running} still "
                          "running (a deadlock? processes that disagree on the number of "
                          "steps?); stopping them")
                self._stop_all()
                return TIMEOUT_STATUS
            time.sleep(0.05)
