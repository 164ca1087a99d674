"""ModelIR: what tracing learned about a model, unit by unit (docs/DESIGN.md 4.2).

Where it sits: `ir.trace()` builds it from a ModelConfig; the planner reads it; it prints as a table.
Try it: `megatrain inspect --model tiny --seq-len 128`.

Byte counts are for one micro-batch of `micro_batch x seq_len` tokens in the compute dtype, except where a
field says otherwise. Parameters are transferred in the compute dtype as one flat buffer per unit.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal

import networkx as nx
from pydantic import Field
from rich.table import Table

from .base import IRModel, dtype_bytes
from .display import fmt_count, format_bytes, render

UnitKind = Literal["embed", "block", "head"]


class TensorSpec(IRModel):
    """Name, shape and dtype of one tensor; no data."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


class ParamSlice(IRModel):
    """Where one parameter lives inside its unit's flat buffer (element offsets)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class ChunkFigures(IRModel):
    """A unit's figures when its token-wise work is tiled in chunks of `chunk_tokens` (None: untiled), as the
    trace priced them for the planner's `chunks` pass; the other fields of UnitIR do not depend on it."""

    chunk_tokens: int | None
    flops_fwd: int
    flops_bwd: int = Field(description="includes the tiles' recompute in backward")
    flops_recompute: int | None = Field(None, description="as UnitIR's")
    saved_bytes: int
    peak_fwd_bytes: int
    peak_bwd_bytes: int
    peak_bwd_replay_bytes: int | None = Field(None, description="as UnitIR's")
    graph_nodes: int = Field(description="as UnitIR's")


