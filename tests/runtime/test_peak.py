"""The MFU peak: measured once per machine, cached, only ever raised, its source stated."""

import json

import pytest

from llm_jax.runtime import peak


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "peak_flops.json"
    monkeypatch.setenv(peak.CACHE_ENV, str(path))
    calls = []

    def fake(dtype, n, repeats):
        calls.append(dtype)
        return {"xla": 1e9 * len(calls), "peak": 1e9 * len(calls)}

    monkeypatch.setattr(peak, "measure_peak_flops", fake)
    return path, calls


def test_first_call_measures_and_caches_later_calls_read(cache):
    path, calls = cache
    value, source = peak.peak_flops("float32")
    assert value == 1e9 and "measured now" in source and str(path) in source
    value, source = peak.peak_flops("float32")
    assert value == 1e9 and calls == ["float32"]
    assert f"max of 1 measurement(s), {path}" in source
    entry = json.loads(path.read_text())[peak.cache_key("float32")]
    assert entry["peak"] == 1e9 and entry["last"]["n"] == 2048


def test_a_start_up_peak_is_called_rough_until_bench_peak_measures(cache):
    """A newcomer's first MFU rests on a figure measured in passing: the log must say so, and
    how to make it exact; one `bench peak` measurement (record_peak's default) makes it exact."""
    path, _ = cache
    value, source = peak.peak_flops("float32")
    assert peak.is_rough(source) and "python -m llm_jax.bench peak" in source
    assert "train.peak_flops" in source
    assert peak.is_rough(peak.peak_flops("float32")[1])  # still rough when read from the cache
    peak.record_peak("float32", {"peak": 5e8}, 2048, 9)  # what `bench peak` does
    value, source = peak.peak_flops("float32")
    assert value == 1e9 and not peak.is_rough(source)
    assert source == f"cached peak, max of 2 measurement(s), {path}"


def test_a_cache_entry_keeps_the_largest_measurement(cache):
    path, _ = cache
    peak.record_peak("float32", {"peak": 3e9}, 2048, 9)
    entry, _ = peak.record_peak("float32", {"peak": 2e9}, 2048, 9)
    assert entry == json.loads(path.read_text())[peak.cache_key("float32")]
    assert entry["peak"] == 3e9 and entry["measurements"] == 2 and entry["last"]["peak"] == 2e9


def test_keys_separate_dtypes_devices_and_jax_versions(cache):
    key = peak.cache_key("bfloat16")
    assert "bfloat16" in key and peak.device_key() in key and "jax " in key
    assert peak.cache_key("float32") != key


def test_off_or_unwritable_cache_still_gives_a_peak(cache, monkeypatch, tmp_path):
    monkeypatch.setenv(peak.CACHE_ENV, "off")
    assert peak.cache_file() is None
    value, source = peak.peak_flops("float32")
    assert value > 0 and source.endswith(f"{peak.CACHE_ENV}=off)")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(peak.CACHE_ENV, str(blocker / "peak.json"))
    value, source = peak.peak_flops("float32")
    assert value > 0 and "not cached" in source


def test_a_corrupt_cache_is_measured_again(cache):
    path, calls = cache
    path.write_text("{not json")
    assert peak.peak_flops("float32")[0] > 0 and calls == ["float32"]


def test_default_cache_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(peak.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peak.cache_file() == tmp_path / "llm_jax" / "peak_flops.json"
