"""TPU self-attention through JAX's Pallas splash attention, with the contract of `attend`.

Shapes: B batch, T query time, S key time (= T), N q heads, K kv heads, G = N / K, H head_dim.

Splash computes our attention exactly (checked in tests/kernels/test_splash_attention.py):
- sinks: its forward starts each row's online softmax at m = sink, l = 1, o = 0, i.e. one
  unscaled logit per query head in the normaliser with value zero, as `attend`; its backward
  returns d(sinks) = -sum exp(sink - lse) o . do, the derivative of that normaliser.
- scores: splash does not scale, so q is multiplied by H^-1/2 first (exact for H = 64).
- window W > 0 (W visible keys including the current one): `LocalMask(window_size=(W - 1, 0))`,
  whose rule is `q - left <= kv <= q + right`; right = 0 is the causal half. Window 0:
  `CausalMask`.
- segment ids: splash only compares q and kv ids; ours also hides segment 0 (padding) from every
  query, so query ids 0 become -1 (padding queries see nothing and return zero, as in `attend`).
- positions: splash masks by index, so the result equals ours when positions are the index plus
  a constant within each contiguous segment (`index_positions`: the model's self-attention,
  arange or right-padded prompts). The `splash` entry of `attention.ATTENTIONS` checks it at
  run time and takes the shape rule's path otherwise, so `auto` stays exact for any positions.

The window is scanned as data next to each layer's weights, but a splash mask is static (its
block-sparsity tables are built in NumPy when the kernel is made). So a traced window selects, by
`lax.switch`, among one kernel per distinct window of the config (`windows`, e.g. (0, 128) for
gpt-oss): both are compiled into the scanned layer body and each layer runs only its own, with
the block skipping of its own mask. A Python int window calls its kernel directly.

Under a mesh (jax.sharding.get_abstract_mesh()) the call runs in `jax.shard_map`: batch split
over the batch axes, heads over the head axes of the RULES table, one kernel per device shard.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as sk,
    splash_attention_mask as sm,
)

from llm_jax.parallel.sharding import mesh_axes

P = jax.sharding.PartitionSpec
LANES = 128  # splash tiles are multiples of the TPU lane width
MAX_BLOCK = 512


def splash_applies(q_len: int, kv_len: int) -> bool:
    """Splash needs self-attention (T = S) over a whole number of 128-wide tiles."""
    return q_len == kv_len and q_len % LANES == 0


def index_positions(positions_BT: jax.Array, segment_ids_BT: jax.Array | None) -> jax.Array:
    """Whether splash's index-based mask is ours for these positions (a bool scalar): within each
    segment, positions go up by one per index, and a segment, once left, never comes back (a
    new one starts with an id above every id before it). Padding (segment 0) is never seen."""
    step_ok = positions_BT[:, 1:] == positions_BT[:, :-1] + 1
    if segment_ids_BT is None:
        return jnp.all(step_ok)
    seg = segment_ids_BT
    seen = jax.lax.cummax(seg, axis=1)[:, :-1]
    cur, prev = seg[:, 1:], seg[:, :-1]
    ok = (cur == 0) | ((cur == prev) & step_ok) | (cur > seen)
    return jnp.all(ok)


def block_size(seq_len: int) -> int:
    """The largest of 512, 256, 128 that divides `seq_len`."""
    for b in (MAX_BLOCK, 256, LANES):
        if seq_len % b == 0:
            return b
    raise ValueError(f"splash attention: sequence length {seq_len} is not a multiple of {LANES}")


@functools.lru_cache(maxsize=64)
def make_kernel(seq_len: int, num_heads: int, window: int, interpret: bool):
    """One splash kernel (forward and backward) for a static window; cached by shape."""
    shape = (seq_len, seq_len)
    mask = sm.LocalMask(shape, (window - 1, 0), 0) if window > 0 else sm.CausalMask(shape)
    b = block_size(seq_len)
    blocks = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                           block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    with jax.ensure_compile_time_eval():  # concrete mask tables, safe to cache across traces
        return sk.make_splash_mha(sm.MultiHeadMask([mask] * num_heads), block_sizes=blocks,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


@jax.custom_vjp
def _float32(x: jax.Array) -> jax.Array:
    """x as float32, whose cotangent comes back in x's dtype: splash returns d(sinks) in the
    activations' dtype (bf16 in training), which must match the float32 sinks parameter."""
    return x.astype(jnp.float32)


