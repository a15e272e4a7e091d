"""What the engine (engine.py) is asked for: its sizes, one sequence's sampling settings (checked
by name before it is queued), the sequence's state as it runs, and the two refusals a server
maps to HTTP status codes. Plain Python: nothing here touches JAX.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

# The engine compiles its programs per sampling mode: greedy, sampled, sampled with top-k /
# top-p filtering (which sorts the vocabulary).
SAMPLING_MODES = (0, 1, 2)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the slot pool and the queue in front of it."""

    slots: int = 16  # B: sequences decoded together
    max_len: int = 1024  # S: positions per slot (prompt + new tokens)
    max_queue: int = 64  # waiting sequences before `submit` refuses
    max_prefill: int = 8  # prompts prefilled in one call
    cache_dtype: str | None = None  # default: the compute dtype
    record: bool = False  # each token's log-prob and each position's experts (RL rollouts)

    def __post_init__(self):
        for name in ("slots", "max_len", "max_queue", "max_prefill"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineConfig.{name}={v!r} is invalid: expected an integer >= 1")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one sequence continues: temperature 0 = greedy; top_k 0 and top_p 1 = off."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()  # tokens that end it (not part of its output)

    def check(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} is invalid: expected an "
                             f"integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < 1e6:
            raise ValueError(f"temperature={self.temperature!r} is invalid: expected a finite "
                             f"number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is invalid: expected an integer >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} is invalid: expected a number in (0, 1]")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not 0 <= self.seed < 2**31:
            raise ValueError(f"seed={self.seed!r} is invalid: expected an integer in [0, 2^31)")

    @property
    def mode(self) -> int:
        """One of SAMPLING_MODES: 0 greedy, 1 sampled, 2 sampled with top-k / top-p
        filtering."""
        if self.temperature == 0:
            return 0
        return 2 if self.top_k > 0 or self.top_p < 1 else 1


class QueueFull(Exception):
    """The waiting queue holds `max_queue` sequences: try again later (HTTP 429)."""


class EngineClosed(Exception):
    """The engine is shutting down (HTTP 503)."""


# (sequence, new token or None when it has finished) -> True to stop it now (a stop string).
Listener = Callable[["Sequence", "int | None"], bool]


class Sequence:
    """One request inside the engine: its prompt, settings, tokens so far and how it ended.
    `finish_reason`: "stop" (a stop token or the listener), "length", "cancelled", "timeout" or
    "error"; None while it runs. `stop_token`: the stop token that ended it, if one did.

    With `EngineConfig.record`: `logprobs` holds one float per sampled token (`tokens`, then the
    stop token if one ended it) and `routing` one int32 [L, k] array of experts per position fed
    to the model (the prompt's, then every generated token but the last)."""

    def __init__(self, prompt: list[int], params: SamplingParams, listener: Listener | None = None,
                 timeout: float | None = None):
        self.prompt, self.params, self.listener = list(prompt), params, listener
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.tokens: list[int] = []
        self.stop_token: int | None = None
        self.logprobs: list[float] = []
        self.routing: list = []  # numpy [L, k] per fed position
        self.finish_reason: str | None = None
        self.slot: int | None = None
        self.cancelled = False
        self.done = threading.Event()
        self.submitted = time.monotonic()
        self.first_token_at: float | None = None

    def cancel(self) -> None:
        """Stops it at the next step (any thread); its slot returns to the pool."""
        self.cancelled = True
