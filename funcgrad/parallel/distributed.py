"""Starting ``jax.distributed`` in each process of a run, with errors before anything hangs.

``funcgrad launch -n N -- cmd`` starts N processes with the environment variables below;
`distributed_init` reads them and calls ``jax.distributed.initialize``. Without them (a SLURM
job, a Cloud TPU VM, Open MPI, Kubernetes) it calls ``jax.distributed.initialize()`` with no
address, and JAX detects the cluster itself.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from typing import Any, NamedTuple

#: The coordinator's ``host:port`` (process 0 serves it), set by ``funcgrad launch``.
ENV_COORDINATOR = "FUNCGRAD_COORDINATOR"
#: How many processes the run has.
ENV_NUM_PROCESSES = "FUNCGRAD_NUM_PROCESSES"
#: This process's index, 0 to N-1.
ENV_PROCESS_ID = "FUNCGRAD_PROCESS_ID"
#: Seconds to wait for all processes to join (`distributed_init`'s `timeout`), optional.
ENV_TIMEOUT = "FUNCGRAD_INIT_TIMEOUT"


class DistributedInfo(NamedTuple):
    """What `distributed_init` set up.

    Attributes:
      process_id: this process's index (``jax.process_index()``).
      num_processes: the processes in the run (``jax.process_count()``).
      local_devices: this process's devices; `devices`: every process's, in JAX's order.
      coordinator: the coordinator's ``host:port``, or None when JAX found it (a cluster) or
        there is one process.
    """
    process_id: int
    num_processes: int
    local_devices: tuple
    devices: tuple
    coordinator: str | None


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"distributed_init: the environment variable {name}={text!r} is not "
                         "an integer.") from None


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"distributed_init: coordinator {address!r} is not host:port "
                         "(e.g. localhost:12355).")
    return host, int(port)


def _wait_reachable(address: str, timeout: float) -> None:
    """Connect to the coordinator until it answers or `timeout` seconds pass."""
    host, port = _split(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"distributed_init: no coordinator answered at {address} within "
                    f"{timeout:g} s ({error.strerror or error}). Process 0 serves it: is it "
                    "running, with the same address? Check the host and port (a firewall, a "
                    "wrong host name), start every process with funcgrad launch, or give a "
                    "longer timeout=.") from None
            time.sleep(0.2)


def port_in_use(host: str, port: int) -> bool:
    """Whether `port` on `host` cannot be bound (another program holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host if host not in ("localhost",) else "127.0.0.1", port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A TCP port on localhost that nothing holds now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distributed_init(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, timeout: float | None = None,
                     heartbeat_timeout: int = 100, shutdown_timeout: int = 300,
                     cpu_collectives: str = "gloo",
                     exit_on_error: bool = True) -> DistributedInfo:
    """Initializes ``jax.distributed`` for this process; call it first, before any JAX
    computation.

    The address, count and index come from the arguments, else from the environment that
    ``funcgrad launch`` sets (``FUNCGRAD_COORDINATOR``, ``FUNCGRAD_NUM_PROCESSES``,
    ``FUNCGRAD_PROCESS_ID``, and ``FUNCGRAD_INIT_TIMEOUT``), else JAX detects them
    (``jax.distributed.initialize()`` with no address: SLURM, Open MPI, Kubernetes, Cloud
    TPU). With one process (``FUNCGRAD_NUM_PROCESSES=1``) nothing is initialized. On CPU the
    processes' collectives run over gloo (``jax_cpu_collectives_implementation``); GPUs use
    NCCL and TPUs their interconnect whatever `cpu_collectives` says.

    Before JAX's own start-up, which waits up to `timeout` for every process and can be hard
    to read when it fails, the coordinator is checked: process 0 fails at once if its port is
    taken, the others if the coordinator does not answer within `timeout` seconds.

    Args:
      coordinator: ``host:port`` of the coordinator (process 0 serves it).
      num_processes: the number of processes; `process_id`: this one's index.
      timeout: seconds to wait for the coordinator and for every process to join (JAX's
        ``initialization_timeout``); default ``FUNCGRAD_INIT_TIMEOUT`` or 300.
      heartbeat_timeout: seconds without a heartbeat after which a process is declared dead
        and the others stop with an error (JAX's ``heartbeat_timeout_seconds``).
      shutdown_timeout: seconds the processes wait for each other at exit (JAX's
        ``shutdown_timeout_seconds``): a process that ran fewer steps reaches it first, and
        the run then ends with an error after this long instead of hanging.
      cpu_collectives: "gloo" (or "mpi") for CPU devices.
      exit_on_error: in a run of several processes, a process whose program ends with an
        uncaught exception prints its traceback and exits at once (status 1; 130 for Ctrl-C),
        without JAX's shutdown barrier: there it would wait for processes that wait for it in
        a collective, and the run would hang for `shutdown_timeout` seconds before anyone saw
        the error. ``funcgrad launch`` (or the cluster's launcher) then stops the others, as
        ``torchrun`` does. False keeps Python's usual exit (and JAX's barrier).
    Returns:
      a `DistributedInfo`.
    Raises:
      ValueError: an environment variable that is not an integer, a coordinator that is not
        host:port, a process id outside ``[0, num_processes)``, only some of the three given;
        none given and no cluster JAX detects (the message says to use ``funcgrad launch``).
      OSError: process 0's coordinator port is already in use (the message names the fix).
      TimeoutError: the coordinator does not answer within `timeout`.
      RuntimeError: (from JAX) JAX already ran a computation, or ``initialize`` was called
        twice; JAX's own errors when the processes do not all join in time.
    """
    import jax

    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if timeout is None:
        found = os.environ.get(ENV_TIMEOUT)
        timeout = float(found) if found else 300.0
    if num_processes == 1:
        return DistributedInfo(0, 1, tuple(jax.local_devices()), tuple(jax.devices()), None)
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError(
            "distributed_init: give the coordinator, num_processes and process_id together "
            f"(got coordinator={coordinator!r}, num_processes={num_processes!r}, "
            f"process_id={process_id!r}), or none of them on a cluster JAX detects (SLURM, "
            "Open MPI, Kubernetes, Cloud TPU). funcgrad launch -n N -- cmd sets all three.")
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    if coordinator is None:  # a cluster: JAX reads its environment
        try:
            jax.distributed.initialize(initialization_timeout=int(timeout),
                                       heartbeat_timeout_seconds=heartbeat_timeout,
                                       shutdown_timeout_seconds=shutdown_timeout)
        except ValueError as error:
            if "coordinator_address" not in str(error):
                raise
            raise ValueError(
                "distributed_init: there is no run to join: funcgrad launch's variables "
                f"({ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}) are not set, and "
                "JAX found no cluster it knows (SLURM, Open MPI, Kubernetes, Cloud TPU) "
                f"({error}). Start the script with funcgrad launch -n N -- python "
                "script.py (N=1 for one process), or pass num_processes=1 (or set "
                f"{ENV_NUM_PROCESSES}=1) to run it alone.") from None
    else:
        assert num_processes is not None and process_id is not None
        if not 0 <= process_id < num_processes:
            raise ValueError(f"distributed_init: process_id {process_id} is outside "
                             f"[0, {num_processes}).")
        host, port = _split(coordinator)
        if process_id == 0 and port_in_use(host, port):
            raise OSError(f"distributed_init: the coordinator's port {port} is in use on "
                          f"{host}, by another program or an earlier run that is still "
                          "alive. Pick another (funcgrad launch --port P), or leave --port "
                          "out and funcgrad launch picks a free one.")
        if process_id != 0:
            _wait_reachable(coordinator, timeout)
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id,
                                   initialization_timeout=int(max(1, timeout)),
                                   heartbeat_timeout_seconds=heartbeat_timeout,
                                   shutdown_timeout_seconds=shutdown_timeout)
    if jax.process_count() > 1:
        _no_shared_compilation_cache_on_cpu()
    if exit_on_error and jax.process_count() > 1:
        _exit_on_uncaught_exception()
    return DistributedInfo(jax.process_index(), jax.process_count(),
                           tuple(jax.local_devices()), tuple(jax.devices()), coordinator)


