"""Benchmark: the extract stage's tokens/s against the verifier's bare prefill, same batches.

Target (issue "generate and extract near the engine's own speed"): the stage's batch path
reaches at least 90% of the tokens/s of a bare vLLM prefill of the same batches (ratio >= 0.9).

Method, in a workspace where the pipeline ran up to `tokenize` (data/tokenized; --workspace,
default the current directory; its params.yaml, or --params): the first N tokenized samples
(--samples, default all; train.jsonl then val.jsonl, file order), split into the stage's own
batches (`extraction.token_budget_batches` with extract.max_tokens_per_batch). Two engines, each
in-process in its own worker process (this script with --worker; vLLM's KV connector is
process-global, so a plain engine beside the stage's would inherit it), started once each, one
after the other (start not timed), then timed passes over all batches:

* stage: `extraction.open_backend(backend, engine, ...)`'s batch function per batch, and the
  stage's `write_batch` on one writer thread, journaled per batch, as stages/extract.py runs
  them (batch n written while batch n+1 computes; the pass ends when the last write is
  journaled). Layer ids and store layout as the stage makes them. Files go to a temp dir.
* bare: a `vllm.LLM` with the stage engine's own kwargs (serving/hidden_states.engine_kwargs:
  model, dtype, max_model_len, enforce_eager, max_num_batched_tokens, seed, prefix caching off,
  vllm.extra_args) minus the hidden-state capture (no speculative_config, no KV connector),
  `generate([{"prompt_token_ids": ids}, ...], SamplingParams(max_tokens=1))` per batch (greedy,
  no detokenizing, as the stage's engine samples).

Both engines first run one untimed warm-up batch (the first). Passes alternate over --repeats
(stage, bare, then bare, stage, ...; the idle worker waits on its stdin); the ratio is of the
median tokens/s, tokens = the samples' input ids. Prints a table and writes
bench/results/extract.json (tokens, batches, seconds, engine kwargs, load average before and
after). Nothing is written into the workspace: vLLM's cache root and every file go to a temp dir
that is deleted. Exit 0 on FAIL too: the figure is the result. Smoke run: --samples 16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's package, as bench_train.py
RESULTS = REPO / "bench/results/extract.json"
TARGET_RATIO = 0.9
RESULT = "@@bench-extract@@"  # a worker's answer line; its other lines go to its log


def first_samples(tokenized: Path, n: int | None) -> dict[str, dict]:
    """The first n rows of train.jsonl then val.jsonl (all when n is None), by id."""
    rows: dict[str, dict] = {}
    for split in ("train", "val"):
        with open(tokenized / f"{split}.jsonl") as fh:
            for line in fh:
                if n is not None and len(rows) >= n:
                    return rows
                if line.strip():
                    row = json.loads(line)
                    rows[row["id"]] = row
    return rows


def stage_pass(run_batch, batches, rows, layout, out: Path) -> float:
    """Seconds for the stage's batch path over all batches: compute, write behind, journal."""
    from eagle3_pipeline.core import resume
    from eagle3_pipeline.stages.extract import write_batch

    out.mkdir(parents=True)
    journal = resume.Journal(out / "entries.jsonl")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-writer") as writer:
        pending = None
        for batch in batches:
            states = run_batch([rows[i]["input_ids"] for i in batch])
            if pending is not None:
                journal.append(pending.result())
            pending = writer.submit(write_batch, out, [rows[i] for i in batch], states, layout)
        if pending is not None:
            journal.append(pending.result())
    return time.perf_counter() - t0


def bare_pass(llm, sampling, batches, rows) -> float:
    t0 = time.perf_counter()
    for batch in batches:
        llm.generate(
            [{"prompt_token_ids": rows[i]["input_ids"]} for i in batch], sampling, use_tqdm=False
        )
    return time.perf_counter() - t0


