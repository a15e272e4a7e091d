"""Start N processes of one command on this machine, as a multi-host run on 127.0.0.1.

    python launch/local.py --num_processes 2 --devices_per_process 4 -- \\
        python -m llm_jax.train --config configs/tiny.py --config.mesh.dcn_data=2 ...

Each process gets JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT (a free port), JAX_NUM_PROCESSES,
JAX_PROCESS_ID (read by llm_jax.parallel.distributed.initialize) and JAX_NUM_CPU_DEVICES (JAX's own
setting: that many CPU devices per process; collectives between processes go through gloo).
Output lines are prefixed with the process id. If one process fails, the others are stopped;
the exit status is the first non-zero one. Nothing listens or connects beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def launch(command: list[str], *, num_processes: int, devices_per_process: int,
           port: int | None = None, platform: str = "cpu", timeout: float | None = None,
           env: dict[str, str] | None = None) -> int:
    """Runs `command` as processes 0..N-1; returns the first non-zero exit status, else 0."""
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(f"num_processes={num_processes} and devices_per_process="
                         f"{devices_per_process} must be positive")
    address = f"127.0.0.1:{port or free_port()}"
    procs, pumps = [], []
    for i in range(num_processes):
        child_env = {**os.environ, **(env or {}), "JAX_COORDINATOR_ADDRESS": address,
                     "JAX_NUM_PROCESSES": str(num_processes), "JAX_PROCESS_ID": str(i),
                     "JAX_NUM_CPU_DEVICES": str(devices_per_process)}
        if platform:
            child_env["JAX_PLATFORMS"] = platform
        p = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[{i}] ", sys.stdout), daemon=True)
        t.start()
        pumps.append(t)
    deadline = None if timeout is None else time.monotonic() + timeout
    status = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or (deadline is not None and time.monotonic() > deadline):
                status = failed[0] if failed else 124
                break
            time.sleep(0.1)
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for t in pumps:
            t.join(timeout=5)
    return status or next((p.returncode for p in procs if p.returncode), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=4,
                        help="CPU devices each process simulates (JAX_NUM_CPU_DEVICES)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument("--platform", default="cpu", help="JAX_PLATFORMS for the children "
                        "('' = leave as is, e.g. one GPU per process)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before stopping all")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    sys.exit(launch(command, num_processes=args.num_processes,
                    devices_per_process=args.devices_per_process, port=args.port,
                    platform=args.platform, timeout=args.timeout))


if __name__ == "__main__":
    main()