def _no_shared_compilation_cache_on_cpu() -> None:
    """Turns JAX's persistent compilation cache off in a CPU run of several processes on
    jax >= 0.12.1, with a warning: there, processes that compile their step through the cache
    (JAX_COMPILATION_CACHE_DIR, or jax_compilation_cache_dir) deadlock in their first gloo
    all-reduce. Seen here on 2 processes of a fit with the cache in a fresh folder: every run
    hung, and every run without it finished (jax 0.12.0.1 and 0.10.2 did not hang)."""
    import jax

    from funcgrad._jax_version import _parse, jax_version

    if _parse(jax_version()) < (0, 12, 1) or jax.default_backend() != "cpu":
        return
    config: Any = jax.config  # its options are attributes mypy does not see
    cache = config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not cache or not config.jax_enable_compilation_cache:
        return
    jax.config.update("jax_enable_compilation_cache", False)
    warnings.warn(
        f"distributed_init: JAX's persistent compilation cache ({cache}) is turned off in "
        f"this run: on the CPU with jax {jax.__version__}, processes that compile through it "
        "deadlock in their first collective. The run compiles its programs itself instead "
        "(slower to start, same numbers).", UserWarning, stacklevel=3)


def _exit_on_uncaught_exception() -> None:
    """Makes an uncaught exception end this process at once, after its traceback (see
    `distributed_init`'s `exit_on_error`): ``os._exit`` skips the atexit handlers, among them
    ``jax.distributed.shutdown``'s barrier."""
    previous = sys.excepthook
    if getattr(previous, "_funcgrad_exits", False):
        return

    def hook(kind, value, traceback) -> None:
        try:
            previous(kind, value, traceback)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # a closed stream: nothing left to flush
                    pass
            os._exit(130 if issubclass(kind, KeyboardInterrupt) else 1)
    hook._funcgrad_exits = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def run_environment(process_id: int, num_processes: int, coordinator: str,
                    timeout: float | None = None) -> dict[str, str]:
    """The environment variables ``funcgrad launch`` gives process `process_id` (also
    ``JAX_COORDINATOR_ADDRESS``, which JAX itself reads)."""
    env = {ENV_COORDINATOR: coordinator, ENV_NUM_PROCESSES: str(num_processes),
           ENV_PROCESS_ID: str(process_id), "JAX_COORDINATOR_ADDRESS": coordinator}
    if timeout is not None:
        env[ENV_TIMEOUT] = f"{timeout:g}"
    return env

