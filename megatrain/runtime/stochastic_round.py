"""Stochastic rounding of fp32 to bf16: how the bf16 policies store their AdamW moments (planner/host_policy.py).

Why: at beta2 0.999 the second moment moves by about a thousandth of itself a step, less than half of bf16's
spacing, so round-to-nearest puts it back where it was and v stagnates well above the exact one
(docs/log/2026-12-06-host-policy-shadow.md). Stochastic rounding rounds up with the probability of the distance
from the lower neighbour, so a rounded moment equals the fp32 one in expectation and small steps add up.

How: add 16 random bits to the fp32 bit pattern and drop the low 16 bits. A NaN is written as c10's rounding
writes it (0x7FC0); an infinity has zero low bits and stays; nothing finite can carry into the sign bit (the
largest finite plus 0xFFFF is at most an infinity's pattern plus 0xFFFE), and a value past the largest finite
bf16 rounds up to infinity with its share of probability, as to any upper neighbour.

The random bits are a pure function of (parameter key, step, element index within the whole parameter), so
training stays a function of its seed: the host store, the eager reference and every data-parallel rank
(a shard is a slice of its parameter at `Moments.origin`) draw the same bits for the same element. Per step and
parameter a seed = lowbias32(key ^ lowbias32(step)), distinct for every step; per element 32 bits
h = x ^ (x >> 16), x = ((index x WEYL) ^ seed) x MUL1 (mod 2^32): its high 16 bits round the first moment, its
low 16 bits the second. For one element the input (index x WEYL) ^ seed is a different word at every step, so
its draws are uniform over steps; the Weyl product spreads neighbouring indices over the word, the multiply and
shift mix them into both halves. One multiply where lowbias32 per element took two: the C loop's rounding cost
(docs/log/2026-12-06-stochastic-rounding.md). The key is the CRC-32 of the parameter's eager name
(`param_key`), which the store (`unit.param`) and the reference (named_parameters) share. Indices are taken
modulo 2^32: elements 2^32 apart in one parameter share their bits. host_kernel.c computes the same bits
(`sr_bits`, `f32_to_bf16_sr`) from the seed computed here; host_kernel.self_check compares the two paths bit
for bit.
"""

from __future__ import annotations

import zlib

import torch

MASK = 0xFFFFFFFF
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers; MUL1 also the per-element one (host_kernel.c)
WEYL = 0x9E3779B9  # 2^32 / golden ratio, odd: the index's multiplier (host_kernel.c SR_WEYL)
BF16_NAN = 0x7FC0  # c10's bf16 of any NaN


def lowbias32(x: int) -> int:
    x &= MASK
    x ^= x >> 16
    x = (x * MUL1) & MASK
    x ^= x >> 15
    x = (x * MUL2) & MASK
    return x ^ (x >> 16)


def param_key(name: str) -> int:
    """A parameter's key from its eager name (`blocks.0.attn.wq`), the same in the store and the reference."""
    return zlib.crc32(name.encode())


def step_seed(key: int, step: int) -> int:
    """The seed of one parameter's rounding at AdamW step `step` (the count after the update, 1-based)."""
    return lowbias32(key ^ lowbias32(step))


def element_bits(seed: int, index: int) -> int:
    """The 32 random bits of element `index` of a parameter under `seed` (what `draws` computes per element)."""
    x = (((index * WEYL) & MASK) ^ seed) * MUL1 & MASK
    return x ^ (x >> 16)


SLICE = 1 << 15  # elements per pass of `round_moments`: its int64 scratch stays in a core's L2


def workspace(n: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for `round_moments` (up to SLICE elements at a time): allocated once per step, since fresh
    temporaries per chunk (page faults on every new buffer) cost more than the arithmetic."""
    n = min(n, SLICE)
    return torch.empty((3, n), dtype=torch.int64, device=device), torch.empty(n, dtype=torch.bool, device=device)


def draws(seed: int, start: int, n: int, device: torch.device | str = "cpu", out: torch.Tensor | None = None,
          tmp: torch.Tensor | None = None) -> torch.Tensor:
    """32 random bits (int64 holding uint32) for elements start .. start + n - 1 of a parameter (into `out`,
    with `tmp` of n int64 for a shift, where given)."""
    x = torch.arange(start, start + n, dtype=torch.int64, device=device, out=out)
    x.mul_(WEYL).bitwise_and_(MASK).bitwise_xor_(seed).mul_(MUL1).bitwise_and_(MASK)  # NOTE: int64 products
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=tmp))  # wrap past 2^63; the low 32 bits are right


def round_into(x: torch.Tensor, out: torch.Tensor, r: torch.Tensor, tmp: torch.Tensor | None = None,
               nan: torch.Tensor | None = None) -> None:
    """bf16 `out` = fp32 `x` stochastically rounded with the 16-bit draws `r` (int64, one per element); `tmp`
    (int64) and `nan` (bool), of x's size: scratch."""
    y = torch.empty(x.shape, dtype=torch.int64, device=x.device) if tmp is None else tmp
    y.copy_(x.view(torch.int32)).bitwise_and_(MASK).add_(r).bitwise_right_shift_(16)
    y.masked_fill_(torch.ne(x, x, out=nan), BF16_NAN)
    out.view(torch.int16).copy_(y.add_(0x8000).bitwise_and_(0xFFFF).sub_(0x8000))  # the 16-bit pattern as int16


def round_moments(m: torch.Tensor, v: torch.Tensor, m_out: torch.Tensor, v_out: torch.Tensor, seed: int,
                  start: int, work: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Both moments of elements start .. start + n - 1 of a parameter, from one draw each: m by its high 16 bits,
    v by its low 16; `work`: a `workspace` (else allocated). SLICE elements at a time: a pass over a whole
    STEP_CHUNK of int64 scratch ran from memory, several times slower."""
    ints, nans = work if work is not None else workspace(m.numel(), m.device)
    for a in range(0, m.numel(), SLICE):
        b = min(m.numel(), a + SLICE)
        n = b - a
        h, r, tmp, nan = ints[0, :n], ints[1, :n], ints[2, :n], nans[:n]
        draws(seed, start + a, n, m.device, out=h, tmp=tmp)
        round_into(m[a:b], m_out[a:b], torch.bitwise_right_shift(h, 16, out=r), tmp, nan)
        round_into(v[a:b], v_out[a:b], h.bitwise_and_(0xFFFF), tmp, nan)
