"""Every path the pipeline reads or writes, relative to the repo root, defined once.

dvc.yaml names the same paths; tests/unit/core/test_paths.py checks that the two agree. Params keep
their own defaults (`verifier.path`, `prepare.prompts`): those are the user's to move.
"""

from __future__ import annotations

from pathlib import Path

PROMPTS = Path("data/prompts")
CORPUS_DIR = Path("data/corpus")  # committed text the tiny verifiers train on
CORPUS = CORPUS_DIR / "verifier_corpus.jsonl"
VERIFIER = Path("data/verifier")
SYNTHESIZED = Path("data/synthesized")  # prompts the verifier wrote (Magpie)
PREPARED = Path("data/prepared")
GENERATED = Path("data/generated")
TOKENIZED = Path("data/tokenized")
TOKEN_FREQ = TOKENIZED / "token_freq.json"
HIDDEN_STATES = Path("data/hidden_states")
VOCAB = Path("data/vocab")
TRAINED = Path("models/trained")
DRAFTER = Path("models/drafter")
FAMILIES_MODELS = Path("models/families")  # one folder per `families` branch
CURVE_MODELS = Path("models/curve")  # one folder per learning-curve fraction
REAL_MODELS = Path("models/verifiers")  # real verifiers fetched from a registry package

METRICS = Path("metrics")
VOCAB_METRICS = METRICS / "vocab.json"
TRAIN_METRICS = METRICS / "train.json"
TRAIN_LIVE = METRICS / "train"
# train's val acceptance per epoch: what the curve stage reads of TRAIN_LIVE (its tokens/s
# differs on every run, so the whole folder would make curve stale after each retraining)
TRAIN_VAL_TAU = TRAIN_LIVE / "plots/metrics/val/acceptance_length.tsv"
EVAL_METRICS = METRICS / "eval.json"
PROVENANCE = METRICS / "provenance"
FAMILIES_METRICS = METRICS / "families"
CURVE_FRACTIONS = METRICS / "fractions"  # per fraction F: F/train (DVCLive), F/eval.json
CURVE = METRICS / "curve.json"  # the learning curve's fit and its predictions
CURVE_PLOTS = METRICS / "curve"  # its plot series:
CURVE_TOKENS = CURVE_PLOTS / "tokens.json"  # acceptance by training tokens, measured + predicted
CURVE_EPOCHS = CURVE_PLOTS / "epochs.json"  # the full run's val acceptance by epoch
CHECKED = Path("data/checked")  # what the check stage verified (key names only)

# Scratch: in-progress work of resumable stages; git-ignored, never a DVC output.
SCRATCH = Path("data/.work")
VLLM_CACHE = SCRATCH / "vllm-cache"
