"""``LLM(...)`` keyword options: the CLI flags of the worker and scheduler, through the same config code.

``LLM(kv_cache_memory="2GiB", max_num_seqs=64)`` means what ``--kv-cache-memory 2GiB --max-num-seqs 64``
means, with the same defaults and the same checks. ``KVGRID_*`` variables are not read here: in a
Python program the arguments are the whole configuration (``kvgrid run-batch`` reads them, as every
command does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from services.common import config as cfg

# The worker's flags (the scheduler's are among them) without the network and logging ones: nothing is served.
SECTIONS = tuple(s for s in cfg.WORKER_SECTIONS if s not in (cfg.NetworkConfig, cfg.ObservabilityConfig))
OPTION_NAMES = tuple(f.name for section in SECTIONS for f in dataclasses.fields(section))


def offline_config(values: dict[str, Any]) -> cfg.Config:
    """A Config from option values (None: the flag's default). Raises TypeError for an unknown option and
    ConfigError (a ValueError) for a bad value."""
    unknown = sorted(set(values) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(OPTION_NAMES)}")
    # build_section takes flag values as the command line gives them: text, or a bool for --x/--no-x.
    # A dict (speculative_config, as vLLM's LLM takes it) is its JSON text.
    raw = {k: v if v is None or isinstance(v, bool) else _text(v) for k, v in values.items()}
    return cfg.build_config(SECTIONS, argparse.Namespace(**raw), environ={})


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else str(value)
