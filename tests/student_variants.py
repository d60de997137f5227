"""The tiny student's tokenizer in another directory, with another chat template or logit width.

Tests that need a student Kiln treats differently (a template that defeats the byte search, one that
puts a target at position 0, a model narrower than its tokenizer) build it here from the session's
tiny student, so every variant shares its vocabulary (and so its teacher binding).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Renders only the last message: prefix renders shrink, so Kiln's fallback masks overlap.
LAST_MESSAGE_ONLY = "{{ messages[-1]['content'] }}"
# Renders only assistant turns, inside generation blocks: the text starts with an action target.
ASSISTANT_FIRST = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}{% endif %}{% endfor %}"
)


def student_variant(tiny_student: Path, directory: Path, *, template: str | None = None,
                    vocab_size: int | None = None) -> Path:
    """Copy the student's tokenizer files (no weights) and replace its template and/or ``vocab_size``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_student / name).exists():
            shutil.copy(tiny_student / name, directory / name)
    if template is not None:
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    if vocab_size is not None:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        (directory / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}), encoding="utf-8")
    return directory
