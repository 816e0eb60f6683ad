"""What each measured kernel effect contributes to the cost model's accuracy: both development sets scored with
all the physics on, with each term of costmodels.kernels.Physics switched off in turn, and with all of it off
(the plain roofline at the GPU's GEMM and attention ceilings); then the torch runtimes' framework terms, each switched
off by appending a runtime option (config.RUNTIME_OPTIONS) to the second set's runtimes.

Usage:  python benchmarks/physics_ablation.py [--markdown]

A term earns its place by the physics it states (its sources are in kernels.py and docs/cost_model.md), not by
this table; the table shows where it moves the predictions, and by how much, so a reader can judge it. Error > 0:
predicted faster than measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from reference_runs import Row, all_rows

from meshplan.costmodels.kernels import Physics

GROUPS = (("set", "first"), ("set", "second"), ("experts", "moe"), ("precision", "fp8"), ("sequence", ">= 32K"),
          ("framework", "torchtitan"))


def scores(rows: list[Row]) -> list[tuple[float, float]]:
    """(MAPE, mean signed error) over all rows, then over each of GROUPS."""
    out = [(statistics.mean(abs(r.error) for r in rows), statistics.mean(r.error for r in rows))]
    for group in GROUPS:
        sel = [r for r in rows if group in r.groups]
        out.append((statistics.mean(abs(r.error) for r in sel), statistics.mean(r.error for r in sel)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="a markdown table for RESULTS.md")
    args = ap.parse_args()
    variants = [("all terms on", Physics())]
    variants += [(f"without {f.name}", Physics().without(f.name)) for f in dataclasses.fields(Physics)]
    variants.append(("all terms off", Physics.none()))
    # framework terms, switched off through runtime options (config.RUNTIME_OPTIONS): torch's separate projection
    # GEMMs, FSDP2's copies, torchao's FP8 TP all-gathers, the repeated GQA heads
    options = [("fused projections (+fused-projections)", ("fused-projections",)),
               ("no FSDP2 copies (+no-fsdp-copies)", ("no-fsdp-copies",)),
               ("16-bit TP all-gathers (+bf16-tp-gather)", ("bf16-tp-gather",)),
               ("grouped K,V heads read in place (+native-gqa)", ("native-gqa",))]
    heads = ["all"] + [f"{k} {v}" for k, v in GROUPS]
    if args.markdown:
        print("| physics | " + " | ".join(f"{h} MAPE (mean)" for h in heads) + " |")
        print("| --- |" + " ---: |" * len(heads))
    else:
        print(f"{'physics':28s}" + "".join(f"{h:>22s}" for h in heads))
    runs = [(label, physics, ()) for label, physics in variants]
    runs += [(label, Physics(), opts) for label, opts in options]
    for label, physics, opts in runs:
        cells = [f"{100 * m:.1f}% ({100 * s:+.1f}%)"
                 for m, s in scores(all_rows(physics=physics, runtime_options=opts))]
        print(f"| {label} | " + " | ".join(cells) + " |" if args.markdown
              else f"{label:28s}" + "".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
