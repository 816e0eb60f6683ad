"""bfloat16 runs (issue 21, review finding 17): what a GPU trains in, held to tolerances per quantity
(executor/compare.py's docstring has them and the figures they rest on). These tests forge a run from the
single-process one to show each rule passes rounding-sized differences and fails a layout bug's; and the rule for
gradients that are zero in exact arithmetic, which float32 needs as well."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from meshplan.costmodels.model_io import load_zoo  # noqa: E402
from meshplan.executor.compare import (ROUTING_GROUP, TOLERANCES, compare_to_reference,  # noqa: E402
                                       routing_dependent)
from meshplan.executor.reference import RunResult, RunSpec, reference_run  # noqa: E402
from meshplan.executor.scale import scale_model  # noqa: E402


def _run(model: str) -> RunSpec:
    return RunSpec(model=scale_model(load_zoo(model), "tiny", num_layers=2), gbs=2, seq=8, steps=2, dtype="bfloat16")


@pytest.fixture(scope="module")
def dense():
    """gpt3-175b@tiny: q/k/v biases, whose key bias has an exactly-zero gradient (rounding noise in bf16)."""
    run = _run("gpt3-175b")
    return run, reference_run(run), dict(run.build().named_parameters())


@pytest.fixture(scope="module")
def moe():
    run = _run("mixtral-8x7b")
    return run, reference_run(run), dict(run.build().named_parameters())


def _forged(ref: RunResult, grads=None, params=None) -> RunResult:
    return dataclasses.replace(ref, grads={**ref.grads, **(grads or {})}, params={**ref.params, **(params or {})},
                               layout="forged")


def _update(ref: RunResult, init, name: str, scale) -> torch.Tensor:
    """The reference's parameter after its update scaled by `scale` (a number or a tensor of the same shape)."""
    p0 = init[name].detach()
    return (p0.double() + (ref.params[name].double() - p0.double()) * scale).to(p0.dtype)


def test_the_reference_against_itself_is_exact_and_bf16_has_its_own_tolerances(dense):
    run, ref, _ = dense
    cmp = compare_to_reference(ref, ref)
    assert cmp.ok and cmp.loss_error == cmp.grad_error == cmp.param_error == 0.0
    tol = cmp.tolerance
    assert tol == TOLERANCES["bfloat16"] and tol.by_update
    assert (tol.loss, tol.grad, tol.param) == (3e-2, 1e-1, 0.5)
    assert TOLERANCES["float64"].loss == TOLERANCES["float64"].param == 1e-6 and not TOLERANCES["float64"].by_update


def test_rounding_sized_sign_flips_pass_and_a_missing_or_reversed_update_fails(dense):
    """AdamW steps every entry by about lr, so an entry whose gradient is rounding-sized may step the other way: 2 %
    of the entries (the smallest gradients) reversed is 2 sqrt(2 %) = 0.28 norm-wise; a whole tensor not updated is
    1.0, reversed 2.0."""
    run, ref, init = dense
    name = "layers.0.attention.wq.weight"
    g = ref.grads[name].double().abs()
    flip = torch.where(g <= g.flatten().quantile(0.02), -1.0, 1.0)
    cmp = compare_to_reference(_forged(ref, params={name: _update(ref, init, name, flip)}), ref)
    assert cmp.ok, cmp.failures()
    assert 0.1 < cmp.param_errors[name] < 0.5
    for scale, error in ((0.0, 1.0), (-1.0, 2.0)):
        cmp = compare_to_reference(_forged(ref, params={name: _update(ref, init, name, scale)}), ref)
        assert not cmp.ok and cmp.param_errors[name] == pytest.approx(error, rel=1e-2)
        assert any(line.startswith(f"parameter {name}: relative error") for line in cmp.failures())


