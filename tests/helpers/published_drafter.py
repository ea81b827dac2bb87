"""A drafter "published" the way SpecForge makes one, and what an init from it starts with.

The issue-13 proof on CPU: a tiny verifier's own greedy answers, every layer's hidden state
captured once (vLLM's convention: id k < N = input of layer k, N = last layer output before the
norm), a drafter trained on ids [2, 4, 5] with SpecForge's wiring (no norm before fc, residual
before hidden_norm, pre-norm state chained) and saved flat with SGLang's ids [1, 3, 4]. Then the
drafter speculators' trainer starts from (step 0), built by `training.run.initial_drafter`:
with the conventions carried (drafter.conventions) and with the old behaviour (ids as written,
speculators' default norms). Run as a script for the README numbers:
`.venv/bin/python tests/helpers/published_drafter.py`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from drafter_fixtures import VOCAB, build_drafter, build_llama_verifier, save_legacy_flat  # noqa: E402

N_LAYERS = 8
PUBLISHED_AUX = [2, 4, 5]  # vLLM's ids of the features it was trained on
SGLANG_AUX = [i - 1 for i in PUBLISHED_AUX]  # what its flat config.json says
DRAFT_VOCAB = 128
K = 3  # draft tokens per step (vLLM's num_speculative_tokens)


@dataclass
class Sample:
    ids: torch.Tensor  # [seq]
    mask: torch.Tensor  # [seq], 1 on the generated answer
    layers: torch.Tensor  # [seq, N + 1, H]: every id 0..N in vLLM's convention

    def features(self, aux: list[int]) -> torch.Tensor:
        """[seq, len(aux) + 1, H]: the aux ids then the final one, as the store holds them."""
        return self.layers[:, [*aux, N_LAYERS]]


def sharp_verifier(out: Path, scale: float = 30.0) -> Path:
    """A random 8-layer Llama whose lm_head is scaled up: the same greedy answers (repetition
    loops a drafter can learn), but peaked distributions, so the KL loss carries a signal."""
    from safetensors.torch import load_file, save_file

    build_llama_verifier(out)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * scale
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def verifier_samples(verifier: Path, n: int, prompt_len: int = 8, new: int = 40) -> list[Sample]:
    """The verifier's own greedy answers to seeded random prompts, with all hidden states."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(verifier).eval()
    last: dict[str, torch.Tensor] = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: last.update(h=out[0] if isinstance(out, tuple) else out)
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.config.vocab_size, (n, prompt_len), generator=gen)
    with torch.no_grad():  # one batch: equal prompt lengths, no padding
        ids = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        out = model(ids, output_hidden_states=True)
    hook.remove()
    # hidden_states[k] (k < N) enters layer k; [N] is after the final norm: the hook's instead.
    layers = torch.stack([*out.hidden_states[:N_LAYERS], last["h"]], dim=2).float()
    mask = torch.zeros(ids.shape[1], dtype=torch.long)
    mask[prompt_len:] = 1
    return [Sample(ids[i], mask, layers[i]) for i in range(n)]


def draft_vocab(samples: list[Sample], out: Path, n_target: int) -> list[int]:
    """d2t/t2d .npy for the DRAFT_VOCAB most frequent supervised tokens; their target ids."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    freq: dict[int, int] = {}
    for s in samples:
        for t, m in zip(s.ids.tolist(), s.mask.tolist(), strict=True):
            freq[t] = freq.get(t, 0) + m
    d2t, t2d = build_vocab_mappings_from_distribution(freq, DRAFT_VOCAB, n_target)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    return (torch.arange(DRAFT_VOCAB) + d2t).tolist()


def _batch(s: Sample, aux: list[int]) -> dict[str, torch.Tensor]:
    """speculators' shift_batch for one sample (models/eagle3/data.py)."""
    f = s.features(aux)
    n = f.shape[0]
    return {
        "hidden_states": f[:-1, :-1].flatten(1).unsqueeze(0),
        "input_ids": s.ids[1:].unsqueeze(0),
        "verifier_last_hidden_states": f[1:, -1].unsqueeze(0),
        "loss_mask": s.mask[1:].unsqueeze(0),
        "document_ids": torch.zeros(1, n - 1, dtype=torch.long),
        "position_ids": torch.arange(1, n).unsqueeze(0),
    }


def _loss_kwargs() -> dict[str, Any]:
    from speculators.models.eagle3.core import Eagle3DraftModel

    train, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=K, ttt_step_loss_decay=1.0
    )
    return train


def mean_loss(model: Any, samples: list[Sample], aux: list[int]) -> float:
    """speculators' own training loss (KL, 3 TTT steps), averaged over samples."""
    kwargs = _loss_kwargs()
    with torch.no_grad():
        losses = [float(model(**_batch(s, aux), **kwargs)[1]) for s in samples]
    return sum(losses) / len(losses)


