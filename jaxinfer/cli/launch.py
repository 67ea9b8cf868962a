"""Start N local processes of one jaxinfer command as one job (testing a
model across processes on one machine):

    python -m jaxinfer.cli.launch -n 2 [--cpus-per-process C|auto] -- jaxinfer serve --config C tp=2 [key=value ...]

Each process runs the command with `coordinator=127.0.0.1:<free port>
num_processes=N process_id=i` appended, its output going to this
terminal. With `--cpus-per-process C`, process i runs on its own C of the
cores this launcher may use (the i-th C of them, in order; "auto": those
cores divided by N), so each process's XLA CPU thread pools, sized by the
cores the process may use, do not share cores with the others'; by
default the processes are not pinned (on a loaded machine a pinned
process cannot move off a busy core). SIGINT or SIGTERM is passed to
process 0 (which stops the job). When a process fails, the others are
terminated; the launcher exits with the first failure's status, or 0 once
all exited cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def commands(command: Sequence[str], num_processes: int, coordinator: str) -> list[list[str]]:
    """The command of each process: `command` plus the job's three keys."""
    return [list(command) + [f"coordinator={coordinator}", f"num_processes={num_processes}",
                             f"process_id={i}"] for i in range(num_processes)]


def core_sets(num_processes: int, cpus_per_process: Optional[int] = 0) -> list[Optional[set[int]]]:
    """The cores each process is pinned to: the i-th `cpus_per_process` of
    this process's allowed cores (None: their count // num_processes, or
    no pinning where they are fewer than the processes; 0: no pinning,
    [None] * num_processes).

    Raises:
      ValueError: cpus_per_process < 0, or more cores asked than allowed.
    """
    if cpus_per_process is not None and cpus_per_process < 0:
        raise ValueError(f"cpus_per_process must be >= 0, got {cpus_per_process}")
    allowed = sorted(os.sched_getaffinity(0))
    if cpus_per_process is None:
        if len(allowed) < num_processes:
            return [None] * num_processes        # fewer cores than processes: let them share
        cpus_per_process = len(allowed) // num_processes
    if cpus_per_process == 0:
        return [None] * num_processes
    if cpus_per_process * num_processes > len(allowed):
        raise ValueError(f"{num_processes} processes x {cpus_per_process} cores need "
                         f"{cpus_per_process * num_processes}, only {len(allowed)} allowed")
    return [set(allowed[i * cpus_per_process:(i + 1) * cpus_per_process])
            for i in range(num_processes)]


def run(command: Sequence[str], num_processes: int, coordinator: Optional[str] = None,
        grace_s: float = 30.0, cpus_per_process: Optional[int] = 0) -> int:
    """Run the job; returns the exit status (first failure's, else 0).
    `cpus_per_process`: as `core_sets`.

    Raises:
      ValueError: num_processes < 1, an empty command, or what `core_sets` raises.
    """
    if num_processes < 1 or not command:
        raise ValueError(f"need num_processes >= 1 and a command, got {num_processes} and "
                         f"{list(command)}")
    cores = core_sets(num_processes, cpus_per_process)
    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(argv, preexec_fn=(lambda c=c: os.sched_setaffinity(0, c)) if c else None)
             for argv, c in zip(commands(command, num_processes, coordinator), cores)]
    forward = lambda signum, frame: procs[0].send_signal(signum)     # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = _wait(procs, grace_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(procs)
    return status


def _wait(procs, grace_s: float) -> int:
    """Wait until every process exits or one fails; the status to report."""
    done_at = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0] if failed[0] > 0 else 128 - failed[0]
        if all(c == 0 for c in codes):
            return 0
        if codes[0] == 0:              # process 0 finished: the others follow within grace_s
            done_at = done_at or time.monotonic()
            if time.monotonic() - done_at > grace_s:
                return 1
        time.sleep(0.1)


def _stop(procs, timeout_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.cli.launch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--num-processes", type=int, required=True, help="processes in the job")
    p.add_argument("--coordinator", help="host:port (default 127.0.0.1 and a free port)")
    p.add_argument("--cpus-per-process", default="0",
                   help="pin process i to the i-th C allowed cores (auto: the allowed cores "
                        "divided by N; default 0: no pinning)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then the command, e.g. jaxinfer serve ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.cpus_per_process != "auto" and not args.cpus_per_process.isdigit():
        p.error(f"--cpus-per-process must be a count or auto, got {args.cpus_per_process!r}")
    try:
        return run(command, args.num_processes, args.coordinator,
                   cpus_per_process=(None if args.cpus_per_process == "auto"
                                     else int(args.cpus_per_process)))
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
