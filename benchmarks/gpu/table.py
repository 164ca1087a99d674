"""The device run's rows as markdown (benchmarks/gpu/run.sh writes it to $OUT/results.md).

Usage: python benchmarks/gpu/table.py rows.jsonl [--preflight preflight.json] [--gpu NAME]
rows.jsonl holds every case's line (gpu_step.py: "system": "megatrain") and every peer run's (peers.py), each
with its run.sh stage. First the preflight's figures; then one row per megatrain case: tokens/s, model TFLOP/s,
MFU, the measured step against the plan's, allocated and reserved GPU peaks against the plan's, host RSS
against the plan's host bytes, the busiest stream (the binding limit); then the peers beside megatrain's runs
of the same case (megatrain's tokens/s over each peer's, from megatrain's median run); a skipped, failed or
rehearsed row says so.
"""

from __future__ import annotations

import argparse
import json
import sys

GiB = 2**30


def _g(row: dict, key: str) -> str:
    return f"{row[key] / GiB:.1f}" if isinstance(row.get(key), int | float) else "-"


def _why(row: dict) -> str:
    return row.get("status") or row.get("skipped") or row.get("error") or "no figures"


def table(rows: list[dict], gpu: str = "") -> str:
    out = [f"# megatrain on {gpu or 'a GPU'}", "",
           "| case | seq | tokens/s | model TFLOP/s | MFU | step s (plan) | alloc GiB (plan) | reserved GiB (plan) "
           "| host RSS GiB (plan) | policy | busiest stream |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("system", "megatrain") != "megatrain":
            continue
        case = r.get("case", r.get("model", "?"))
        if r.get("resident") == "none":  # the headline again with every unit streamed (run.sh headline-streamed)
            case += ", all streamed"
        elif r.get("resident_units"):
            case += f", {len(r['resident_units'])} units on the GPU"
        if "tokens_per_s" not in r:
            out.append(f"| {case} | {r.get('seq_len', '-')} | {_why(r)} |" + " |" * 8)
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
    ours: dict[str, list[float]] = {}
    for r in rows:
        if r.get("system", "megatrain") == "megatrain" and "tokens_per_s" in r:
            ours.setdefault(r.get("case"), []).append(r["tokens_per_s"])
    out = ["", "## against the systems a user would pick instead", "",
           "| case | system | tokens/s | megatrain / it | model TFLOP/s | alloc GiB | reserved GiB | host RSS GiB "
           "| note |", "|---|---|---|---|---|---|---|---|---|"]
    for p in peers:
        case, system = p.get("case", "?"), p.get("system", "?")
        if "tokens_per_s" not in p:
            out.append(f"| {case} | {system} | {_why(p)} |" + " |" * 6)
            continue
        mine = sorted(ours.get(case, []))
        ratio = f"{mine[len(mine) // 2] / p['tokens_per_s']:.2f}x" if mine else "-"
        out.append(f"| {case} | {system} | {p['tokens_per_s']:,.0f} | {ratio} | {p['model_tflops']:.1f} "
                   f"| {_g(p, 'peak_device_bytes')} | {_g(p, 'peak_reserved_bytes')} | {_g(p, 'host_rss_bytes')} "
                   f"| {p.get('optimizer', '')} |")
    return "\n".join(out) + "\n"


def preflight_lines(pf: dict) -> str:
    if not pf:
        return ""
    cast = pf.get("cast_bf16_elements_per_s") or {}
    casts = ", ".join(f"{k}: {v / 1e9:.2f}" for k, v in cast.items())
    rates = pf.get("host_optimizer_bytes_per_s") or {}
    return ("\n## the machine (preflight)\n\n"
            f"bf16 matmul {pf.get('bf16_matmul_flops', 0) / 1e12:.1f} TFLOP/s; pinned h2d "
            f"{pf.get('h2d_bytes_per_s', 0) / 1e9:.1f} GB/s, d2h {pf.get('d2h_bytes_per_s', 0) / 1e9:.1f} GB/s; host "
            f"first touch {pf.get('first_touch_bytes_per_s', 0) / 1e9:.1f} GB/s, stream "
            f"{pf.get('host_stream_bytes_per_s', 0) / 1e9:.1f} GB/s; fp32->bf16 cast (G elements/s by threads) "
            f"{casts or '-'}; host optimizer (GB/s of its traffic) "
            f"{', '.join(f'{k} {v / 1e9:.0f}' for k, v in rates.items() if '+' not in k) or '-'} on "
            f"{pf.get('host_optimizer_threads', '-')} threads; host memory {pf.get('host_memory_bytes', 0) / GiB:.0f} "
            f"GiB ({pf.get('host_memory_from', '')})"
            + (f"; not measured: {', '.join(pf['not_measured'])}" if pf.get("not_measured") else "") + "\n")


def _read(path: str | None) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, TypeError):
        return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl")
    ap.add_argument("--preflight", default=None)
    ap.add_argument("--gpu", default="")
    args = ap.parse_args(argv)
    rows = _read(args.jsonl)
    try:
        with open(args.preflight or "") as f:
            pf = json.load(f)
    except (OSError, ValueError):
        pf = {}
    sys.stdout.write(table(rows, args.gpu))
    sys.stdout.write(peer_table(rows, [r for r in rows if r.get("system", "megatrain") != "megatrain"]))
    sys.stdout.write(preflight_lines(pf))
    return 0


if __name__ == "__main__":
    sys.exit(main())
