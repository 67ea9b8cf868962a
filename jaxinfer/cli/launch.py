"""Start N local processes of one jaxinfer command as one job (testing a
model across processes on one machine):

    python -m jaxinfer.cli.launch -n 2 -- jaxinfer serve --config C tp=2 [key=value ...]

Each process runs the command with `coordinator=127.0.0.1:<free port>
num_processes=N process_id=i` appended, its output going to this
terminal. SIGINT or SIGTERM is passed to process 0 (which stops the job).
When a process fails, the others are terminated; the launcher exits with
the first failure's status, or 0 once all exited cleanly.
"""

from __future__ import annotations

import argparse
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


def run(command: Sequence[str], num_processes: int, coordinator: Optional[str] = None,
        grace_s: float = 30.0) -> int:
    """Run the job; returns the exit status (first failure's, else 0).

    Raises:
      ValueError: num_processes < 1 or an empty command.
    """
    if num_processes < 1 or not command:
        raise ValueError(f"need num_processes >= 1 and a command, got {num_processes} and "
                         f"{list(command)}")
    coordinator = coordinator or f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(c) for c in commands(command, num_processes, coordinator)]
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
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then the command, e.g. jaxinfer serve ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        return run(command, args.num_processes, args.coordinator)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
