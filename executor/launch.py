"""Running one function on every rank of a torch.distributed world, on this machine or under torchrun.

`run_world(n, fn, *args)` starts n processes (multiprocessing's fork server, which imports torch once, or
"spawn" where there is none: each rank is a fresh process, so `fn` must be a picklable top-level function),
gives each a process group with one torch thread, calls `fn(rank, n, *args)` and returns the n return values
in rank order. It never hangs: a rank that raises ends the whole world with `RankFailure("rank 3: ValueError:
...")`, and a world that has not finished after `timeout_s` is killed with `RankFailure("rank 2: no result after
60 s (still running)")`.

On a cluster the same `fn` runs under `torchrun`: `run_torchrun(fn, *args)` reads RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR/MASTER_PORT from the environment torchrun sets (`world_env`), makes the
process group (NCCL when CUDA is there, gloo otherwise) and calls `fn(rank, world, *args)` once, in
this process. See docs/executor.md, "Launching".
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshplan.hardware_db.errors import InputError

__all__ = ["RankFailure", "WorldEnv", "bind_device", "check_gpus", "run_torchrun", "run_world", "world_env"]

_GRACE_S = 0.25  # after a first failure, how long to wait for the others' messages (to name the earliest)
_KILL_WAIT_S = 2.0  # how long terminate() may take before kill()
# the ranks' own process-group timeout beyond run_world's deadline (a CI run under load saw rank 0's gloo connect give
# up on a rank 1 still starting, at the same 5 s as the deadline, so the wrong failure was named)
_PG_MARGIN_S = 60.0
# the executor's modules whose functions run on ranks: the fork server imports them once (_rank_context)
RANK_MODULES = ("meshplan.executor.plan_run", "meshplan.executor.serving", "meshplan.executor.profiler")


class RankFailure(RuntimeError):
    """A rank raised, died or did not finish in time; the message is one line: 'rank R: what happened'."""

    def __init__(self, rank: int, message: str, rank_traceback: str = "") -> None:
        self.rank = rank
        self.detail = message
        self.rank_traceback = rank_traceback  # the rank's own traceback, when it raised
        super().__init__(f"rank {rank}: {message}")

    def __reduce__(self) -> tuple[Any, tuple[int, str, str]]:
        return type(self), (self.rank, self.detail, self.rank_traceback)


def _one_line(exc: BaseException, limit: int = 500) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _die_with_parent(parent: int) -> None:
    """The rank dies with run_world's process (`parent`), even when that one is killed by SIGKILL (no cleanup runs),
    so a killed verify leaves no rank behind. Linux: the kernel kills the rank when the fork server that forked it
    dies (prctl PR_SET_PDEATHSIG); but the server outlives the caller while a rank lives (each rank holds a copy of
    the pipe whose end the server waits for), so a daemon thread also waits on the caller itself (a pidfd: readable
    when that process ends) and kills the rank then. A caller already gone by now ends the rank here. Elsewhere a
    no-op: the parent's own cleanup stops the ranks."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import select
    import threading

    forker = os.getppid()
    pr_set_pdeathsig = 1  # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    watched: int | None = None
    try:
        watched = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)
    except OSError:  # a kernel before 5.3 has no pidfd: poll instead
        pass
    if os.getppid() != forker:  # the forker died between fork and prctl
        os._exit(1)

    def wait_for_the_caller() -> None:
        if watched is not None:
            select.select([watched], [], [])
        else:
            while True:
                time.sleep(1.0)
                try:
                    os.kill(parent, 0)  # signal 0: only whether the process exists
                except ProcessLookupError:
                    break
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_the_caller, name="meshplan-caller-watch", daemon=True).start()


def _child(rank: int, world: int, backend: str, init_method: str, timeout_s: float,
           fn: Callable[..., Any], args: tuple, conn: Connection, parent: int, stack_dir: str) -> None:
    """One rank: process group, fn, and exactly one message on `conn`: ("ok", pickled result) or
    ("error", one-line message, traceback, time of the error). SIGUSR1 writes its Python stack to
    stack_dir/<rank>.stack (faulthandler: even while blocked inside a C++ collective), which names a hung rank."""
    _die_with_parent(parent)
    stack_file = open(os.path.join(stack_dir, f"{rank}.stack"), "w")  # noqa: SIM115 - open for the rank's life
    if hasattr(faulthandler, "register"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    try:
        device = bind_device(backend, rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), device_id=device)
        result = fn(rank, world, *args)
        payload = pickle.dumps(result)  # plain pickle: tensors travel as bytes, not as shared-memory handles
        conn.send(("ok", payload))
    except BaseException as exc:  # noqa: BLE001 - anything a rank does wrong ends up in the parent's message
        with contextlib.suppress(Exception):  # the parent may be gone; the exit code still tells
            conn.send(("error", _one_line(exc), traceback.format_exc(), time.time()))
    finally:
        conn.close()
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer that died first can make teardown fail; nothing to save
                dist.destroy_process_group()


