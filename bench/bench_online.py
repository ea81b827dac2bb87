"""Benchmark: training from the store vs online (hidden states from vLLM while training).

On this repo's tiny-llama data (a finished `make train`: data/verifier, tokenized, vocab and a
store with every sample, i.e. the store profile), it starts one vLLM server of the verifier with
`extract_hidden_states` (the train stage's own spec), then:

* prefill: every train row's hidden states fetched once through the server, one request at a
  time as speculators' dataloader does (num_workers 0): the verifier prefill one epoch costs;
* store: `run.run_training` for `--epochs` from the store;
* online: the same settings with online mode's flags against that server (the val rows read from
  the store, as the stage does).

Training tokens/s = train tokens x epochs / wall time of the run (setup included, server start-up
excluded: the stage pays it once per run). Prints a table, writes bench/results/online.json.
"""

from __future__ import annotations

import argparse
import argparse as _argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eagle3_pipeline.config.params import load_params  # noqa: E402
from eagle3_pipeline.core import atomic, readers  # noqa: E402
from eagle3_pipeline.drafter.conventions import run_conventions  # noqa: E402
from eagle3_pipeline.online_training import source as online  # noqa: E402
from eagle3_pipeline.serving.hidden_states import hidden_state_spec  # noqa: E402
from eagle3_pipeline.serving.server import serve  # noqa: E402
from eagle3_pipeline.store import format as store  # noqa: E402
from eagle3_pipeline.training.data import (  # noqa: E402
    TrainingSample,
    train_data_ratio_for,
    write_training_data,
)
from eagle3_pipeline.training.run import (  # noqa: E402
    TrainSettings,
    build_train_config,
    run_training,
)
from eagle3_pipeline.verifier import identity as vf  # noqa: E402

RESULTS = REPO / "bench/results/online.json"


def _samples(data: Path, keep_train_files: bool) -> tuple[list[TrainingSample], int, int]:
    manifest = store.read_manifest(data / "hidden_states")
    samples: list[TrainingSample] = []
    n_train = tokens = 0
    for split in ("train", "val"):
        for row in readers.read_jsonl(data / "tokenized" / f"{split}.jsonl"):
            entry = manifest["samples"][row["id"]]
            keep = split == "val" or keep_train_files
            samples.append(
                {
                    "input_ids": row["input_ids"],
                    "loss_mask": row["loss_mask"],
                    "hidden_states_file": data / "hidden_states" / entry["file"] if keep else None,
                }
            )
            if split == "train":
                n_train += 1
                tokens += len(row["input_ids"])
    return samples, n_train, tokens


def _run(settings: TrainSettings, samples: list[TrainingSample]) -> float:
    write_training_data(settings.data_dir, samples)
    t0 = time.monotonic()
    run_training(settings, on_metrics=None, on_init_line=lambda line: None)
    return time.monotonic() - t0


def _prefill_once(args: _argparse.Namespace, samples: list[TrainingSample], n_train: int) -> float:
    """Seconds to fetch (request, load, delete) every train row once, one at a time."""
    import openai
    from speculators.data_generation.vllm_client import generate_hidden_states

    client = openai.OpenAI(base_url=args.vllm_endpoint, api_key="EMPTY", max_retries=0)
    transfer = online.transfer_for(args)
    transfer.setup()
    t0 = time.monotonic()
    for s in samples[:n_train]:
        handle, params = generate_hidden_states(
            client, args.verifier_name_or_path, {"input_ids": s["input_ids"]}, timeout=120
        )
        assert transfer.get_generated(params) is not None
        transfer.delete(handle)
    return time.monotonic() - t0


