"""Pictures of a sweep and of a serving search: PNG files and one self-contained HTML page (inline SVG, no script,
no network), drawn with matplotlib's object API (Figure + Agg canvas: no pyplot global state).

Every plotted series carries an SVG id (`gid`) naming what it shows (e.g. `throughput-h100-sxm`, `pareto`), so a
test can find each figure's points in the page a browser rendered.
"""

from __future__ import annotations

import csv
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.planner.outputs import OutputFile
from meshplan.planner.sweep import Sweep, SweepPoint, sweep_csv, time_s, usd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from meshplan.planner.plan import Plan, ServingPlan

__all__ = ["Table", "sweep_report", "serving_report", "html_page"]

MARKERS = "osD^v<>ph*"
# the files each report may write in its folder (fnmatch patterns): a command checks its other outputs against them
# before any work (planner.outputs.check_folder_contents)
SWEEP_FILES = ("sweep.csv", "sweep-*.png", "sweep.html")
SERVE_FILES = ("serve-pareto.csv", "serve-pareto.png", "serve.html")


@dataclass(frozen=True)
class Table:
    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


def _figure(width: float = 10.0, height: float = 4.0, columns: int = 2) -> tuple[Figure, list]:
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, [fig.add_subplot(1, columns, i + 1) for i in range(columns)]


def _png(fig: Figure) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=110, metadata={"Software": None})
    return out.getvalue()


def _svg(fig: Figure) -> str:
    """The figure as SVG text for inlining (no XML prolog; ids made repeatable with a fixed hash salt)."""
    import matplotlib
    out = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": "meshplan", "svg.fonttype": "path"}):
        fig.savefig(out, format="svg", metadata={"Date": None})
    text = out.getvalue()
    return text[text.index("<svg"):]


