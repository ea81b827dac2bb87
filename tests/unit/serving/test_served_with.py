"""The verifier layers vLLM captured for a drafter, read from its log and checked against the
layers the drafter was trained on (serving.served_with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_pipeline.core.errors import ServerError
from eagle3_pipeline.serving.served_with import aux_layers, check_aux_layers, served_with

V1 = (
    "(Worker pid=2918) INFO 12-03 13:40:22 [gpu_model_runner.py:5243] Using auxiliary layers "
    "from speculative config: (1, 3, 5, 7)\n"
)
V2_CONFIG = "INFO [eagle3_utils.py:27] Using Eagle3 auxiliary layers from config: (2, 30, 58)\n"
V2_MODEL = "INFO [eagle3_utils.py:30] Using Eagle3 auxiliary layers from model: (2, 30, 58)\n"


def test_both_model_runners_lines_are_read() -> None:
    assert aux_layers(V1) == ("config", [1, 3, 5, 7])
    assert aux_layers(V2_CONFIG) == ("config", [2, 30, 58])
    assert aux_layers(V2_MODEL) == ("model", [2, 30, 58])
    assert aux_layers("started\n" + V2_CONFIG + V1) == ("config", [1, 3, 5, 7])  # the last
    assert aux_layers("no such line") is None


def test_other_layers_than_trained_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    log = tmp_path / "vllm-dflash.log"
    log.write_text(V1)
    assert check_aux_layers(log, [1, 3, 5, 7], tmp_path / "d", "evaluate") == [1, 3, 5, 7]
    with pytest.raises(
        ServerError,
        match=r"captured verifier layers \[1, 3, 5, 7\] \(from the "
        r"config\) for .*d, trained on \[2, 4, 6, 8\]",
    ):
        check_aux_layers(log, [2, 4, 6, 8], tmp_path / "d", "evaluate")
    log.write_text(V2_MODEL)  # the model's defaults: the drafter's own ids never reached vLLM
    with pytest.raises(ServerError, match=r"\(from the model\)"):
        check_aux_layers(log, [2, 30, 58], tmp_path / "d", "evaluate")
    log.write_text("nothing logged")
    assert check_aux_layers(log, [2, 30, 58], tmp_path / "d", "evaluate") is None
    assert "served layers not checked" in capsys.readouterr().out


def test_served_with_reads_runner_and_backends_from_the_server_log() -> None:
    log = (
        "(Worker_TP0 pid=1) INFO Using FLASH_ATTN_MLA attention backend out of potential "
        "backends: ['FLASH_ATTN_MLA', 'FLASHMLA'].\n"
        "(Worker_TP1 pid=2) INFO Using 'HUMMING' WNA16 MoE backend.\n"
        "INFO Using TRITON Unquantized MoE backend out of potential backends: ['TRITON'].\n"
        "compilation_config={'pass_config': {'fuse_allreduce_rms': True}}\n"
    )
    got = served_with(log)
    assert got == {
        "runner": "Model Runner V2",
        "attention": "FLASH_ATTN_MLA",
        "moe": "HUMMING,TRITON",
        "allreduce+rmsnorm fusion": "True",
    }
    cpu = "WARNING Model Runner V2 requires Triton; using the V1 model runner instead.\n"
    assert served_with(cpu)["runner"] == "V1 (MRV2 requires Triton)"
    assert served_with("")["attention"] == "not logged"
