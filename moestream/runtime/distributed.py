"""Expert parallel across processes: rank 0 runs the engine, the other ranks follow its model calls.

One process per device. Rank 0 is the caller's process: it owns the tokenizer, the scheduler,
sampling and every output; it starts ranks 1..N-1 (`python -m moestream.engine.follower`, so
the caller's script is never re-imported; the engine layer names that module, this one builds no
engine itself) and meets them
through a TCP store on 127.0.0.1 that also carries the configuration and its model calls to them. Every rank holds the
replicated dense weights and its own share of the routed experts (`experts/sharded.py`); each
model call that rank 0 makes (prefill a chunk into a row, decode a batch, a full forward, a cache
row grown or moved) is published in the store first, every follower makes the same call, and the
MoE layers' all-reduces keep the ranks in step inside it. Tensors stay on the ranks; only ids,
positions and sizes travel through the store, and, at start-up, each rank's memory budget (so
unequal cards get unequal shares of the experts) and whether it can capture its decode steps as
CUDA graphs (over NCCL the graphs capture the all-reduces: whole steps where the rank's bank reads
nothing back, a bounded bank's steps as segments split at each router, whose reads of the routing
make that rank's share of the routed experts resident; the group uses graphs only if every rank can).

A decode call carries only what the host knows ahead (batch size, positions, attended length): its
token ids are broadcast from rank 0 on the device as the step's first collective (`share_tokens`,
captured in the decode graphs over NCCL). Rank 0 therefore never reads a step's tokens back to
publish it, may publish and launch step N+1 while step N computes (overlapped decode), and a
follower, which never waits on its device, queues its steps as fast as the calls arrive.

Under `torchrun` (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, possibly across hosts) nothing is
started: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT+1, the other ranks run `follow` there
(the CLI does that for them), and each rank checks that it loaded the same checkpoint (a digest of
config.json and the shard names and sizes).

The store carries calls rather than a collective so that an idle engine (a server waiting for
requests) keeps its followers waiting without tripping collective timeouts. The collectives
themselves (gloo on CPU, NCCL on CUDA) time out after `rank_timeout_s`, so a rank that dies ends
the group with a `DistributedError` on rank 0 instead of a hang; a follower whose parent is gone
exits by itself.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moestream.errors import DistributedError
from moestream.runtime.model_runner import ModelRunner

_POLL = timedelta(seconds=5)   # how often a waiting follower checks that rank 0 is still there
_KEPT_CALLS = 4096             # published calls kept in the store
_WATCH_S = 0.5                 # how often a watchdog checks that the other side of the group lives


def backend(runtime) -> str:
    """The collectives' backend of a group (`RuntimeConfig.dist_backend`): NCCL on CUDA, gloo on the
    CPU, unless one is named (gloo on CUDA tensors lets two ranks share one GPU)."""
    if runtime.dist_backend != "auto":
        return runtime.dist_backend
    return "nccl" if torch.device(runtime.devices[0]).type == "cuda" else "gloo"


def use_device(device: str) -> None:
    """Make a CUDA rank's device the current one: NCCL's communicator, the copy and capture streams
    and CUDA graphs are created on the current device, whatever device the tensors name."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))


@dataclass(frozen=True)
class TorchrunEnv:
    """Where `torchrun` (or SLURM through it) put this process: its rank, the world, the master."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int

    @property
    def store_port(self) -> int:
        return self.master_port + 1   # torchrun's own rendezvous store holds MASTER_PORT


def torchrun_env() -> TorchrunEnv | None:
    """This process's place in a torchrun launch of two or more processes, else None."""
    env = os.environ
    try:
        world = int(env["WORLD_SIZE"])
        if world < 2:
            return None
        return TorchrunEnv(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                           int(env.get("LOCAL_WORLD_SIZE", world)), env.get("MASTER_ADDR", "127.0.0.1"),
                           int(env.get("MASTER_PORT", 29500)))
    except (KeyError, ValueError):
        return None


