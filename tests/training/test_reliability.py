"""Fault injection: kill -9 at seeded random points (start-up, mid-step, mid-save), SIGTERM,
a double SIGINT, a corrupted checkpoint, a NaN on purpose, and hostile inputs. Every kill of the
real CLI is followed by a restart; the run's final params must equal an uninterrupted run's,
bitwise, and no step may be lost beyond the last complete checkpoint. docs/reliability.md lists
each fault and what happened."""

from __future__ import annotations

import json
import logging
import os
import re
import runpy
import shutil
import signal
import time
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest
from cli_forks import CliForks
from flax import nnx
from helpers import (
    EVERY,
    NUM_STEPS,
    OVERRIDES,
    ROOT,
    SMALL_MODEL,
    complete_steps,
    read_records,
    saved_params,
    small_cfg,
)

from llm_jax.parallel.sharding import make_mesh
from llm_jax.training import step as train_step
from llm_jax.training.loop import train
from llm_jax.training.run_config import model_config, validate_run_config
from llm_jax.training.step import compile_steps
from llm_jax.weights.checkpointing import Checkpointer, restore_params, tmp_leftovers
from llm_jax.weights.manifest import MANIFEST
from llm_jax.weights.restore_check import RestoreError

RNG = np.random.default_rng(8)  # the kill points are random, and reproducible


def _argv(workdir: Path, corpus_dir: str, **extra) -> list[str]:
    """The command line's arguments after `python -m llm_jax.train`."""
    args = {**OVERRIDES, "data.files": os.path.join(corpus_dir, "*"), **extra}
    return (["--config", str(ROOT / "configs/tiny.py"), f"--workdir={workdir}"]
            + [f"--config.{k}={v}" for k, v in args.items()])


@pytest.fixture(scope="module")
def cli():
    """The command line's runs, each a process forked after the imports (cli_forks)."""
    server = CliForks()
    yield server
    server.close()


class Run:
    """A run of the CLI in its own process, its output in a file we can watch while it runs."""

    def __init__(self, cli: CliForks, workdir: Path, corpus_dir: str, name: str, **extra):
        self.log = workdir.parent / f"{workdir.name}.{name}.log"
        self.workdir = workdir
        self.log.write_text("")
        self.proc = cli.start(_argv(workdir, corpus_dir, **extra), self.log)

    def text(self) -> str:
        return self.log.read_text()

    def last_step(self) -> int:
        """The last step this run logged (metrics.jsonl is stale until its start-up is done)."""
        path = self.workdir / "metrics.jsonl"
        if "] model: " not in self.text() or not path.exists():
            return 0
        lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
        return json.loads(lines[-1])["step"] if lines else 0

    def wait_until(self, cond, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert self.proc.poll() is None, f"exited early ({self.proc.returncode}):\n" + \
                self.text()[-3000:]
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.002)

    def finish(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout)


def _resumed_from(text: str) -> int | None:
    m = re.search(r"resumed from step (\d+)", text)
    return int(m.group(1)) if m else None


def _same_run(a: Path, b: Path) -> None:
    """Bitwise equal final params, and the same loss at every step."""
    for x, y in zip(saved_params(a), saved_params(b), strict=True):
        np.testing.assert_array_equal(x, y)
    assert [(r["step"], r["loss"]) for r in read_records(a)] == \
        [(r["step"], r["loss"]) for r in read_records(b)]


def cli_config(corpus_dir: str) -> ml_collections.ConfigDict:
    """The run config `_cmd` gives the command line, built in this process."""
    cfg = runpy.run_path(str(ROOT / "configs/tiny.py"))["get_config"]()
    for key, value in {**OVERRIDES, "data.files": os.path.join(corpus_dir, "*")}.items():
        section, field = key.split(".")
        cfg[section][field] = value
    return cfg