def test_a_gradient_that_is_rounding_noise_is_judged_on_the_floor_not_by_its_update(dense):
    run, ref, init = dense
    largest = max(float(g.abs().max()) for g in ref.grads.values())
    noise = [n for n, g in ref.grads.items() if float(g.abs().max()) < TOLERANCES["bfloat16"].floor * largest]
    assert any(n.endswith("attention.wk.bias") for n in noise), noise  # softmax ignores q . b_k: zero in exact math
    name = noise[0]
    other_sign = _update(ref, init, name, -1.0)  # noise's sign: what another summation order gives
    cmp = compare_to_reference(_forged(ref, grads={name: -ref.grads[name]}, params={name: other_sign}), ref)
    assert cmp.ok, cmp.failures()
    assert name in cmp.grad_errors and name not in cmp.param_errors
    big = ref.grads[name] + 1e-2 * largest  # a gradient well above the floor where there should be none
    assert not compare_to_reference(_forged(ref, grads={name: big}), ref).ok


def test_routers_and_routed_experts_are_judged_together(moe):
    """One routed expert's gradient wholly different (a token routed elsewhere under rounding) passes; every expert's
    gradient doubled (a missing average over the expert-data-parallel ranks) fails."""
    run, ref, init = moe
    grouped = [n for n in ref.grads if routing_dependent(n)]
    assert any(".router." in n for n in grouped) and any(".experts." in n for n in grouped)
    assert not any("shared_experts" in n for n in grouped)
    one = min((n for n in grouped if ".experts." in n), key=lambda n: float(ref.grads[n].norm()))
    cmp = compare_to_reference(_forged(ref, grads={one: torch.zeros_like(ref.grads[one])}), ref)
    assert cmp.ok, cmp.failures()
    assert one not in cmp.grad_errors and 0 < cmp.grad_errors[ROUTING_GROUP] <= TOLERANCES["bfloat16"].routing_norm
    doubled = {n: ref.grads[n] * 2 for n in grouped}
    cmp = compare_to_reference(_forged(ref, grads=doubled), ref)
    assert not cmp.ok and cmp.grad_errors[ROUTING_GROUP] == pytest.approx(1.0, rel=1e-2)
    assert any(line.startswith(f"gradient {ROUTING_GROUP}") for line in cmp.failures())


def test_a_wrong_loss_fails_at_its_step(moe):
    run, ref, _ = moe
    cmp = compare_to_reference(dataclasses.replace(ref, losses=(ref.losses[0], ref.losses[1] * 1.1)), ref)
    assert not cmp.ok and cmp.failures() == [f"loss at step 2: relative error {cmp.loss_errors[1]:.3g} "
                                             f"(tolerance {TOLERANCES['bfloat16'].loss:g})"]


def test_float32_judges_zero_gradients_by_the_gradient_and_parameters_by_their_update():
    """In float32 AdamW maps the key biases' gradient noise (~1e-11, below its eps) to parameter values 0.2-0.6 apart
    between correct runs (gpt3-175b@tiny, CP2 x PP2): those parameters are not judged, their gradients are. Every
    other parameter is judged by its update, to 1e-2: a whole update 10 % short fails."""
    from meshplan.executor.compare import noise_gradients

    run = dataclasses.replace(_run("gpt3-175b"), dtype="float32")
    ref = reference_run(run)
    init = dict(run.build().named_parameters())
    tol = TOLERANCES["float32"]
    assert (tol.loss, tol.grad, tol.param, tol.floor, tol.by_update) == (1e-4, 1e-4, 1e-2, 1e-5, True)
    noise = noise_gradients(ref, tol.floor)
    assert noise and all(n.endswith("attention.wk.bias") for n in noise), noise
    apart = {n: ref.params[n] * 1.6 + 1e-6 for n in noise}
    cmp = compare_to_reference(_forged(ref, params=apart), ref)
    assert cmp.ok, cmp.failures()
    assert not noise & set(cmp.param_errors) and set(noise) <= set(cmp.grad_errors)
    name = "layers.0.attention.wq.weight"
    for scale, ok in ((1 + 1e-3, True), (0.9, False)):
        cmp = compare_to_reference(_forged(ref, params={name: _update(ref, init, name, scale)}), ref)
        assert cmp.ok == ok and cmp.param_errors[name] == pytest.approx(abs(1 - scale), rel=1e-2)
