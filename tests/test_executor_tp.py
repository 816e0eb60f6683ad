"""Tensor and sequence parallelism (issue 4): TP (+SP) of dense GQA, MHA with biases, learned positions and a
tied head, and MLA + MoE models reproduces the single-process loss, gradients and AdamW parameters, alone and
composed with DP (ZeRO 0, and FSDP2 2-D) and PP (gathered logits), each through plan_rank (the path `meshplan
verify` runs); model chunks shard too; broken layouts are caught.

Two shared worlds (2 and 4 ranks, module-scoped) run every case in one spawn each, as tests/test_executor_dp.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from executor_helpers import exec_layout, reference

from meshplan.costmodels.model_io import load_model
from meshplan.executor.compare import compare_to_reference, relative_error
from meshplan.executor.launch import run_world
from meshplan.executor.reference import RunSpec, reference_step
from meshplan.executor.scale import scale_model

# GQA (8 heads, 2 kv heads); MHA with biases, learned positions, LayerNorm and a tied head; MLA + dense + MoE
DENSE, TIED, MLA = "llama3.1-8b", "gpt3-175b", "deepseek-v3"


MLA_FULL_Q = "deepseek-v3/uncompressed-q"  # MLA without the query bottleneck (as DeepSeek-V2-Lite), not in the zoo


def run_of(name: str, steps: int = 2) -> RunSpec:
    """2 layers (deepseek-v3@tiny: a dense layer then an MoE layer), 4 sequences of 8 tokens."""
    spec = scale_model(load_model(name.split("/")[0]), "tiny", num_layers=2)
    if name == MLA_FULL_Q:
        spec = spec.model_copy(update={"name": spec.name + "-uncompressed-q",
                                       "mla": spec.mla.model_copy(update={"q_lora_rank": None})})
    return RunSpec(spec, gbs=4, seq=8, steps=steps)


# (case id) -> (model, knobs of the layout, injection): each run by plan_rank on the layout resolve() makes of them
TP2_CASES = {
    "gqa-tp2": (DENSE, dict(tp=2, sp=False, mbs=2, zero=0), None),
    "gqa-tp2-sp": (DENSE, dict(tp=2, sp=True, mbs=1, zero=0), None),
    "biases-tied-tp2": (TIED, dict(tp=2, sp=False, mbs=2, zero=0), None),
    "biases-tied-tp2-sp": (TIED, dict(tp=2, sp=True, mbs=2, zero=0), None),
    "mla-moe-tp2": (MLA, dict(tp=2, sp=False, mbs=2, zero=0), None),
    "mla-moe-tp2-sp": (MLA, dict(tp=2, sp=True, mbs=2, zero=0), None),
    "mla-uncompressed-q-tp2-sp": (MLA_FULL_Q, dict(tp=2, sp=True, mbs=2, zero=0), None),
    "broken-no-wo-reduce": (DENSE, dict(tp=2, sp=False, mbs=2, zero=0), "no-wo-reduce"),
    "broken-no-kpe-sync": (MLA, dict(tp=2, sp=True, mbs=2, zero=0), "no-kpe-sync"),
}
WORLD4_CASES = {
    "gqa-tp2-dp2": (DENSE, dict(tp=2, sp=False, dp=2, mbs=1, zero=0), None),
    # the head's logits gathered (plain tensors between pipeline stages), the loss outside loss_parallel
    "gqa-tp2-pp2-gathered-logits": (DENSE, dict(tp=2, sp=False, pp=2, mbs=2, zero=0), None),
    "mla-moe-tp2-sp-dp2-zero3": (MLA, dict(tp=2, sp=True, dp=2, mbs=1, zero=3), None),
    "tied-tp2-sp-dp2-zero2": (TIED, dict(tp=2, sp=True, dp=2, mbs=2, zero=2), None),
    "biases-tied-tp4-sp": (TIED, dict(tp=4, sp=True, mbs=2, zero=0), None),
    "broken-no-grad-sync": (DENSE, dict(tp=2, sp=False, dp=2, mbs=1, zero=0), "no-grad-sync"),
}
BROKEN = {c for c in {**TP2_CASES, **WORLD4_CASES} if c.startswith("broken")}


# ---- rank functions: top level, so spawn can pickle them by name ---------------------------------
def chunked_step(rank: int, world: int, run: RunSpec) -> dict:
    """The model as two ModelChunks (layers [0, 1) with the embeddings, [1, 2) with the head), each sharded by
    apply_tensor_parallel with SP, run back to back; loss by tp_loss. Also: a later chunk without positions."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.executor.model import ModelChunk
    from meshplan.executor.tensor_parallel import (apply_tensor_parallel, full_grads, reduce_partial_grads, tp_loss,
                                                   vocab_parallel_loss)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = run.build()
    seq = run.seq
    chunks = [ModelChunk(model, 0, 1), ModelChunk(model, 1, 2, positions=torch.arange(seq))]
    for chunk in chunks:
        apply_tensor_parallel(chunk, mesh, sp=True)
    tokens, labels = run.batch(0)
    with vocab_parallel_loss():
        hidden = chunks[0](tokens)
        loss = tp_loss(chunks[1](hidden), labels)
        loss.backward()
    grads: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        reduce_partial_grads(chunk)
        grads.update(full_grads(chunk))
    unguarded = ModelChunk(run.build(), 1, 2)
    apply_tensor_parallel(unguarded, mesh, sp=True)
    try:
        unguarded(hidden.detach())
        guard = "no error"
    except ValueError as exc:
        guard = str(exc)
    return {"loss": float(loss.detach()), "grads": grads, "hidden_shape": tuple(hidden.shape), "guard": guard}