def torchrun_devices(env: TorchrunEnv, device: str) -> list[str]:
    """One device per rank: the local GPU of each (by local rank), or the CPU for every rank."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return ["cpu"] * env.world
    return [f"cuda:{rank % env.local_world}" for rank in range(env.world)]


def checkpoint_digest(folder) -> str:
    """What every rank must agree on: config.json's bytes and the shard files' names and sizes."""
    from pathlib import Path

    folder = Path(folder)
    if folder.is_file():   # a GGUF: its parts' names and sizes (the metadata is inside them)
        from moestream.checkpoint.gguf_file import split_files

        return hashlib.sha256("".join(f"{p.name}:{p.stat().st_size}" for p in split_files(folder)).encode()).hexdigest()
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for shard in sorted(folder.glob("*.safetensors")):
        h.update(f"{shard.name}:{shard.stat().st_size}".encode())
    return h.hexdigest()


def _named(device: str) -> torch.device:
    d = torch.device(device)
    return torch.device(d.type, 0) if d.type == "cuda" and d.index is None else d


def rank_config(cfg, rank: int):
    """The engine configuration of one rank: its device, no group of its own, nothing rank 0 alone does,
    one cache row per sequence (a paged cache's blocks are handed out by rank 0's engine alone).

    CUDA graphs stay on only over NCCL, whose all-reduce a graph can capture (gloo's runs on the
    host); the group still switches them off unless every rank's bank can replay a whole step
    (`RankGroup.wait_ready`)."""
    devices = cfg.runtime.devices
    graphs = cfg.runtime.cuda_graphs and backend(cfg.runtime) == "nccl"
    mine = _named(devices[rank])
    launched = torchrun_env()
    sharing = 1 if launched is not None else sum(_named(d) == mine for d in devices)   # torchrun: across hosts
    host_share = (launched.local_rank, launched.local_world) if launched is not None else (rank, len(devices))
    runtime = dataclasses.replace(cfg.runtime, device=devices[rank], devices=None, cuda_graphs=graphs,
                                  ranks_on_device=sharing, host_share=host_share,
                                  kv_layout="rows")   # only rank 0 would own blocks
    warm = cfg.warm_start if rank == 0 else dataclasses.replace(cfg.warm_start, warmup_tokens=0)
    return dataclasses.replace(cfg, runtime=runtime, warm_start=warm)


def gather_budgets(store, rank: int, world: int, timeout: timedelta, budget: int | None) -> list[int | None]:
    """Every rank's budget in rank order (each rank measured its own device): the ranks place their
    experts from all of them, each computing the same placement."""
    store.set(f"budget/{rank}", json.dumps(budget))
    keys = [f"budget/{r}" for r in range(world)]
    store.wait(keys, timeout)
    return [json.loads(store.get(key)) for key in keys]


class RankGroup:
    """Rank 0's view of the group: the store, the follower processes, the calls it publishes."""

    def __init__(self, cfg, follower: str):
        """`follower`: the module each follower process runs (`python -m follower RANK PORT WORLD TIMEOUT`),
        which builds that rank's engine and calls `follow`."""
        devices = cfg.runtime.devices
        self.world, self.timeout = len(devices), timedelta(seconds=cfg.runtime.rank_timeout_s)
        if dist.is_initialized():
            raise DistributedError("this process already belongs to a process group; one expert-parallel engine "
                                   "per process (close the other engine first).")
        launched = torchrun_env()
        if launched is not None and launched.world == self.world:   # torchrun started every rank
            self.store = dist.TCPStore(launched.master_addr, launched.store_port, self.world, is_master=True,
                                       timeout=self.timeout, wait_for_workers=False)
            self.procs = []
        else:
            self.store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, timeout=self.timeout,
                                       wait_for_workers=False)   # port 0: the system picks a free one, no race
            self.procs = [subprocess.Popen([sys.executable, "-m", follower, str(rank),
                                            str(self.store.port), str(self.world), str(cfg.runtime.rank_timeout_s)],
                                           stdout=subprocess.DEVNULL) for rank in range(1, self.world)]
        self.store.set("config", pickle.dumps(cfg))
        atexit.register(self.close)   # followers stop when rank 0's process ends, whatever it ran
        try:
            use_device(devices[0])
            dist.init_process_group(backend(cfg.runtime), store=self.store, rank=0, world_size=self.world,
                                    timeout=self.timeout)
        except Exception as exc:
            self._kill()
            raise DistributedError(f"the other ranks did not join within {cfg.runtime.rank_timeout_s:g} s ({exc}); "
                                   "check that every device can start an engine.") from None
        self.calls = 0
        self.closed = False
        if self.procs and backend(cfg.runtime) == "nccl":
            threading.Thread(target=self._watch, daemon=True, name="moestream-rank-watch").start()

    def wait_ready(self, digest: str | None = None) -> bool:
        """Every follower has built its engine (or one failed: its error, raised here) from the same
        checkpoint as rank 0 (`digest`). Returns whether every follower can capture its decode steps
        as CUDA graphs (NCCL on CUDA: whole steps, or a bounded bank's segments; the group captures
        graphs only if all of them can)."""
        if digest is not None:
            self.store.set("checkpoint", digest)
        graph_safe = True
        for rank in range(1, self.world):
            key = f"state/{rank}"
            try:
                self.store.wait([key], self.timeout)
            except Exception:
                self.close()
                raise DistributedError(f"rank {rank} did not finish loading within "
                                       f"{self.timeout.total_seconds():g} s; raise rank_timeout_s for large models.") from None
            state = self.store.get(key).decode()
            if state not in ("ready", "ready+graphs"):
                self.close()
                raise DistributedError(f"rank {rank} failed to load: {state}")
            graph_safe = graph_safe and state == "ready+graphs"
        return graph_safe

    def gather_budgets(self, budget: int | None) -> list[int | None]:
        """Rank 0's budget given, every rank's returned (see `gather_budgets`)."""
        try:
            return gather_budgets(self.store, 0, self.world, self.timeout, budget)
        except DistributedError:
            raise
        except Exception:
            raise DistributedError(f"a rank did not report its memory budget within {self.timeout.total_seconds():g} s; "
                                   "check that every device can start an engine.") from None

    def publish(self, op: str, *args) -> None:
        self._check_followers()
        self.store.set(f"call/{self.calls}", pickle.dumps((op, args)))
        self.calls += 1
        if self.calls > _KEPT_CALLS:   # long read: followers are never this far behind (calls with collectives keep them in step)
            self.store.delete_key(f"call/{self.calls - _KEPT_CALLS}")

    def _check_followers(self) -> None:
        """A follower this process started that has exited (killed, crashed, out of memory) fails the
        next call before it is published: its collectives would wait for a rank that is gone (on NCCL
        until the watchdog's timeout, which may end this whole process, not with an error). Followers
        that torchrun started are not this process's to poll; a collective's timeout finds those."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                why = self._error_of(rank)
                raise DistributedError(f"a rank of the expert-parallel group stopped answering (rank {rank} exited "
                                       f"with code {code}{': ' + why if why else ''}); the engine cannot continue: "
                                       "load it again.")

    def _error_of(self, rank: int) -> str | None:
        """The error a follower said it ended with, if it said one (a killed process says none)."""
        try:
            return self.store.get(f"error/{rank}").decode() if self.store.check([f"error/{rank}"]) else None
        except Exception:   # the store itself is gone
            return None

    def _watch(self) -> None:
        """NCCL: a follower that dies inside a step leaves this process's kernels waiting in the step's
        all-reduce, which no timeout watches inside a replayed graph; abort the communicators so they
        return, and the wait for the step's tokens raises (`DistributedRunner.check_ranks`)."""
        while not self.closed:
            if any(proc.poll() is not None for proc in self.procs) and not self.closed:
                abort_collectives()
                return
            time.sleep(_WATCH_S)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.publish("stop")
        except Exception:
            pass
        leave_group(self.timeout.total_seconds())   # with the followers, who leave on "stop"
        for proc in self.procs:
            try:
                proc.wait(self.timeout.total_seconds())
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class DistributedRunner(ModelRunner):
    """Rank 0's model runner: each model call is published to the followers before it runs here."""

    group: RankGroup

    def check_ranks(self) -> None:
        self.group._check_followers()

    def set_cuda_graphs(self, enabled: bool) -> None:
        self.group.publish("set_cuda_graphs", enabled)
        super().set_cuda_graphs(enabled)

    def enter_eager(self) -> None:
        self.group.publish("enter_eager")
        super().enter_eager()

    def leave_eager(self) -> None:
        self.group.publish("leave_eager")
        super().leave_eager()

    def prepare(self, batch: int, length: int, prompt_length: int = 1) -> None:
        self.group.publish("prepare", batch, length, prompt_length)   # a capture runs collectives on every rank
        _checked(super().prepare, batch, length, prompt_length)

    def capture_batches(self, max_batch: int, length: int) -> None:
        self.group.publish("capture_batches", max_batch, length)
        _checked(super().capture_batches, max_batch, length)

    def ensure_rows(self, rows: int):
        if self.cache is None or self.cache.rows < rows:
            self.group.publish("ensure_rows", rows)
        return super().ensure_rows(rows)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.group.publish("move_row", src, dst, length)
        super().move_row(src, dst, length)

    def prefill(self, row: int, ids: list[int], start: int = 0) -> torch.Tensor:
        self.group.publish("prefill", row, ids, start)
        return _checked(super().prefill, row, ids, start)

    def prefill_packed(self, parts: list[tuple[int, list[int], int]]) -> torch.Tensor:
        self.group.publish("prefill_packed", parts)
        return _checked(super().prefill_packed, parts)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Published with what the host knows ahead of the step (the batch size, the positions, the
        attended length), never its tokens: those may still be computing (overlapped decode) and
        reach the followers on the device, broadcast inside the step (`share_tokens`). `positions`
        come from the host (the engine's); a device tensor (teacher forcing) is read back here."""
        self.group.publish("decode", tokens.shape[0], positions.tolist(), kv_len)
        return _checked(super().decode, tokens, positions, kv_len)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.group.publish("logits", input_ids.cpu(), attention_mask.cpu() if attention_mask is not None else None)
        return _checked(super().logits, input_ids, attention_mask)

    def use_routing(self, routing) -> None:
        self.group.publish("use_routing", routing)   # pickled without device tensors: each rank places its own
        super().use_routing(routing)

    def reset_routing(self) -> None:
        self.group.publish("reset_routing")
        super().reset_routing()

    def reset_rank_stats(self) -> None:
        """Every follower starts its statistics again (rank 0 resets its own)."""
        self.group.publish("reset_stats")

    def rank_stats(self) -> list[dict]:
        """Every follower's bank statistics (rank 1, 2, ...), asked for between steps."""
        tag = self.group.calls
        self.group.publish("report_stats", tag)
        out = []
        for rank in range(1, self.group.world):
            key = f"stats/{rank}/{tag}"
            self.group.store.wait([key], self.group.timeout)
            out.append(json.loads(self.group.store.get(key)))
            self.group.store.delete_key(key)
        return out


def share_tokens(tokens: torch.Tensor) -> None:
    """Rank 0's token ids of a decode step, into `tokens` on every rank: the step's first collective
    (`ModelRunner.before_decode`; captured in the decode graphs over NCCL like the all-reduces, eager
    on gloo). Rank 0 thus hands a step's tokens on without reading them back, and publishes the step
    before the one in flight has finished."""
    dist.broadcast(tokens, src=0)


def leave_group(timeout_s: float) -> None:
    """Destroy this rank's process group, every rank at the same time (rank 0 after publishing "stop",
    each follower on reading it): NCCL's teardown of buffers that graphs registered with the other ranks
    waits for those ranks to tear down too, so a rank that destroyed its group only after the others had
    exited would wait forever. A teardown that outlasts `timeout_s` (a rank died) is left behind on a
    daemon thread rather than hanging the caller."""
    if not dist.is_initialized():
        return
    done = threading.Thread(target=dist.destroy_process_group, daemon=True, name="moestream-leave-group")
    done.start()
    done.join(timeout_s)


def abort_collectives() -> None:
    """Abort this process's NCCL communicators, so kernels waiting in a collective for a rank that is
    gone return (a collective replayed inside a CUDA graph has no timeout watching it). Their
    results are not the model's: the group cannot go on after this."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group()
    except Exception:   # gloo, or a group already gone: nothing waits on the device
        pass


def exit_when_orphaned(parent: int) -> None:
    """A follower's watchdog: when rank 0 (the process that started it) is gone, end this process at
    once, even in the middle of a step whose collective would wait for rank 0 forever."""
    while os.getppid() == parent:
        time.sleep(_WATCH_S)
    os._exit(1)


def _checked(call, *args):
    try:
        return call(*args)
    except RuntimeError as exc:   # a collective failed: a rank died or stopped answering
        if not dist.is_initialized():
            raise
        raise DistributedError(f"a rank of the expert-parallel group stopped answering ({str(exc).splitlines()[0]}); "
                               "the engine cannot continue: load it again.") from None


def follow(rank: int, port: int, world: int, timeout_s: float, build: Callable, host: str = "127.0.0.1") -> None:
    """A follower rank: join, build this rank's engine, then make rank 0's calls until told to stop.

    `build(cfg, rank=, world=, gather=)` returns the rank's engine: the caller (the engine layer)
    passes it, so this module never imports what sits above it."""
    parent = os.getppid()
    if torchrun_env() is None:   # started by rank 0: end with it (torchrun's agent ends its own ranks)
        threading.Thread(target=exit_when_orphaned, args=(parent,), daemon=True, name="moestream-orphan-watch").start()
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    cfg = pickle.loads(store.get("config"))
    use_device(cfg.runtime.devices[rank])
    dist.init_process_group(backend(cfg.runtime), store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        engine = build(rank_config(cfg, rank), rank=rank, world=world,
                       gather=functools.partial(gather_budgets, store, rank, world, timeout))
        store.wait(["checkpoint"], timeout)
        if checkpoint_digest(engine.plan.folder) != store.get("checkpoint").decode():
            raise DistributedError(f"its checkpoint at {engine.plan.folder} differs from rank 0's (config.json or "
                                   "shard sizes); give every host the same files")
    except BaseException as exc:
        store.set(f"state/{rank}", f"{type(exc).__name__}: {exc}")
        return
    store.set(f"state/{rank}", "ready+graphs" if engine.runner.cuda_graphs else "ready")
    runner, device, call = engine.runner, engine.device, 0
    inbox = torch.zeros(0, dtype=torch.long, device=device)   # decode steps' tokens, received from rank 0
    try:
        with torch.inference_mode():
            while True:
                key = f"call/{call}"
                try:
                    store.wait([key], _POLL)
                except dist.DistNetworkError:   # rank 0's store closed: rank 0 is gone
                    return
                except Exception:
                    if os.getppid() != parent:   # rank 0 (our parent) is gone: nobody will call again
                        return
                    continue
                op, args = pickle.loads(store.get(key))
                call += 1
                if op == "stop":
                    runner.release_graphs()
                    leave_group(timeout_s)
                    return
                if op == "report_stats":
                    store.set(f"stats/{rank}/{args[0]}", json.dumps(engine.stats()))
                    continue
                if op == "reset_stats":
                    engine.reset_stats()
                    continue
                if op == "decode":   # queued without waiting: the step's tokens come from rank 0 inside it
                    batch, positions, kv_len = args
                    if inbox.numel() < batch:
                        inbox = torch.zeros(batch, dtype=torch.long, device=device)
                    runner.decode(inbox[:batch], torch.tensor(positions, dtype=torch.long), kv_len)
                    continue
                args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
                getattr(runner, op)(*args)
    except BaseException as exc:   # said before this process ends, so rank 0's error names it
        try:
            store.set(f"error/{rank}", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        except Exception:   # rank 0's store is gone too
            pass
        raise
