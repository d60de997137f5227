"""What a ``kiln-flows`` command's terminal shows besides its own output: quiet libraries, whole lines.

* ``quiet_third_party_warnings()`` — deprecation notices that libraries print for their *own* internal
  calls (transformers' ``FutureWarning: `is_gradient_checkpointing` is deprecated`` on every train, and
  the like from peft, huggingface_hub, torch) say nothing a user can act on. They are filtered by
  category *and* module, so a warning raised by kiln-flows itself, a ``UserWarning`` from a library, or
  anything from another module still shows; ``--debug`` (or ``KILN_FLOWS_DEBUG=1``) keeps them all.
* ``lines_above_bars()`` — progress bars (tqdm, on stderr) redraw their line with ``\\r``; a log line or
  warning written meanwhile used to land on the bar's line (``train: 25%|██▌ | 2/8 …/work/…: Future
  Warning``). While the context is active, every complete line written to stderr by anything else
  (logging handlers — Prefect's console handler included — ``warnings``, ``print(file=sys.stderr)``)
  clears the active bars first and redraws them below it (``tqdm.external_write_mode``).
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from typing import Iterator

# tqdm moving between nested bars' lines: newlines then cursor-up codes (``tqdm.std.moveto``).
_BAR_MOVES = re.compile(r"\n*(?:\x1b\[A)*")
# Modules whose own deprecation notices are silenced; matched against the module that warns.
QUIET_MODULES = r"(transformers|peft|huggingface_hub|torch|accelerate)(\.|$)"


def quiet_third_party_warnings() -> None:
    """Ignore ``FutureWarning``/``DeprecationWarning`` raised inside the libraries of ``QUIET_MODULES``."""
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=QUIET_MODULES)


class _LinesAboveBars:
    """A text stream wrapper: a bar's own output (it starts with ``\\r``) passes through; other text is
    written line by line, with the active bars cleared before and redrawn after."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._pending = ""
        self._redrawing = False

    def write(self, text: str) -> int:
        if not text:
            return 0
        if self._redrawing or text.startswith("\r") or (not self._pending and _BAR_MOVES.fullmatch(text)):
            # a bar drawing itself (or moving between nested bars' lines), a closing bar's newline, or the
            # bars redrawn below a line: straight through, never another clear-and-redraw
            return self._stream.write(text)
        self._pending += text
        if "\n" not in self._pending:
            return len(text)
        lines, _, self._pending = self._pending.rpartition("\n")
        self._write_lines(lines + "\n")
        return len(text)

    def _write_lines(self, lines: str) -> None:
        from tqdm import tqdm

        if not getattr(tqdm, "_instances", None):
            self._stream.write(lines)
            return
        self._redrawing = True
        try:
            with tqdm.external_write_mode(file=self):
                self._stream.write(lines)
                self._stream.flush()
        finally:
            self._redrawing = False

    def flush(self) -> None:
        self._stream.flush()  # a partial line waits for its newline (or the end of the block)

    def finish(self) -> None:
        """Write a last line that never got its newline."""
        if self._pending:
            pending, self._pending = self._pending, ""
            self._write_lines(pending)
        self._stream.flush()

    def __getattr__(self, name: str):
        stream = self.__dict__.get("_stream")  # not yet set (a copy being built): no recursion
        if stream is None:
            raise AttributeError(name)
        return getattr(stream, name)


@contextlib.contextmanager
def lines_above_bars() -> Iterator[None]:
    """Route ``sys.stderr`` through ``_LinesAboveBars`` for the duration of the block."""
    original = sys.stderr
    wrapper = _LinesAboveBars(original)
    sys.stderr = wrapper
    try:
        yield
    finally:
        try:
            wrapper.finish()
        finally:
            sys.stderr = original