def rank_world(rank: int, world: int, cases: dict[str, tuple], chunked: RunSpec | None) -> dict:
    from meshplan.executor.plan_run import plan_rank

    out: dict = {"tp": {}}
    for case, (run, knobs, inject) in cases.items():
        out["tp"][case] = plan_rank(rank, world, run, exec_layout(run, world, **knobs), inject=inject)
    if chunked is not None:
        out["chunked"] = chunked_step(rank, world, chunked)
    return out


def jobs(cases: dict) -> dict:
    return {case: (run_of(model), *rest) for case, (model, *rest) in cases.items()}


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return run_world(2, rank_world, jobs(TP2_CASES), run_of(DENSE, steps=1), timeout_s=240)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return run_world(4, rank_world, jobs(WORLD4_CASES), None, timeout_s=240)


def results_of(case: str, world2, world4) -> list:
    ranks = world2 if case in TP2_CASES else world4
    return [out["tp"][case] for out in ranks]


# ---- numerics ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in {**TP2_CASES, **WORLD4_CASES} if c not in BROKEN])
def test_tp_matches_the_reference(case: str, world2, world4) -> None:
    from meshplan.executor.compare import merge_reports

    results = results_of(case, world2, world4)
    merged, problems = merge_reports(results)
    assert problems == ()  # replicas (tp gathers, dp copies) agree to 1e-12
    cmp = compare_to_reference(merged, reference(merged.run))
    assert cmp.ok, cmp.summary() + "\n" + "\n".join(cmp.failures())
    assert len(cmp.loss_errors) == 2 and set(cmp.grad_errors) == set(reference(merged.run).grads)
    assert cmp.loss_error < 1e-12 and cmp.grad_error < 1e-10  # summation order only (key biases: see compare.py)


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_tp_is_caught(case: str, world2, world4) -> None:
    from meshplan.executor.compare import merge_reports

    results = results_of(case, world2, world4)
    merged, problems = merge_reports(results)
    cmp = compare_to_reference(merged, reference(merged.run))
    assert not cmp.ok and cmp.grad_error > 1e-3, cmp.summary()
    assert problems  # the replicas drift apart too
    assert merged.layout.endswith(f"[{case.removeprefix('broken-')}]")


def test_model_chunks_shard_and_chain(world2) -> None:
    """Two chunks under SP: the hand-off is this rank's seq/tp tokens; the gradients are the reference's."""
    run = run_of(DENSE, steps=1)
    ref = reference_step(run.build(), *run.batch(0))
    for out in world2:
        got = out["chunked"]
        assert got["hidden_shape"] == (run.gbs, run.seq // 2, run.model.hidden)
        assert relative_error(got["loss"], ref.loss) < 1e-12
        assert set(got["grads"]) == set(ref.grads)
        assert max(relative_error(got["grads"][n], g) for n, g in ref.grads.items()) < 1e-10
        assert "explicit positions" in got["guard"]


# ---- without a world -----------------------------------------------------------------------------------
def test_tp_degree_must_divide_the_sharded_dims() -> None:
    from meshplan.executor.model import build_model
    from meshplan.executor.tensor_parallel import check_tp_degree

    model = build_model(scale_model(load_model(DENSE), "tiny", num_layers=1))
    check_tp_degree(model, 2)
    with pytest.raises(ValueError, match="kv heads 2"):  # 8 query heads, 2 kv heads
        check_tp_degree(model, 4)


def test_tp_injections_are_checked() -> None:
    from meshplan.executor.plan_run import injection_problem

    run = run_of(DENSE)
    assert "needs tp > 1" in injection_problem(exec_layout(run, 2, dp=2), "no-wo-reduce")
    assert "sequence parallelism off" in injection_problem(exec_layout(run, 2, tp=2, sp=True), "no-wo-reduce")
    assert injection_problem(exec_layout(run, 2, tp=2, sp=False), "no-wo-reduce") is None


def test_merge_reports_lists_disagreeing_replicas() -> None:
    from meshplan.executor.compare import merge_reports
    from meshplan.executor.reference import RankResult

    run = run_of(DENSE)
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    b = {"w": a["w"] * (1 + 1e-9)}
    r0 = RankResult(run=run, losses=(1.0, 2.0), grads=a, params=a, layout="x", rank=0)
    r1 = RankResult(run=run, losses=(1.0, 2.0), grads=b, params={"v": a["w"]}, layout="x", rank=1)
    assert merge_reports([r0, r0])[1] == ()
    merged, problems = merge_reports([r0, r1])
    assert len(problems) == 1 and problems[0].startswith("gradient w: rank 1 differs from rank 0")
    assert set(merged.params) == {"w", "v"} and torch.equal(merged.grads["w"], a["w"])
