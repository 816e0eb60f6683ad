"""The knobs are one type: ParallelConfig's fields make the options of `estimate` and `plan` (cli/options.py
with_knobs), and docs/knobs.md lists the same flags and defaults."""

import re
from pathlib import Path
from typing import get_args

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from meshplan.cli.options import with_knobs
from meshplan.costmodels.config import RECOMPUTE_MODULES, ParallelConfig, Workload, knob_help
from meshplan.costmodels.model_io import load_model
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.search import search

DOCS = Path(__file__).resolve().parents[1] / "docs" / "knobs.md"
FLAGGED = [name for name in ParallelConfig.model_fields if knob_help(name) is not None]


def _app(searching: bool, seen: list[ParallelConfig]) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @with_knobs(searching=searching)
    def command(name: str = "x", config: ParallelConfig = ParallelConfig(), last: int = 0) -> None:
        seen.append(config)

    return app


def _argv(config: ParallelConfig) -> list[str]:
    """The command line that sets the knobs of `config` that are set."""
    argv = []
    for name in FLAGGED:
        value, flag = getattr(config, name), knob_help(name).flag_name(name)
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, tuple):
            argv += [flag, ",".join(value)]
        else:
            argv += [flag, str(value)]
    return argv


def test_the_options_are_the_fields():
    seen: list[ParallelConfig] = []
    argv = ["--tp", "2", "--no-sp", "--order", "tp-cp-pp-dp", "--recompute-modules", "core_attn,mlp", "--zero", "3",
            "--name", "y", "--last", "4"]
    result = CliRunner().invoke(_app(True, seen), argv)
    assert result.exit_code == 0, result.output
    assert seen == [ParallelConfig(tp=2, sp=False, rank_order="tp-cp-pp-dp", recompute_modules=("core_attn", "mlp"),
                                   zero=3)]
    assert CliRunner().invoke(_app(True, seen), []).exit_code == 0 and seen[-1] == ParallelConfig()


def test_plan_has_only_the_knobs_it_searches():
    """--offload-layers is estimate's (KnobHelp.searched False): plan has no such option."""
    assert knob_help("offload_layers").searched is False
    seen: list[ParallelConfig] = []
    assert CliRunner().invoke(_app(False, seen), ["--offload-layers", "2"]).exit_code == 0
    assert seen == [ParallelConfig(offload_layers=2)]
    result = CliRunner().invoke(_app(True, seen), ["--offload-layers", "2"])
    assert result.exit_code == 2 and "No such option" in result.output


@pytest.mark.parametrize("argv,words", [(["--zero", "4"], "less than or equal to 3"),
                                         (["--tp", "0"], "greater than or equal to 1"),
                                         (["--schedule", "zigzag"], "zigzag")])
def test_a_bad_value_is_a_usage_error(argv, words):
    result = CliRunner().invoke(_app(False, []), argv)
    assert result.exit_code == 2 and words in result.output, result.output


def test_an_unknown_module_is_one_error_line():
    result = CliRunner().invoke(_app(False, []), ["--recompute-modules", "core_attn,attention"])
    assert isinstance(result.exception, InputError)
    assert "choose from core_attn" in str(result.exception)


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "tp": st.integers(1, 64), "pp": st.integers(1, 64), "vpp": st.integers(1, 8), "dp": st.integers(1, 512),
    "cp": st.integers(1, 16), "cp_comm": st.sampled_from(["ring", "a2a"]), "ep": st.integers(1, 64),
    "etp": st.integers(1, 8), "mbs": st.integers(1, 16), "zero": st.sampled_from([0, 1, 2, 3]),
    "recompute": st.sampled_from(["none", "selective", "full", "per-stage"]),
    "recompute_modules": st.lists(st.sampled_from(RECOMPUTE_MODULES), min_size=1, max_size=3, unique=True).map(tuple),
    "offload_layers": st.integers(0, 8), "recompute_group": st.integers(1, 8), "sp": st.booleans(),
    "schedule": st.sampled_from(["gpipe", "1f1b", "interleaved", "zb"]),
    "rank_order": st.sampled_from(["tp-cp-dp-pp", "tp-cp-pp-dp"])}))
def test_any_config_round_trips_through_the_command_line(knobs):
    """Every configuration of the flagged knobs, written as options, parses back to itself: the options lose and add
    nothing."""
    config = ParallelConfig(**knobs)
    seen: list[ParallelConfig] = []
    result = CliRunner().invoke(_app(False, seen), _argv(config))
    assert result.exit_code == 0, result.output
    assert seen == [config]


def test_docs_table_lists_every_flag_with_its_default():
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`"):
            rows[cells[1].strip("`")] = cells
    assert sorted(rows) == sorted(FLAGGED)
    for name in FLAGGED:
        doc = knob_help(name)
        flag, _, default, in_plan = rows[name]
        assert re.sub(r"/--no-.*", "", flag.strip("`")) == doc.flag_name(name)
        assert default.replace("`", "") == doc.default.replace("`", ""), name
        assert in_plan.startswith("estimate only") == (not doc.searched), name


def test_the_search_refuses_what_it_does_not_take_pinned():
    model, cluster = load_model("llama3.1-8b"), Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=8))
    wl = Workload(global_batch=16, seq_len=2048)
    for config in (ParallelConfig(offload_layers=2), ParallelConfig(pp=2, stage_layers=(15, 17))):
        with pytest.raises(InputError, match="plan chooses the stage partition and does not search"):
            search(model, cluster, wl, config, max_mbs=2)


def test_every_literal_knob_offers_its_choices():
    """A choice knob's options are its Literal's values (a new value appears in --help with no other edit)."""
    runner = CliRunner()
    help_text = " ".join(runner.invoke(_app(False, []), ["--help"], env={"COLUMNS": "400"}).output.split())
    for name in ("cp_comm", "schedule", "rank_order"):
        choices = get_args(get_args(ParallelConfig.model_fields[name].annotation)[0])
        assert "|".join(choices) in help_text, (name, choices)
