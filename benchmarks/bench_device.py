"""Per-instruction overhead of the sim device: queue dispatch alone, and a cross-stream record/wait ping-pong.

Run: `.venv/bin/python -m pytest benchmarks/bench_device.py --benchmark-only -o addopts=""`.
The figures bound how fine-grained a step program can be before the runtime, not the work, dominates.
"""

from megatrain.runtime.stream_device import SimDevice

N = 2000


def _dispatch(dev):
    for _ in range(N):
        dev.submit("compute", _noop, "noop")
    dev.synchronize()


def _ping_pong(dev, state):
    base = state["step"]
    for k in range(N // 2):
        step = base + k
        dev.submit("h2d", _noop, "load")
        dev.record("h2d", "loaded", step)
        dev.wait("compute", "loaded", step)
        dev.submit("compute", _noop, "forward")
        dev.record("compute", "consumed", step)
        dev.wait("h2d", "consumed", step)
    dev.synchronize()
    state["step"] = base + N // 2


def _noop():
    pass


def test_sim_dispatch(benchmark):
    with SimDevice() as dev:
        benchmark.pedantic(_dispatch, args=(dev,), rounds=5, iterations=1)
        benchmark.extra_info["ops"] = N
        print(f"\nsim dispatch: {benchmark.stats['mean'] / N * 1e6:.1f} us per op")


def test_sim_record_wait_ping_pong(benchmark):
    with SimDevice() as dev:
        state = {"step": 0}
        benchmark.pedantic(_ping_pong, args=(dev, state), rounds=5, iterations=1)
        print(f"\nsim ping-pong: {benchmark.stats['mean'] / (N // 2) * 1e6:.1f} us per cross-stream round trip")