def _scaling_figure(sw: Sweep) -> Figure:
    fig, (ax_tput, ax_mfu) = _figure()
    for i, gpu in enumerate(dict.fromkeys(p.gpu for p in sw.points)):
        pts = [p for p in sw.feasible if p.gpu == gpu]
        if not pts:
            continue
        xs = [p.gpus for p in pts]
        line, = ax_tput.plot(xs, [p.cost.tokens_per_s for p in pts], marker=MARKERS[i % len(MARKERS)], label=gpu,
                             gid=f"throughput-{gpu}")
        ranges = [(p.gpus, *r) for p in pts if (r := _throughput_range(p)) is not None]
        if ranges:
            ax_tput.vlines(*zip(*ranges, strict=True), colors=line.get_color(), alpha=0.6, gid=f"interval-{gpu}")
        ax_mfu.plot(xs, [100 * p.plan.prediction.mfu for p in pts if p.plan], marker=MARKERS[i % len(MARKERS)],
                    label=gpu, gid=f"mfu-{gpu}")
    for ax, label in ((ax_tput, "tokens/s"), (ax_mfu, "MFU, %")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax_tput.set_yscale("log")
    ax_tput.set_title("throughput")
    ax_mfu.set_title("model FLOPs utilisation")
    ax_mfu.set_ylim(bottom=0)
    ax_tput.legend()
    return fig


def _throughput_range(point: SweepPoint) -> tuple[float, float] | None:
    """(low, high) tokens/s of a point's 80 % range (costmodels/uncertainty.py): its throughput over the step
    time's interval; None without one."""
    if point.plan is None or point.plan.prediction.interval is None:
        return None
    step, (fast, slow) = point.plan.prediction.step_time_s, point.plan.prediction.interval.step_time_s
    return point.cost.tokens_per_s * step / slow, point.cost.tokens_per_s * step / fast


def _cost_figure(sw: Sweep) -> Figure:
    with_tokens = any(p.cost.expected_s is not None for p in sw.feasible)
    fig, (ax,) = _figure(7.0, 4.5, 1)
    scale_t, scale_u = (86400.0, 1e6) if with_tokens else (1.0, 1.0)
    for i, gpu in enumerate(dict.fromkeys(p.gpu for p in sw.points)):
        pts = [p for p in sw.feasible if p.gpu == gpu]
        if pts:
            ax.plot([usd(p.cost) / scale_u for p in pts], [time_s(p.cost) / scale_t for p in pts], linestyle="none",
                    marker=MARKERS[i % len(MARKERS)], label=gpu, gid=f"cost-{gpu}")
    front = sorted(sw.pareto, key=lambda p: usd(p.cost))
    ax.plot([usd(p.cost) / scale_u for p in front], [time_s(p.cost) / scale_t for p in front], color="black",
            linewidth=1, drawstyle="steps-post", label="Pareto front", gid="pareto")
    best = sw.best
    if best is not None:
        ax.plot([usd(best.cost) / scale_u], [time_s(best.cost) / scale_t], marker="*", markersize=16,
                linestyle="none", color="gold", markeredgecolor="black", label=f"chosen ({sw.objective})",
                gid="chosen")
    ax.set_xlabel("expected cost, million USD" if with_tokens else "USD per million tokens")
    ax.set_ylabel("expected days to train" if with_tokens else "seconds per million tokens")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.set_title("time against money, every GPU type and count")
    ax.legend()
    return fig


def _plan_figure(doc: Plan, title: str) -> Figure:
    fig, (ax_step, ax_mem) = _figure()
    terms = {k: v for k, v in doc.prediction.breakdown_s.items() if v > 0}
    for bar, term in zip(ax_step.barh(list(terms), list(terms.values())), terms, strict=True):
        bar.set_gid(f"step-{term}")
    ax_step.invert_yaxis()
    ax_step.set_xlabel("seconds per step (sum of terms; overlap not shown)")
    ax_step.set_title(f"{title}: step breakdown")
    ranks = [str(s.rank) for s in doc.memory.stages]
    bottom = [0.0] * len(ranks)
    for name in type(doc.memory.stages[0].breakdown_gib).model_fields:
        values = [getattr(s.breakdown_gib, name) for s in doc.memory.stages]
        bars = ax_mem.bar(ranks, values, bottom=bottom, label=name)
        for bar, rank in zip(bars, ranks, strict=True):
            bar.set_gid(f"memory-{name}-rank{rank}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax_mem.axhline(doc.prediction.hbm_gib, color="black", linestyle="--", linewidth=1, label="HBM")
    ax_mem.set_xlabel("pipeline stage (first rank)")
    ax_mem.set_ylabel("GiB per GPU")
    ax_mem.set_title("memory per stage")
    ax_mem.legend(fontsize="x-small", ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return fig


def html_page(title: str, lines: Sequence[str], tables: Sequence[Table], svgs: Sequence[str]) -> str:
    """One page with everything inline: the lines, the pictures and the tables."""
    def table_html(t: Table) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in t.header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in t.rows)
        return f"<h2>{html.escape(t.title)}</h2><table><tr>{head}</tr>{body}</table>"

    style = ("body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;"
             "font-size:small}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
             "figure{margin:1em 0}svg{max-width:100%;height:auto}")
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>"]
    parts += [f"<p>{html.escape(line)}</p>" for line in lines]
    parts += [f"<figure>{svg}</figure>" for svg in svgs]
    parts += [table_html(t) for t in tables]
    parts.append("</body></html>\n")
    return "".join(parts)


def _sweep_table(sw: Sweep) -> Table:
    rows = []
    for p in sw.points:
        if p.plan is None:
            rows.append((p.gpu, str(p.gpus), "no plan", "", "", "", p.why or ""))
            continue
        c, lay = p.cost, p.plan.prediction.layout
        days = "" if c.expected_s is None else f"{c.expected_s / 86400:,.1f}"
        rows.append((p.gpu, str(p.gpus), f"TP{lay.tp} CP{lay.cp} PP{lay.pp} DP{lay.dp} EP{lay.ep} mbs{lay.mbs}",
                     f"{c.tokens_per_s:,.0f}", f"{100 * p.plan.prediction.mfu:.1f}", days,
                     f"${usd(c):,.0f}" if c.total_usd is not None else f"${c.usd_per_million_tokens:.3f}/M"))
    return Table("every point", ("GPU", "GPUs", "plan", "tokens/s", "MFU %", "days", "cost"), tuple(rows))


def sweep_report(sw: Sweep, directory: Path, title: str, lines: Sequence[str]) -> list[OutputFile]:
    """sweep.csv, three PNGs and sweep.html in `directory`."""
    figures = {"scaling": _scaling_figure(sw)}
    if sw.feasible:
        figures["cost"] = _cost_figure(sw)
    best = sw.best
    if best is not None and best.plan is not None:
        figures["plan"] = _plan_figure(best.plan, f"{best.gpus} x {best.gpu}")
    files = [OutputFile(directory / "sweep.csv", sweep_csv(sw))]
    files += [OutputFile(directory / f"sweep-{name}.png", _png(fig)) for name, fig in figures.items()]
    page = html_page(title, lines, [_sweep_table(sw)], [_svg(fig) for fig in figures.values()])
    return files + [OutputFile(directory / "sweep.html", page)]


def serving_report(doc: ServingPlan, directory: Path, title: str) -> list[OutputFile]:
    """serve-pareto.csv, serve-pareto.png and serve.html: every deployment on the Pareto front, those that meet
    the targets apart from those that do not, and the chosen one."""
    assert doc.search is not None
    front = doc.search.pareto
    fig, (ax,) = _figure(7.0, 4.5, 1)
    for meets, style in ((True, "o"), (False, "x")):
        pts = [d for d in front if d.meets_targets == meets]
        if not pts:
            continue
        ax.plot([d.tokens_per_s_per_user for d in pts], [d.tokens_per_s_per_gpu for d in pts], marker=style,
                linestyle="none", label="meets the targets" if meets else "misses a target",
                gid="pareto-meets" if meets else "pareto-misses")
    p = doc.prediction
    ax.plot([p.tokens_per_s_per_user], [p.tokens_per_s_per_gpu], marker="*", markersize=16, linestyle="none",
            color="gold", markeredgecolor="black", label="chosen", gid="chosen")
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title("Pareto front: throughput per GPU against speed per user")
    ax.grid(True, alpha=0.3)
    ax.legend()
    header = ("deployment", "GPUs", "tok/s/GPU", "tok/s/user", "TTFT ms", "TPOT ms", "meets")
    rows = tuple((d.deployment, str(d.gpus), f"{d.tokens_per_s_per_gpu:,.0f}", f"{d.tokens_per_s_per_user:.1f}",
                  f"{d.ttft_ms:.0f}", f"{d.tpot_ms:.1f}", "yes" if d.meets_targets else "no") for d in front)
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["deployment", "gpus", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "ttft_ms", "tpot_ms",
                "meets_targets"])
    w.writerows([d.deployment, d.gpus, f"{d.tokens_per_s_per_gpu:.6g}", f"{d.tokens_per_s_per_user:.6g}",
                 f"{d.ttft_ms:.6g}", f"{d.tpot_ms:.6g}", "yes" if d.meets_targets else "no"] for d in front)
    lines = [f"best: {doc.mode}, {p.gpus} GPUs, {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
             f"{p.tokens_per_s_per_user:.1f} tokens/s/user"]
    page = html_page(title, lines, [Table("Pareto front", header, rows)], [_svg(fig)])
    return [OutputFile(directory / "serve-pareto.csv", out.getvalue()),
            OutputFile(directory / "serve-pareto.png", _png(fig)), OutputFile(directory / "serve.html", page)]
