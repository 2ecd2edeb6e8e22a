"""``funcgrad launch``: environment, prefixed output, failure of one process stopping the
others, signals passed on, --timeout, a port in use; and distributed_init's own errors
(a coordinator nobody serves, a port in use) before JAX's start-up. The commands are small
Python programs (no JAX) except the two distributed_init cases; every run has a hard limit."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

LIMIT = 60


def _launch(*flags: str, code: str, limit: float = LIMIT, **kwargs) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "funcgrad", "launch", *flags, "--", sys.executable, "-c",
               textwrap.dedent(code)]
    return subprocess.run(command, capture_output=True, text=True, timeout=limit, **kwargs)


def test_environment_and_prefixed_output():
    done = _launch("-n", "3", code="""
        import os, sys
        env = {k: os.environ[k] for k in ("FUNCGRAD_PROCESS_ID", "FUNCGRAD_NUM_PROCESSES",
                                          "FUNCGRAD_COORDINATOR", "JAX_COORDINATOR_ADDRESS")}
        print("env", env["FUNCGRAD_PROCESS_ID"], env["FUNCGRAD_NUM_PROCESSES"],
              env["FUNCGRAD_COORDINATOR"] == env["JAX_COORDINATOR_ADDRESS"],
              env["FUNCGRAD_COORDINATOR"].startswith("127.0.0.1:"))
        print("second line")
        print("to stderr", file=sys.stderr)
    """)
    assert done.returncode == 0, done.stderr
    out = sorted(done.stdout.splitlines())
    assert out == ["[0] env 0 3 True True", "[0] second line", "[1] env 1 3 True True",
                   "[1] second line", "[2] env 2 3 True True", "[2] second line"]
    assert sorted(done.stderr.splitlines()) == [f"[{i}] to stderr" for i in range(3)]


def test_a_failing_process_stops_the_others():
    start = time.perf_counter()
    done = _launch("-n", "3", "--grace", "1", code="""
        import os, sys, time
        i = int(os.environ["FUNCGRAD_PROCESS_ID"])
        if i == 1:
            time.sleep(0.3)
            print("failing", flush=True)
            sys.exit(3)
        time.sleep(50)
        print("never")
    """)
    assert time.perf_counter() - start < 20  # not the 50 s of the others
    assert done.returncode == 3, done.stderr
    assert "[1] failing" in done.stdout and "never" not in done.stdout
    assert "funcgrad launch: process 1 exited with status 3; stopping the other 2" in done.stderr


def test_a_process_killed_by_a_signal_fails_the_run():
    done = _launch("-n", "2", "--grace", "1", code="""
        import os, signal, time
        if os.environ["FUNCGRAD_PROCESS_ID"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(50)
    """)
    assert done.returncode == 128 + signal.SIGKILL
    assert "process 0 was killed by signal 9 (SIGKILL)" in done.stderr


def test_timeout_stops_a_hung_run():
    start = time.perf_counter()
    done = _launch("-n", "2", "--timeout", "2", "--grace", "1", code="import time; time.sleep(50)")
    assert done.returncode == 124
    assert time.perf_counter() - start < 20
    assert "timed out after 2 s with processes [0, 1] still running" in done.stderr


def _signalled_when_ready(code: str, *flags: str) -> tuple[subprocess.Popen, str, str, float]:
    """Launches 2 processes running `code` (each prints "ready" when its handlers are set),
    sends the launcher SIGTERM once both are ready; the launcher, its stdout and stderr, and
    the seconds from the signal to its end."""
    p = subprocess.Popen([sys.executable, "-m", "funcgrad", "launch", "-n", "2", *flags, "--",
                          sys.executable, "-c", textwrap.dedent(code)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = 0
        assert p.stdout is not None
        while ready < 2:
            line = p.stdout.readline()
            assert line, "a process ended before it was ready"
            ready += "ready" in line
        start = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=LIMIT)
        return p, out, err, time.perf_counter() - start
    finally:
        if p.poll() is None:
            p.kill()


def test_sigterm_is_passed_on():
    p, out, _, _ = _signalled_when_ready("""
        import signal, sys, time
        def bye(sig, frame):
            print("got", signal.Signals(sig).name, flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("ready", flush=True)
        time.sleep(50)
    """)
    assert p.returncode == 128 + signal.SIGTERM
    assert sorted(out.splitlines()) == ["[0] got SIGTERM", "[1] got SIGTERM"]


def test_usage_errors():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = _launch("-n", "2", "--port", str(port), code="print('never')")
    assert done.returncode == 2 and done.stdout == ""
    assert f"port {port} is in use" in done.stderr and "leave --port out" in done.stderr
    done = subprocess.run([sys.executable, "-m", "funcgrad", "launch", "-n", "2"],
                          capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 2 and "give the command to run after --" in done.stderr
    done = subprocess.run([sys.executable, "-m", "funcgrad", "launch", "-n", "0", "--", "true"],
                          capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 2 and "expected a positive int" in done.stderr
    done = _launch("-n", "1", code="pass")
    assert done.returncode == 0
    done = subprocess.run([sys.executable, "-m", "funcgrad", "launch", "-n", "1", "--",
                           "no-such-program-here"], capture_output=True, text=True,
                          timeout=LIMIT)
    assert done.returncode == 127 and "cannot start 'no-such-program-here'" in done.stderr


INIT = """
    import sys, time, funcgrad as fg
    start = time.perf_counter()
    try:
        fg.distributed_init({args})
    except (OSError, TimeoutError) as e:
        print(type(e).__name__, round(time.perf_counter() - start), e)
        sys.exit(0)
    print("initialized")
"""


def test_distributed_init_unreachable_coordinator_fails_in_seconds():
    from funcgrad.parallel.distributed import free_port

    port = free_port()  # nobody serves it
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(INIT.format(
        args=f"'127.0.0.1:{port}', 2, 1, timeout=2"))], capture_output=True, text=True,
        timeout=LIMIT)
    assert done.returncode == 0, done.stderr[-2000:]
    kind, seconds, message = done.stdout.split(" ", 2)
    # The 2 s asked for, plus start-up on a loaded machine: not JAX's own 300 s.
    assert kind == "TimeoutError" and int(seconds) < 60
    assert f"no coordinator answered at 127.0.0.1:{port} within 2 s" in message
    assert "Process 0 serves it" in message


def test_distributed_init_port_in_use():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(INIT.format(
            args=f"'127.0.0.1:{port}', 2, 0, timeout=120"))], capture_output=True,
            text=True, timeout=3 * LIMIT)
    assert done.returncode == 0, done.stderr[-2000:]
    kind, seconds, message = done.stdout.split(" ", 2)
    assert kind == "OSError" and int(seconds) < 60  # at once, not after the 120 s timeout
    assert f"port {port} is in use" in message and "funcgrad launch --port" in message


def test_distributed_init_arguments():
    from funcgrad.parallel import distributed

    env = {distributed.ENV_NUM_PROCESSES: "two"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        with pytest.raises(ValueError, match="FUNCGRAD_NUM_PROCESSES='two' is not an integer"):
            distributed.distributed_init()
    with pytest.raises(ValueError, match="together"):
        distributed.distributed_init("localhost:1234")
    with pytest.raises(ValueError, match="not host:port"):
        distributed.distributed_init("localhost", 2, 0)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        distributed.distributed_init("localhost:1234", 2, 2)
    info = distributed.distributed_init(num_processes=1)  # one process: nothing to start
    assert info.num_processes == 1 and info.coordinator is None
    assert os.environ.get(distributed.ENV_COORDINATOR) is None


def test_an_exception_in_one_process_ends_the_run_at_once():
    """Process 1 raises while process 0 waits for it in a collective. Without funcgrad's
    exit on an uncaught exception, process 1 would wait at JAX's shutdown barrier (for
    process 0, which waits for process 1) until that barrier's timeout, and the launcher
    would see no failure before its own --timeout."""
    start = time.perf_counter()
    done = _launch("-n", "2", "--timeout", "50", "--grace", "1", code="""
        import os
        import funcgrad as fg
        fg.distributed_init(timeout=20)
        import numpy as np
        from jax.experimental import multihost_utils
        multihost_utils.process_allgather(np.ones(1))   # both joined
        if os.environ["FUNCGRAD_PROCESS_ID"] == "1":
            raise RuntimeError("planted failure in process 1")
        multihost_utils.process_allgather(np.ones(1))   # waits for process 1: never comes
        print("never")
    """)
    seconds = time.perf_counter() - start
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert seconds < 30, seconds  # not the launcher's 50 s
    assert "[1] RuntimeError: planted failure in process 1" in done.stderr
    # The launcher names the first exit it sees: process 1's, or process 0's (its collective
    # fails when process 1's connection closes: gloo's "Connection reset/closed by peer").
    assert re.search(r"process [01] exited with status 1", done.stderr), done.stderr[-3000:]
    assert "never" not in done.stdout


def test_distributed_init_with_no_run_to_join_says_to_launch():
    # Plain `python script.py` (no funcgrad launch, no cluster): JAX's own error was
    # "coordinator_address should be defined."; funcgrad's names the launcher and N=1.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FUNCGRAD_COORDINATOR", "FUNCGRAD_NUM", "FUNCGRAD_PROCESS",
                                "JAX_COORDINATOR", "SLURM_", "OMPI_"))}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import funcgrad as fg
        try:
            fg.distributed_init()
        except ValueError as e:
            print(e)
    """)], capture_output=True, text=True, timeout=LIMIT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "there is no run to join" in done.stdout, done.stdout
    assert "funcgrad launch -n N -- python script.py" in done.stdout
    assert "num_processes=1" in done.stdout


def test_a_launched_process_that_never_joined_is_refused():
    # Under `funcgrad launch -n 2` each process is one of 2; without fg.distributed_init()
    # JAX runs each alone (1 process, 1 device), and each would train on its own, silently.
    done = _launch("-n", "2", code="""
        import funcgrad as fg
        try:
            fg.data_mesh()
        except ValueError as e:
            print("refused:", e)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = sorted(done.stdout.splitlines())
    assert len(lines) == 2 and all("refused: data_mesh: this process was started as one of 2"
                                   in line for line in lines), lines
    assert all("fg.distributed_init()" in line for line in lines)


def test_a_process_that_ignores_the_signal_is_killed_after_the_grace():
    # JAX's preemption notifier catches SIGTERM and a process blocked in a collective never
    # runs Python's SIGINT handler: the launcher kills what still runs --signal-grace s after
    # the signal it passed on (here 1 s) instead of waiting for it for minutes.
    p, _, err, seconds = _signalled_when_ready("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(50)
    """, "--signal-grace", "1")
    assert p.returncode == 128 + signal.SIGTERM
    assert seconds < 10, seconds  # 1 s of grace, not the 50 s the processes would sleep
    assert "processes [0, 1] still running 1 s after SIGTERM" in err, err
