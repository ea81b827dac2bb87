"""EAGLE-3 drafter training pipeline: DVC stages around speculators and vLLM."""

__version__ = "0.1.0"
