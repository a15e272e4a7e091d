"""The training command line as processes forked from one that has already imported it.

A process of `python -m llm_jax.train` spends seconds importing JAX and llm_jax before its
start-up proper (tokenizer, data, compile). The tests that kill, signal and restart the command
line many times pay that once: `CliForks` starts this file as a server that imports
llm_jax.train (no device is touched, no Python thread started) and then forks one child per
run. Each child is a real process of the command line from its flag parsing on, with its own
pid, signals, exit status and log, so a kill -9 or a signal reaches it as it would reach a fresh
one. (It runs under the server's malloc: the command line's re-execution under tcmalloc or
mimalloc changes its speed, not what it computes.)

Protocol (JSON lines on the server's stdin and stdout): {"start": argv, "env": {...}, "log":
path} -> {"pid": pid}; {"poll": pid} -> {"exit": code or null}, the code as
`subprocess.Popen.returncode` gives it (-9 for SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Forked:
    """One forked run of the command line: the parts of subprocess.Popen the tests use."""

    def __init__(self, server: CliForks, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.ask({"poll": self.pid})["exit"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked run {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class CliForks:
    """The server: `start` forks a run of `python -m llm_jax.train` with `argv`; `env` is set
    in the child before its flags are parsed (settings JAX reads at import, such as
    JAX_PLATFORMS or JAX_NUM_CPU_DEVICES, must be in `server_env` instead)."""

    def __init__(self, server_env: dict[str, str] | None = None):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(server_env or {})}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the fork server exited ({self.proc.poll()})"
        return json.loads(line)

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Forked:
        return Forked(self, self.ask({"start": argv, "env": env or {}, "log": str(log)})["pid"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def _child(argv: list[str], env: dict[str, str], log: str) -> None:
    """Runs the command line as `python -m llm_jax.train argv...` would. Its SystemExit (or
    any other exception) ends this process as it ends a fresh one: atexit handlers (JAX's
    distributed shutdown among them) run, and an uncaught exception's traceback goes to the log
    with exit status 1."""
    from absl import app

    from llm_jax import train as cli
    from llm_jax.runtime.cli import parse_flags

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.update(env)
    sys.argv = ["llm_jax.train", *argv]
    app.run(cli.main, flags_parser=parse_flags(cli.PROG))


def serve() -> None:
    import llm_jax.train  # noqa: F401  the imports every child would otherwise repeat

    children: dict[int, int | None] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "start" in request:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(request["start"], request["env"], request["log"])
            children[pid] = None
            reply = {"pid": pid}
        else:
            pid = request["poll"]
            if children[pid] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children[pid] = os.waitstatus_to_exitcode(status)
            reply = {"exit": children[pid]}
        print(json.dumps(reply), flush=True)
    for pid, code in children.items():  # the test is over: nothing it started outlives it
        if code is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


if __name__ == "__main__":
    serve()
