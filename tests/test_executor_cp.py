"""Context parallelism (issue 4): load-balanced sharding, the ring and all-to-all attention cores against the
single-process attention (values and gradients), whole CP runs through plan_rank (with DP, MLA, learned positions)
against the reference, and broken layouts that the comparison catches.

Two shared worlds (2 and 4 ranks, module-scoped) run every case in one spawn each.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from executor_helpers import exec_layout, reference

from meshplan.costmodels.model_io import load_model
from meshplan.executor.compare import compare_to_reference, relative_error
from meshplan.executor.launch import run_world
from meshplan.executor.model import causal_attention
from meshplan.executor.reference import RunResult, RunSpec
from meshplan.executor.scale import scale_model

DENSE, MLA, LEARNED = "llama3.1-8b", "deepseek-v3", "gpt3-175b"  # GQA 8/2 heads; MLA + MoE; learned pos + biases
F64 = torch.float64

# (case id) -> (model, knobs of the layout, injection); world = cp * dp; each run by plan_rank (model chunks)
CP2_CASES = {
    "ring-gqa": (DENSE, dict(cp=2, cp_comm="ring", mbs=2), None),
    "a2a-gqa": (DENSE, dict(cp=2, cp_comm="a2a", mbs=1), None),
    "ring-mla": (MLA, dict(cp=2, cp_comm="ring", mbs=2), None),  # v head dim 8 != qk head dim 12
    "a2a-mla": (MLA, dict(cp=2, cp_comm="a2a", mbs=2), None),
    "ring-learned-positions": (LEARNED, dict(cp=2, cp_comm="ring", mbs=1), None),
    "broken-contiguous-shard": (DENSE, dict(cp=2, cp_comm="ring", mbs=2), "contiguous-shard"),
    "broken-no-cp-grad-sync": (DENSE, dict(cp=2, cp_comm="ring", mbs=2, zero=0), "no-cp-grad-sync"),
}
CP4_CASES = {
    "cp4-ring-gqa": (DENSE, dict(cp=4, cp_comm="ring", mbs=2), None),
    "cp4-a2a-gqa": (DENSE, dict(cp=4, cp_comm="a2a", mbs=1), None),  # 2 kv heads < cp 4: each repeated twice
    "cp2-dp2-ring": (DENSE, dict(cp=2, dp=2, cp_comm="ring", mbs=1), None),
    "cp2-dp2-a2a-mla": (MLA, dict(cp=2, dp=2, cp_comm="a2a", mbs=1), None),
}
BROKEN = ("broken-contiguous-shard", "broken-no-cp-grad-sync")

# attention-core shapes: (batch, seq, q heads, kv heads, qk dim, v dim)
CORE_SHAPES = {
    "mha": (2, 16, 4, 4, 8, 8),
    "mqa": (1, 16, 4, 1, 8, 8),
    "gqa": (2, 16, 8, 2, 8, 8),
    "mla-dims": (1, 16, 4, 4, 12, 8),
}


def run_of(name: str) -> RunSpec:
    return RunSpec(scale_model(load_model(name), "tiny"), gbs=4, seq=16, steps=2, seed=0)


# ---- rank functions: top level, so spawn can pickle them by name ---------------------------------
def _core_case(shape: tuple[int, ...], kind: str, group, cp: int, cp_rank: int) -> dict[str, torch.Tensor]:
    """One shape through one core: this rank's output and q, k, v gradients for a fixed upstream gradient."""
    from meshplan.executor.context_parallel import cp_shard, make_core

    b, s, h, kv, d, dv = shape
    gen = torch.Generator().manual_seed(sum(shape))
    full = [torch.randn(b, s, n, e, generator=gen, dtype=F64) for n, e in ((h, d), (kv, d), (kv, dv), (h, dv))]
    q, k, v, g = (cp_shard(t, cp, cp_rank).requires_grad_(i < 3) for i, t in enumerate(full))
    out = make_core(kind, group)(q, k, v)
    (out * g).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _core_errors(group, cp: int, cp_rank: int) -> dict:
    """Both cores on every CORE_SHAPES entry, and the a2a core's refusal of heads that cp does not divide."""
    from meshplan.executor.context_parallel import UlyssesAttention

    out: dict = {kind: {name: _core_case(shape, kind, group, cp, cp_rank) for name, shape in CORE_SHAPES.items()}
                 for kind in ("ring", "a2a")}
    q = torch.zeros(1, 4, 2 * cp + 1, 8, dtype=F64)
    try:
        UlyssesAttention(group)(q, q, q)
        out["a2a_indivisible"] = "no error"
    except ValueError as exc:
        out["a2a_indivisible"] = str(exc)
    return out


