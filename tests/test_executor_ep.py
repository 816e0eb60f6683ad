"""Expert parallelism and expert tensor parallelism (executor/expert_parallel.py) against the single-process
reference: EP2 and EP4 over dp ranks, EP2 x ETP2 with etp over dp ranks, a linear-bias MoE under ETP (the w2
bias added once), DeepSeek-V3 (dense first layer, shared experts, MLA), tokens replicated over tp2 (the dense
part run whole on every tp rank) with etp 1 and 2, 2 optimizer steps and 2 micro-batches; broken layouts (no
expert gradient reduction, experts on the wrong ranks, replicated tokens dispatched by every tp rank) fail.

Two shared worlds (2 and 4 ranks, module-scoped) run every case in one spawn each, as tests/test_executor_dp.py.
Every rank reports the full tensors it holds; the reports must agree (1e-12) where they overlap, and merged
they must match the reference to 1e-6 (float64; seen: ~1e-15 in gradients).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist
from executor_helpers import exec_layout, layout, reference

from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model
from meshplan.executor.compare import compare_to_reference, relative_error
from meshplan.executor.launch import run_world
from meshplan.executor.reference import RunSpec
from meshplan.executor.scale import scale_model

MOE, MLA, BIAS = "mixtral-8x7b", "deepseek-v3", "mixtral-8x7b+bias"
F64 = torch.float64


def tiny(name: str) -> ModelSpec:
    if name == BIAS:  # every linear with a bias: ETP's row-parallel w2 must add its bias once
        spec = scale_model(load_model(MOE), "tiny")
        return ModelSpec.model_validate({**spec.model_dump(), "linear_bias": True, "name": f"{spec.name}+bias"})
    return scale_model(load_model(name), "tiny")


# (case id) -> (model, knobs of the layout, gbs, seq, steps, injection); ZeRO 0, no SP; each run by plan_rank
CASES2 = {
    "mixtral-ep2-dp2-2steps-2micro": (MOE, {"dp": 2, "ep": 2}, 4, 8, 2, None),  # mbs 1: 2 micro-batches
    "deepseek-ep2-dp2": (MLA, {"dp": 2, "ep": 2}, 2, 8, 1, None),
    "broken-no-expert-grad-sync": (MOE, {"dp": 2, "ep": 2}, 2, 8, 1, "no-expert-grad-sync"),
    "broken-wrong-expert-placement": (MOE, {"dp": 2, "ep": 2}, 2, 8, 1, "wrong-expert-placement"),
}
CASES4 = {
    "mixtral-ep4-dp4": (MOE, {"dp": 4, "ep": 4}, 4, 8, 1, None),
    "mixtral-ep2-etp2-dp4-2steps": (MOE, {"dp": 4, "ep": 2, "etp": 2}, 4, 8, 2, None),
    "bias-ep2-etp2-dp4": (BIAS, {"dp": 4, "ep": 2, "etp": 2}, 4, 8, 1, None),
    "mixtral-tp2-dp2-ep2": (MOE, {"tp": 2, "dp": 2, "ep": 2}, 2, 8, 1, None),  # the ep group is the tp group
    "mixtral-tp2-dp2-ep2-etp2-seq7": (MOE, {"tp": 2, "dp": 2, "ep": 2, "etp": 2}, 2, 7, 1, None),  # 7 tokens: 4 + 3
    "broken-no-token-split": (MOE, {"tp": 2, "dp": 2, "ep": 2}, 2, 8, 1, "no-token-split"),
}
BROKEN = {case for cases in (CASES2, CASES4) for case, job in cases.items() if job[5] is not None}


def jobs(cases: dict) -> dict:
    out = {}
    for case, (model, knobs, gbs, seq, steps, inject) in cases.items():
        run = RunSpec(tiny(model), gbs=gbs, seq=seq, steps=steps)
        out[case] = (run, exec_layout(run, knobs.get("tp", 1) * knobs["dp"], zero=0, sp=False, **knobs), inject)
    return out


# ---- rank functions: top level, so spawn can pickle them by name ---------------------------------
def a2a_block(rank: int, world: int) -> dict[str, bool]:
    """The differentiable ragged all_to_all: rank r sends (r + p) % 3 rows (zero for some pairs) to peer p, with
    value 100 r + 10 p + row; peer q's loss is (q + 1) * sum(received), so every sent row's gradient is p + 1."""
    from meshplan.executor.expert_parallel import all_to_all

    sizes = [[(r + p) % 3 for p in range(world)] for r in range(world)]
    rows = [torch.full((sizes[rank][p], 2), 100.0 * rank + 10 * p, dtype=F64) + torch.arange(sizes[rank][p],
            dtype=F64)[:, None] for p in range(world)]
    x = torch.cat(rows).requires_grad_()
    out = all_to_all(x, [sizes[q][rank] for q in range(world)], sizes[rank], dist.group.WORLD)
    ((rank + 1) * out.sum()).backward()
    want = torch.cat([torch.full((sizes[q][rank], 2), 100.0 * q + 10 * rank, dtype=F64)
                      + torch.arange(sizes[q][rank], dtype=F64)[:, None] for q in range(world)])
    want_grad = torch.cat([torch.full((sizes[rank][p], 2), p + 1.0, dtype=F64) for p in range(world)])
    return {"forward": torch.equal(out, want), "backward": torch.equal(x.grad, want_grad)}


def chunk_block(rank: int, world: int) -> dict:
    """apply_expert_parallel on a ModelChunk (layers 1-2 + head) of an EP2 layout: the forward of the same hidden
    states on both ranks equals the reference chunk's, and the names are the reference's."""
    from meshplan.executor.expert_parallel import apply_expert_parallel
    from meshplan.executor.mesh import build_meshes
    from meshplan.executor.model import ModelChunk

    lay = layout(dp=2, ep=2)
    run = RunSpec(tiny(MOE), gbs=2, seq=8)
    ref = ModelChunk(run.build(), 1, 3)
    chunk = apply_expert_parallel(ModelChunk(run.build(), 1, 3), build_meshes(lay), lay)
    h = torch.randn(2, 8, run.model.hidden, generator=torch.Generator().manual_seed(1), dtype=F64)
    with torch.no_grad():
        error = relative_error(chunk(h), ref(h))
    return {"error": error, "names": sorted(n for n, _ in chunk.named_parameters()),
            "ref_names": sorted(n for n, _ in ref.named_parameters())}


def rank_world(rank: int, world: int, cases: dict, chunk: bool) -> dict:
    from meshplan.executor.plan_run import plan_rank

    out: dict = {"a2a": a2a_block(rank, world)}
    if chunk:
        out["chunk"] = chunk_block(rank, world)
    out["ep"] = {case: plan_rank(rank, world, run, lay, inject) for case, (run, lay, inject) in cases.items()}
    return out


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_world(2, rank_world, jobs(CASES2), True, timeout_s=120)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_world(4, rank_world, jobs(CASES4), False, timeout_s=120)


def results_of(case: str, world2, world4) -> list:
    ranks = world2 if case in CASES2 else world4
    return [out["ep"][case] for out in ranks]


# ---- building blocks ----------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_ragged_all_to_all_and_its_backward(world: int, world2, world4) -> None:
    for out in world2 if world == 2 else world4:
        assert out["a2a"] == {"forward": True, "backward": True}


def test_expert_parallel_on_a_model_chunk(world2) -> None:
    chunk_names = [out["chunk"]["names"] for out in world2]
    ref_names = world2[0]["chunk"]["ref_names"]
    assert all(out["chunk"]["error"] < 1e-14 for out in world2)
    assert set(chunk_names[0]) | set(chunk_names[1]) == set(ref_names)  # every name, as the reference has it
    for rank, names in enumerate(chunk_names):  # 4 experts, ep2: rank r holds experts 2r, 2r + 1
        held = {n.split(".")[4] for n in names if ".experts." in n}
        assert held == {str(2 * rank), str(2 * rank + 1)}


# ---- numerics -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in (*CASES2, *CASES4) if c not in BROKEN])
def test_ep_matches_the_reference(case: str, world2, world4) -> None:
    from meshplan.executor.compare import merge_reports

    results = results_of(case, world2, world4)
    merged, problems = merge_reports(results)
    assert problems == ()  # ranks holding the same tensor report it alike (1e-12)
    cmp = compare_to_reference(merged, reference(merged.run))
    assert cmp.ok, cmp.summary() + "\n" + "\n".join(cmp.failures())
    assert max(cmp.loss_error, cmp.grad_error) < 1e-12  # in fact ~1e-15: only the summation order differs
    assert len(cmp.loss_errors) == merged.run.steps


def test_each_expert_is_reported_by_the_ranks_that_hold_it(world4) -> None:
    """EP2 x ETP2 over dp4: ranks (0, 1) are the etp shards of experts 0-1, ranks (2, 3) of experts 2-3."""
    results = results_of("mixtral-ep2-etp2-dp4-2steps", None, world4)
    for r in results:
        experts = {name.split(".")[4] for name in r.grads if ".experts." in name}
        assert experts == ({"0", "1"} if r.rank < 2 else {"2", "3"})
        assert r.grads["layers.0.feed_forward.experts.0.w2.weight" if r.rank < 2
                        else "layers.0.feed_forward.experts.2.w2.weight"].shape == (32, 112)  # gathered


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_ep_is_caught(case: str, world2, world4) -> None:
    from meshplan.executor.compare import merge_reports

    merged, _ = merge_reports(results_of(case, world2, world4))
    cmp = compare_to_reference(merged, reference(merged.run))
    assert not cmp.ok and cmp.failures()
    assert cmp.grad_error > 1e-2 and cmp.param_error > 1e-4  # far above the 1e-6 tolerance
    assert "FAIL" in cmp.summary() and merged.layout.endswith("]")


# ---- pieces without a world -----------------------------------------------------------------------
def test_expert_placement() -> None:
    from meshplan.executor.expert_parallel import ExpertPlacement

    p = ExpertPlacement(8, ep=4, etp=2, ep_rank=2, etp_rank=1)
    assert (p.per_rank, p.group_size, p.position, p.local_experts) == (2, 8, 5, range(4, 6))
    assert [list(p.experts_of(i)) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="does not divide"):
        ExpertPlacement(6, ep=4)
    with pytest.raises(ValueError, match="outside"):
        ExpertPlacement(8, ep=2, ep_rank=2)


def test_etp_shards_sum_to_the_expert() -> None:
    """Column-parallel w1/w3 and row-parallel w2 (bias on shard 0 only): the shards' partial outputs add up to the
    whole expert's output, and the sliced parameters are the whole one's rows / columns."""
    import copy

    from meshplan.executor.expert_parallel import _shard_expert
    from meshplan.executor.model import build_model

    model = build_model(tiny(BIAS))
    whole = model.layers[0].feed_forward.experts[1]
    with torch.no_grad():
        for p in whole.parameters():  # biases are 0 at init; make them count
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=F64) * 0.1)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0), dtype=F64)
    shards = [_shard_expert(copy.deepcopy(whole), 4, t) for t in range(4)]
    for t, s in enumerate(shards):
        part = slice(28 * t, 28 * (t + 1))
        assert torch.equal(s.w1.weight, whole.w1.weight[part]) and torch.equal(s.w3.bias, whole.w3.bias[part])
        assert torch.equal(s.w2.weight, whole.w2.weight[:, part]) and torch.equal(s.w2.bias, whole.w2.bias)
    with torch.no_grad():
        assert relative_error(sum(s(x) for s in shards), whole(x)) < 1e-14
    assert shards[0].w1.weight.shape == (28, 32) and shards[3].w2.weight.shape == (32, 28)
    assert [s.w2.add_bias for s in shards] == [True, False, False, False]


def test_chunk_rows_are_torch_chunk() -> None:
    from meshplan.executor.expert_parallel import _chunk_rows

    for n in (0, 1, 6, 7, 8):
        for parts in (1, 2, 4):
            sizes = [len(c) for c in torch.arange(n).chunk(parts)] if n else []
            sizes += [0] * (parts - len(sizes))  # torch.chunk may return fewer pieces; DTensor pads with empty ones
            assert [len(range(n)[_chunk_rows(n, parts, i)]) for i in range(parts)] == sizes


def test_ep_arguments_are_checked() -> None:
    from meshplan.executor.expert_parallel import apply_expert_parallel
    from meshplan.executor.plan_run import injection_problem

    run = RunSpec(tiny(MOE), gbs=2, seq=8)
    assert "needs ep > 1" in injection_problem(exec_layout(run, 2, dp=2), "wrong-expert-placement")
    assert "needs tp > 1" in injection_problem(exec_layout(run, 2, dp=2, ep=2), "no-token-split")
    with pytest.raises(ValueError, match="injection"):
        apply_expert_parallel(run.build(), None, layout(), inject="typo")  # type: ignore[arg-type]
