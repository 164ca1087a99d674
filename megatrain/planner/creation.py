"""The time to the first step: creating the host store, predicted from the hardware profile.

Where it sits: `plan()` (report.py) sets Plan.time_to_first_step_s from it; the printed plan and `plan --json`
show it; the Trainer records the measured creation beside it (runtime/trainer.py, `time_to_first_step_s`).

What creating a store costs (runtime/host_init.py): every host byte of the plan is touched once, at the
profile's first-touch rate (`host_touch_bytes_per_s`: the page faults, not the writes, are the cost), and
every parameter's initial value is drawn once, at its drawing rate (`host_init_params_per_s`). A world's rank
draws every whole tensor and keeps its slice (runtime/sharded_store.py), so each rank draws the whole model.
A run resumed from a checkpoint, or started from a model folder, reads its weights instead of drawing them:
not priced here.
"""

from __future__ import annotations

from .hardware import Hardware


def store_creation_s(hw: Hardware, host_bytes: int, params: int) -> float:
    """Seconds to create a host store of `host_bytes` bytes whose model has `params` parameters on `hw`."""
    return host_bytes / hw.host_touch_bytes_per_s + params / hw.host_init_params_per_s


def describe(hw: Hardware, host_bytes: int, params: int) -> str:
    """One line: the prediction and its two parts."""
    from .bytesize import format_bytes

    rate = hw.host_init_params_per_s
    touch, draw = host_bytes / hw.host_touch_bytes_per_s, params / rate
    return (f"time to first step {touch + draw:.3g} s creating the host store: {format_bytes(host_bytes)} first "
            f"touched at {hw.host_touch_bytes_per_s / 1e9:.3g} GB/s ({touch:.3g} s), initial weights drawn at "
            + (f"{rate / 1e9:.3g}G/s" if rate >= 1e9 else f"{rate / 1e6:.3g}M/s") + f" ({draw:.3g} s)")
