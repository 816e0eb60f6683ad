"""The launcher and data parallelism (issue 4, step 2): ranks that fail or hang end the world with their
message; gloo's collectives do what the executor relies on; DP with ZeRO 0-3 reproduces the single-process
loss, gradients and AdamW parameters; a broken DP is caught; FSDP2 averages (and a summing FSDP2 is fixed).

Two shared worlds (2 and 4 ranks, module-scoped) run every DP case in one spawn each: starting a rank
(a fresh interpreter importing torch) costs more than a tiny model's three steps. executor.data_parallel
(FSDP2, DTensor: ~1 s to import) is imported where used, so the launcher's own worlds start faster.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import signal
import sys
import time

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist
from executor_helpers import exec_layout, layout, reference
from proc_helpers import alive, parent

from meshplan.costmodels.model_io import load_model
from meshplan.executor.compare import TOLERANCE, compare_to_reference, relative_error
from meshplan.executor.launch import RankFailure, run_world, world_env
from meshplan.executor.reference import RunSpec
from meshplan.executor.scale import scale_model

DENSE, MOE, TIED, MLA = "llama3.1-8b", "mixtral-8x7b", "gpt3-175b", "deepseek-v3"
F64 = torch.float64


def run_of(name: str, dtype: str = "float64") -> RunSpec:
    return RunSpec(scale_model(load_model(name), "tiny"), gbs=8, seq=8, steps=3, seed=0, dtype=dtype)


# (case id) -> (model, zero, mbs, injection); every ZeRO stage on the dense and the MoE model at DP=2
DP2_CASES = {
    "dense-zero0-mbs1": (DENSE, 0, 1, None),
    "dense-zero1-mbs2": (DENSE, 1, 2, None),
    "dense-zero2-mbs1": (DENSE, 2, 1, None),
    "dense-zero3-mbs2": (DENSE, 3, 2, None),
    "moe-zero0-mbs2": (MOE, 0, 2, None),
    "moe-zero1-mbs1": (MOE, 1, 1, None),
    "moe-zero2-mbs2": (MOE, 2, 2, None),
    "moe-zero3-mbs1": (MOE, 3, 1, None),
    "tied-zero3-mbs1": (TIED, 3, 1, None),  # tied head + embedding in FSDP2's root; key biases (zero gradient)
    "dense-zero3-fsdp-sums": (DENSE, 3, 2, "fsdp-sums"),  # a summing FSDP2, detected and corrected
    "broken-no-grad-sync": (DENSE, 0, 2, "no-grad-sync"),
    "broken-scale-loss": (MOE, 3, 1, "scale-loss"),
}
DP4_CASES = {
    "moe-zero2-mbs1": (MOE, 2, 1, None),
    "mla-moe-zero3-mbs2": (MLA, 3, 2, None),  # one micro-batch per rank
    "dense-zero1-mbs1": (DENSE, 1, 1, None),
}
BROKEN = {"broken-no-grad-sync", "broken-scale-loss"}


# ---- rank functions: top level, so spawn can pickle them by name ---------------------------------
def rank_all_reduce(rank: int, world: int) -> tuple[float, int]:
    x = torch.tensor([float(rank + 1)], dtype=F64)
    dist.all_reduce(x)
    return float(x), torch.get_num_threads()


def rank_raises(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken\non purpose")
    time.sleep(600)  # the others wait as if for a collective; run_world must stop them
    return rank


def rank_hangs_in_a_collective(rank: int, world: int) -> int:
    """Rank 1 hangs in plain Python; rank 0 waits for it in a barrier (as a rank waits in the next collective)."""
    if rank == 1:
        time.sleep(3600)
    dist.barrier()
    return rank


def rank_hangs(rank: int, world: int, pid_dir: str) -> int:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)
    return rank


def gloo_blocks(world: int) -> dict[str, list[float]]:
    """The collectives the executor relies on (DDP: all_reduce; ZeroRedundancyOptimizer: broadcast; FSDP2:
    all_gather, reduce_scatter, AVG for float32; later EP: all_to_all_single), in float64 unless named."""
    rank = dist.get_rank()
    out: dict[str, list[float]] = {}
    x = torch.arange(2 * world, dtype=F64) + 10 * rank
    y = x.clone()
    dist.all_reduce(y)
    out["all_reduce"] = y.tolist()
    for name, dtype in (("all_reduce_avg", F64), ("all_reduce_avg_f32", torch.float32)):
        y = x.clone().to(dtype)
        dist.all_reduce(y, op=dist.ReduceOp.AVG)
        out[name] = y.tolist()
    b = x.clone()
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.tolist()
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for name, op, dtype in (("reduce_scatter", dist.ReduceOp.SUM, F64), ("reduce_scatter_avg", dist.ReduceOp.AVG, F64),
                            ("reduce_scatter_avg_f32", dist.ReduceOp.AVG, torch.float32)):
        o = torch.empty(2, dtype=dtype)
        reduce_scatter(o, x.to(dtype), op=op)
        out[name] = o.tolist()
    g = torch.empty(2 * world, dtype=F64)
    all_gather(g, x[:2].clone())
    out["all_gather"] = g.tolist()
    a = torch.empty(2 * world, dtype=F64)
    dist.all_to_all_single(a, x.clone())
    out["all_to_all_single"] = a.tolist()
    return out


def expected_blocks(rank: int, world: int) -> dict[str, list[float]]:
    xs = [torch.arange(2 * world, dtype=F64) + 10 * r for r in range(world)]
    total = sum(xs)
    return {
        "all_reduce": total.tolist(),
        "all_reduce_avg": (total / world).tolist(),
        "all_reduce_avg_f32": (total / world).tolist(),
        "broadcast": xs[world - 1].tolist(),
        "reduce_scatter": total[2 * rank:2 * rank + 2].tolist(),
        "reduce_scatter_avg": (total / world)[2 * rank:2 * rank + 2].tolist(),
        "reduce_scatter_avg_f32": (total / world)[2 * rank:2 * rank + 2].tolist(),
        "all_gather": torch.cat([x[:2] for x in xs]).tolist(),
        "all_to_all_single": torch.cat([x[2 * rank:2 * rank + 2] for x in xs]).tolist(),
    }


def rank_world(rank: int, world: int, cases: dict[str, tuple[RunSpec, int, int, str | None]]) -> dict:
    """Everything a shared world runs: building blocks, FSDP2's averaging, then every DP case through plan_rank
    (the path `meshplan verify` runs) on a data-parallel layout."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.executor.data_parallel import fsdp_reduction_factor
    from meshplan.executor.plan_run import plan_rank

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out: dict = {"blocks": gloo_blocks(world), "threads": torch.get_num_threads()}
    out["fsdp_factor"] = {dtype: fsdp_reduction_factor(mesh, dt) for dtype, dt in
                          (("float64", F64), ("float32", torch.float32))}
    out["fsdp_factor_emulated_sum"] = fsdp_reduction_factor(mesh, F64, emulate_sum=True)
    out["dp"] = {}
    for case, (run, zero, mbs, inject) in cases.items():
        out["dp"][case] = plan_rank(rank, world, run, exec_layout(run, world, dp=world, zero=zero, mbs=mbs),
                                    inject=inject)
    return out


