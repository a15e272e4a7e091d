"""The MoE dispatches that run inside `jax.shard_map`: `expert_parallel` (tokens exchanged by
all_to_all, below) and `gmm` (`moe_gmm`: the grouped-matmul kernels, opaque to XLA's sharding
propagation, run on each device's tokens).

Expert parallel:

Shapes (per device): T local tokens, D hidden, k experts per token, A = T k assignments,
n devices on the expert axis, El = E / n local experts, C slots per (source, destination) pair,
R = n C rows received, F2 = 2F / tensor local gate-up width.

Layout (from the one RULES table): tokens are split over the batch axes (data, fsdp, expert),
expert weights over `expert` (E) and `tensor` (F); their `embed` (fsdp) dimension is gathered on
entry, as FSDP does. On every device:

1. sort its assignments by expert id; destination device = expert // El;
2. pack them into a [n, C] send buffer (slot = rank among the assignments to that device);
3. `all_to_all` over `expert`: device j receives the rows meant for its experts from every
   source;
4. sort the received rows by local expert, grouped matmul (`jax.lax.ragged_dot`, or with
   `kernel` a Pallas kernel of kernels/grouped_matmul.py: the `expert_parallel_gmm` dispatch),
   clamped SwiGLU, grouped matmul; with tensor > 1 each device holds a slice of F and the
   partial outputs are summed (`psum` over `tensor`);
5. reverse `all_to_all`; each row returns to its source's slot; combine with the router weights.

Formulation: capacity per device pair, C = min(A, ceil(moe_capacity_factor * A / n)). With
factor >= n, C = A (a source's every assignment fits in one destination), so nothing can be
dropped and the layer is exactly the single-device MoE; with a smaller factor it moves and
computes n C ~ factor x A rows (not n A), overflow is dropped and counted in `drop_fraction`
(like the capacity dispatch). Without a mesh (or on one device) the same code runs with n = 1:
dropless for a factor >= 1, dropping for a factor below 1 (which the config allows).

gmm (`moe_gmm`): the function of `moe_dispatch.moe_ragged`, its two grouped matmuls by a Pallas
kernel. Under a mesh it runs in `jax.shard_map`: tokens split over the batch axes, expert weights
split over the `mlp` axes (tensor, on F) and gathered over the others (as FSDP gathers `embed`),
the down projection's partial sums added by `psum` over `mlp`. So on a mesh with an `expert`
axis every device gathers every expert: there `expert_parallel_gmm` (tokens sent to the experts'
devices, the kernels on each device's own experts) is the kernel path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from llm_jax.kernels.grouped_matmul import TILE, Tile, grouped_matmul, whole_lanes
from llm_jax.model.experts import (
    ExpertWeights,
    Routing,
    blocked_halves,
    combine,
    expert_rows,
    sort_by_expert,
    stack_spec,
    swiglu,
    take_rows,
)
from llm_jax.model.mxfp4 import ExpertStack, PackedExperts, dense
from llm_jax.parallel.sharding import RULES, mesh_axes

P = jax.sharding.PartitionSpec
GroupedMatmul = Callable[..., jax.Array]  # ragged_dot's signature (+ group_offset: a kernel)


def experts_per_unpack(w: PackedExperts, unpack_mib: int) -> int:
    """How many of the stack's (local) experts are unpacked at a time: the most whose dense
    form fits in `unpack_mib` MiB (at least one, all with 0) and that divide their number."""
    e, i, o = w.shape
    if unpack_mib == 0:
        return e
    fit = max(1, unpack_mib * 2**20 // (i * o * jnp.dtype(w.dtype).itemsize))
    return max(d for d in range(1, e + 1) if e % d == 0 and d <= fit)


def grouped_experts(x_MK: jax.Array, w: ExpertStack, sizes_E: jax.Array, *,
                    grouped: GroupedMatmul, unpack_mib: int = 0) -> jax.Array:
    """`grouped(x, w, sizes)` for sorted rows. A packed stack is unpacked `experts_per_unpack`
    experts at a time (`grouped`, a kernel, takes a `group_offset`: those experts' rows are
    multiplied, the others are zero), each group inside one step of a loop, and
    recomputed in the backward pass: a layer never holds more than one group unpacked. (gpt-oss-
    20b's 32 gate-up experts are 1.06 GB in bfloat16; 8 at a time, 265 MB.) `lax.ragged_dot`
    takes no offset: its callers pass `unpack_mib=0`, the whole stack unpacked."""
    if not isinstance(w, PackedExperts):
        return grouped(x_MK, w, sizes_E)
    e = w.shape[0]
    n = experts_per_unpack(w, unpack_mib)
    if n == e:
        return grouped(x_MK, dense(w), sizes_E)

    @jax.checkpoint
    def one_group(i, y_MN):
        part = w.experts(i * n, n)
        return y_MN + grouped(x_MK, dense(part), sizes_E, group_offset=i * n)

    y0 = jnp.zeros((x_MK.shape[0], w.shape[2]), x_MK.dtype)
    return jax.lax.fori_loop(0, e // n, one_group, y0)


def gate_up_blocked(w: ExpertWeights, rows: int, devices: int, tp: int
                    ) -> tuple[ExpertWeights, bool]:
    """(w, blocked): the gate-up stack and bias with their columns as [glu | linear] within
    each `tensor` shard (`experts.blocked_halves`) and blocked = True, when that is the cheaper
    layout, else w as it is. Interleaved, the SwiGLU reads strided lanes of each device's
    [rows, 2F] pre-activations and XLA:TPU interleaves their gradient back through layout copies
    (the largest MoE cost left after `take_rows` in gpt-oss-20b's step at 8k tokens per chip);
    blocked, the weights are reordered instead, each device its shard (E D 2F / devices
    elements), before the `embed` gather, and their gradient after its reduce-scatter. So
    blocked when a device's rows outweigh its shard: training batches, not decoding steps. A
    packed (MXFP4) stack stays interleaved: reordering it would rewrite the packed weights at
    every call."""
    stack = w.gate_up_EDF2
    e, d, _ = stack.shape
    if isinstance(stack, PackedExperts) or rows * devices < e * d * tp:
        return w, False
    return w._replace(gate_up_EDF2=blocked_halves(stack, tp),
                      gate_up_bias_EF2=blocked_halves(w.gate_up_bias_EF2, tp)), True


def exchange_width(hidden: int, kernel: str | None, expert_devices: int, w: ExpertWeights,
                   rows: int, tp: int = 1) -> int:
    """The width of the rows the expert-parallel dispatch exchanges: `hidden`, or with the
    megablox kernel (TPU's) over an expert axis with dense stacks, `hidden` rounded up to whole
    128-lane tiles where a device's `rows` received outweigh its padded weights (so training
    batches, not decoding steps).

    Why: XLA:TPU lays an all_to_all's operand out without partial lane tiles. For gpt-oss's
    D = 2,880 (22.5 tiles) that puts the rows minor, so every exchange of an [R, D] buffer was a
    transposing copy of it before and after (gpt-oss-20b's 2-layer step at capacity 1.25: 88.9 GB
    of copies, 16.8 with the padding; docs/scaling.md). With zero columns appended to the
    tokens, zero input rows to the gate-up stack and zero output columns to the down stack and
    its bias, the rows are 128-lane wide from the send buffer to the combine, at the cost of
    padding each device's expert weights once a pass. The products gain only 0 x 0 terms and
    the extra columns are sliced off: the same function. Packed (MXFP4) stacks are left as they
    are (padding them would unpack them).

    The trade, per layer and pass: the two exchanges' copies cost about 16 R D bytes (two
    buffers, each copied twice, read and written, in bfloat16); padding the El local experts'
    gate-up [D, F2] and down [F2 / 2, D] stacks costs about 6 El D F2. So pad where
    8 R >= 3 El F2 (gpt-oss-20b at 8k tokens per chip and capacity 1.25: 40,960 rows against
    17,280)."""
    padded = whole_lanes(hidden)
    e, _, f2 = w.gate_up_EDF2.shape
    local_weights = (e // expert_devices) * (f2 // tp)
    if (kernel != "megablox" or expert_devices == 1 or padded == hidden
            or isinstance(w.gate_up_EDF2, PackedExperts) or isinstance(w.down_EFD, PackedExperts)
            or 8 * rows < 3 * local_weights):
        return hidden
    return padded


def slots_per_pair(local_assignments: int, expert_devices: int, factor: float) -> int:
    """C: rows a device may send to one device of the expert axis (see module doc)."""
    return max(1, min(local_assignments, math.ceil(factor * local_assignments / expert_devices)))


def _local_moe(x_TD, experts_Tk, weights_Tk, w1_EDF, b1_EF, w2_EFD, b2_ED, *, limit: float,
               factor: float, expert_axes: tuple[str, ...], mlp_axes: tuple[str, ...],
               batch_axes: tuple[str, ...], n: int, grouped: GroupedMatmul,
               unpack_mib: int = 0, blocked: bool = False, width: int = 0):
    """One device's share: steps 1-5 of the module doc. Returns (y [T, D], dropped count).
    Packed stacks are unpacked here, on the device that holds those experts
    (`grouped_experts`). `blocked`: the gate-up columns are [glu | linear] (`gate_up_blocked`).
    `width` > D: rows are exchanged and multiplied zero-padded to it (`exchange_width`)."""
    hidden = x_TD.shape[1]
    if width > hidden:
        pad = width - hidden
        x_TD = jnp.pad(x_TD, ((0, 0), (0, pad)))
        w1_EDF = jnp.pad(w1_EDF, ((0, 0), (0, pad), (0, 0)))
        w2_EFD = jnp.pad(w2_EFD, ((0, 0), (0, 0), (0, pad)))
        b2_ED = jnp.pad(b2_ED, ((0, 0), (0, pad)))
    t, d = x_TD.shape
    k = experts_Tk.shape[1]
    el = w1_EDF.shape[0]
    a = t * k
    c = slots_per_pair(a, n, factor)

    # 1-2. Sort by expert, pack per destination device: sorted assignment i goes to slot
    # dst * C + its rank among the assignments to dst, if that rank is < C. Both ways between
    # assignments and slots are index maps (`take_rows`): no rows are scattered.
    s = sort_by_expert(experts_Tk, n * el)
    dst = s.experts_A // el
    counts_n = s.group_sizes_E.reshape(n, el).sum(1)
    starts_n = jnp.cumsum(counts_n) - counts_n
    rank = jnp.arange(a) - starts_n[dst]
    kept = rank < c
    slot_A = jnp.where(kept, dst * c + rank, n * c)[s.inverse_A]  # n * c: dropped
    slot_dst, slot_rank = jnp.divmod(jnp.arange(n * c), c)
    filled = slot_rank < counts_n[slot_dst]
    sorted_of_slot = jnp.where(filled, starts_n[slot_dst] + slot_rank, 0)
    assignment_of_slot = jnp.where(filled, s.order_A[sorted_of_slot], a)  # a: empty slot
    x_send = take_rows(x_TD, assignment_of_slot, slot_A, k)
    e_send = jnp.where(filled, s.experts_A[sorted_of_slot] - slot_dst * el, el)

    # 3. Exchange: chunk j of the send buffer goes to device j; chunk i received is from i.
    if expert_axes:
        x_recv = jax.lax.all_to_all(x_send, expert_axes, 0, 0, tiled=True)
        e_recv = jax.lax.all_to_all(e_send, expert_axes, 0, 0, tiled=True)
    else:
        x_recv, e_recv = x_send, e_send

    # 4. Grouped matmul over the local experts; empty rows (id el) join the last group, masked.
    r = sort_by_expert(e_recv, el + 1)
    sizes = r.group_sizes_E[:el].at[el - 1].add(r.group_sizes_E[el])
    ge = jnp.minimum(r.experts_A, el - 1)
    grouped = functools.partial(grouped_experts, grouped=grouped, unpack_mib=unpack_mib)
    h = grouped(r.rows(x_recv), w1_EDF, sizes) + expert_rows(b1_EF, ge)
    y = grouped(swiglu(h, limit, blocked), w2_EFD, sizes)
    if mlp_axes:  # each device computed its slice of F: sum the partial outputs
        y = jax.lax.psum(y, mlp_axes)
    y = jnp.where((r.experts_A < el)[:, None], y + expert_rows(b2_ED, ge), 0.0)
    y_recv = r.unsort(y)  # back to arrival order

    # 5. Back to the sources, each assignment from its slot (a dropped one: zeros), combined.
    y_back = jax.lax.all_to_all(y_recv, expert_axes, 0, 0, tiled=True) if expert_axes else y_recv
    y_TD = combine(take_rows(y_back, slot_A, assignment_of_slot).reshape(t, k, d), weights_Tk)
    dropped = jnp.sum(~kept).astype(jnp.float32)
    if batch_axes:
        dropped = jax.lax.psum(dropped, batch_axes)
    return y_TD[:, :hidden], dropped


def moe_expert_parallel(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float,
                        capacity_factor: float, rules=RULES, *, kernel: str | None = None,
                        interpret: bool = False, unpack_mib: int = 0, tile: Tile = TILE
                        ) -> tuple[jax.Array, jax.Array]:
    """Returns (output [T, D], fraction of assignments dropped), on the mesh in context.
    `kernel` ("megablox", "triton"): the local grouped matmuls by that Pallas kernel instead of
    `lax.ragged_dot` (and packed experts unpacked `unpack_mib` MiB at a time; `tile`:
    megablox's tiles)."""
    mesh = jax.sharding.get_abstract_mesh()
    t, k = routing.experts_Tk.shape
    grouped: GroupedMatmul = jax.lax.ragged_dot
    if kernel is not None:
        grouped = functools.partial(grouped_matmul, kernel=kernel, interpret=interpret, tile=tile)
    # lax.ragged_dot takes no group offset: without a kernel a packed stack unpacks whole.
    kwargs = dict(limit=limit, factor=capacity_factor, grouped=grouped,
                  unpack_mib=unpack_mib if kernel is not None else 0)
    if mesh.empty:
        w, blocked = gate_up_blocked(w, slots_per_pair(t * k, 1, capacity_factor), 1, 1)
        y, dropped = _local_moe(x_TD, routing.experts_Tk, routing.weights_Tk, *w, expert_axes=(),
                                mlp_axes=(), batch_axes=(), n=1, blocked=blocked, **kwargs)
        return y, dropped / (t * k)
    batch_axes = mesh_axes(mesh, ("batch",), rules)
    expert_axes = mesh_axes(mesh, ("experts",), rules)
    mlp_axes = mesh_axes(mesh, ("mlp",), rules)
    n = math.prod(mesh.shape[a] for a in expert_axes)
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    e, f2 = w.gate_up_EDF2.shape[0], w.gate_up_EDF2.shape[2]
    tp = math.prod(mesh.shape[a] for a in mlp_axes)
    if not set(expert_axes) <= set(batch_axes):
        raise ValueError(f"expert_parallel: the experts' mesh axes {expert_axes} must also split "
                         f"the batch (batch axes {batch_axes}): tokens are exchanged over them")
    if e % n:
        raise ValueError(f"expert_parallel: num_experts={e} is not divisible by the expert axis "
                         f"size {'x'.join(expert_axes)}={n}")
    if (f2 // 2) % tp:
        raise ValueError(f"expert_parallel: intermediate_size={f2 // 2} is not divisible by the "
                         f"mlp axes {'x'.join(mlp_axes)}={tp} (gate/linear pairs must stay "
                         f"together)")
    if t % shards:
        raise ValueError(f"expert_parallel: {t} tokens are not divisible by the batch axes "
                         f"{'x'.join(batch_axes)}={shards}")
    ba, ea, ma = (batch_axes or None), (expert_axes or None), (mlp_axes or None)
    tok, tok_k = P(ba, None), P(ba, None)
    rows = n * slots_per_pair(t // shards * k, n, capacity_factor)
    w, blocked = gate_up_blocked(w, rows, math.prod(mesh.shape.values()), tp)
    fn = functools.partial(_local_moe, expert_axes=expert_axes, mlp_axes=mlp_axes,
                           batch_axes=batch_axes, n=n, blocked=blocked,
                           width=exchange_width(x_TD.shape[1], kernel, n, w, rows, tp),
                           **kwargs)
    y, dropped = jax.shard_map(
        fn, mesh=mesh,
        in_specs=(tok, tok_k, tok_k, stack_spec(w.gate_up_EDF2, (ea, None, ma)), P(ea, ma),
                  stack_spec(w.down_EFD, (ea, ma, None)), P(ea, None)),
        # A Pallas call's outputs carry no varying-axes type, so with a kernel the check is off.
        out_specs=(tok, P()), check_vma=kernel is None,
    )(x_TD, routing.experts_Tk, routing.weights_Tk, *w)
    return y, dropped / (t * k)


def _local_gmm(x_TD, experts_Tk, weights_Tk, w1, b1, w2, b2, *, limit: float, interpret: bool,
               kernel: str, mlp_axes: tuple[str, ...], unpack_mib: int, tile: Tile,
               blocked: bool = False):
    t, d = x_TD.shape
    k = experts_Tk.shape[1]
    s = sort_by_expert(experts_Tk, w1.shape[0])
    # Packed stacks: unpacked on this device, a group of experts at a time.
    grouped = functools.partial(
        grouped_experts, unpack_mib=unpack_mib,
        grouped=functools.partial(grouped_matmul, kernel=kernel, interpret=interpret, tile=tile))
    h_AF2 = grouped(s.rows(x_TD), w1, s.group_sizes_E) + expert_rows(b1, s.experts_A)
    y_AD = grouped(swiglu(h_AF2, limit, blocked), w2, s.group_sizes_E)
    if mlp_axes:
        y_AD = jax.lax.psum(y_AD, mlp_axes)
    y_AD = y_AD + expert_rows(b2, s.experts_A)
    return combine(s.unsort(y_AD).reshape(t, k, d), weights_Tk)


def moe_gmm(x_TD: jax.Array, routing: Routing, w: ExpertWeights, limit: float, *,
            kernel: str = "megablox", interpret: bool = False, unpack_mib: int = 0,
            tile: Tile = TILE) -> jax.Array:
    """`moe_ragged` with grouped-matmul kernels (`kernel`: "megablox" for TPU, "triton" for
    GPU), packed experts unpacked `unpack_mib` MiB at a time (`grouped_experts`), megablox's
    `tile`; on the mesh in context (see module doc)."""
    mesh = jax.sharding.get_abstract_mesh()
    t, k = routing.experts_Tk.shape
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        w, blocked = gate_up_blocked(w, t * k, 1, 1)
        return _local_gmm(x_TD, routing.experts_Tk, routing.weights_Tk, *w, limit=limit,
                          interpret=interpret, kernel=kernel, mlp_axes=(), unpack_mib=unpack_mib,
                          tile=tile, blocked=blocked)
    batch, mlp = mesh_axes(mesh, ("batch",)), mesh_axes(mesh, ("mlp",))
    if t % math.prod(mesh.shape[a] for a in batch):
        batch = ()
    bs, ms = batch or None, mlp or None
    shards = math.prod(mesh.shape[a] for a in batch)
    w, blocked = gate_up_blocked(w, t // shards * k, math.prod(mesh.shape.values()),
                                 math.prod(mesh.shape[a] for a in mlp))
    args = (x_TD, routing.experts_Tk, routing.weights_Tk, *w)
    fn = functools.partial(_local_gmm, limit=limit, interpret=interpret, kernel=kernel,
                           mlp_axes=mlp, unpack_mib=unpack_mib, tile=tile, blocked=blocked)
    return jax.shard_map(
        fn, mesh=mesh,
        in_specs=(P(bs), P(bs), P(bs), stack_spec(w.gate_up_EDF2, (None, None, ms)), P(None, ms),
                  stack_spec(w.down_EFD, (None, ms, None)), P()),
        out_specs=P(bs), check_vma=False,
    )(*args)
