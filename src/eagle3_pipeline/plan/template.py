"""The verifier's chat template as the stages meet it, checked before any work.

transformers' AutoTokenizer, loaded as verifier/loading.py loads it, reads the template from
chat_template.jinja, additional_chat_templates/*.jinja or tokenizer_config.json's
chat_template; chat_template.json is a processor's file it leaves alone. The template must
render a conversation with generate.chat_template_kwargs, as generate's server and tokenize
render every prompt. `eagle3 plan` and the `check` stage reach it through support.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config.params import Params
from eagle3_pipeline.core.errors import VerifierError
from eagle3_pipeline.verifier import loading

TINY_TEMPLATE = "the project's own (verifier/tiny.py)"
# Two conversations every chat template must render: one turn, and a reply in context.
SAMPLES: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name three prime numbers."},
    ],
]


@dataclass(frozen=True)
class TemplateSupport:
    """Where the chat template is and whether it rendered the sample conversations."""

    source: str
    rendered: bool
    note: str | None = None

    def describe(self) -> str:
        if self.rendered:
            return f"{self.source}: renders a conversation with generate.chat_template_kwargs"
        return f"{self.source}" + (f": {self.note}" if self.note else "")

    def record(self) -> dict[str, Any]:
        return {"source": self.source, "rendered": self.rendered}


def _template_source(directory: Path) -> str | None:
    """The file transformers' AutoTokenizer takes the chat template from (its own order:
    chat_template.jinja over tokenizer_config.json's), or None."""
    if (directory / "chat_template.jinja").is_file():
        return "chat_template.jinja"
    extra = sorted((directory / "additional_chat_templates").glob("*.jinja"))
    if extra:
        return str(extra[0].relative_to(directory))
    cfg = directory / "tokenizer_config.json"
    if cfg.is_file():
        try:
            if json.loads(cfg.read_text()).get("chat_template"):
                return "tokenizer_config.json"
        except (ValueError, AttributeError):
            raise VerifierError(
                f"{cfg}: not a JSON object: the tokenizer files are damaged"
            ) from None
    return None


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def check_chat_template(params: Params, directory: Path | None, required: bool) -> TemplateSupport:
    """The tokenizer, loaded as the stages load it (verifier/loading.py), has a chat template
    that renders SAMPLES with generate.chat_template_kwargs. directory None: a tiny verifier the
    verifier stage builds later. Tokenizer files that are absent or do not load are an error
    when `required` (the check stage, right before the stages that load them), a note otherwise
    (a plan made from config files alone, before the download finished)."""
    if directory is None:
        return TemplateSupport(TINY_TEMPLATE, False, "written by the verifier stage, later")
    files = [f for f in ("tokenizer_config.json", "tokenizer.json") if (directory / f).is_file()]
    if not files and not required:
        return TemplateSupport(f"no tokenizer files in {directory}", False, "not checked")
    try:
        if not files:
            raise FileNotFoundError("no tokenizer_config.json nor tokenizer.json")
        tokenizer = loading.load_tokenizer(
            params.verifier.model_copy(update={"path": str(directory)})
        )
    except Exception as exc:  # transformers raises what it likes on missing or damaged files
        if required:
            raise VerifierError(
                f"{directory}: the tokenizer does not load ({one_line(exc)}): generate and "
                "tokenize load it and its chat template from verifier.path: copy the model's "
                "tokenizer files there"
            ) from None
        return TemplateSupport(
            f"tokenizer in {directory}",
            False,
            f"does not load here ({one_line(exc)}): not checked",
        )
    source = _template_source(directory)
    if not getattr(tokenizer, "chat_template", None):
        legacy = directory / "chat_template.json"
        if legacy.is_file():
            raise VerifierError(
                f"{legacy}: the chat template is in a processor's file, which the tokenizer "
                "(transformers' AutoTokenizer, as tokenize loads it) does not read: copy its "
                f'"chat_template" value into {directory}/chat_template.jinja'
            )
        raise VerifierError(
            f"{directory}: no chat template (neither chat_template.jinja nor tokenizer_config."
            "json's chat_template): generate and tokenize render every prompt with it: add the "
            "model's template as chat_template.jinja (a base model has none: use its chat or "
            "instruct variant)"
        )
    source = source or f"{type(tokenizer).__name__}'s own"
    where = directory / source
    kwargs = params.generate.chat_template_kwargs
    for messages in SAMPLES:
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as exc:  # jinja raises its own types, templates raise what they like
            raise VerifierError(
                f"{where}: the chat template fails on a {len(messages)}-message conversation "
                f"with generate.chat_template_kwargs {kwargs} ({one_line(exc)}): fix the "
                "template or generate.chat_template_kwargs"
            ) from None
        if messages[-1]["content"] not in str(text):
            raise VerifierError(
                f"{where}: the chat template drops the user's message from a "
                f"{len(messages)}-message conversation (generate.chat_template_kwargs "
                f"{kwargs}): fix the template"
            )
    return TemplateSupport(source, True)