def _packed(samples: list[Sample], aux: list[int]) -> dict[str, torch.Tensor]:
    """All samples in one packed batch, documents apart, as speculators' collate packs them."""
    parts = [_batch(s, aux) for s in samples]
    out = {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}
    out["document_ids"] = torch.cat(
        [torch.full_like(p["document_ids"], i) for i, p in enumerate(parts)], dim=1
    )
    return out


def train_published(
    verifier: Path, target_ids: list[int], samples: list[Sample], steps: int, lr: float = 3e-3
):
    """SpecForge's wiring (speculators' flags all false), AdamW, fp32, on PUBLISHED_AUX."""
    model = build_drafter(
        verifier, target_ids, PUBLISHED_AUX, seed=1, legacy_flags=True, perturb_norms=False
    )
    model.lm_head.weight.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    kwargs = _loss_kwargs()
    batch = _packed(samples, PUBLISHED_AUX)
    model.train()
    for _ in range(steps):
        _, loss, _ = model(**batch, **kwargs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def acceptance(model: Any, verifier: Path, samples: list[Sample], aux: list[int]) -> float:
    """Offline simulated mean acceptance length (evaluation.offline, as the evaluate stage)."""
    from eagle3_pipeline.evaluation import offline

    head = offline.VerifierHead(verifier, 1e-6)
    counts = offline.AcceptanceCounts(K)
    for s in samples:
        counts.add(
            offline.simulate_sample(model.float().eval(), head, s.features(aux), s.ids, s.mask, K)
        )
    return counts.summary()["mean_acceptance_length"]


def start_of_training(
    root: Path, verifier: Path, init_from: Path, conventions: Any, name: str
) -> Any:
    """The drafter speculators' trainer starts from under `conventions` (no step taken)."""
    from builders import train_params

    from eagle3_pipeline.training.run import TrainSettings, initial_drafter

    train = train_params(lr=1e-4, ttt_steps=K, train_lm_head=True, init_from=str(init_from))
    settings = TrainSettings(
        train=train,
        data_dir=root / name / "data",
        verifier_dir=verifier,
        save_dir=root / name / "ckpt",
        d2t_path=root / "vocab" / "d2t.npy",
        t2d_path=root / "vocab" / "t2d.npy",
        draft_vocab_size=DRAFT_VOCAB,
        target_layer_ids=list(conventions.aux_layer_ids),
        train_data_ratio=1.0,
        **conventions.flags,
        draft_layer_config=conventions.layer_config,
    )
    return initial_drafter(settings, on_init_line=lambda line: None)


def run_params(verifier: Path, init_from: Path, aux: list[int], **train: Any) -> Any:
    from eagle3_pipeline.config.params import Params

    return Params.model_validate(
        {
            "verifier": {"source": "pretrained", "path": str(verifier)},
            "layers": {"aux_layer_ids": aux, "final_layer_id": N_LAYERS},
            "vocab": {"draft_vocab_size": DRAFT_VOCAB},
            "train": {"init_from": str(init_from), **train},
        }
    )


def proof(root: Path, n_samples: int = 16, steps: int = 30) -> dict[str, float]:
    """Every number of the proof: acceptance on all samples and on the held-out quarter
    (`_val`), SpecForge-style loss on the training samples."""
    from eagle3_pipeline.drafter.conventions import (
        TRAINER_DEFAULT_FLAGS,
        RunConventions,
        run_conventions,
    )

    verifier = sharp_verifier(root / "verifier")
    samples = verifier_samples(verifier, n_samples, new=32)
    train, val = samples[: -n_samples // 4], samples[-n_samples // 4 :]
    target_ids = draft_vocab(samples, root / "vocab", VOCAB)
    published = train_published(verifier, target_ids, train, steps, lr=1e-2)
    flat = save_legacy_flat(published, root / "published", SGLANG_AUX)

    run = run_params(verifier, flat, PUBLISHED_AUX)
    carried = run_conventions(run.layers, run.train, N_LAYERS)
    old = RunConventions(SGLANG_AUX, N_LAYERS, dict(TRAINER_DEFAULT_FLAGS), {})
    drafters = {
        "published": (published, PUBLISHED_AUX),
        "init_carried": (
            start_of_training(root, verifier, flat, carried, "carried"),
            carried.aux_layer_ids,
        ),
        "init_old": (start_of_training(root, verifier, flat, old, "old"), old.aux_layer_ids),
    }
    out: dict[str, float] = {}
    for name, (model, aux) in drafters.items():
        out[name] = acceptance(model, verifier, samples, aux)
        out[f"{name}_val"] = acceptance(model, verifier, val, aux)
        out[f"loss_{name}"] = mean_loss(model, train, aux)
    return out


if __name__ == "__main__":
    import tempfile

    from eagle3_pipeline.core.progress import log  # noqa: F401 (package importable)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        numbers = proof(Path(tmp))
    for key, value in numbers.items():
        print(f"{key}: {value:.4f}")
    print(f"wall: {time.perf_counter() - t0:.1f} s")
