"""One training run per workdir: an OS advisory lock on WORKDIR/train.lock.

A second run would remove the first one's in-flight saves as "interrupted" (its tmp folders),
write checkpoints with the same step numbers and rebuild the tokenizer under it. The lock is
`fcntl.flock` on a file held open for the whole run: the kernel releases it when the process
ends in any way, `kill -9` included, so there is never a stale lock to clean up. The file is
never deleted (a deleted lock file lets two runs lock two different files); it holds the
holder's pid, host and start time, for the error the next run prints.

Multi-process runs: process 0 takes the lock and every process learns the outcome (one
all-gather), so the whole run refuses together. What is guaranteed: on a local filesystem, and
on NFS (Linux emulates flock there with POSIX byte-range locks, which the NFS lock manager sees
across clients), a second run's process 0 is refused wherever it runs. Filesystems without
cluster-wide locks (e.g. Lustre mounted with `localflock`, gcsfuse and other FUSE stores) only
see the lock on the same host; where flock is not supported at all the run warns and goes on
unlocked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator

import jax
from absl import logging

from llm_jax.parallel import distributed

LOCK_FILE = "train.lock"


class WorkdirInUse(RuntimeError):
    """Another training process holds the workdir."""


class WorkdirLock:
    """`flock(LOCK_EX | LOCK_NB)` on WORKDIR/train.lock, held until `release` or exit."""

    def __init__(self, workdir: str):
        self.workdir = os.path.abspath(workdir)
        self.path = os.path.join(self.workdir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises WorkdirInUse naming the holder (pid, host, since)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise WorkdirInUse(
                f"workdir {self.workdir} is in use by another training run ({holder}; lock "
                f"file {self.path}). Wait for it to finish or stop it, or use another "
                "--workdir") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            logging.warning("%s: this filesystem does not support flock (%s); training without "
                            "a workdir lock: nothing stops a second run here", self.path,
                            e.strerror)
        os.ftruncate(fd, 0)
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv}
        os.write(fd, json.dumps(record).encode())
        os.fsync(fd)
        self._fd = fd

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            record = json.loads(os.pread(fd, 1 << 16, 0).decode())
            return f"pid {record['pid']} on host {record['host']}, since {record['since']}"
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return "holder unknown: it has not written its pid yet"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


@contextlib.contextmanager
def hold_workdir(workdir: str) -> Iterator[None]:
    """The workdir lock for a (possibly multi-process) training run; every process raises
    WorkdirInUse together if process 0 cannot take it."""
    lock = WorkdirLock(workdir)
    error: WorkdirInUse | None = None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except WorkdirInUse as e:
            error = e
    refused = max(distributed.process_allgather_int(int(error is not None)))
    if refused:
        lock.release()
        raise error or WorkdirInUse(
            f"workdir {lock.workdir} is in use by another training run (process 0 of this run "
            f"found {lock.path} locked; its log names the holder)")
    try:
        yield
    finally:
        lock.release()