def rank_world(rank: int, world: int, cases: dict) -> dict:
    """Everything a shared world runs: the cores over all ranks as one cp group, then every CP case."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.executor.plan_run import plan_rank

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out: dict = {"cores": _core_errors(mesh.get_group(), world, rank), "cp": {}}
    for case, (run, knobs, inject) in cases.items():
        out["cp"][case] = plan_rank(rank, world, run, exec_layout(run, world, **knobs), inject=inject)
    return out


def jobs(cases: dict) -> dict:
    return {case: (run_of(model), *rest) for case, (model, *rest) in cases.items()}


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_world(2, rank_world, jobs(CP2_CASES), timeout_s=150)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_world(4, rank_world, jobs(CP4_CASES), timeout_s=150)


# ---- sharding, without a world --------------------------------------------------------------------
def test_cp_positions_are_load_balanced_chunks() -> None:
    from meshplan.executor.context_parallel import cp_positions

    assert cp_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert cp_positions(6, 1, 0).tolist() == list(range(6))
    for cp in (1, 2, 4):
        parts = [cp_positions(32, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(32))  # a partition of the sequence
        work = {int((p + 1).sum()) for p in parts}  # causal (query, key) pairs a rank computes
        assert len(work) == 1  # the same on every rank: the point of 2*cp chunks
    with pytest.raises(ValueError, match="divisible by 2\\*cp = 4"):
        cp_positions(10, 2, 0)
    with pytest.raises(ValueError, match="outside"):
        cp_positions(16, 2, 2)


def test_cp_shard_and_unshard_are_inverse() -> None:
    from meshplan.executor.context_parallel import cp_positions, cp_shard, cp_unshard

    x = torch.arange(3 * 16 * 2).view(3, 16, 2)
    for cp in (1, 2, 4):
        shards = [cp_shard(x, cp, r) for r in range(cp)]
        assert torch.equal(shards[-1][:, :, 0] // 2 % 16, cp_positions(16, cp, cp - 1).expand(3, -1))
        assert torch.equal(cp_unshard(shards), x)
    tokens = torch.arange(16).view(1, 16)
    assert cp_shard(tokens, 2, 1, dim=-1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]


def test_merge_rank_results_needs_the_ranks_to_agree() -> None:
    from meshplan.executor.context_parallel import merge_rank_results

    run = run_of(DENSE)
    w = torch.ones(3, dtype=F64)
    a = RunResult(run=run, losses=(1.0,), grads={"w": w}, params={"w": w}, layout="x")
    b = RunResult(run=run, losses=(1.0,), grads={"w": w * (1 + 1e-13), "v": w}, params={"w": w}, layout="x")
    merged = merge_rank_results([a, b])
    assert set(merged.grads) == {"w", "v"} and set(merged.params) == {"w"}
    c = RunResult(run=run, losses=(1.0,), grads={"w": w * (1 + 1e-9)}, params={"w": w}, layout="x")
    with pytest.raises(ValueError, match="ranks disagree: gradient w"):
        merge_rank_results([a, c])


def test_unknown_kind_and_injection_are_refused() -> None:
    from meshplan.costmodels.config import ParallelConfig, Workload, resolve
    from meshplan.executor.context_parallel import make_core
    from meshplan.executor.plan_run import injection_problem
    from meshplan.hardware_db.errors import InputError

    with pytest.raises(ValueError, match="unknown cp_comm"):
        make_core("allgather", None)
    run = run_of(DENSE)
    assert "needs cp > 1" in injection_problem(exec_layout(run, 2, dp=2), "contiguous-shard")
    assert "ZeRO 0 or 1" in injection_problem(exec_layout(run, 2, cp=2, zero=3), "no-cp-grad-sync")
    with pytest.raises(InputError, match="divisible by 2\\*cp"):
        resolve(run.model, 2, Workload(global_batch=4, seq_len=10), ParallelConfig(cp=2))


# ---- the attention cores against the single-process attention --------------------------------------
@pytest.mark.parametrize("kind", ["ring", "a2a"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", list(CORE_SHAPES))
def test_core_matches_causal_attention(kind: str, world: int, shape: str, world2, world4) -> None:
    from meshplan.executor.context_parallel import cp_unshard

    ranks = world2 if world == 2 else world4
    parts = [out["cores"][kind][shape] for out in ranks]
    b, s, h, kv, d, dv = CORE_SHAPES[shape]
    gen = torch.Generator().manual_seed(sum(CORE_SHAPES[shape]))
    full = [torch.randn(b, s, n, e, generator=gen, dtype=F64) for n, e in ((h, d), (kv, d), (kv, dv), (h, dv))]
    q, k, v = (t.requires_grad_() for t in full[:3])
    out = causal_attention(q, k, v)
    (out * full[3]).sum().backward()
    want = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, expected in want.items():
        got = cp_unshard([p[name] for p in parts])
        assert relative_error(got, expected) < 1e-13, (name, relative_error(got, expected))


@pytest.mark.parametrize("world", [2, 4])
def test_a2a_refuses_heads_that_cp_does_not_divide(world: int, world2, world4) -> None:
    for out in world2 if world == 2 else world4:
        want = f"a2a context parallelism needs the {2 * world + 1} query heads divisible by cp={world}"
        assert out["cores"]["a2a_indivisible"] == want


# ---- whole runs against the reference -----------------------------------------------------------------
@pytest.mark.parametrize("world,case", [(2, c) for c in CP2_CASES if c not in BROKEN] + [(4, c) for c in CP4_CASES])
def test_cp_matches_the_reference(world: int, case: str, world2, world4) -> None:
    from meshplan.executor.context_parallel import merge_rank_results

    results = [out["cp"][case] for out in (world2 if world == 2 else world4)]
    knobs = (CP2_CASES if world == 2 else CP4_CASES)[case][1]
    assert {r.coords["cp"] for r in results} == set(range(knobs["cp"]))
    assert all(f"cp{knobs['cp']} {knobs['cp_comm']}" in r.layout for r in results)
    merged = merge_rank_results(results)  # every rank holds every parameter; they agree to 1e-12
    cmp = compare_to_reference(merged, reference(merged.run))
    assert cmp.ok, cmp.summary() + "\n" + "\n".join(cmp.failures())
    assert len(cmp.loss_errors) == 2 and set(cmp.grad_errors) == set(reference(merged.run).grads)
    assert max(cmp.loss_error, cmp.grad_error) < 1e-12  # rounding only
    # AdamW turns the key biases' zero-in-exact-arithmetic gradient noise into ~1e-9 (executor/compare.py)
    assert max(e for name, e in cmp.param_errors.items() if not name.endswith("wk.bias")) < 1e-12


def test_contiguous_chunks_under_load_balanced_masks_are_caught(world2) -> None:
    results = [out["cp"]["broken-contiguous-shard"] for out in world2]
    from meshplan.executor.context_parallel import merge_rank_results

    merged = merge_rank_results(results)  # gradients are synchronised: the ranks agree, on the wrong values
    cmp = compare_to_reference(merged, reference(merged.run))
    assert not cmp.ok and "FAIL" in cmp.summary()
    assert cmp.loss_error > 1e-4 and cmp.grad_error > 1e-2 and cmp.param_error > 1e-3  # tolerance: 1e-6
    assert merged.layout.endswith("[contiguous-shard]")


def test_a_missing_cp_gradient_average_is_caught(world2) -> None:
    from meshplan.executor.context_parallel import merge_rank_results

    results = [out["cp"]["broken-no-cp-grad-sync"] for out in world2]
    with pytest.raises(ValueError, match="ranks disagree"):
        merge_rank_results(results)
    for r in results:  # each rank's own gradient is wrong, though the loss (computed before it) is right
        cmp = compare_to_reference(r, reference(r.run))
        assert not cmp.ok and cmp.grad_error > 1e-2 and cmp.loss_errors[0] < 1e-12