def _float32_fwd(x):
    return x.astype(jnp.float32), jnp.zeros((), x.dtype)


def _float32_bwd(like, g):
    return (g.astype(like.dtype),)


_float32.defvjp(_float32_fwd, _float32_bwd)


def _local(q_BTNH, k_BSKH, v_BSKH, sinks_N, qs_BT, ks_BS, window, *, windows: tuple[int, ...],
           interpret: bool):
    """Splash on one device's shard: vmap over batch, one kernel per window, switch on window."""
    b, t, n, h = q_BTNH.shape
    q_BNTH = jnp.swapaxes(q_BTNH * jnp.asarray(h ** -0.5, q_BTNH.dtype), 1, 2)
    k_BKSH, v_BKSH = jnp.swapaxes(k_BSKH, 1, 2), jnp.swapaxes(v_BSKH, 1, 2)
    segments = None if qs_BT is None else sk.SegmentIds(q=qs_BT, kv=ks_BS)

    def run(w: int):
        kernel = make_kernel(t, n, w, interpret)
        def one(q, k, v, seg):
            return kernel(q, k, v, segment_ids=seg, sinks=_float32(sinks_N))
        return lambda q, k, v, seg: jax.vmap(one)(q, k, v, seg)

    args = (q_BNTH, k_BKSH, v_BKSH, segments)
    if isinstance(window, int):
        o_BNTH = run(window)(*args)
    else:
        index = sum(jnp.where(window == w, i, 0) for i, w in enumerate(windows))
        o_BNTH = jax.lax.switch(index, [run(w) for w in windows], *args)
    return jnp.swapaxes(o_BNTH, 1, 2).astype(v_BSKH.dtype)


def splash_attend(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    sinks_N: jax.Array,
    q_positions_BT: jax.Array,
    kv_positions_BS: jax.Array,
    window: jax.Array | int,
    q_segment_ids_BT: jax.Array | None = None,
    kv_segment_ids_BS: jax.Array | None = None,
    *,
    windows: Sequence[int] = (0,),
    interpret: bool = False,
) -> jax.Array:
    """`attend(q, k, v, sinks, attention_mask(...))` for self-attention (see the module doc for
    when positions may be left out). `windows`: every value a traced `window` can take."""
    del q_positions_BT, kv_positions_BS  # index-based masks: see the module docstring
    b, t, n, h = q_BTNH.shape
    s, kh = k_BSKH.shape[1], k_BSKH.shape[2]
    if not splash_applies(t, s):
        raise ValueError(f"splash attention needs T = S, a multiple of {LANES}: got T={t}, S={s}")
    windows = tuple(sorted(set(int(w) for w in windows)))
    if isinstance(window, int) and window not in windows:
        windows += (window,)
    if kv_segment_ids_BS is not None:
        qs = kv_segment_ids_BS if q_segment_ids_BT is None else q_segment_ids_BT
        qs_BT = jnp.where(qs == 0, -1, qs).astype(jnp.int32)  # padding sees nothing
        ks_BS = kv_segment_ids_BS.astype(jnp.int32)
    else:
        qs_BT = ks_BS = None
    fn = functools.partial(_local, windows=windows, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(q_BTNH, k_BSKH, v_BSKH, sinks_N, qs_BT, ks_BS, window)
    batch = mesh_axes(mesh, ("batch",))
    heads = mesh_axes(mesh, ("heads",))
    shards = math.prod(mesh.shape[a] for a in batch)
    hs = math.prod(mesh.shape[a] for a in heads)
    if b % shards:
        batch = ()  # a batch the batch axes do not divide (generation): replicate it
    if n % hs or kh % hs:
        raise ValueError(f"splash attention: num_attention_heads={n} and num_key_value_heads={kh}"
                         f" must be divisible by the head mesh axes {heads} (size {hs})")
    bspec = batch or None
    hspec = heads or None
    x_spec, s_spec = P(bspec, None, hspec, None), P(bspec, None)
    seg_spec = None if qs_BT is None else s_spec
    win_spec = None if isinstance(window, int) else P()

    def body(q, k, v, sinks, qs, ks, w):
        return fn(q, k, v, sinks, qs, ks, window if isinstance(window, int) else w)

    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(x_spec, x_spec, x_spec, P(hspec), seg_spec, seg_spec, win_spec),
        out_specs=x_spec, check_vma=False,
    )(q_BTNH, k_BSKH, v_BSKH, sinks_N, qs_BT, ks_BS, None if isinstance(window, int) else window)
