"""The README documents every flag and variable, and `make serve` is `kvgrid serve`."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from kvgrid.cli import bench, chat
from kvgrid.cli import generate as client
from kvgrid.offline import run_batch
from services.common import config as cfg
from tools import flags_doc as docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_flag_table_is_current():
    assert docs.replace_table(README) == README, "run `python -m tools.flags_doc --write README.md`"


def test_every_service_flag_and_variable_is_in_the_table():
    table = README.split(docs.BEGIN, 1)[1].split(docs.END, 1)[0]
    for section in cfg.ALL_SECTIONS:
        for f in dataclasses.fields(section):
            assert f"`--{f.name.replace('_', '-')}" in table, f.name
            assert f"`{cfg.env_name(f.name)}`" in table, f.name


def test_every_client_flag_is_documented():
    for module in (client, chat, bench, run_batch):
        for action in module.build_parser()._actions:
            longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            for option in longs:
                assert re.search(rf"{re.escape(option)}\b", README), f"{module.__name__} {option}"


def test_make_serve_runs_kvgrid_serve():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"^\t\S*kvgrid serve\s*$", recipe, re.MULTILINE), recipe
