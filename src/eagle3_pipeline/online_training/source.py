"""Online hidden states: the vLLM server train asks while it trains, checked before step one.

speculators' own online path does the work (`--on-missing generate`, `--vllm-endpoint`, an
hs_connectors backend): for a row without a stored file its dataloader sends the row's token ids
to the server with `max_tokens=1`, loads the file (or Mooncake object) the server's connector
reports, checks tokens, length and finiteness, and deletes it. This module adds what the stage
needs around it: the server (started here, or a given URL), the speculators flags, a refusal
before the first step when the server computes other hidden states than the store's (another
model, revision or layer ids: compared on a stored val sample), and one line naming the sample,
the server and the reason when speculators gives a sample up. A refused sample stops training
(`max_consecutive_generation_failures` 1): speculators would otherwise drop it and go on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.config.params import VllmParams
from eagle3_pipeline.config.training_params import OnlineParams
from eagle3_pipeline.core.errors import DataError, ServerDown, ServerError, VerifierError
from eagle3_pipeline.core.progress import log
from eagle3_pipeline.in_vllm import auth
from eagle3_pipeline.serving.chat import API_KEY_VAR
from eagle3_pipeline.training.online_backend import speculators_flags as backend_flags
from eagle3_pipeline.verifier.identity import VerifierFacts

# Largest |server - store| / max|store| per layer accepted by the pre-flight probe. The store
# rounds to bf16 (relative error <= 2^-9 of each value) and vLLM's server and in-process engine
# batch differently; another model, revision or layer is off by tens of percent.
PROBE_TOLERANCE = 0.02
# speculators' with_retries: backoff 2 ** attempt seconds after each failed attempt.
_BACKOFF_BASE = 2


@dataclass(frozen=True)
class OnlineSource:
    """Where hidden states come from: the server's /v1 URL, how to name it in errors, and the
    key it wants (the run's own for a server started here; never shown)."""

    endpoint: str
    name: str
    api_key: str | None = field(default=None, repr=False)


def check_layer_order(aux: list[int], final: int) -> None:
    """The server returns layers in ascending order and speculators reads the last as the
    final layer: online mode takes aux ids ascending and below the final id."""
    if list(aux) != sorted(aux) or max(aux) >= final:
        raise VerifierError(
            f"params.yaml: layers.aux_layer_ids {list(aux)} + final {final}: online mode needs "
            "the aux ids ascending and below the final id (vLLM returns layers sorted): sort them"
        )


def timeout_bound_s(o: OnlineParams) -> float:
    """The longest speculators spends on one sample before it gives up (requests, backoffs)."""
    attempts = o.max_retries + 1
    one_trip = attempts * o.request_timeout_s + sum(_BACKOFF_BASE**a for a in range(1, attempts))
    return (o.round_trip_retries + 1) * one_trip


def speculators_flags(o: OnlineParams, endpoint: str) -> dict[str, Any]:
    """speculators' TrainConfig flags of online mode (merged over the store mode's)."""
    flags: dict[str, Any] = {
        "on_missing": "generate",
        "vllm_endpoint": endpoint,
        "request_timeout": o.request_timeout_s,
        "max_retries": o.max_retries,
        "generation_validation_retries": o.round_trip_retries,
        "max_consecutive_generation_failures": 1,
    }
    return flags | backend_flags(o)


@contextlib.contextmanager
def online_source(
    o: OnlineParams, verifier: VerifierFacts, v: VllmParams, layer_ids: list[int], work: Path
) -> Iterator[OnlineSource]:
    """The given endpoint (`o`: params' train.online), or a server of the verifier started here
    with params' `vllm` and always stopped after."""
    if o.endpoint:
        endpoint = o.endpoint.rstrip("/")
        name = f"the vLLM server at {endpoint} (train.online.endpoint)"
        yield OnlineSource(endpoint, name, os.environ.get(API_KEY_VAR) or None)
        return
    from eagle3_pipeline.serving.hidden_states import clear_dir, hidden_state_spec
    from eagle3_pipeline.serving.server import serve
    from eagle3_pipeline.serving.server_process import down_reason

    storage = work / "online-hidden-states"
    clear_dir(storage)
    log_file = work / "vllm-online.log"
    spec = hidden_state_spec(verifier, v, layer_ids, storage, log_file)
    spec.api_key = auth.run_key()
    log("train", f"starting vLLM with extract_hidden_states, layers {sorted(layer_ids)}")
    # Training waits on the server inside speculators' loader: a server that stops is answered
    # by interrupting this process (torchrun's launcher forwards it to the workers), and the
    # interruption is then reported as what it is.
    with _interruptible(), serve(spec, on_down=_interrupt_main) as url:
        name = f"the stage's vLLM server at {url} (log: {log_file})"
        try:
            yield OnlineSource(f"{url}/v1", name, spec.api_key)
        except BaseException:
            if why := down_reason(url):
                raise ServerDown(
                    f"{why}; rerun to resume from the last complete checkpoint"
                ) from None
            raise


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Python's own SIGINT handler in the main thread while the server serves, the one before
    restored after: a handler an earlier library left behind that returns without raising (a
    finished trainer's, say) would let `_interrupt_main`'s signal be swallowed and training wait
    on a dead server. speculators' trainer installs its own while it trains, which raises too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.SIG_DFL)


def _interrupt_main(_why: str) -> None:
    """SIGINT to this process's main thread, where training waits (a server's watch calls this
    from its own thread). Aimed at the thread, not the process: a process-wide signal may be
    taken by any thread, and a main thread blocked in a call would then wait that call out."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


ENDPOINTS_VAR = "EAGLE3_ONLINE_ENDPOINTS"  # the inference pool's servers, comma-separated


def endpoint_for_rank(default: str) -> str:
    """This rank's server: one of the inference pool's (round robin by global RANK: ranks of
    one node spread over the servers too), else `default` (the one params name)."""
    given = [e for e in os.environ.get(ENDPOINTS_VAR, "").split(",") if e]
    return given[int(os.environ.get("RANK", "0")) % len(given)] if given else default


def trainer_env(source: OnlineSource) -> dict[str, str]:
    """What a trainer process needs to reach `source` (its key: `trainer_key`)."""
    return {API_KEY_VAR: source.api_key} if source.api_key else {}


def trainer_key() -> str | None:
    """The server key this trainer process was given (`trainer_env`, inherited by torchrun's
    workers), if any: TrainSettings.online_api_key, which speculators' client sends."""
    return os.environ.get(API_KEY_VAR)


def transfer_for(args: argparse.Namespace) -> Any:
    """The hs_connectors transfer speculators builds from its flattened config (same registry)."""
    from hs_connectors import HiddenStatesBackend

    backend = HiddenStatesBackend.registry[args.hidden_states_backend]
    return backend.from_train_args(args, args.data_path)


def check_server(
    source: OnlineSource,
    args: argparse.Namespace,
    probe_ids: list[int],
    stored: torch.Tensor,
    sample_id: str,
    verifier: str,
) -> float:
    """Refuse a server whose hidden states for a stored sample differ from the store's.

    `args`: speculators' flattened TrainConfig of this run. Returns the largest relative
    difference over layers (logged by the stage). One request before the first step, so a wrong
    server costs seconds, not an epoch.
    """
    import openai
    from speculators.data_generation.vllm_client import generate_hidden_states

    key = source.api_key or "EMPTY"  # speculators' own placeholder without a key
    client = openai.OpenAI(base_url=source.endpoint, api_key=key, max_retries=0)
    try:
        model = client.models.list().data[0]
    except openai.AuthenticationError:
        given = "its key" if source.api_key else "no key"
        raise ServerError(
            f"{source.name} answered 401 to {given}: export {API_KEY_VAR} with the server's "
            "key (its --api-key)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - one line naming the server
        raise ServerError(f"{source.name} does not answer: {type(exc).__name__}: {exc}") from None
    served = f"'{model.id}' (root {getattr(model, 'root', None) or '?'})"
    if model.id != args.verifier_name_or_path:
        # speculators asks for the model by this name and stops at the first sample otherwise.
        raise VerifierError(
            f"{source.name} serves {served}, not the verifier {args.verifier_name_or_path}: "
            f"serve verifier.path with --served-model-name {args.verifier_name_or_path}"
        )
    try:
        handle, transfer_params = generate_hidden_states(
            client,
            model.id,
            {"input_ids": probe_ids},
            timeout=args.request_timeout,
            max_retries=args.max_retries,
        )
    except Exception as exc:  # noqa: BLE001 - one line naming the server
        raise ServerError(
            f"{source.name} did not return hidden states: {type(exc).__name__}: {exc}"
        ) from None
    transfer = transfer_for(args)
    transfer.setup()
    got = transfer.get_generated(transfer_params)
    with contextlib.suppress(Exception):
        transfer.delete(handle)
    if got is None:
        raise ServerError(f"{source.name}: the hidden states it reported ({handle}) are missing")
    hs = got["hidden_states"].float()
    want = stored.float()
    if tuple(hs.shape) != tuple(want.shape):
        raise VerifierError(
            f"{source.name} serves {served} with hidden states {list(hs.shape)} for sample "
            f"{sample_id}; the store holds {list(want.shape)} [tokens, layers, hidden] from "
            f"verifier {verifier}: serve that verifier with these layer ids"
        )
    scale = want.abs().amax(dim=(0, 2)).clamp_min(1e-6)
    rel = ((hs - want).abs().amax(dim=(0, 2)) / scale).tolist()
    worst = max(rel)
    if worst > PROBE_TOLERANCE:
        per_layer = ", ".join(f"{r:.3f}" for r in rel)
        raise VerifierError(
            f"{source.name} serves {served}, whose hidden states for sample {sample_id} differ "
            f"from the store's (verifier {verifier}) by up to {worst:.1%} per layer "
            f"[{per_layer}] (accepted {PROBE_TOLERANCE:.0%}): another model, revision or layer "
            "ids; serve the verifier of params.yaml"
        )
    return worst


_FILE_INDEX = re.compile(r"file index (\d+)")


def refusal(exc: BaseException, row_ids: list[str], source: OnlineSource) -> DataError | None:
    """speculators' circuit-breaker error as one line naming the sample and the server."""
    text = str(exc)
    if "circuit breaker tripped" not in text:
        return None
    found = _FILE_INDEX.search(text)
    sid = row_ids[int(found.group(1))] if found and int(found.group(1)) < len(row_ids) else "?"
    reason = text.split("): ", 1)[-1] if "): " in text else text
    reason = reason.splitlines()[0][:400]
    return DataError(f"hidden states of sample {sid} refused, from {source.name}: {reason}")


def log_plan(
    o: OnlineParams, source: OnlineSource, n_rows: int, n_stored: int, servers: int = 1
) -> None:
    where = source.name if servers == 1 else f"{servers} vLLM servers (first: {source.name})"
    log(
        "train",
        f"online hidden states: {n_rows - n_stored} rows from {where} each epoch, "
        f"{n_stored} val rows from the store; backend {o.backend}; a sample is given up after "
        f"at most {timeout_bound_s(o):.0f} s (train.online.request_timeout_s, max_retries, "
        "round_trip_retries)",
    )
