"""Helpers for tests of data parallelism: run a function on R real processes joined by gloo on localhost,
with the environment torchrun gives its workers, bounded by a timeout; and the tiny plans they train."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, size: int, port: int, **extra) -> dict:
    """The environment torchrun gives worker `rank` of `size` on one node."""
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    env.pop("MEGATRAIN_TEST_PAUSE_AT", None)
    env.update(extra)
    return env


def run_ranks(func: str, size: int, tmp_path: Path, timeout_s: float = TIMEOUT_S, **kwargs) -> list:
    """Run `module:function(comm, **kwargs)` on `size` processes (each with its Communicator, gloo, sim);
    returns each rank's (picklable) result in rank order. Fails, naming the rank, if any process fails."""
    port = free_port()
    args = tmp_path / f"args-{port}.pkl"
    args.write_bytes(pickle.dumps(kwargs))
    here = str(Path(__file__).parent)
    code = textwrap.dedent(f"""
        import os, pickle, sys
        sys.path.insert(0, {here!r})
        import importlib
        from megatrain.runtime.distributed import Communicator
        mod, fn = {func!r}.split(":")
        kwargs = pickle.loads(open({str(args)!r}, "rb").read())
        comm = Communicator.from_env("sim", timeout_s=float(os.environ.get("TEST_DIST_TIMEOUT", "60")))
        with comm.guard():
            result = getattr(importlib.import_module(mod), fn)(comm, **kwargs)
            comm.close()
        out = {str(tmp_path)!r} + f"/result-{port}-{{comm.rank}}.pkl"
        open(out, "wb").write(pickle.dumps(result))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=rank_env(r, size, port), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(size)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-3000:]}"
    return [pickle.loads((tmp_path / f"result-{port}-{r}.pkl").read_bytes()) for r in range(size)]
