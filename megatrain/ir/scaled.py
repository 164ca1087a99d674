"""Measuring a unit at a short sequence and scaling its figures to a long one, exactly.

Where it sits: ir/trace.py traces each template through `measure`; for a long sequence (or to price several
chunk sizes from one trace) it traces at a short `Scale` and evaluates the figures at the real sequence
length and chunk size with `Measured.at`. Try it: `pytest tests/ir/test_scaled.py -q`.

Why it is exact: every tensor a unit creates has a shape whose sequence-long dimensions are multiples of the
traced sequence length T' (B x T' flattened, or a whole N x B x T' x d state) and whose chunk-long ones small
multiples of the traced chunk C'; the scale picks T' and C' so that no dimension or parameter size of the
model is one. Each storage is classed by how many of
each it has, so its bytes at (T, C) are its traced bytes x (T/T')^a x (C/C')^b, integers throughout. A
tiled loop runs the same ops in every iteration on chunk-sized tensors, with its full-length outputs
allocated once, so the live bytes after each allocation form the same set of classed sums at any number of
iterations: the peak at (T, C) is the largest of those sums evaluated there. FLOPs are linear in T except
the fused attention's, which FlopCounterMode's formula makes quadratic (it counts the full T x T).
The graph size is the one figure that is not exact: a scaled trace counts the ops its no-grad forward
dispatches (plus inputs and output) rather than make_fx's nodes, which also records autograd's bookkeeping
ops (10-25% more), and adds the ops of one iteration of each loop (`tiled.region`) once per iteration more
at (T, C) than traced. It only prices dispatch overhead, which a long sequence's kernels dwarf.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from megatrain.models import tiled

Class = tuple[int, int]  # (sequence-long dimensions, chunk-long dimensions) of a storage's shape
# the largest multiples of the traced length and chunk a dimension may be to count as sequence- or chunk-long:
# mixings flatten whole states (N x B x T x d), tiles only batch x chunk
SEQ_MULTIPLE, CHUNK_MULTIPLE = 2**20, 64
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")


@dataclass(frozen=True)
class Scale:
    """The traced sequence length and chunk (None: untiled) of a measurement, for micro-batch size `batch`.
    A dimension that is a multiple of the traced length (B x T', or a whole state N x B x T' x d flattened)
    is sequence-long, else one that is a small multiple of the chunk (B x C') is chunk-long."""

    seq: int
    chunk: int | None
    batch: int

    def _degree(self, size: int) -> Class:
        if size % self.seq == 0 and size // self.seq <= SEQ_MULTIPLE:
            return 1, 0
        if self.chunk is not None and size % self.chunk == 0 and size // self.chunk <= CHUNK_MULTIPLE:
            return 0, 1
        return 0, 0

    def classify(self, shape) -> Class:
        a = b = 0
        for size in shape:
            da, db = self._degree(size)
            a, b = a + da, b + db
        return a, b

    def scale_bytes(self, cls: Class, nbytes: int, seq: int, chunk: int | None) -> int:
        a, b = cls
        num, den = seq**a, self.seq**a
        if b:
            num, den = num * chunk**b, den * self.chunk**b
        return nbytes * num // den

    def scale_shape(self, shape, seq: int) -> tuple[int, ...]:
        """A carry's shape at `seq` tokens (carries are never chunk-sized)."""
        return tuple(size // self.seq * seq if self._degree(size) == (1, 0) else size for size in shape)


def choose_scale(seq_len: int, batch: int, loss_chunk: int, forbidden: set[int], chunked: bool) -> Scale:
    """A short trace length T' = q x loss_chunk (whole loss chunks, at least three) and a chunk C' = T'/m
    (m >= 3 tiles) such that every dimension in `forbidden` (the model's) and the loss chunk class as neither,
    T' and B x T' as sequence-long, C' and B x C' as chunk-long. Three iterations of each loop: the first
    allocates, the second may still alias the first's results, from the third on every iteration is the same."""
    others = forbidden | {loss_chunk, batch * loss_chunk}
    for q in range(3, 64):
        seq = q * loss_chunk
        for m in (3, 4, 5, 6, 7, 8) if chunked else (None,):
            if m is not None and seq % m:
                continue
            sc = Scale(seq, None if m is None else seq // m, batch)
            tiles = () if m is None else (sc.chunk, batch * sc.chunk)
            if (all(sc.classify((f,)) == (0, 0) for f in others) and sc.classify((seq, batch * seq)) == (2, 0)
                    and all(sc.classify((c,)) == (0, 1) for c in tiles)):
                return sc
    raise ValueError(f"found no short trace length for seq_len {seq_len} with loss chunk {loss_chunk} that divides "
                     "no model dimension; trace with scaled=False and chunk_options=False")


def _flash_backward_workspace(grad_out, q, k, v, *_):
    """What CUDA's flash-attention backward allocates besides its outputs (FlashAttention-2, as torch ships
    it): an fp32 accumulator of dq (B, T, H, hd rounded up to 32) and, for grouped-query heads, dk and dv
    expanded to the query's heads before they are summed back (meta tensors: shapes only)."""
    B, H, T, hd = q.shape
    out = [torch.empty((B, T, H, -(-hd // 32) * 32), dtype=torch.float32, device=q.device)]
    if k.shape[1] != H:
        out += [torch.empty((B, k.shape[2], H, hd), dtype=q.dtype, device=q.device) for _ in range(2)]
    return out


_WORKSPACE = {torch.ops.aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_workspace}


class LiveBytes(TorchDispatchMode):
    """Follows storages created by ops until they die, classed by `scale` (all (0, 0) without one): the live
    bytes after every allocation (as classed sums, `sums`), and the dispatched ops, per `tiled.region` too.
    `exclude` takes a storage out of every sum from its allocation on: a program buffer holds it."""

    def __init__(self, scale: Scale | None = None, inputs=()) -> None:
        super().__init__()
        self.scale = scale
        # storages that existed before (parameters, the carry, RoPE tables, the batch) are program buffers:
        # a view an op makes of one allocates nothing
        self.inputs = {t.untyped_storage()._cdata for t in inputs}
        self.live: dict[int, tuple[Class, int]] = {}
        self.current: Counter = Counter()
        self.snaps: list[tuple[tuple[Class, int], ...]] = []  # the classed live sums after each allocation
        self.born: dict[int, int] = {}  # storage -> index of the snapshot its allocation made
        self.died: dict[int, int] = {}  # storage -> number of snapshots when it was freed
        self.excluded: list[tuple[int, int | None, Class, int]] = []
        self.ops = 0
        self.region_ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        workspace = _WORKSPACE.get(func)
        scratch = workspace(*args) if workspace is not None else ()
        for t in scratch:  # allocated before the op's outputs and alive with them, freed when it returns
            self._track(t)
        out = func(*args, **(kwargs or {}))
        del scratch
        self.ops += 1
        name = tiled.current_region()
        if name is not None:
            self.region_ops[name] += 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def cls(self, t: torch.Tensor) -> Class:
        return self.scale.classify(t.shape) if self.scale is not None else (0, 0)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live or key in self.inputs:
            return
        cls, n = self.cls(t), storage.nbytes()
        self.live[key] = (cls, n)
        self.current[cls] += n
        self.snaps.append(tuple(sorted(self.current.items())))
        self.born[key] = len(self.snaps) - 1
        self.died.pop(key, None)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        cls, n = self.live.pop(key, ((0, 0), 0))
        self.current[cls] -= n
        self.died[key] = len(self.snaps)

    def exclude(self, tensors) -> None:
        """Count these tensors' storages (made in this mode) as a program buffer's from their allocation on."""
        for t in tensors:
            key = t.untyped_storage()._cdata
            if key in self.born and key in self.live:
                cls, n = self.live[key]
                self.excluded.append((self.born[key], self.died.get(key), cls, n))

    @property
    def sums(self) -> set[tuple[tuple[Class, int], ...]]:
        """The distinct classed live sums after each allocation, exclusions taken out."""
        out = set()
        for i, snap in enumerate(self.snaps):
            d = Counter(dict(snap))
            for start, end, cls, n in self.excluded:
                if start <= i and (end is None or i < end):
                    d[cls] -= n
            out.add(tuple(sorted(d.items())))
        return out

    def storage_class(self, t: torch.Tensor) -> tuple[Class, int]:
        """The class and bytes of a tensor's storage (created in this mode, else classed by its shape)."""
        storage = t.untyped_storage()
        return self.live.get(storage._cdata, (self.cls(t), storage.nbytes()))


@dataclass
class Measured:
    """One template's measurement at `scale`; `at(seq, chunk)` gives its figures there."""

    scale: Scale | None
    loss_chunk: int
    flops_fwd: Counter  # {"linear" | "attention": FLOPs}
    flops_bwd: Counter
    flops_recompute: Counter  # the forward as a backward recomputes it (models/unevaluated.py)
    saved: Counter  # class -> bytes
    fwd_sums: set
    bwd_sums: set
    graph_nodes: int
    ops: int
    region_ops: Counter
    region_iters: Counter
    rebuild: Counter | None = None
    bwd_replay_sums: set | None = None  # a backward whose recompute replays attention (models/replay.py)
    extra: dict = field(default_factory=dict)

    def _bytes(self, classed, seq: int, chunk: int | None) -> int:
        if self.scale is None:
            return sum(n for _, n in classed)
        return sum(self.scale.scale_bytes(c, n, seq, chunk) for c, n in classed)

    def _flops(self, flops: Counter, seq: int) -> int:
        if self.scale is None:
            return flops["linear"] + flops["attention"]
        t = self.scale.seq
        return flops["linear"] * seq // t + flops["attention"] * seq * seq // (t * t)

    def _iters(self, name: str, seq: int, chunk: int | None) -> int:
        s = self.scale
        if name == "tile":
            calls = self.region_iters[name] // -(-s.seq // s.chunk)
            return calls * -(-seq // chunk)
        return -(-s.batch * seq // self.loss_chunk)  # "loss": over the micro-batch's flattened tokens

    def _nodes(self, seq: int, chunk: int | None) -> int:
        if self.scale is None:
            return self.graph_nodes
        extra = 0
        for name, n in self.region_ops.items():
            extra += n // self.region_iters[name] * (self._iters(name, seq, chunk) - self.region_iters[name])
        return self.graph_nodes + extra

    def at(self, seq: int, chunk: int | None) -> dict:
        """The unit's figures at `seq` tokens in chunks of `chunk` (exact but for graph_nodes)."""
        def peak(sums) -> int:
            return max((self._bytes(s, seq, chunk) for s in sums), default=0)

        t = self.scale.seq if self.scale is not None else seq
        attention = {f"attn_flops_{k}": c["attention"] * seq * seq // (t * t)
                     for k, c in (("fwd", self.flops_fwd), ("bwd", self.flops_bwd))}
        return dict(flops_fwd=self._flops(self.flops_fwd, seq), flops_bwd=self._flops(self.flops_bwd, seq),
                    flops_recompute=self._flops(self.flops_recompute, seq), **attention,
                    saved_bytes=self._bytes(self.saved.items(), seq, chunk), peak_fwd_bytes=peak(self.fwd_sums),
                    peak_bwd_bytes=peak(self.bwd_sums), graph_nodes=self._nodes(seq, chunk),
                    peak_bwd_replay_bytes=None if self.bwd_replay_sums is None else peak(self.bwd_replay_sums),
                    rebuild_bytes=None if self.rebuild is None else self._bytes(self.rebuild.items(), seq, chunk))


def _gqa_heads(formula, query: int):
    """A fused-attention FLOP formula that takes grouped-query shapes (fewer key/value heads, which the kernel
    broadcasts): key and value are counted at the query's head count. Older torch asserts equal heads."""
    def count(*args, **kwargs):
        q = args[query]
        # NOTE: shapes, not tensors: the formula reads only shapes (shape_wrapper), and a tensor made here would
        # be an allocation the trace's memory tracking counts
        wide = [torch.Size((*t.shape[:1], q.shape[1], *t.shape[2:]))
                if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] != q.shape[1] else t
                for t in args[query + 1 : query + 3]]
        return formula(*args[: query + 1], *wide, *args[query + 3 :], **kwargs)

    return count


def _any_out_dtype(formula):
    """addmm's FLOP formula for every overload: `addmm.dtype` passes its out_dtype positionally."""
    def count(self, mat1, mat2, *_, out_val=None, **__):
        return formula(self, mat1, mat2, out_val=out_val)

    return count


def flop_formulas() -> dict:
    """torch's FlopCounterMode formulas (`flop_registry`) completed for what a trace runs, in a copy: torch's
    own table stays as it was, for every other user of FlopCounterMode in the process."""
    aten = torch.ops.aten
    table = dict(flop_registry)
    # torch knows CUDA's fused attention kernels but not the CPU's: count them with the same formulas
    table.setdefault(aten._scaled_dot_product_flash_attention_for_cpu,
                     table[aten._scaled_dot_product_flash_attention])
    table.setdefault(aten._scaled_dot_product_flash_attention_for_cpu_backward,
                     table[aten._scaled_dot_product_flash_attention_backward])
    for op, query in ((aten._scaled_dot_product_flash_attention, 0),
                      (aten._scaled_dot_product_flash_attention_for_cpu, 0),
                      (aten._scaled_dot_product_flash_attention_backward, 1),
                      (aten._scaled_dot_product_flash_attention_for_cpu_backward, 1)):
        table[op] = _gqa_heads(table[op], query)
    table[aten.addmm] = _any_out_dtype(table[aten.addmm])
    return table


class FlopCount(TorchDispatchMode):
    """FLOPs of the dispatched ops by `flop_formulas`, as {"linear": .., "attention": ..}.
    NOTE: FlopCounterMode itself tracks modules with autograd hooks, which a nested autograd.grad (a tiled
    piece's backward) does not support; this counts the same global totals without them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.formulas = flop_formulas()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in self.formulas:
            kind = "attention" if any(a in str(packet) for a in ATTENTION_OPS) else "linear"
            self.counts[kind] += self.formulas[packet](*args, **kwargs, out_val=out)
        return out
