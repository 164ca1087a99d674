"""benchmarks/gpu_step.py's JSON lines as a markdown table (benchmarks/gpu/run.sh writes it to $OUT/results.md).

Usage: python benchmarks/gpu/table.py gpu_step.jsonl [--peers peers.jsonl] [--gpu NAME]
One row per case: tokens/s, model TFLOP/s, MFU, the measured step against the plan's, allocated and reserved
GPU peaks against the plan's, host RSS against the plan's host bytes, and the busiest stream (the binding
limit); a skipped or failed case says why.
"""

from __future__ import annotations

import argparse
import json
import sys

GiB = 2**30


def _g(row: dict, key: str) -> str:
    return f"{row[key] / GiB:.1f}" if isinstance(row.get(key), int | float) else "-"


def table(rows: list[dict], gpu: str = "") -> str:
    out = [f"# megatrain on {gpu or 'a GPU'}", "",
           "| case | seq | tokens/s | model TFLOP/s | MFU | step s (plan) | alloc GiB (plan) | reserved GiB (plan) "
           "| host RSS GiB (plan) | policy | busiest stream |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        case = r.get("case", r.get("model", "?"))
        if "tokens_per_s" not in r:
            why = r.get("skipped") or r.get("error") or "no figures"
            out.append(f"| {case} | {r.get('seq_len', '-')} | {why} |" + " |" * 8)
            continue
        busy = r.get("busy_share") or {}
        top = max(busy, key=busy.get) if busy else "-"
        mfu = f"{r['mfu']:.1%}" if isinstance(r.get("mfu"), float) else "-"
        out.append(
            f"| {case} | {r['seq_len']} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.1f} | {mfu} "
            f"| {r['measured_step_s']:.3f} ({r['predicted_step_s']:.3f}) "
            f"| {_g(r, 'peak_device_bytes')} ({_g(r, 'planned_peak_device_bytes')}) "
            f"| {_g(r, 'peak_reserved_bytes')} ({_g(r, 'planned_peak_reserved_bytes')}) "
            f"| {_g(r, 'host_rss_bytes')} ({_g(r, 'host_bytes')}) | {r.get('host_policy', '-')} "
            f"| {top} {busy.get(top, 0):.0%} |")
    return "\n".join(out) + "\n"


def peer_table(rows: list[dict], peers: list[dict]) -> str:
    """Each peer's row beside megatrain's on the same case: tokens/s, memory and the ratio (the headline)."""
    ours = {r.get("case"): r for r in rows if "tokens_per_s" in r}
    out = ["", "## against the systems a user would pick instead", "",
           "| case | system | tokens/s | megatrain / it | model TFLOP/s | alloc GiB | reserved GiB | host RSS GiB "
           "| note |", "|---|---|---|---|---|---|---|---|---|"]
    for p in peers:
        case, system = p.get("case", "?"), p.get("system", "?")
        if "tokens_per_s" not in p:
            out.append(f"| {case} | {system} | {p.get('skipped') or p.get('error') or 'no figures'} |" + " |" * 6)
            continue
        mine = ours.get(case)
        ratio = f"{mine['tokens_per_s'] / p['tokens_per_s']:.2f}x" if mine else "-"
        out.append(f"| {case} | {system} | {p['tokens_per_s']:,.0f} | {ratio} | {p['model_tflops']:.1f} "
                   f"| {_g(p, 'peak_device_bytes')} | {_g(p, 'peak_reserved_bytes')} | {_g(p, 'host_rss_bytes')} "
                   f"| {p.get('optimizer', '')} |")
    return "\n".join(out) + "\n"


def _read(path: str | None) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, TypeError):
        return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--peers", default=None, help="benchmarks/gpu/peers.py's JSON lines")
    ap.add_argument("--gpu", default="")
    args = ap.parse_args(argv)
    rows = _read(args.jsonl)
    sys.stdout.write(table(rows, args.gpu))
    if args.peers:
        sys.stdout.write(peer_table(rows, _read(args.peers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
