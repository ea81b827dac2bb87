"""Stage `check`: before any work, the params file holds every key dvc.yaml reads, the
installed vLLM can capture and serve beside the verifier's class, and its chat template renders;
every path a stage reads (prompts, the verifier's files, train.init_from) is here.

The same checks as `eagle3 plan` (plan/params_keys.py, plan/support.py: this module imports
nothing else of plan/, so editing the plan's estimates does not rerun it). It runs on every
params edit, and every stage after it depends on its output, so that output names what was
checked (key names, the architecture and its class, that the template rendered), never a value
an ordinary edit changes: editing train.lr reruns this stage, which writes the same bytes, and
nothing downstream reruns for it.

A tiny verifier (verifier.source: tiny) is checked from params alone, built or not: the
verifier stage rebuilds it from them after this stage, and the output must not depend on
whether an earlier build lies in data/verifier.
"""

from __future__ import annotations

import time
from pathlib import Path

from eagle3_pipeline.config.params import DEFAULT_PARAMS, Params
from eagle3_pipeline.core import atomic, paths
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.plan import params_keys, support
from eagle3_pipeline.verifier import identity as vf

STAGE = "check"
OUTPUT = paths.CHECKED / "checked.json"


def run(params: Params, params_path: str | Path = DEFAULT_PARAMS) -> None:
    t0 = time.monotonic()
    keys = params_keys.check_params_file(params_path)
    log(STAGE, f"{params_path}: all {len(keys)} params keys dvc.yaml reads are present")
    support.refuse_missing(params, params_path)  # the plan's words: a path no stage finds
    v = params.verifier
    if v.source == "tiny":
        config, config_file = None, None
        where = f"{params_path} (verifier.tiny)"
    else:
        config_file = Path(v.path) / "config.json"
        facts = vf.read_verifier(v)
        config, where = facts.config, str(config_file)
    result = support.check_verifier(params, config, config_file, where, required=True)
    log(STAGE, f"vLLM {result.vllm.describe()}")
    log(STAGE, f"chat template: {result.template.describe()}")
    top, inner = support.architectures(params, config)
    record = {
        "params_keys": keys,
        "verifier": {
            "source": v.source,
            "architectures": top,
            "text_architectures": inner,
            "built_later": result.built_later,
        },
        **{k: val for k, val in result.record().items() if k != "built_later"},
    }
    atomic.write_json(OUTPUT, record)
    log(STAGE, f"-> {OUTPUT} in {time.monotonic() - t0:.1f} s")
