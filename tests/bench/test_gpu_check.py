"""The prepared GPU check: its model is ~1B active, and custom calls are read from HLO text.
(`python -m llm_jax.bench.gpu_check --quick` runs the whole check on CPU in about a minute.)"""

from llm_jax.bench.gpu_check import check_config, custom_calls
from llm_jax.model.costs import active_params


def test_check_model_is_about_one_billion_active():
    assert 0.9e9 < active_params(check_config()) < 1.2e9
    assert check_config().dtype == "bfloat16"


def test_custom_calls_counted_by_target():
    hlo = ('%a = f32[2] custom-call(%x), custom_call_target="__cublas$gemm"\n'
           '%b = f32[2] custom-call(%x), custom_call_target="__cublas$gemm"')
    assert custom_calls(hlo) == {"__cublas$gemm": 2}