def plan(params_path: str, samples: int | None):
    """(params, store layout, rows by id, the stage's batches), as stages/extract.py makes them."""
    from eagle3_pipeline.config.layer_ids import store_aux_layer_ids
    from eagle3_pipeline.config.params import load_params
    from eagle3_pipeline.core import paths
    from eagle3_pipeline.store import format as store
    from eagle3_pipeline.store.extraction import token_budget_batches
    from eagle3_pipeline.verifier import identity as vf

    params = load_params(params_path)
    verifier = vf.read_verifier(params.verifier)
    n_layers, hidden = verifier.num_layers, verifier.hidden_size
    aux = store_aux_layer_ids(params.layers, n_layers)
    layout = store.StoreLayout(aux, n_layers, hidden, params.extract.store_dtype, verifier.identity)
    rows = first_samples(paths.TOKENIZED, samples)
    lengths = {i: len(r["input_ids"]) for i, r in rows.items()}
    return params, layout, rows, token_budget_batches(lengths, params.extract.max_tokens_per_batch)


def extraction_engine(params):
    """The engine the extract stage builds from these params (stages/extract.py)."""
    from eagle3_pipeline.serving.hidden_states import ExtractionEngine
    from eagle3_pipeline.verifier.identity import read_verifier

    return ExtractionEngine(
        read_verifier(params.verifier),
        params.vllm,
        params.extract.max_tokens_per_batch,
        params.seed,
    )


def bare_engine_kwargs(params, layer_ids: list[int], tmp: Path) -> dict:
    """The stage engine's kwargs without the hidden-state capture (method and connector)."""
    from eagle3_pipeline.serving.hidden_states import engine_kwargs

    drop = ("speculative_config", "kv_transfer_config")
    kwargs = engine_kwargs(extraction_engine(params), layer_ids, tmp)
    return {k: v for k, v in kwargs.items() if k not in drop}


def worker(args: argparse.Namespace) -> int:
    """One side's engine in its own process (vLLM's KV connector is process-global: a second
    engine beside the stage's would inherit it): start, warm up on the first batch, answer the
    engine kwargs, then one timed pass per line read (a tag) until `quit`."""
    params, layout, rows, batches = plan(args.params, args.samples)
    tmp = args.tmp
    with contextlib.ExitStack() as stack:
        if args.worker == "stage":
            from eagle3_pipeline.store.extraction import open_backend

            run_batch = stack.enter_context(
                open_backend(
                    params.extract.backend,
                    extraction_engine(params),
                    layout.layer_ids,
                    tmp / "vllm-files",
                )
            )

            def one_pass(tag: str) -> float:
                out = tmp / f"store-{tag}"
                todo = batches[:1] if tag == "warmup" else batches
                try:
                    return stage_pass(run_batch, todo, rows, layout, out)
                finally:
                    shutil.rmtree(out, ignore_errors=True)

            kwargs = {}
        else:
            from eagle3_pipeline.in_vllm import cpu_patches
            from eagle3_pipeline.in_vllm.server_entry import patch_cpu_kernel_rebind

            patch_cpu_kernel_rebind()  # what the stage's engine applies before it starts
            cpu_patches.patch_in_process(params.verifier.path)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process, as the stage's
            from vllm import LLM, SamplingParams

            kwargs = bare_engine_kwargs(params, layout.layer_ids, tmp / "unused")
            llm = LLM(**kwargs)
            sampling = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

            def one_pass(tag: str) -> float:
                return bare_pass(llm, sampling, batches[:1] if tag == "warmup" else batches, rows)

        one_pass("warmup")
        print(f"{RESULT} {json.dumps(kwargs, default=str)}", flush=True)
        for line in sys.stdin:
            tag = line.strip()
            if tag == "quit":
                break
            print(f"{RESULT} {one_pass(tag)!r}", flush=True)
    return 0


