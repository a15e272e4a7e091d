"""Multi-process preemption: the training CLI as two processes on 127.0.0.1, SIGTERM to
one of them, then (after a resume) to both. Each time both processes must stop after the same
step, save it together and exit 143; the resumed run must equal an uninterrupted one bitwise (the
loss at every logged step, the params saved at its preemption). Nothing listens or connects
beyond 127.0.0.1.

JAX polls for SIGTERM once a second, so how many steps pass before the stop depends on the
machine. The interrupted runs therefore ask for far more steps than they will run, and the
uninterrupted one is run afterwards to exactly the step the second one stopped at: with
`train.min_lr_ratio=1` the learning rate after warmup is `peak * 1.0` whatever `num_steps` is,
so the two trajectories are the same computation.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))

from cli_forks import CliForks  # noqa: E402
from helpers import FAST_XLA_FLAGS, OVERRIDES, ROOT, complete_steps, read_records, saved_params  # noqa: E402
from local import free_port  # noqa: E402

from llm_jax.weights.checkpointing import tmp_leftovers  # noqa: E402

UNTIL_STOPPED, LOG_EVERY = 100_000, 4  # steps asked of the interrupted runs; log (and agree
# on SIGINT) every 4 steps
RNG = np.random.default_rng(16)


@pytest.fixture(scope="module")
def cli():
    """The command line's processes, each forked after the imports (cli_forks); one CPU device
    each, cheap compiles (FAST_XLA_FLAGS, the same for every run), and faulthandler on: a process
    that hangs is sent SIGABRT and prints every thread's Python stack into its log
    (`Job.hung`)."""
    server = CliForks({"JAX_NUM_CPU_DEVICES": "1", "XLA_FLAGS": FAST_XLA_FLAGS,
                       "PYTHONFAULTHANDLER": "1"})
    yield server
    server.close()


class Job:
    """Two processes of the CLI on one coordinator at 127.0.0.1; output in WORKDIR.NAME.P.log."""

    def __init__(self, cli: CliForks, workdir: Path, corpus_dir: str, name: str,
                 num_steps: int = UNTIL_STOPPED):
        args = {**OVERRIDES, "data.files": os.path.join(corpus_dir, "*"), "mesh.dcn_data": 2,
                "train.num_steps": num_steps, "train.min_lr_ratio": 1.0,
                "train.log_every_steps": LOG_EVERY, "checkpoint.every_steps": UNTIL_STOPPED}
        argv = ([f"--config={ROOT / 'configs/tiny.py'}", f"--workdir={workdir}"]
                + [f"--config.{k}={v}" for k, v in args.items()])
        address = f"127.0.0.1:{free_port()}"
        self.workdir, self.logs, self.procs = workdir, [], []
        for i in range(2):
            self.logs.append(workdir.parent / f"{workdir.name}.{name}.{i}.log")
            self.logs[-1].write_text("")
            self.procs.append(cli.start(argv, self.logs[-1], env={
                "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i)}))

    def text(self, i: int = 0) -> str:
        return self.logs[i].read_text()

    def hung(self, what: str) -> str:
        """Stops the processes still running with SIGABRT (each prints its threads' stacks)
        and returns what both logged: the failure message of a wait that timed out."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGABRT)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        return f"{what}\n" + "\n".join(f"--- process {i}:\n{self.text(i)[-6000:]}"
                                        for i in range(2))

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        path, deadline = self.workdir / "metrics.jsonl", time.monotonic() + timeout
        while not (path.exists() and "] model: " in self.text()
                   and any(r["step"] >= step for r in read_records(self.workdir))):
            if any(p.poll() is not None for p in self.procs):
                pytest.fail(self.hung(f"a process exited before step {step}"))
            if time.monotonic() > deadline:
                pytest.fail(self.hung(f"no step {step} within {timeout} s"))
            time.sleep(0.01)

    def finish(self, timeout: float = 300) -> list[int]:
        try:
            return [p.wait(timeout) for p in self.procs]
        except subprocess.TimeoutExpired:
            pytest.fail(self.hung(f"not finished within {timeout} s"))
        finally:
            for p in self.procs:  # only the processes started here
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def stopped_at(self) -> int:
        """The step both processes say they stopped after and saved (the same on both)."""
        found = [re.findall(r"stopped by preemption after step (\d+)", self.text(i))
                 for i in range(2)]
        assert all(len(f) == 1 for f in found), [self.text(i)[-2000:] for i in range(2)]
        assert found[0] == found[1], found
        return int(found[0][0])


def _preempt(cli: CliForks, workdir: Path, corpus_dir: str, name: str,
             signalled: list[int]) -> int:
    """Runs (or resumes) the job, SIGTERMs the processes `signalled` a few steps after it
    started training, and checks that both saved the same step; returns that step."""
    done = complete_steps(workdir)
    job = Job(cli, workdir, corpus_dir, name)
    at = (done[-1] if done else 0) + int(RNG.integers(1, 2 * LOG_EVERY))
    job.wait_for_step(at)
    for i in signalled:
        job.procs[i].send_signal(signal.SIGTERM)
    assert job.finish() == [128 + signal.SIGTERM] * 2, [job.text(i)[-2000:] for i in range(2)]
    step = job.stopped_at()
    assert step >= at
    assert complete_steps(workdir)[-1] == step and not tmp_leftovers(
        str(workdir / "checkpoints"))
    data = workdir / "checkpoints" / str(step) / "data"
    assert sorted(p.name for p in data.iterdir() if p.suffix == ".json") == \
        ["process_0-of-2.json", "process_1-of-2.json"]  # both data iterators, one step
    assert max(r["step"] for r in read_records(workdir)) > step - LOG_EVERY  # nothing logged lost
    if done:
        assert f"resumed from step {done[-1]}" in job.text()
    return step


@pytest.mark.slow
def test_sigterm_to_one_process_and_to_all_then_resume_equals_an_uninterrupted_run(
        cli, corpus_dir, tmp_path):
    workdir = tmp_path / "run"
    first = _preempt(cli, workdir, corpus_dir, "sigterm-one", signalled=[1])
    second = _preempt(cli, workdir, corpus_dir, "sigterm-all", signalled=[0, 1])
    assert second > first

    reference = Job(cli, tmp_path / "reference", corpus_dir, "straight", num_steps=second)
    assert reference.finish() == [0, 0], reference.text()[-3000:]
    assert complete_steps(tmp_path / "reference") == [second]
    for a, b in zip(saved_params(tmp_path / "reference"), saved_params(workdir), strict=True):
        np.testing.assert_array_equal(a, b)  # the params at the second preemption, bitwise
    # Every step both logged has the same loss (a resumed run also logs its first step).
    ref = {r["step"]: r["loss"] for r in read_records(tmp_path / "reference")}
    run = {r["step"]: r["loss"] for r in read_records(workdir)}
    common = set(ref) & set(run)
    assert len(common) >= second // LOG_EVERY and all(run[s] == ref[s] for s in common)