def jobs(cases: dict) -> dict:
    return {case: (run_of(model), zero, mbs, inject) for case, (model, zero, mbs, inject) in cases.items()}


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_world(2, rank_world, jobs(DP2_CASES), timeout_s=120)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_world(4, rank_world, jobs(DP4_CASES), timeout_s=120)


# ---- the launcher -------------------------------------------------------------------------------
def test_run_world_returns_every_rank_in_order() -> None:
    assert run_world(2, rank_all_reduce) == [(3.0, 1), (3.0, 1)]  # one torch thread per rank


def test_a_rank_that_raises_ends_the_world_with_its_message() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_world(3, rank_raises, timeout_s=900)
    assert str(info.value) == "rank 1: ValueError: rank one is broken on purpose"  # one line
    assert info.value.rank == 1 and "rank_raises" in info.value.rank_traceback
    # not the others' 600 s sleep, nor the 900 s timeout; the margin is for spawning three ranks on a busy machine
    assert time.monotonic() - start < 300
    assert not multiprocessing.active_children()


def test_a_hanging_rank_is_killed_at_the_timeout(tmp_path) -> None:
    start = time.monotonic()
    # rank 1 hangs; rank 0 is named instead only if it had not even reported by then (a slow start on a busy machine)
    with pytest.raises(RankFailure, match=r"^rank [01]: no result after 5 s \(still running"):
        run_world(2, rank_hangs, str(tmp_path), timeout_s=5)
    # the timeout, then terminate (kill after 2 s), not the hour the rank sleeps; the margin is for a busy machine
    assert time.monotonic() - start < 5 + 120
    assert not multiprocessing.active_children()
    pid = int((tmp_path / "1.pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)


def test_the_hanging_rank_is_named_not_the_one_waiting_for_it() -> None:
    """Rank 0 waits in a barrier for rank 1, which sleeps: the stacks the ranks dump at the timeout name rank 1
    (the lowest running rank, 0, was named before) and where it is."""
    with pytest.raises(RankFailure) as info:
        run_world(2, rank_hangs_in_a_collective, timeout_s=20)
    assert info.value.rank == 1, str(info.value)
    assert "rank_hangs_in_a_collective" in str(info.value) and "ranks 0 wait for it" in str(info.value)
    assert not multiprocessing.active_children()


_WATCH_SCRIPT = """
import os, signal, sys, time
from meshplan.executor import launch
caller = os.getpid()
if os.fork() == 0:  # the forker (a fork server's stand-in): outlives the caller
    if os.fork() == 0:  # the rank
        if sys.argv[1] == "no-pidfd":
            def no_pidfd(pid):
                raise OSError(38, "Function not implemented")
            os.pidfd_open = no_pidfd
        launch._die_with_parent(caller)
        print(os.getpid(), flush=True)
        time.sleep(600)
        os._exit(0)
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank's watch is Linux's (prctl, pidfd)")
@pytest.mark.parametrize("how", ["pidfd", "no-pidfd"])
def test_a_rank_dies_with_its_caller_while_its_forker_lives(how) -> None:
    """A rank forked by a fork server dies when run_world's process does, though the server lives on (it did not,
    and a hanging rank outlived a killed verify): the pidfd watch, or on a kernel without pidfds the polling one."""
    import subprocess

    caller = subprocess.Popen([sys.executable, "-c", _WATCH_SCRIPT, how], stdout=subprocess.PIPE, text=True)
    rank = int(caller.stdout.readline())
    forker = parent(rank)
    try:
        caller.kill()
        caller.wait()
        gone_by = time.monotonic() + 30
        while time.monotonic() < gone_by and alive(rank):
            time.sleep(0.1)
        assert not alive(rank), "the rank outlived its caller"
        assert alive(forker), "the forker must still be alive for this to test the watch"
    finally:
        for pid in (rank, forker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_run_world_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_world(0, rank_all_reduce)
    with pytest.raises(ValueError, match="timeout_s"):
        run_world(2, rank_all_reduce, timeout_s=0)



def test_nccl_worlds_are_checked_against_the_visible_gpus(monkeypatch) -> None:
    """NCCL runs one rank per GPU: a world larger than the GPUs torch sees is one InputError before any rank starts
    (here none: this CPU host sees 0); gloo worlds are not limited."""
    from meshplan.executor.launch import bind_device, check_gpus
    from meshplan.hardware_db.errors import InputError

    with pytest.raises(InputError, match=r"2 rank\(s\) here but torch sees \d+ GPU"):
        run_world(2, rank_all_reduce, backend="nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    check_gpus("nccl", 8)  # one rank per GPU: accepted
    with pytest.raises(InputError, match=r"9 rank\(s\)"):
        check_gpus("nccl", 9)
    check_gpus("gloo", 64)
    bound: list = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    assert bind_device("nccl", 3) == torch.device("cuda", 3) and bound == [torch.device("cuda", 3)]
    threads = torch.get_num_threads()
    try:
        assert bind_device("gloo", 3) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)  # the rest of the suite runs in this process


def test_world_env_reads_torchrun_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    w = world_env(env)
    assert (w.rank, w.world_size, w.local_rank, w.master_addr, w.master_port) == (3, 8, 1, "node0", 29500)
    with pytest.raises(KeyError, match="RANK"):
        world_env({})


# ---- gloo building blocks -----------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_gloo_collectives(world: int, world2, world4) -> None:
    ranks = world2 if world == 2 else world4
    for rank, out in enumerate(ranks):
        assert out["threads"] == 1
        expected = expected_blocks(rank, world)
        assert set(out["blocks"]) == set(expected)
        for name, want in expected.items():
            assert out["blocks"][name] == pytest.approx(want, rel=1e-6 if name.endswith("f32") else 1e-15), name


# ---- FSDP2's gradient averaging on gloo ---------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_averages_gradients_on_gloo(world: int, world2, world4) -> None:
    """torch 2.13 averages (float64: SUM then divide; float32: ReduceOp.AVG). A summing FSDP2 (as gloo had in
    some versions, emulated here) reads as factor = world, and plan_rank divides it out: that case matches."""
    for out in world2 if world == 2 else world4:
        assert out["fsdp_factor"] == {"float64": pytest.approx(1.0, abs=1e-12),
                                      "float32": pytest.approx(1.0, abs=1e-6)}
        assert out["fsdp_factor_emulated_sum"] == pytest.approx(world, rel=1e-12)
    if world == 2:
        cmp = compare_to_reference(world2[0]["dp"]["dense-zero3-fsdp-sums"], reference(run_of(DENSE)))
        assert cmp.ok, cmp.summary()


# ---- DP numerics --------------------------------------------------------------------------------
@pytest.mark.parametrize("world,case", [(2, c) for c in DP2_CASES if c not in BROKEN] + [(4, c) for c in DP4_CASES])
def test_dp_matches_the_reference(world: int, case: str, world2, world4) -> None:
    ranks = world2 if world == 2 else world4
    results = [out["dp"][case] for out in ranks]
    first = results[0]
    assert first.coords["dp"] == 0 and f"dp{world}" in first.layout
    assert first.grads is not None and first.params is not None
    assert all(r.losses == first.losses for r in results)  # the global loss, on every rank
    for r in results[1:]:  # every rank holds the full gradients and parameters, gathered (ZeRO 3: from shards)
        assert compare_to_reference(r, reference(first.run)).ok
    cmp = compare_to_reference(first, reference(first.run))
    assert cmp.ok, cmp.summary() + "\n" + "\n".join(cmp.failures())
    assert cmp.tolerance.loss == cmp.tolerance.grad == cmp.tolerance.param == TOLERANCE["float64"] == 1e-6
    assert len(cmp.loss_errors) == 3 and set(cmp.grad_errors) == set(first.grads)
    assert max(cmp.loss_error, cmp.grad_error) < 1e-12  # in fact: only the summation order differs


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_dp_is_caught(case: str, world2) -> None:
    result = world2[0]["dp"][case]
    cmp = compare_to_reference(result, reference(result.run))
    assert not cmp.ok and cmp.failures()
    assert cmp.grad_error > 1e-2 and cmp.param_error > 1e-3  # far above the 1e-6 tolerance
    assert "FAIL" in cmp.summary() and result.layout.endswith(f"[{DP2_CASES[case][3]}]")


# ---- pieces without a world -----------------------------------------------------------------------
def test_micro_batches_split_the_global_batch() -> None:
    from meshplan.executor.data_parallel import micro_batches

    tokens = torch.arange(8 * 3).view(8, 3)
    parts = [micro_batches(tokens, tokens, r, 2, 2) for r in range(2)]
    assert [len(p) for p in parts] == [2, 2]
    assert torch.equal(torch.cat([t for p in parts for t, _ in p]), tokens)  # contiguous, in order
    with pytest.raises(ValueError, match="multiple"):
        micro_batches(tokens, tokens, 0, 3, 1)


def test_dp_injections_are_checked() -> None:
    """A fault that cannot be injected into the layout is refused by plan_rank (and by verify, before any rank
    starts) with the reason."""
    from meshplan.executor.plan_run import injection_problem, plan_rank

    run = run_of(DENSE)
    with pytest.raises(ValueError, match="unknown injection 'typo'"):
        plan_rank(0, 1, run, exec_layout(run, 1), inject="typo")
    assert "ZeRO 0 or 1" in injection_problem(layout(dp=2, zero=3), "no-grad-sync")
    assert "ZeRO 2 or 3" in injection_problem(layout(dp=2, zero=1), "fsdp-sums")
    assert injection_problem(layout(dp=2, zero=2), "fsdp-sums") is None


def test_relative_error_definition() -> None:
    b = torch.tensor([1.0, -4.0], dtype=F64)
    assert relative_error(b + torch.tensor([0.0, 2e-6], dtype=F64), b) == pytest.approx(5e-7)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.zeros(3), b) == math.inf  # shape
    assert relative_error(torch.tensor([math.nan, 0.0]), b) == math.inf
    assert relative_error(torch.tensor([1e-12]), torch.tensor([0.0]), floor=1e-6) == pytest.approx(1e-6)


def test_results_pickle_and_compare_without_a_world() -> None:
    """The reference against itself is exact; a RunResult survives pickling with read-only maps."""
    import pickle

    run = RunSpec(scale_model(load_model(DENSE), "tiny"), gbs=2, seq=4, steps=2)
    ref = reference(run)
    again = pickle.loads(pickle.dumps(ref))
    assert again.run == run and again.losses == ref.losses
    with pytest.raises(TypeError):
        again.grads["x"] = torch.zeros(1)  # type: ignore[index]
    cmp = compare_to_reference(again, ref)
    assert cmp.ok and cmp.loss_error == cmp.grad_error == cmp.param_error == 0.0
    with pytest.raises(ValueError, match="different run"):
        compare_to_reference(again, reference(RunSpec(run.model, gbs=2, seq=4, steps=2, seed=1)))
