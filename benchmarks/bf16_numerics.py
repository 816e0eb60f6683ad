"""verify in bfloat16 and float32 (issue 21): the errors behind executor/compare.py's tolerances, reproducible.

Runs the composed layouts of tests/test_verify.py (CASES: 2 AdamW steps, seq 16, models at "tiny") in the dtype on
gloo ranks, then a few of them with a fault injected, and prints one markdown row each: loss error, the worst
gradient and the worst parameter update outside the routing group, the routing group's (bf16), and the verdict.

Usage:  python benchmarks/bf16_numerics.py [--dtype bfloat16|float32] [--faults-only]   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (case, injected fault): each fault a layout bug the float64 check finds, here at bf16's tolerances
FAULTS = (("zero1-tp2-dp2-moe", "no-grad-sync"), ("ep4", "no-expert-grad-sync"), ("ep4", "wrong-expert-placement"),
          ("recompute-full-selective-moe", "shift-stage"), ("zero3-dp4", "scale-loss"),
          ("tp2-sp-cp2-ring", "no-cp-grad-sync"))


def _worst(errors: dict[str, float], group: str) -> str:
    rest = {k: v for k, v in errors.items() if k != group}
    if not rest:
        return "-"
    name = max(rest, key=rest.__getitem__)
    return f"{rest[name]:.2e} ({name})"


def row(case: str, inject: str | None, dtype: str) -> str:
    from test_verify import CASES, _layout_case

    from meshplan.executor.compare import ROUTING_GROUP
    from meshplan.executor.launch import RankFailure
    from meshplan.executor.verify import run_layout

    model, layers, gbs, knobs = CASES[case]
    run, lay = _layout_case(model, layers, gbs, **dict(knobs))
    run = dataclasses.replace(run, dtype=dtype)
    label = f"{case}{f' + {inject}' if inject else ''}"
    try:
        result = run_layout(run, lay, inject=inject, timeout_s=400)
    except RankFailure as exc:
        return f"| {label} | {model} | refused: {exc} | | | | |"
    c = result.comparison
    group = (f"{c.grad_errors[ROUTING_GROUP]:.2e} / {c.param_errors[ROUTING_GROUP]:.2e}"
             if ROUTING_GROUP in c.grad_errors else "-")
    verdict = "OK" if result.ok else f"FAIL ({len(result.failures)})"
    return (f"| {label} | {model} | {c.loss_error:.2e} | {_worst(dict(c.grad_errors), ROUTING_GROUP)} | "
            f"{_worst(dict(c.param_errors), ROUTING_GROUP)} | {group} | {verdict} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--faults-only", action="store_true", help="only the layouts with a fault injected")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))  # the layouts are the test suite's, so the two cannot drift apart
    from test_verify import CASES

    print("| layout | model@tiny | loss | worst gradient | worst update (norm-wise) | routing group: gradients / "
          "updates | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    cases = [] if args.faults_only else [(case, None) for case in CASES]
    for case, inject in [*cases, *FAULTS]:
        print(row(case, inject, args.dtype), flush=True)


if __name__ == "__main__":  # spawned ranks re-import this file
    main()