class UnitIR(IRModel):
    """One streaming unit: its parameters, carries, costs and memory."""

    name: str = Field(description="unit id, also the prefix of its parameter names in build_eager()")
    index: int
    kind: UnitKind
    template: str = Field(description="key of the stateless template this unit runs")
    params: tuple[ParamSlice, ...] = Field(description="layout of the unit's flat parameter buffer")
    flat_numel: int = Field(description="elements in the flat buffer, including alignment padding")
    tied: dict[str, str] = Field(
        default_factory=dict,
        description="parameter name -> 'unit.param' it shares storage with in the model (tied embeddings)",
    )
    buffers: tuple[TensorSpec, ...] = Field((), description="state that is not a parameter (MoE routing), fp32")
    carry_in: tuple[TensorSpec, ...]
    carry_out: tuple[TensorSpec, ...]
    flops_fwd: int = Field(description="forward FLOPs for one micro-batch (FlopCounterMode)")
    flops_bwd: int = Field(description="backward FLOPs for one micro-batch, recompute excluded")
    flops_recompute: int | None = Field(
        None, description="FLOPs of the forward a backward recomputes from the checkpoint, which skips work whose "
        "values no gradient reads (models/unevaluated.py); None: flops_fwd")
    attn_flops_fwd: int = Field(0, description="of flops_fwd, the fused attention's: quadratic in the sequence, "
                                "counted in full (T x T) as FlopCounterMode does, though causal kernels skip half")
    attn_flops_bwd: int = Field(0, description="of flops_bwd, the fused attention's")
    saved_bytes: int = Field(description="bytes autograd saves for backward, parameters and inputs excluded")
    peak_fwd_bytes: int = Field(description="peak of bytes allocated inside a no-grad forward, its outputs "
                                "excluded (the program holds them as the next unit's carry)")
    peak_bwd_bytes: int = Field(
        description="peak of bytes allocated inside forward-with-grad plus autograd.grad, the parameters' "
        "gradients included; the incoming gradient and the carry's gradient excluded (program buffers)"
    )
    graph_nodes: int = Field(
        0, description="ops of the unit's forward, which price its per-op overhead: the nodes of its torch.fx "
        "graph (make_fx), or, for a trace scaled from a short length (traced_seq_len), the ops its no-grad forward "
        "dispatches plus one per input and output, each tiled loop's ops counted once per iteration")
    rebuild_bytes: int | None = Field(
        None, description="bytes the forward records so the backward can rebuild the carry-in from the carry-out "
        "(DepthSSD: its sub-layer inputs); None when the unit cannot rebuild"
    )
    replay: tuple[TensorSpec, ...] = Field(
        (), description="the fused attention outputs (output, log-sum-exp) a forward records so that the "
        "backward's recompute replays them instead of running attention (models/replay.py); empty: it cannot")
    peak_bwd_replay_bytes: int | None = Field(
        None, description="peak_bwd_bytes of a backward whose recompute replays attention (the record is a "
        "program buffer, not counted here); None when the unit cannot replay")
    chunk_options: tuple[ChunkFigures, ...] = Field(
        (), description="the unit's figures untiled and at each candidate chunk size (empty: not priced)")

    @property
    def recompute_flops(self) -> int:
        """FLOPs of the forward that a backward recomputes (flops_recompute, else the whole forward's)."""
        return self.flops_fwd if self.flops_recompute is None else self.flops_recompute

    @property
    def replay_bytes(self) -> int:
        """Bytes of the attention record a replaying unit keeps with its checkpoint (0: it cannot replay)."""
        return sum(t.nbytes for t in self.replay)

    @property
    def replay_recompute_flops(self) -> int:
        """FLOPs of a recompute that replays attention: recompute_flops less the fused attention's forward."""
        return self.recompute_flops - self.attn_flops_fwd

    @property
    def n_params(self) -> int:
        """Parameters this unit owns (tied ones are counted at their owner)."""
        return sum(p.numel for p in self.params if p.name not in self.tied)

    def host_params(self) -> tuple[ParamSlice, ...]:
        """The owned parameters where the host holds them (fp32 master, moments): at their flat-buffer offsets,
        or for a unit holding tied parameters back to back without them (a tied one lives at its owner, so
        the host keeps no master or moments for it here)."""
        if not self.tied:
            return self.params
        out, at = [], 0
        for p in self.params:
            if p.name not in self.tied:
                out.append(p.replace(offset=at))
                at += p.numel
        return tuple(out)

    @property
    def host_numel(self) -> int:
        """Elements of the unit's host master and of each moment: the flat buffer (padding included, so an fp32
        master crosses the link as it is), or only the owned parameters of a unit holding tied ones."""
        return self.flat_numel if not self.tied else self.n_params

    def param_bytes(self, dtype: str) -> int:
        """Bytes of the flat buffer in `dtype`: what one transfer moves."""
        return self.flat_numel * dtype_bytes(dtype)

    @property
    def carry_in_bytes(self) -> int:
        return sum(t.nbytes for t in self.carry_in)

    @property
    def carry_out_bytes(self) -> int:
        return sum(t.nbytes for t in self.carry_out)

    @property
    def buffer_bytes(self) -> int:
        return sum(t.nbytes for t in self.buffers)

    def buffer_offset(self, dtype: str) -> int:
        """Byte offset of the unit's buffers in a parameter slot: after its flat parameters in `dtype`, on a
        64-byte boundary. Buffers (fp32, packed in `buffers` order) stream with the unit, in its slot."""
        return -(-self.param_bytes(dtype) // 64) * 64

    def slot_bytes(self, dtype: str) -> int:
        """Bytes of a parameter slot holding this unit: its parameters, then its buffers if it has any."""
        return self.buffer_offset(dtype) + self.buffer_bytes if self.buffers else self.param_bytes(dtype)


class ModelIR(IRModel):
    """A traced model: units in depth order, resident constants, and the unit dependency graph."""

    model: str = Field(description="preset or config name")
    config: dict = Field(description="the ModelConfig as JSON data")
    micro_batch: int
    seq_len: int
    dtype: str = Field(description="compute dtype: what moves over the link and what the device computes in")
    target: Literal["cuda", "cpu"] = Field("cuda", description="the device whose kernels the trace stands for")
    packed: bool = Field(False, description="traced for packed micro-batches: several documents per row, "
                         "attention within each (models/layers.py packing)")
    units: tuple[UnitIR, ...]
    resident: tuple[TensorSpec, ...] = Field(description="per-step constants kept on device (RoPE tables)")
    edges: tuple[tuple[str, str, str], ...] = Field(
        description="(src unit, dst unit, kind) with kind in carry | skip | tied"
    )
    chunk_tokens: int | None = Field(None, description="tokens per chunk of the units' tiled token-wise work "
                                     "(StepInputs.chunk_tokens, models/tiled.py); None: untiled")
    traced_seq_len: int | None = Field(None, description="the sequence length the templates were traced at when "
                                       "the figures were scaled to seq_len (ir/scaled.py); None: traced at seq_len")
    trace_seconds: float = 0.0

    @property
    def params_total(self) -> int:
        return sum(u.n_params for u in self.units)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self.resident)

    @property
    def chunk_choices(self) -> tuple[int | None, ...]:
        """The chunk sizes every unit was priced at (None: untiled), in the trace's order."""
        sets = [tuple(o.chunk_tokens for o in u.chunk_options) for u in self.units]
        return sets[0] if sets and all(s == sets[0] for s in sets) else ()

    def with_chunk(self, chunk: int | None) -> ModelIR:
        """This IR with every unit's figures at `chunk` (one of `chunk_choices`) and chunk_tokens set."""
        if chunk not in self.chunk_choices:
            raise ValueError(f"chunk size {chunk} was not priced by the trace; choose one of {self.chunk_choices}")
        units = []
        for u in self.units:
            f = next(o for o in u.chunk_options if o.chunk_tokens == chunk)
            units.append(u.replace(**{k: getattr(f, k) for k in type(f).model_fields if k != "chunk_tokens"}))
        return self.replace(units=tuple(units), chunk_tokens=chunk)

    def without_replay(self) -> ModelIR:
        """This IR with no unit able to replay its attention (a runtime that cannot: compiled units, whose
        torch.compile'd calls a dispatch mode does not see)."""
        strip = dict(replay=(), peak_bwd_replay_bytes=None)
        return self.replace(units=tuple(u.replace(**strip, chunk_options=tuple(
            o.replace(peak_bwd_replay_bytes=None) for o in u.chunk_options)) for u in self.units))

    def unit(self, name: str) -> UnitIR:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit {name!r}; units are {[u.name for u in self.units][:4]}...")

    @cached_property
    def _graph(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for u in self.units:
            g.add_node(u.name, index=u.index, kind=u.kind)
        for src, dst, kind in self.edges:
            g.add_edge(src, dst, kind=kind)
        return g

    def graph(self) -> nx.DiGraph:
        """The unit dependency graph; a DAG whose topological order is the depth order."""
        return self._graph.copy()

    def __str__(self) -> str:
        return format_model_ir(self)


def model_ir_table(ir: ModelIR, collapse: bool = True) -> Table:
    """Per-unit table; runs of identical blocks collapse into one row (`blocks.0-79 x80`)."""
    tokens = ir.tokens
    mixing = ir.config.get("depth_mixing", "residual")
    rebuild = any(u.rebuild_bytes is not None for u in ir.units)
    t = Table(title=f"{ir.model}: {fmt_count(ir.params_total)} params, micro-batch {ir.micro_batch} x "
                    f"{ir.seq_len} tokens, {ir.dtype}" + ("" if mixing == "residual" else f", depth mixing {mixing}"),
              title_justify="left")
    cols = ("unit", "params", "FLOPs/token fwd", "FLOPs/token bwd", "saved", "carry in", "carry out", "peak bwd")
    for col in (*cols, *(("rebuild ckpt",) if rebuild else ())):
        t.add_column(col, justify="left" if col == "unit" else "right")
    rows: list[list] = []
    for u in ir.units:
        key = (u.template, u.n_params, u.flops_fwd, u.flops_bwd, u.saved_bytes, u.carry_in_bytes, u.carry_out_bytes,
               u.peak_bwd_bytes, u.rebuild_bytes)
        if collapse and rows and rows[-1][0] == key:
            rows[-1][2] = u.name
            rows[-1][3] += 1
        else:
            rows.append([key, u.name, u.name, 1, u])
    for _key, first, last, count, u in rows:
        label = first if count == 1 else f"{first}-{last.split('.')[-1]} x{count}"
        t.add_row(label, fmt_count(u.n_params), fmt_count(u.flops_fwd / tokens), fmt_count(u.flops_bwd / tokens),
                  format_bytes(u.saved_bytes), format_bytes(u.carry_in_bytes), format_bytes(u.carry_out_bytes),
                  format_bytes(u.peak_bwd_bytes),
                  *((format_bytes(u.rebuild_bytes) if u.rebuild_bytes is not None else "-",) if rebuild else ()))
    fwd = sum(u.flops_fwd for u in ir.units)
    bwd = sum(u.flops_bwd for u in ir.units)
    t.add_section()
    t.add_row("total", fmt_count(ir.params_total), fmt_count(fwd / tokens), fmt_count(bwd / tokens),
              format_bytes(sum(u.saved_bytes for u in ir.units)), "", "", "", *(("",) if rebuild else ()))
    return t


def notes(ir: ModelIR) -> list[str]:
    """What the table's figures are, for a long-sequence trace: scaled, and priced at other chunk sizes."""
    out = []
    if ir.traced_seq_len is not None:
        out.append(f"traced at {ir.traced_seq_len:,} tokens and scaled to {ir.seq_len:,} (ir/scaled.py): bytes and "
                   "FLOPs exact, graph nodes extrapolated")
    if ir.chunk_tokens is not None:
        out.append(f"units tiled in chunks of {ir.chunk_tokens:,} tokens")
    attn = sum(u.attn_flops_fwd for u in ir.units) / max(1, sum(u.flops_fwd for u in ir.units))
    if attn >= 0.01:
        out.append(f"fused attention: {attn:.0%} of forward FLOPs (counted in full, T x T)")
    choices = [c for c in ir.chunk_choices if c is not None]
    if choices:
        block = max((u for u in ir.units if u.kind == "block"), key=lambda u: u.peak_bwd_bytes, default=None)
        if block is not None:
            figs = {o.chunk_tokens: o for o in block.chunk_options}
            out.append(f"{block.name} tiled (for the planner's chunks pass), peak bwd: " + ", ".join(
                f"{c:,} tokens {format_bytes(figs[c].peak_bwd_bytes)}" for c in choices[:1] + choices[-1:])
                + f"; untiled {format_bytes(figs[None].peak_bwd_bytes)}")
    return out


def format_model_ir(ir: ModelIR) -> str:
    return render(model_ir_table(ir)) + "".join(line + "\n" for line in notes(ir))