class Worker:
    """A worker process (this script with --worker) and its log; `ask` waits for its answer."""

    def __init__(self, side: str, args: argparse.Namespace, tmp: Path) -> None:
        self.side, self.log = side, tmp / f"worker-{side}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side]
        cmd += ["--params", args.params, "--tmp", str(tmp), "--repeats", "1"]
        if args.samples is not None:
            cmd += ["--samples", str(args.samples)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.engine_kwargs = json.loads(self.answer())  # started and warmed up

    def answer(self) -> str:
        assert self.proc.stdout is not None
        with open(self.log, "a") as log:
            for line in self.proc.stdout:
                if line.startswith(RESULT):
                    return line[len(RESULT) :].strip()
                log.write(line)
        self.proc.wait()
        tail = self.log.read_text()[-4000:]
        raise SystemExit(f"the {self.side} worker exited ({self.proc.returncode}):\n{tail}")

    def ask(self, tag: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(tag + "\n")
        self.proc.stdin.flush()
        return float(self.answer())

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Method and target: see the module docstring (bench/bench_extract.py).",
    )
    parser.add_argument("--workspace", type=Path, default=Path("."), help="(default: .)")
    parser.add_argument("--params", default="params.yaml", help="in the workspace")
    parser.add_argument(
        "--samples", type=int, default=500, help="first N tokenized samples (default: 500)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="passes per side (default: 1)")
    parser.add_argument("--worker", choices=["stage", "bare"], help=argparse.SUPPRESS)
    parser.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)  # cwd and environment set by the parent

    load_before = os.getloadavg()
    workspace = args.workspace.resolve()
    os.chdir(workspace)  # the stage's paths and params are relative to the workspace
    tmp = Path(tempfile.mkdtemp(prefix="bench-extract-"))
    # vLLM's caches into the temp dir; the rest as the CLI sets it for every stage.
    os.environ["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache")
    from eagle3_pipeline.core import atomic
    from eagle3_pipeline.serving.server import vllm_env_defaults

    for key, value in vllm_env_defaults().items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    params, layout, rows, batches = plan(args.params, args.samples)
    tokens = sum(len(r["input_ids"]) for r in rows.values())
    max_tokens = params.extract.max_tokens_per_batch
    print(
        f"{workspace}: {len(rows)} samples, {tokens:,} tokens, {len(batches)} batches of <= "
        f"{max_tokens} padded tokens; backend {params.extract.backend}, layer ids "
        f"{layout.layer_ids}",
        flush=True,
    )
    times: dict[str, list[float]] = {"stage": [], "bare": []}
    workers: dict[str, Worker] = {}
    try:
        for side in ("stage", "bare"):  # one after the other: starts are not timed
            workers[side] = Worker(side, args, tmp)
            print(f"  {side} engine started and warmed up", flush=True)
        for i in range(args.repeats):
            for side in ("stage", "bare") if i % 2 == 0 else ("bare", "stage"):
                s = workers[side].ask(str(i))
                times[side].append(s)
                print(f"  {side} pass {i}: {s:.2f} s, {tokens / s:,.0f} tok/s", flush=True)
        bare_kwargs = workers["bare"].engine_kwargs
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()

    med = {k: statistics.median(v) for k, v in times.items()}
    tps = {k: tokens / v for k, v in med.items()}
    ratio = tps["stage"] / tps["bare"]
    verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
    print(f"{'side':<6} {'median s':>9} {'tokens/s':>10}")
    for k in ("stage", "bare"):
        print(f"{k:<6} {med[k]:>9.2f} {tps[k]:>10.0f}")
    print(
        f"extract stage {tps['stage']:,.0f} tok/s vs bare vLLM prefill {tps['bare']:,.0f}: "
        f"ratio {ratio:.3f} (target >= {TARGET_RATIO}): {verdict}"
    )
    print(f"load average before {load_before}, after {load_after} ({os.cpu_count()} cores)")
    result = {
        "target_ratio": TARGET_RATIO,
        "workspace": str(workspace),
        "params": args.params,
        "verifier": params.verifier.path,
        "backend": params.extract.backend,
        "samples": len(rows),
        "tokens": tokens,
        "batches": len(batches),
        "max_tokens_per_batch": max_tokens,
        "layer_ids": layout.layer_ids,
        "repeats": args.repeats,
        "seconds": times,
        "tokens_per_s": tps,
        "ratio": ratio,
        "verdict": verdict,
        "bare_engine_kwargs": bare_kwargs,
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "loadavg_before": list(load_before),
        "loadavg_after": list(load_after),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    atomic.write_json(RESULTS, result)
    print(f"-> {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