@pytest.fixture(scope="module")
def reference(corpus_dir, tmp_path_factory) -> Path:
    """The uninterrupted run, in this process: train() with the command line's config computes
    what the command line does (its start-up adds nothing to the run)."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    train(cli_config(corpus_dir), str(workdir))
    assert complete_steps(workdir) == list(range(EVERY, NUM_STEPS + 1, EVERY))
    assert all((workdir / "checkpoints" / str(s) / MANIFEST).exists()
               for s in complete_steps(workdir))
    return workdir


@pytest.mark.slow
def test_kills_and_signals_then_restart_equal_an_uninterrupted_run(cli, reference, corpus_dir,
                                                                   tmp_path):
    """One workdir through five faults in a row, each followed by a restart:
    1. kill -9 at a random moment of start-up; 2. kill -9 at a random step, mid-step;
    3. kill -9 mid-save (the run kills itself right after an async save starts);
    4. SIGTERM at a random step: it finishes the step, saves, exits 143;
    5. SIGINT twice: the second exits at once (130); then a restart finishes the run."""
    workdir = tmp_path / "run"

    # 1. Start-up (tokenizer, data, compile; the imports are done before the fork): nothing is
    # saved yet, nothing is lost. At a random moment, or as soon as start-up ends.
    run = Run(cli, workdir, corpus_dir, "1-kill-startup")
    kill_at = time.monotonic() + RNG.uniform(0.0, 3.0)
    run.wait_until(lambda: time.monotonic() > kill_at or "] model: " in run.text())
    run.proc.send_signal(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    assert complete_steps(workdir) == []

    # 2. A random step. The restart resumes from the newest complete checkpoint.
    kill_at = int(RNG.integers(EVERY + 1, 3 * EVERY))
    run = Run(cli, workdir, corpus_dir, "2-kill-step")
    assert _resumed_from(run.text()) is None
    run.wait_until(lambda: run.last_step() >= kill_at)
    time.sleep(RNG.uniform(0, 0.02))  # anywhere inside the following step
    run.proc.send_signal(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    # Saves are asynchronous: the newest one may still have been in flight (a tmp folder).
    saved = complete_steps(workdir)
    base = saved[-1] if saved else 0
    assert base <= run.last_step() and all(s % EVERY == 0 for s in saved)

    # 3. Mid-save: the save of step save_at is left as an Orbax temporary directory.
    save_at = base + 2 * EVERY
    run = Run(cli, workdir, corpus_dir, "3-kill-mid-save",
              **{"checkpoint.inject_kill_during_save_at_step": save_at})
    assert run.finish() == -signal.SIGKILL
    assert _resumed_from(run.text()) == (base or None)  # no step lost beyond the last checkpoint
    assert [os.path.basename(p) for p in tmp_leftovers(str(workdir / "checkpoints"))] == \
        [f"{save_at}.orbax-checkpoint-tmp"]
    saved = complete_steps(workdir)
    assert saved[-1] == save_at - EVERY

    # 4. SIGTERM at a random step between checkpoints: finish it, save it, exit 143.
    run = Run(cli, workdir, corpus_dir, "4-sigterm")
    term_at = int(RNG.integers(saved[-1] + 1, saved[-1] + EVERY))
    run.wait_until(lambda: run.last_step() >= term_at)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM, run.text()[-3000:]
    text = run.text()
    assert "incomplete checkpoint" in text and f"{save_at}.orbax-checkpoint-tmp" in text
    assert _resumed_from(text) == saved[-1]
    assert tmp_leftovers(str(workdir / "checkpoints")) == []
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", text).group(1))
    assert stopped >= term_at and complete_steps(workdir)[-1] == stopped
    assert run.last_step() == stopped  # not one step lost
    assert (workdir / "checkpoints" / str(stopped) / MANIFEST).exists()

    # 5. SIGINT, and again once the first is acknowledged: out at once, checkpoints intact.
    run = Run(cli, workdir, corpus_dir, "5-double-sigint")
    int_at = stopped + int(RNG.integers(1, EVERY))
    run.wait_until(lambda: run.last_step() >= int_at)
    run.proc.send_signal(signal.SIGINT)
    run.wait_until(lambda: "SIGINT received" in run.text(), timeout=30)
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 128 + signal.SIGINT
    assert _resumed_from(run.text()) == stopped
    assert "second signal SIGINT: exiting now" in run.text()
    good = complete_steps(workdir)

    run = Run(cli, workdir, corpus_dir, "6-finish")
    assert run.finish() == 0, run.text()[-3000:]
    assert _resumed_from(run.text()) == good[-1]
    _same_run(reference, workdir)


@pytest.mark.slow
def test_corrupted_checkpoint_is_named_and_the_previous_one_used(reference, corpus_dir,
                                                                 tmp_path, caplog):
    """The restart runs in this process, as `reference` did."""
    workdir = tmp_path / "run"
    shutil.copytree(reference, workdir)
    shutil.rmtree(workdir / "checkpoints" / str(NUM_STEPS - EVERY))  # fall back two steps
    step_dir = workdir / "checkpoints" / str(NUM_STEPS)
    victim = max((p for p in (step_dir / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size: only the sha256 tells

    # A reader (load_pretrained) reports it and takes the previous step; asked for it, refuses.
    with pytest.raises(ValueError, match=rf"step {NUM_STEPS} .* corrupt: file params/.*sha256"):
        restore_params(str(workdir), NUM_STEPS)
    assert complete_steps(workdir)[-1] == NUM_STEPS  # a reader moves nothing

    caplog.set_level(logging.INFO)
    train(cli_config(corpus_dir), str(workdir))
    text = caplog.text
    rel = victim.relative_to(step_dir)
    assert f"checkpoint step {NUM_STEPS} in" in text and f"file {rel} does not match" in text
    assert _resumed_from(text) == NUM_STEPS - 2 * EVERY
    assert (workdir / "corrupt_checkpoints" / str(NUM_STEPS) / rel).exists()  # kept, aside
    _same_run(reference, workdir)


@pytest.mark.slow
def test_injected_nan_stops_the_cli_at_that_step_and_saves_nothing_after(cli, corpus_dir,
                                                                         tmp_path):
    """Log every 10 steps: the loop still reads each step's isfinite flag (one step late)."""
    workdir = tmp_path / "run"
    nan_at = 2 * EVERY + 2
    run = Run(cli, workdir, corpus_dir, "nan", **{"train.inject_nan_at_step": nan_at,
                                                 "train.log_every_steps": 10})
    assert run.finish() == 1
    text = run.text()
    assert (f"FloatingPointError: non-finite loss or gradients at step {nan_at}: training "
            f"stopped and nothing after step {2 * EVERY} was saved. Last good checkpoint: step "
            f"{2 * EVERY}") in text
    assert complete_steps(workdir) == [EVERY, 2 * EVERY]
    for s in complete_steps(workdir):
        _, params, _ = restore_params(str(workdir), s)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


