"""Data parallelism on torch.distributed: the communicator of a run, its collectives, and failure handling.

Where it sits: `megatrain train` under torchrun (`torchrun --nproc-per-node R -m megatrain train ...`) builds one
`Communicator.from_env()` per process; the Trainer plans one rank's step of the world (planner/world.py), the
engine runs the Program's collectives through it on the `comm` stream (runtime/engine.py), and the sharded
host store all-reduces the clip norm through it on the `host` stream (runtime/sharded_store.py). Nothing here
is a transport of our own: NCCL on CUDA, gloo on the CPU (the sim device's "device tensors" are CPU tensors).
Verified: gloo on sim, one node, 2-4 ranks (tests/runtime/test_distributed.py). Not verified: NCCL on GPUs and
more than one node (UNVERIFIED_NCCL; the CLI says so when it runs NCCL).
Try it: `torchrun --nproc-per-node 2 -m megatrain train --model tiny --device sim --gpu-mem 6MiB --seq-len 64
--grad-accum 2 --steps 4` (or `tests/runtime/test_distributed.py`).

Process groups, created once per run, one per thread that issues collectives, so every rank issues each group's
collectives in the same order (a group's collectives are matched by order):
- `comm`: the comm stream's all_gather / reduce_scatter / all_reduce of slots (NCCL on CUDA, gloo on sim);
- `host`: the host stream's clip_grads (gloo: its values are host tensors);
- `main`: the caller's thread: the step's loss, the stop flag after each step, checkpoints, start-up checks.

Failures (ranks must never hang on a dead peer):
- every collective has a timeout (`timeout_s`, init_process_group's), and its error is re-raised as
  CollectiveError naming the collective;
- a watchdog thread per rank beats a heartbeat into the rendezvous store (torchrun's agent store, or rank 0's)
  every `beat_s`; a peer whose beat stops for `dead_after_s` is dead (SIGKILL, a crash, a lost node), and one
  on this node whose process is gone (its pid, recorded in the store, no longer runs) is dead at once;
- a rank whose run raises publishes one line `rank R failed: ...` under the store's `abort` key (the first
  writer wins: the root cause); a rank that sees a dead peer publishes `rank R stopped ...` there;
- a rank whose collective failed waits (at most dead_after_s + 2 beats) for that verdict and raises
  PeerFailure with it: one line naming the rank, which the CLI prints as `error: ...` (exit 2); a rank that is
  not in a collective learns it from its watchdog, which prints the line and ends the process (os._exit(2))
  after `grace_s` unless the main thread has reported it by then. A collective that timed out with every peer
  alive names the ranks that had not reached it (their heartbeats carry how many collectives they started).
- a stop signal (signals.py `stop_vote`: every rank stops after the same step) ends with `exit_stopped`: after
  the stop checkpoint, no closing barrier, the groups destroyed within DESTROY_S, os._exit with the exit code.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatrain.files import pid_alive

DEFAULT_TIMEOUT_S = 600.0
UNVERIFIED_NCCL = ("data parallelism over NCCL on CUDA has not been run on GPUs by megatrain's tests yet (they run "
                   "gloo on the sim device; tests/runtime/test_distributed.py -m cuda is the GPU check): compare a "
                   "few steps against one GPU before relying on it")
EXIT_CODE = 2
DESTROY_S = 5.0  # the longest a rank waits for its process groups to be destroyed before it goes on
GROUPS = ("comm", "host", "main", "disk")  # disk: a checkpointing step's gathers, from its disk stream


class PeerFailure(RuntimeError):
    """Another rank failed or stopped; the message names it (one line)."""


class CollectiveError(RuntimeError):
    """A collective failed (a peer is gone, or it timed out); the message names the collective."""


def world_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by it)."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={text!r} is not an integer; launch with torchrun --nproc-per-node R") from None


def timings(timeout_s: float) -> tuple[float, float, float]:
    """(beat_s, dead_after_s, grace_s) for a collective timeout: a peer is declared dead after a tenth of the
    timeout, between 3 and 30 s, beating ten times in that span."""
    dead = min(30.0, max(3.0, timeout_s / 10))
    return dead / 10, dead, min(5.0, dead)


class Communicator:
    """The ranks of one run: process groups, collectives, and the watchdog. Build with `from_env()` (torchrun)
    or `Communicator(rank=..., size=..., addr=..., port=...)`; `close()` at the end on every rank."""

    def __init__(self, *, rank: int, size: int, addr: str, port: int, device: str = "sim",
                 local_rank: int | None = None, local_size: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, agent_store: bool = False, attempt: int = 0):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of a world of {size}: launch with torchrun --nproc-per-node R")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"--dist-timeout must be a positive number of seconds, got {timeout_s}")
        self.rank, self.size = rank, size
        self.local_rank = rank if local_rank is None else local_rank
        self.local_size = size if local_size is None else local_size
        if self.local_size < 1 or size % self.local_size:
            raise ValueError(f"LOCAL_WORLD_SIZE {self.local_size} does not divide WORLD_SIZE {size}: every node must "
                             "run the same number of ranks (torchrun --nproc-per-node)")
        self.nnodes = size // self.local_size
        self.device = device
        self.backend = "nccl" if device == "cuda" else "gloo"
        self.timeout_s = timeout_s
        self.beat_s, self.dead_after_s, self.grace_s = timings(timeout_s)
        self.addr, self.port, self.agent_store = addr, port, agent_store
        self.prefix = f"megatrain/{attempt}/"
        self.progress = dict.fromkeys(GROUPS, 0)  # collectives started, per group
        self.failure: str | None = None  # the verdict on a peer (the watchdog's or the store's)
        self.reported = False  # the main thread raised PeerFailure: the watchdog need not print it
        self._lock = threading.Lock()
        timeout = datetime.timedelta(seconds=timeout_s)
        if device == "cuda":
            torch.cuda.set_device(self.local_rank)
        base = dist.TCPStore(addr, port, size, rank == 0 and not agent_store, timeout=timeout)
        self.store = dist.PrefixStore(self.prefix, base)
        self.store.set(f"hb/{rank}", " ".join("0" * (1 + len(GROUPS))))
        self.store.set(f"pid/{rank}", f"{socket.gethostname()} {os.getpid()}")  # a peer here can see it die
        kw = {"device_id": torch.device("cuda", self.local_rank)} if device == "cuda" else {}
        dist.init_process_group(self.backend, store=dist.PrefixStore("pg/", self.store), rank=rank,
                                world_size=size, timeout=timeout, **kw)
        self.groups = {"comm": dist.new_group(backend=self.backend, timeout=timeout),
                       "host": dist.new_group(backend="gloo", timeout=timeout),
                       "main": dist.new_group(backend="gloo", timeout=timeout),
                       "disk": dist.new_group(backend="gloo", timeout=timeout)}
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"megatrain-watchdog-{rank}", daemon=True)
        self.barrier()  # every rank is up (and has beaten once) before anyone watches
        self._watchdog.start()

    @classmethod
    def from_env(cls, device: str = "sim", timeout_s: float = DEFAULT_TIMEOUT_S) -> Communicator | None:
        """The communicator torchrun's environment describes (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT); None for a single process."""
        env = os.environ
        size = world_from_env()
        if size <= 1:
            return None
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise ValueError(f"WORLD_SIZE={size} but {', '.join(missing)} not set: launch with torchrun "
                             "--nproc-per-node R -m megatrain train ...")
        if env["MASTER_PORT"].strip() == "0":  # torchrun --master-port 0 hands its workers port 0, not the port
            raise ValueError("MASTER_PORT=0: torchrun --master-port 0 passes port 0 to its workers, which then cannot "
                             "find the rendezvous store; give --master-port a free port (or leave the default)")
        try:
            return cls(rank=int(env["RANK"]), size=size, addr=env["MASTER_ADDR"], port=int(env["MASTER_PORT"]),
                       device=device, local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                       local_size=int(env.get("LOCAL_WORLD_SIZE", size)), timeout_s=timeout_s,
                       agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                       attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        except (RuntimeError, dist.DistStoreError) as e:
            raise ValueError(f"rank {env['RANK']}: cannot join the other ranks at {env['MASTER_ADDR']}:"
                             f"{env['MASTER_PORT']} within {timeout_s:g} s ({str(e).splitlines()[0]}); check "
                             "that every node was started with the same --rdzv-endpoint / --master-addr") from None

    # -- collectives ---------------------------------------------------------------------------------------------
    def _run(self, group: str, what: str, fn: Callable[[], object]):
        with self._lock:
            self.progress[group] += 1
            n = self.progress[group]
        try:
            return fn()
        except Exception as e:
            raise CollectiveError(f"{what} (collective #{n} of the {group} group) failed on rank {self.rank}: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e

    def all_gather_shards(self, flat: torch.Tensor, what: str = "all_gather", group: str = "comm") -> None:
        """In place: rank r's shard flat[r S : (r+1) S] gathered so every rank holds the whole of `flat`."""
        S = flat.numel() // self.size
        mine = flat[self.rank * S : (self.rank + 1) * S]
        src = mine if self.backend == "nccl" else mine.clone()  # NCCL gathers in place; gloo wants its own input
        self._run(group, what, lambda: dist.all_gather_single(flat, src, group=self.groups[group]))

    def reduce_scatter_shards(self, flat: torch.Tensor, what: str = "reduce_scatter") -> None:
        """In place: flat summed across ranks, rank r's summed shard left at flat[r S : (r+1) S]."""
        S = flat.numel() // self.size
        mine = flat[self.rank * S : (self.rank + 1) * S]
        out = mine if self.backend == "nccl" else torch.empty_like(mine)
        self._run("comm", what, lambda: dist.reduce_scatter_single(out, flat, group=self.groups["comm"]))
        if out is not mine:
            mine.copy_(out)

    def all_reduce(self, t: torch.Tensor, what: str = "all_reduce", group: str = "comm") -> None:
        """In place: t summed across ranks."""
        self._run(group, what, lambda: dist.all_reduce(t, group=self.groups[group]))

    def sum(self, values: list[float], group: str = "main", what: str = "sum") -> list[float]:
        """Floats summed across ranks, in fp64 (the loss, token counts)."""
        t = torch.tensor(values, dtype=torch.float64)
        self._run(group, what, lambda: dist.all_reduce(t, group=self.groups[group]))
        return t.tolist()

    def gather_objects(self, obj, group: str = "main", what: str = "gather") -> list:
        """Every rank's `obj` (picklable, small), in rank order, on every rank."""
        out = [None] * self.size
        self._run(group, what, lambda: dist.all_gather_object(out, obj, group=self.groups[group]))
        return out

    def any(self, flag: bool, what: str = "stop flag") -> bool:
        """Whether any rank passed True (every rank gets the same answer)."""
        return self.sum([1.0 if flag else 0.0], what=what)[0] > 0

    def barrier(self, what: str = "barrier") -> None:
        self._run("main", what, lambda: dist.monitored_barrier(group=self.groups["main"],
                                                                 timeout=datetime.timedelta(seconds=self.timeout_s),
                                                                 wait_all_ranks=True))

    def gather_records(self, per_mb: list[list[dict[str, torch.Tensor]]]) -> list[list[dict[str, torch.Tensor]]]:
        """Every rank's routing records of one unit (one list per micro-batch, one dict per MoE layer), in the
        global step's micro-batch order (rank 0's first), on the comm group. Every rank holds records of the
        same structure (the same layers and keys, fp32): they travel packed in one all_gather."""
        flat = [t.reshape(-1).float() for mb in per_mb for rec in mb for _, t in sorted(rec.items())]
        local = torch.cat(flat) if flat else torch.zeros(0)
        out = torch.empty(local.numel() * self.size, dtype=local.dtype, device=local.device)
        if local.numel():
            self._run("comm", "gather routing records",
                      lambda: dist.all_gather_single(out, local, group=self.groups["comm"]))
        result, at = [], 0
        for _ in range(self.size):
            for mb in per_mb:
                recs = []
                for rec in mb:
                    new = {}
                    for k, t in sorted(rec.items()):
                        new[k] = out[at : at + t.numel()].view(t.shape).to(t.dtype)
                        at += t.numel()
                    recs.append(new)
                result.append(recs)
        return result

    # -- failures ------------------------------------------------------------------------------------------------
    def _beat_value(self, beats: int) -> str:
        return " ".join(str(x) for x in (beats, *(self.progress[g] for g in GROUPS)))

    def _watch(self) -> None:
        try:
            client = dist.TCPStore(self.addr, self.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=max(2 * self.beat_s, 1.0)),
                                   wait_for_workers=False)
        except Exception:  # the store is gone already: the main thread will meet it
            return
        store = dist.PrefixStore(self.prefix, client)
        peers = [r for r in range(self.size) if r != self.rank]
        seen: dict[int, tuple[str, float]] = {}
        beats = 0
        while not self._stop.wait(self.beat_s):
            beats += 1
            try:
                store.set(f"hb/{self.rank}", self._beat_value(beats))
                verdict = self._verdict(store, peers, seen)
            except Exception:
                host = "torchrun's agent" if self.agent_store else "rank 0"
                verdict = (f"the rendezvous store at {self.addr}:{self.port}, hosted by {host}, is unreachable: "
                           f"{'rank 0 stopped' if not self.agent_store else 'the node running torchrun is down'}")
            if verdict is not None:
                self._give_up(verdict)
                return

    def _verdict(self, store, peers: list[int], seen: dict) -> str | None:
        if store.check(["abort"]):
            msg = store.get("abort").decode(errors="replace")
            if not msg.startswith(f"rank {self.rank} "):
                return msg
        gone = self._gone(store, peers)
        if gone is not None:
            return store.compare_set("abort", "", gone).decode(errors="replace")
        now = time.monotonic()
        values = store.multi_get([f"hb/{r}" for r in peers])
        for r, raw in zip(peers, values):
            v = raw.decode()
            if seen.get(r, ("", 0.0))[0] != v:
                seen[r] = (v, now)
            elif now - seen[r][1] > self.dead_after_s and not store.check([f"done/{r}"]):
                msg = (f"rank {r} stopped: no heartbeat for {self.dead_after_s:g} s (it was killed, crashed, or its "
                       "node is down)")
                return store.compare_set("abort", "", msg).decode(errors="replace")
        return None

    def _gone(self, store, peers: list[int]) -> str | None:
        """A peer on this host whose process has ended (and was reaped: torchrun's agent reaps a worker at once)
        without saying it was done: named now, not after dead_after_s of silence."""
        host = socket.gethostname()
        for r in peers:
            try:
                where, pid = store.get(f"pid/{r}").decode().rsplit(" ", 1)
                if where == host and not pid_alive(int(pid)) and not store.check([f"done/{r}"]):
                    return f"rank {r} stopped: its process (pid {pid}) is gone (it was killed or crashed)"
            except (ValueError, RuntimeError, dist.DistStoreError):
                continue
        return None

    def _give_up(self, verdict: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = verdict
        if self._stop.wait(self.grace_s):
            return  # closed meanwhile
        if not self.reported:
            print(f"error: {verdict}; rank {self.rank} stops", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    def publish(self, message: str) -> str:
        """Record this rank's failure for the others (the first one recorded wins); returns the recorded one."""
        try:
            return self.store.compare_set("abort", "", message).decode(errors="replace")
        except Exception:
            return message

    def verdict(self, wait: bool) -> str | None:
        """What failed elsewhere: the watchdog's verdict or the store's abort record; with `wait`, until one
        comes (at most dead_after_s + 2 beats), then the ranks behind in their collectives, if any."""
        deadline = time.monotonic() + (self.dead_after_s + 2 * self.beat_s if wait else 0)
        while True:
            if self.failure:
                return self.failure
            try:
                if self.store.check(["abort"]):
                    msg = self.store.get("abort").decode(errors="replace")
                    if not msg.startswith(f"rank {self.rank} "):
                        return msg
                gone = self._gone(self.store, [r for r in range(self.size) if r != self.rank])
                if gone is not None:
                    return self.publish(gone)
            except Exception:
                return f"the rendezvous store at {self.addr}:{self.port} is unreachable (rank 0 or torchrun stopped)"
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.1, self.beat_s))
        return self._laggards() if wait else None

    def _laggards(self) -> str | None:
        try:
            values = self.store.multi_get([f"hb/{r}" for r in range(self.size)])
        except Exception:
            return None
        behind = []
        for r, raw in enumerate(values):
            fields = [int(x) for x in raw.decode().split()]
            if r != self.rank and any(fields[1 + k] < self.progress[g] for k, g in enumerate(GROUPS)):
                behind.append(r)
        if not behind:
            return None
        who = ", ".join(str(r) for r in behind)
        return (f"rank{'s' if len(behind) > 1 else ''} {who} did not reach a collective within {self.timeout_s:g} s "
                "(stuck, or far behind: raise --dist-timeout if its steps are that slow)")

    @contextlib.contextmanager
    def guard(self):
        """Around a rank's run: a failure caused elsewhere becomes PeerFailure naming the rank; this rank's own
        failure is published for the others, then re-raised."""
        try:
            yield self
        except PeerFailure:
            self.reported = True
            raise
        except BaseException as e:
            verdict = self.verdict(wait=_collective(e))
            if verdict is not None:
                self.reported = True
                raise PeerFailure(f"{verdict}; rank {self.rank} stops") from e
            if not isinstance(e, (KeyboardInterrupt, SystemExit)):
                line = str(e).splitlines()[0] if str(e) else ""
                self.publish(f"rank {self.rank} failed: {type(e).__name__}: {line}")
            raise

    def close(self) -> None:
        """The end of the run on this rank: done (no longer watched), every rank here, groups destroyed."""
        with contextlib.suppress(Exception):
            self.store.set(f"done/{self.rank}", "1")
        try:
            if self.failure is None:
                self.barrier("the closing barrier")
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the watchdog and destroy the groups, with no closing barrier (after a failure the others are
        stopping too). A process that exits with its gloo group alive can abort at exit ("terminate called
        without an active exception") instead of ending with its exit code."""
        self._stop.set()
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=2 * self.beat_s + 1)

        def destroy():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

        closing = threading.Thread(target=destroy, name="megatrain-destroy-groups", daemon=True)
        closing.start()
        closing.join(timeout=DESTROY_S)  # NOTE: a group torn down under a dead peer may block; the exit does not

    def exit_stopped(self, code: int) -> None:
        """The end of a rank stopped by a signal, after its stop checkpoint (whose save ends with a barrier: it
        is durable on every rank) or the stop vote: done, the groups destroyed (bounded), output flushed, and
        the process ended at once with `code`, leaving nothing (a closing collective, a thread, a destructor)
        to wait on a peer that is exiting too."""
        with contextlib.suppress(Exception):
            self.store.set(f"done/{self.rank}", "1")
        self.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    def __repr__(self) -> str:
        return (f"Communicator(rank {self.rank} of {self.size}, {self.nnodes} node(s), {self.backend}, timeout "
                f"{self.timeout_s:g} s)")


def _collective(e: BaseException) -> bool:
    """Whether a collective's failure is somewhere in the exception's chain (a peer's doing, or a timeout)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CollectiveError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def local_batch(batch: list, n_micro: int, rank: int, size: int) -> list:
    """Rank `rank`'s micro-batches of a global step of `size` x `n_micro` (the r-th contiguous group)."""
    if len(batch) != n_micro * size:
        raise ValueError(f"the step program runs {n_micro} micro-batch(es) on each of {size} ranks: the global step "
                         f"takes {n_micro * size}, got {len(batch)}")
    return batch[rank * n_micro : (rank + 1) * n_micro]
