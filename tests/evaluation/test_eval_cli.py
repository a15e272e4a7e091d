"""`python -m llm_jax.eval` is lm_eval's command line with the model "llm_jax": --checkpoint DIR
becomes lm_eval's --model llm_jax --model_args checkpoint=DIR (no lm_eval needed to check it)."""

from llm_jax.eval import lm_eval_argv


def test_eval_cli_turns_checkpoint_into_lm_eval_model_args():
    assert lm_eval_argv(["--checkpoint", "/ck", "--tasks", "t"]) == [
        "run", "--tasks", "t", "--model_args", "checkpoint=/ck", "--model", "llm_jax",
        "--batch_size", "8"]
    assert lm_eval_argv(["--tasks", "t", "--checkpoint=/ck", "--model_args", "pack=true",
                         "--batch_size", "4"]) == [
        "run", "--tasks", "t", "--batch_size", "4", "--model_args", "checkpoint=/ck,pack=true",
        "--model", "llm_jax"]