def bind_device(backend: str, local_rank: int) -> torch.device | None:
    """NCCL: this rank's GPU (local rank i on cuda:i, set as the current device before the process group, as NCCL
    needs one rank per GPU); gloo: none, and one torch thread (n ranks on a few cores: intra-op threads only
    oversubscribe, 10x slower seen)."""
    if backend != "nccl":
        torch.set_num_threads(1)
        return None
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def check_gpus(backend: str, ranks_here: int) -> None:
    """NCCL runs one rank per GPU (two on one GPU fail with "Duplicate GPU detected", NVIDIA/nccl#418): refuse, in
    one line, more ranks on this machine than the GPUs torch sees."""
    if backend != "nccl":
        return
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ranks_here > visible:
        raise InputError(f"NCCL runs one rank per GPU: {ranks_here} rank(s) here but torch sees {visible} GPU(s); "
                         "lower the world (--max-ranks, a smaller plan) or use --backend gloo")


def _stop(procs: list[Any], settle_s: float = 0.0) -> None:
    """Give the ranks `settle_s` to exit by themselves, then terminate, kill what does not stop, reap all."""
    deadline = time.monotonic() + settle_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _KILL_WAIT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_world(world_size: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo",
              timeout_s: float = 60.0) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` new processes (_rank_context); their return values in rank order.

    Each rank has a process group (`backend`, a file:// store in a temporary directory; its own timeout
    _PG_MARGIN_S past `timeout_s`, so that this launcher, which stops the world at `timeout_s` and names the
    hung rank, decides before a rank's gloo connect or collective gives up on a slow peer and names itself)
    and one torch thread. Raises RankFailure naming the earliest rank that
    raised (or died, or, after `timeout_s` in all, one that had not reported), after stopping every rank.
    Return values and `args` must pickle.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    check_gpus(backend, world_size)
    ctx = _rank_context(fn)
    tmp = tempfile.mkdtemp(prefix="meshplan-world-")
    # a file store, not tcp://127.0.0.1:<port>: no free-port race between parallel worlds; gloo itself
    # still connects the ranks over TCP (set GLOO_SOCKET_IFNAME if the host name does not resolve)
    init_method = "file://" + os.path.join(tmp, "store")
    procs: list[Any] = []
    conns: list[Connection] = []
    settle_s = 0.0
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"meshplan-rank-{rank}", daemon=True,
                            args=(rank, world_size, backend, init_method, timeout_s + _PG_MARGIN_S, fn, args, send,
                                  os.getpid(), tmp))
            p.start()
            send.close()  # the child holds the only write end, so its death reads as EOF here
            procs.append(p)
            conns.append(recv)
        results = _collect(procs, conns, timeout_s, tmp)
        settle_s = _KILL_WAIT_S  # every rank reported: let them tear down their process groups themselves
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs, settle_s)
        for c in conns:
            c.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _rank_context(fn: Callable[..., Any]) -> Any:
    """Where multiprocessing offers it (Linux, macOS), a fork server that imports torch once and forks every rank
    from there: a spawned rank imports torch afresh (about 2 CPU s each, 8 ranks on 2 cores ~8 s of a verify's
    start). The server starts on first use with this process's environment, sys.path and working directory, and
    lives until this process ends; the ranks are forks of that fresh server, never of this process (whose threads
    and CUDA state a fork would copy). Elsewhere, spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # read only when the server starts, once per process (an import that fails there is skipped; the rank then
    # imports it itself): torch, and every module whose functions run on ranks (plan_run alone pulls in DTensor and
    # pipelining, about 2.7 CPU s a rank)
    ctx.set_forkserver_preload(["torch", "torch.distributed", __name__, *RANK_MODULES, fn.__module__])
    return ctx


def _collect(procs: list[Any], conns: list[Connection], timeout_s: float, stack_dir: str) -> dict[int, Any]:
    """Every rank's result, or RankFailure for the earliest failure (by the time the rank saw it)."""
    results: dict[int, Any] = {}
    failures: list[tuple[float, int, str, str]] = []  # (when, rank, message, traceback)
    pending = set(range(len(procs)))
    deadline = time.monotonic() + timeout_s
    first_failure_at: float | None = None
    while pending:
        now = time.monotonic()
        if first_failure_at is not None and now >= first_failure_at + _GRACE_S:
            break
        if now >= deadline:
            if not failures:
                rank, where = _hung_rank(procs, sorted(pending), stack_dir)
                raise RankFailure(rank, f"no result after {timeout_s:g} s (still running{where})")
            break
        until = deadline if first_failure_at is None else min(deadline, first_failure_at + _GRACE_S)
        by_handle: dict[Any, int] = {}
        for r in pending:
            by_handle[conns[r]] = r
            by_handle[procs[r].sentinel] = r
        ready = wait(list(by_handle), timeout=max(0.0, until - now))
        for r in sorted({by_handle[h] for h in ready}):
            if r not in pending:
                continue
            conn = conns[r]
            if conn.poll():  # data (or EOF) first: a rank that exits right after sending has still reported
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
            else:  # only the process sentinel is ready: it ended without writing anything
                msg = None
            if msg is None:
                procs[r].join(_KILL_WAIT_S)
                failures.append((time.time(), r, f"exited with code {procs[r].exitcode} without a result", ""))
            elif msg[0] == "ok":
                results[r] = pickle.loads(msg[1])
            else:
                _, text, tb, when = msg
                failures.append((when, r, text, tb))
            pending.discard(r)
            if failures and first_failure_at is None:
                first_failure_at = time.monotonic()
    if failures:
        _when, rank, text, tb = min(failures)
        raise RankFailure(rank, text, tb)
    return results


def _hung_rank(procs: list[Any], pending: list[int], stack_dir: str) -> tuple[int, str]:
    """Which of the ranks still running hangs: each dumps its Python stack (SIGUSR1, see _child); a rank waiting
    inside torch.distributed waits for another, so the first rank that is not is named, with where it is. When
    every rank waits in a collective (a mismatched collective), or no stack could be read, the lowest rank."""
    for r in pending:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.5)  # the handlers write at once; this is the slack for a loaded machine
    stacks = {}
    for r in pending:
        try:
            with open(os.path.join(stack_dir, f"{r}.stack"), encoding="utf-8", errors="replace") as f:
                frames = [line.strip() for line in f if line.strip().startswith("File ")]
        except OSError:
            frames = []
        if frames:
            stacks[r] = frames
    waiting = [r for r, frames in stacks.items() if any("torch/distributed" in fr for fr in frames)]
    culprits = [r for r in pending if r in stacks and r not in waiting]
    if culprits:
        innermost = stacks[culprits[0]][0].removeprefix("File ")
        others = ", ".join(str(r) for r in waiting)
        tail = f"; ranks {others} wait for it in a collective" if waiting else ""
        return culprits[0], f", at {innermost}{tail}"
    if waiting and len(waiting) == len(pending):
        return pending[0], "; every running rank waits in a collective (a mismatched collective?)"
    return pending[0], ""


# ---- under torchrun ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorldEnv:
    """What torchrun (or any launcher following its convention) tells a rank through the environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def world_env(environ: dict[str, str] | None = None) -> WorldEnv:
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun sets them; KeyError names a missing one."""
    env = os.environ if environ is None else environ
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise KeyError(f"not under torchrun: {', '.join(missing)} not set")
    return WorldEnv(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                    local_rank=int(env.get("LOCAL_RANK", "0")), master_addr=env["MASTER_ADDR"],
                    master_port=int(env["MASTER_PORT"]))


def run_torchrun(fn: Callable[..., Any], *args: Any, backend: str | None = None, timeout_s: float = 600.0) -> Any:
    """`fn(rank, world_size, *args)` in this process, one rank of a torchrun world; returns its value.

    backend None: NCCL (binding LOCAL_RANK's GPU) when CUDA is available, else gloo. The process group
    uses torchrun's env:// rendezvous and `timeout_s` for collectives; torchrun itself ends the other
    ranks when one fails.
    """
    env = world_env()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    check_gpus(backend, env.local_rank + 1)
    device = bind_device(backend, env.local_rank)
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device)
    try:
        return fn(env.rank, env.world_size, *args)
    finally:
        dist.destroy_process_group()