# ---------------------------------------------------------------- in-process: cheaper checks


@pytest.fixture(scope="module")
def small_run(corpus_dir, tmp_path_factory) -> Path:
    """8 steps of the small model: checkpoints 4 and 8, each with its manifest. Copy it."""
    workdir = tmp_path_factory.mktemp("small") / "run"
    train(small_cfg(corpus_dir), str(workdir))
    return workdir


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _zero_biggest(step_dir: Path) -> None:
    victim = max((p for p in (step_dir / "params").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
    victim.write_bytes(b"\0" * victim.stat().st_size)


def test_skipped_nonfinite_update_keeps_params_and_moments_bitwise():
    """The NaN at step 3, as in the next test: the same train step, compiled once."""
    cfg = small_cfg("unused", inject_nan_at_step=3, skip_nonfinite_updates=True)
    steps = compile_steps(model_config(cfg), cfg.train, make_mesh(), seed=0)
    batch = {k: np.ones((4, 32), np.int32) for k in ("inputs", "targets")}
    state = steps.init()
    for _ in range(2):
        state, metrics = steps.train(state, batch)
        assert bool(metrics["finite"])
    before = jax.device_get(state)
    after, metrics = steps.train(state, batch)
    assert not bool(metrics["finite"]) and np.isnan(float(metrics["loss"]))
    after = jax.device_get(after)
    assert int(after.step) == 3
    for a, b in zip(jax.tree.leaves((before.params, before.opt_state)),
                    jax.tree.leaves((after.params, after.opt_state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_skip_mode_counts_the_skip_and_saves_finite_params(corpus_dir, tmp_path):
    workdir = str(tmp_path / "run")
    train(small_cfg(corpus_dir, inject_nan_at_step=3, skip_nonfinite_updates=True), workdir)
    records = {r["step"]: r for r in read_records(Path(workdir))}
    assert np.isnan(records[3]["loss"]) and records[3]["skipped_updates"] == 1
    assert records[2]["skipped_updates"] == 0 and records[8]["skipped_updates"] == 1
    assert np.isfinite(records[8]["loss"])
    _, params, _ = restore_params(workdir)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    assert Checkpointer(workdir).restore_progress(8) == {"skipped_updates": 1}


def test_truncated_checkpoint_file_is_named_and_reader_falls_back(small_run, tmp_path, caplog):
    workdir = _copy(small_run, tmp_path)
    victim = workdir / "checkpoints" / "8" / "opt_state" / "_METADATA"
    victim.write_bytes(victim.read_bytes()[:7])
    _, fallback, _ = restore_params(str(workdir))
    assert "checkpoint step 8" in caplog.text and "opt_state/_METADATA has 7 bytes" in caplog.text
    _, step4, _ = restore_params(str(workdir), 4)
    for a, b in zip(jax.tree.leaves(fallback), jax.tree.leaves(step4)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_unknown_field_wrong_type_and_conflicts_are_named(small_run, corpus_dir,
                                                                 tmp_path):
    def bad(section, key, value):
        d = small_cfg(corpus_dir).to_dict()
        d[section][key] = value
        return ml_collections.ConfigDict(d)  # a config file may build any dict

    for cfg, match in [
        (bad("train", "num_step", 10), r"unknown config field\(s\) \['train.num_step'\]"),
        (bad("checkpoint", "every_steps", "5"), r"checkpoint.every_steps='5' has type str"),
        (bad("train", "skip_nonfinite_updates", 1), r"skip_nonfinite_updates=1 has type int"),
        (bad("checkpoint", "every_steps", 0), r"checkpoint.every_steps=0 is invalid"),
        (bad("train", "learning_rate", float("nan")), r"train.learning_rate=nan is invalid"),
        (bad("train", "grad_accum_steps", 3), r"batch_size=4 and train.grad_accum_steps=3"),
        (bad("sft", "on_bad_line", "skp"), r"sft.on_bad_line='skp' is invalid: expected one of"),
        (bad("data", "on_bad_file", "eror"), r"data.on_bad_file='eror' is invalid: expected one "
                                             r"of \['skip', 'stop'\]"),
        (bad("model", "remat", True), r"model.remat is an execution setting.*"
                                      r"set config.execution.remat instead"),
        (bad("execution", "loss_chunk_tokens", 0), r"ExecutionConfig.loss_chunk_tokens=0"),
    ]:
        with pytest.raises(ValueError, match=match):
            validate_run_config(cfg)
    # Refused before anything in the workdir is touched: its checkpoints stay.
    workdir = str(_copy(small_run, tmp_path))
    before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
    assert before == ["4", "8"]
    with pytest.raises(ValueError, match="every_steps=0"):
        train(bad("checkpoint", "every_steps", 0), workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == before


@pytest.mark.slow
def test_cli_wrong_type_and_repeated_overrides_are_clear_errors(cli, tmp_path):
    cases = [
        (["--config.train.num_steps=abc"], "train.num_steps"),
        (["--config.train.num_steps=5", "--config.train.num_steps=6"],
         "--config.train.num_steps is given twice, as '5' and '6'"),
        (["--config.train.num_stpes=3"], "--config.train.num_stpes: config.train has no field "
                                         "'num_stpes'"),
        (["--config.model.hidden_size=-5"], "ModelConfig.hidden_size=-5 is invalid"),
        (["--config.model.moe_dispatch=gmm"], "--config.model.moe_dispatch: config.model has no "
                                              "field 'moe_dispatch'; it is "
                                              "config.execution.moe_dispatch: use "
                                              "--config.execution.moe_dispatch=..."),
        (["--config.sft.on_bad_line=skp"], "sft.on_bad_line='skp' is invalid: expected one of "
                                           "['skip', 'stop']"),
    ]
    for i, (extra, message) in enumerate(cases):
        log = tmp_path / f"{i}.log"
        log.write_text("")
        argv = ["--config", str(ROOT / "configs/tiny.py"), f"--workdir={tmp_path / 'run'}",
                *extra]
        code = cli.start(argv, log).wait(120)
        stderr = log.read_text()
        assert code == 2 and message in stderr, (extra, code, stderr[-2000:])
        assert "Traceback" not in stderr, stderr[-2000:]
        assert stderr.strip().splitlines()[-1].startswith("llm_jax.train: error: "), stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_hostile_corpus_files_are_skipped_by_name_and_training_runs(corpus_dir, tmp_path, caplog):
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    (corpus / "empty.py").write_bytes(b"")
    (corpus / "blob.bin").write_bytes(bytes(range(256)) * 8)
    (corpus / "latin1.txt").write_bytes("caf\xe9 na\xefve\n".encode("latin-1") * 50)
    cfg = small_cfg(str(corpus))  # small_run's steps: its compiled program, from the cache
    train(cfg, str(tmp_path / "run"))
    assert "empty.py: it is empty" in caplog.text  # found at start-up, from its size
    assert complete_steps(tmp_path / "run") == [4, 8]
    # Files are read in place, as the pipeline reaches them: undecodable text is named then.
    from llm_jax.data import DataConfig
    from llm_jax.data.sources import open_text_splits

    splits = open_text_splits(DataConfig.from_dict(cfg.data), data_dir="")
    texts = [t for split in ("train", "eval") for t in splits.texts(split)]
    for name in ("blob.bin", "latin1.txt"):
        assert name in caplog.text
    assert texts.count("") == 2  # each read as nothing, which the pipeline drops


def test_prompt_ids_outside_the_vocabulary_are_named():
    from llm_jax.inference import sample as generate
    from llm_jax.model import Transformer

    model = Transformer(SMALL_MODEL, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] holds 384, outside the vocabulary"):
        generate(model, [[1, 2], [3, 384]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] holds -1"):
        generate(model, [[-1]], max_new_tokens=2)


# ---------------------------------------------------------------- restore failures


def test_changed_optimizer_state_stops_the_run_and_moves_nothing(small_run, corpus_dir,
                                                                  tmp_path, monkeypatch):
    """Measured on main: an EMA around the optimizer made every step 'corrupt'; all were moved
    aside and the next run started from step 0. Now: stop, name the step and the difference."""
    import optax

    workdir = _copy(small_run, tmp_path)
    plain = train_step.make_optimizer
    monkeypatch.setattr(train_step, "make_optimizer",
                        lambda tc: optax.chain(plain(tc), optax.ema(0.99)))
    with pytest.raises(RestoreError) as e:
        train(small_cfg(corpus_dir), str(workdir))
    msg = str(e.value)
    assert f"checkpoint step 8 in {workdir / 'checkpoints'} does not fit" in msg
    assert "array(s) only in this run (e.g. opt_state.opt_state." in msg
    assert "nothing was moved" in msg
    assert complete_steps(workdir) == [4, 8] and not (workdir / "corrupt_checkpoints").exists()
    _same_run(small_run, workdir)  # every step and its params still there, bitwise


def test_a_failure_that_is_no_corruption_moves_nothing(small_run, tmp_path):
    """Judged per failure: a verified step never counts as corrupt; an unverified one only for a
    read error (a zeroed file), not for a bug or memory."""
    workdir = _copy(small_run, tmp_path)
    ckpt = Checkpointer(str(workdir), async_save=False)

    def fail(exc):
        def restore(step):
            raise exc
        return restore

    for exc in (MemoryError("out of host memory"), ValueError("bad value")):
        with pytest.raises(RestoreError, match=r"step 8 .*match the sha256 manifest") as e:
            ckpt.first_restorable(fail(exc), move_bad=True)
        assert type(exc).__name__ in str(e.value) and "Nothing was moved" in str(e.value)
    ckpt.close()
    os.remove(workdir / "checkpoints" / "8" / MANIFEST)  # unverified from here on
    ckpt = Checkpointer(str(workdir), async_save=False)
    with pytest.raises(RestoreError, match=r"step 8 .*TypeError.*no checksum manifest"):
        ckpt.first_restorable(fail(TypeError("a bug")), move_bad=True)
    assert complete_steps(workdir) == [4, 8]
    _zero_biggest(workdir / "checkpoints" / "8")
    step, _ = ckpt.first_restorable(ckpt.restore_progress, move_bad=True)
    assert step == 8  # the zeroed params are not read by this restore: no evidence yet
    step, params = ckpt.first_restorable(
        lambda s: restore_params(str(workdir), s), move_bad=True)
    assert step == 4 and complete_steps(workdir) == [4]  # a read error: moved aside
    assert (workdir / "corrupt_checkpoints" / "8").is_dir()
    ckpt.close()


def test_quarantined_workdir_is_not_restarted_from_step_0_unless_asked(small_run, corpus_dir,
                                                                       tmp_path):
    workdir = _copy(small_run, tmp_path)
    for step in (4, 8):
        _zero_biggest(workdir / "checkpoints" / str(step))
    for attempt in range(2):  # this run quarantines them; the next one finds them moved
        with pytest.raises(ValueError, match="corrupt_checkpoints/ holds") as e:
            train(small_cfg(corpus_dir), str(workdir))
        assert "['4', '8']" in str(e.value) and "allow_fresh_start=True" in str(e.value)
        assert complete_steps(workdir) == []
    before = [(r["step"], r["loss"]) for r in read_records(workdir)]
    cfg = small_cfg(corpus_dir)
    cfg.checkpoint.allow_fresh_start = True
    train(cfg, str(workdir))
    assert complete_steps(workdir) == [4, 8]
    assert sorted(os.listdir(workdir / "corrupt_checkpoints")) == ["4", "8"]  # still kept
    assert [(r["step"], r["loss"]) for r in read_records(workdir)] == before  # redone, the same


def test_a_stop_before_the_first_step_says_nothing_was_saved(tmp_path):
    """The message after a stop signal names the saved step, or says that none was saved."""
    from llm_jax.training.preemption import Interrupted, save_and_stop

    class Stop:
        preempted, signum = False, signal.SIGTERM

    class Ckpt:
        directory = str(tmp_path)

        def __init__(self, latest):
            self.latest, self.saved = latest, []

        def wait(self):
            pass

        def latest_step(self):
            return self.latest

    fresh = Ckpt(None)
    with pytest.raises(Interrupted, match="before the first RL step completed: nothing saved"):
        save_and_stop(Stop(), 0, 0, fresh.saved.append, fresh, what="RL step")
    assert fresh.saved == []
    resumed = Ckpt(7)
    with pytest.raises(Interrupted, match="after step 9: checkpoint step 9 saved") as e:
        save_and_stop(Stop(), 9, 7, resumed.saved.append, resumed)
    assert resumed.saved == [9] and e.value.exit_code == 128 + signal.SIGTERM
