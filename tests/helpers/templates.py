"""Chat templates of the kind downloaded models ship, none written for this pipeline."""

from __future__ import annotations

# ChatML with a default system prompt, string content only, no reasoning section (the shape of
# SmolLM2-Instruct's template): tools and content parts are not rendered.
CHATML_DEFAULT_SYSTEM = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named Tiny.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML that renders tools, tool calls, tool results and text content parts (Qwen-like).
CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n"
    "{%- for t in tools %}\n{{ t.function.name }}: {{ t.function.description }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content is string %}{{ m.content }}"
    "{%- else %}{%- for p in m.content %}{{ p.text }}{%- endfor %}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}\n<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

# The tiny verifier's Kimi-style template, except that the generation prompt does NOT open
# `<think>`: the model emits it itself (as Kimi-K2 and Qwen3 do).
KIMI_MODEL_OPENS_THINK = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "<think></think>{{ m.content }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
