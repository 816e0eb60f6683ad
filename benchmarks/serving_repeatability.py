"""How far AIConfigurator's measured deployments disagree with themselves (issue 45, item 2): the rows that measure
one deployment more than once (costmodels/aic_deployments.repeats: the same engine, model, GPU, precision, layout,
request shape and users), on the same engine version or on two. No prediction from the deployment alone can be
closer than they are to each other: exact on one row of a pair, it is off on the other by 1 - smaller / larger. So
these spreads are the floor under the engine fit's held-out errors (benchmarks/serving_engine_fit.py), which predicts
every version of an engine with one set of parameters.

Usage:  pip install 'meshplan[aic]' && python benchmarks/serving_repeatability.py [--markdown]
(a few seconds: it only reads the file)

Printed: the copies the reader counts once; then per engine, for pairs on one version and pairs across versions,
the pairs, the deployments they measure, and the median spread (larger / smaller - 1) of TTFT and TPOT, for all rows
and for those of models meshplan expresses (the engine fit's); then each
pair of versions with at least 10 pairs, with the median change of each figure from the first version named to
the later (versions ordered by their numbers: 0.5.9 before 0.5.10), and the models they measured.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.costmodels.aic_deployments import (COPY, Deployment, Repeat, measured_deployment,  # noqa: E402
                                                 models_named, read_deployments, repeats)
from meshplan.hardware_db.errors import InputError  # noqa: E402


def _row(cells: list[str], markdown: bool, widths: list[int]) -> str:
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _head(head: list[str], widths: list[int], markdown: bool) -> list[str]:
    """The header line, and markdown's alignment line (the first column left, the others right but the last text)."""
    lines = [_row(head, markdown, widths)]
    if markdown:
        lines.append("| --- | " + " | ".join("---:" for _ in head[1:-1]) + (" | --- |" if head[-1] == "models"
                                                                             else " | ---: |"))
    return lines


def spread_table(pairs: list[Repeat], markdown: bool) -> list[str]:
    widths = [30, 6, 12, 12, 12]
    lines = _head(["engine, versions", "pairs", "deployments", "TTFT spread", "TPOT spread"], widths, markdown)
    groups: dict[str, list[Repeat]] = defaultdict(list)
    for p in pairs:
        kind = "one version" if p.same_version else "two versions"
        groups[f"{p.first.engine}, {kind}"].append(p)
        groups[f"all, {kind}"].append(p)
    for name in sorted(groups, key=lambda g: (g.startswith("all"), g)):
        ps = groups[name]
        deployments = len({measured_deployment(p.first) for p in ps})
        lines.append(_row([name, str(len(ps)), str(deployments),
                           _pct(statistics.median(p.spread("ttft") for p in ps)),
                           _pct(statistics.median(p.spread("tpot") for p in ps))], markdown, widths))
    return lines


def _natural(version: str) -> tuple[tuple[int, int | str], ...]:
    """A version's sort key: its runs of digits as numbers (0.5.9 before 0.5.10), the rest as text after them."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.findall(r"\d+|\D+", version))


def version_table(pairs: list[Repeat], markdown: bool) -> list[str]:
    widths = [54, 6, 12, 12, 30]
    lines = _head(["engine: from -> to", "pairs", "TTFT change", "TPOT change", "models"], widths, markdown)
    by: dict[tuple[str, str, str], list[tuple[Deployment, Deployment]]] = defaultdict(list)
    for p in pairs:
        if not p.same_version:
            old, new = sorted((p.first, p.second), key=lambda d: _natural(d.version))
            by[(p.first.engine, old.version or "(none)", new.version or "(none)")].append((old, new))
    for (engine, old_version, new_version), ps in sorted(by.items()):
        if len(ps) < 10:
            continue
        ttft = statistics.median(math.log(b.ttft_ms / a.ttft_ms) for a, b in ps)
        tpot = statistics.median(math.log(b.tpot_ms / a.tpot_ms) for a, b in ps)
        models = ", ".join(sorted({a.model_path.split("/")[-1] for a, _ in ps}))
        lines.append(_row([f"{engine}: {old_version} -> {new_version}", str(len(ps)),
                           f"{100 * math.expm1(ttft):+.0f} %", f"{100 * math.expm1(tpot):+.0f} %", models],
                          markdown, widths))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the tables in markdown for RESULTS.md")
    args = ap.parse_args()
    try:
        rows = read_deployments()
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    copies = sum(u.why.startswith(COPY) for u in rows.unread)
    print(f"{rows.source}: {len(rows.deployments)} rows read; {copies} more are copies of a row read "
          "(one run listed twice), counted once")
    pairs = repeats(rows.deployments)
    models = Counter(p.first.model_path.split("/")[-1] for p in pairs)
    print(f"{len(pairs)} pairs of rows measure one deployment twice with different figures; by model: "
          + ", ".join(f"{m} {n}" for m, n in models.most_common()))
    print()
    print("\n".join(spread_table(pairs, args.markdown)))
    named = models_named(rows.deployments)  # "" for a model meshplan expresses: the rows the engine fit uses
    fit = [p for p in pairs if not named[p.first.model_path]]
    print(f"\nof them, the {len(fit)} pairs of models meshplan expresses (the engine fit's rows):")
    print("\n".join(spread_table(fit, args.markdown)))
    print()
    print("\n".join(version_table(pairs, args.markdown)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