def _agreement(
    args: _argparse.Namespace, samples: list[TrainingSample], n_train: int
) -> dict[str, list[float] | int]:
    """Server vs store on every stored val row, per layer: the largest |difference| and how
    many values differ once the server's are rounded to the store's bf16."""
    import openai
    from safetensors.torch import load_file
    from speculators.data_generation.vllm_client import generate_hidden_states

    client = openai.OpenAI(base_url=args.vllm_endpoint, api_key="EMPTY", max_retries=0)
    transfer = online.transfer_for(args)
    transfer.setup()
    worst: list[float] | None = None
    differ, values = 0, 0
    for s in samples[n_train:]:
        assert s["hidden_states_file"] is not None
        stored = load_file(str(s["hidden_states_file"]))["hidden_states"]
        handle, params = generate_hidden_states(
            client, args.verifier_name_or_path, {"input_ids": s["input_ids"]}, timeout=120
        )
        served = transfer.get_generated(params)["hidden_states"]
        transfer.delete(handle)
        diff = (served.float() - stored.float()).abs().amax(dim=(0, 2)).tolist()
        worst = diff if worst is None else [max(x, y) for x, y in zip(worst, diff, strict=True)]
        differ += int((served.to(stored.dtype) != stored).sum())
        values += stored.numel()
    # Exact resume needs the same bits for the same sample on every request.
    repeats = []
    for _ in range(2):
        handle, params = generate_hidden_states(
            client, args.verifier_name_or_path, {"input_ids": samples[0]["input_ids"]}, timeout=120
        )
        repeats.append(transfer.get_generated(params)["hidden_states"])
        transfer.delete(handle)
    return {
        "same_bits_on_repeat": bool((repeats[0] == repeats[1]).all()),
        "max_abs_diff_per_layer": [round(x, 6) for x in worst or []],
        "values_differing_after_bf16_rounding": differ,
        "values": values,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=REPO, help="a checkout after `make train`")
    ap.add_argument("--epochs", type=int, default=2)
    a = ap.parse_args(argv)
    os.chdir(a.repo)
    data = Path("data")
    if not (data / "hidden_states" / store.MANIFEST).is_file():
        print(f"no store under {a.repo}/data: run `make train` (profile tiny-llama) first")
        return 1
    params = load_params("params.yaml")
    params = params.model_copy(
        update={"train": params.train.model_copy(update={"epochs": a.epochs})}
    )
    verifier = vf.read_verifier(params.verifier)
    conventions = run_conventions(params.layers, params.train, verifier.num_layers)
    full, n_train, tokens = _samples(data, keep_train_files=True)
    if len(store.read_manifest(data / "hidden_states")["samples"]) < len(full):
        print("the store lacks train samples (an online-mode run?): run the store profile")
        return 1
    val_only, _, _ = _samples(data, keep_train_files=False)
    work = Path(tempfile.mkdtemp(prefix="bench-online-"))
    try:

        def settings(name: str) -> TrainSettings:
            return TrainSettings.from_params(
                params.train,
                data_dir=work / name / "data",
                save_dir=work / name / "ckpt",
                verifier_dir=Path(params.verifier.path),
                vocab_dir=data / "vocab",
                draft_vocab_size=params.vocab.draft_vocab_size,
                conventions=conventions,
                train_data_ratio=train_data_ratio_for(n_train, len(full)),
            )

        layer_ids = [*conventions.aux_layer_ids, conventions.final_layer_id]
        spec = hidden_state_spec(
            verifier, params.vllm, layer_ids, work / "served", work / "vllm.log"
        )
        t0 = time.monotonic()
        with serve(spec) as url:
            start_s = time.monotonic() - t0
            flags = online.speculators_flags(params.train.online, f"{url}/v1")
            on = replace(settings("online"), online_flags=flags)
            write_training_data(on.data_dir, val_only)
            ns = _argparse.Namespace(**build_train_config(on).flatten())
            prefill_s = _prefill_once(ns, val_only, n_train)
            agreement = _agreement(ns, val_only, n_train)
            store_s = _run(settings("store"), full)
            online_s = _run(on, val_only)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "epochs": a.epochs,
        "train_rows": n_train,
        "train_tokens_per_epoch": tokens,
        "server_start_s": round(start_s, 1),
        "prefill_per_epoch_s": round(prefill_s, 2),
        "prefill_tokens_per_s": round(tokens / prefill_s, 1),
        "store_s": round(store_s, 1),
        "online_s": round(online_s, 1),
        "store_tokens_per_s": round(tokens * a.epochs / store_s, 1),
        "online_tokens_per_s": round(tokens * a.epochs / online_s, 1),
        "online_over_store": round(store_s / online_s, 3),
        "server_vs_store": agreement,
    }
    rate = (result["store_tokens_per_s"], result["online_tokens_per_s"])
    print(f"{'':28}{'store':>10}{'online':>10}")
    print(f"{'training tokens/s':28}{rate[0]:>10}{rate[1]:>10}")
    print(
        f"verifier prefill per epoch: {tokens:,} tokens in {prefill_s:.1f} s "
        f"({result['prefill_tokens_per_s']} tok/s, one request at a time); server start-up "
        f"{start_s:.0f} s once per run; online/store throughput {result['online_over_store']}"
    )
    print(
        f"server vs store on {len(val_only) - n_train} val rows: largest |diff| per layer "
        f"{agreement['max_abs_diff_per_layer']}; values differing after rounding the server's to "
        f"bf16: {agreement['values_differing_after_bf16_rounding']} of {agreement['values']:,}; "
        f"same bits when asked twice: {agreement['same_bits_on_repeat']}"
    )
    atomic.write_json(RESULTS, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
