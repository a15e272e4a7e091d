"""One writer per workdir: a second training run on a workdir in use is refused,
naming the workdir and the holder, and a run killed with SIGKILL leaves no stale lock."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
from helpers import ROOT, small_cfg

from llm_jax.training.workdir_lock import LOCK_FILE, WorkdirInUse, WorkdirLock

HOLDER = """
import sys, time
from llm_jax.training.workdir_lock import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_second_training_run_is_refused_naming_the_holder(corpus_dir, tmp_path):
    from llm_jax.training.loop import train

    workdir = tmp_path / "run"
    workdir.mkdir()
    first = WorkdirLock(str(workdir))
    first.acquire()  # stands for a run in progress (flock is per open file: this process too)
    try:
        with pytest.raises(WorkdirInUse) as e:
            train(small_cfg(corpus_dir), str(workdir))
    finally:
        first.release()
    msg = str(e.value)
    assert f"workdir {workdir} is in use" in msg
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg
    assert sorted(os.listdir(workdir)) == [LOCK_FILE]  # refused before anything was written


def test_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(WorkdirInUse, match=f"pid {proc.pid} on host"):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert (tmp_path / LOCK_FILE).exists()  # the file stays; the kernel dropped the lock
    lock = WorkdirLock(str(tmp_path))
    lock.acquire()
    lock.release()
