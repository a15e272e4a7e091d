"""The command lines' flag errors: one line naming the bad flag or value, exit status 2."""

import pytest

from llm_jax import chat, convert, generate, serve
from llm_jax.runtime.cli import fail, refuse_repeated_overrides


@pytest.mark.parametrize("main, argv, named", [
    (generate.main, ["--max_new_tokens", "abc"], "--max_new_tokens: invalid int value: 'abc'"),
    (generate.main, ["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (convert.main, ["--src", "a", "--dst", "b", "--to", "hf5"], "--to: invalid choice: 'hf5'"),
    (serve.main, ["--checkpoint", "a", "--warmup", "some"], "--warmup: invalid choice: 'some'"),
    (chat.main, ["--checkpoint", "a", "--max_len", "x"], "--max_len: invalid int value: 'x'"),
    (generate.main, ["--dtype", "bfloat61"], "--dtype: 'bfloat61' is not a floating-point dtype"),
    (serve.main, ["--checkpoint", "a", "--cache_dtype", "int8"],
     "--cache_dtype: 'int8' is not a floating-point dtype"),
    (chat.main, ["--checkpoint", "a", "--dtype", "x"], "--dtype: 'x' is not a floating-point"),
])
def test_a_bad_flag_is_one_line_naming_it(main, argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and named in err, err


def test_fail_flattens_a_message_to_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        fail("llm_jax.x", "first\n  second")
    assert e.value.code == 2 and capsys.readouterr().err == "llm_jax.x: error: first second\n"


def test_a_repeated_override_with_two_values_is_refused():
    refuse_repeated_overrides(["--config.train.num_steps=3", "--config.train.num_steps=3"])
    with pytest.raises(ValueError, match="--config.train.num_steps is given twice, as '3' and '4'"):
        refuse_repeated_overrides(["--config.train.num_steps=3", "--config.train.num_steps=4"])



def test_an_unreadable_prompt_file_is_one_line_naming_it(tmp_path, capsys):
    from helpers import SMALL_MODEL

    from llm_jax.model import init_model
    from llm_jax.weights.writers import save_llm_jax

    save_llm_jax(init_model(SMALL_MODEL, seed=0), tmp_path / "ckpt")
    missing = tmp_path / "prompt.txt"
    assert generate.main(["--checkpoint", str(tmp_path / "ckpt"), "--prompt_file",
                          str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--prompt_file={str(missing)!r} cannot be read" in err, err
