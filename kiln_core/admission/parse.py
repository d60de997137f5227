"""``parse_corpus``: the columnar fast path when the corpus fits it, else the exact record parser.

It sits above both parsers (``columnar`` builds on ``records``' structures), so neither imports the
other's dispatcher.
"""

from __future__ import annotations

from kiln_core.admission import columnar
from kiln_core.admission.records import ParsedCorpus, parse_exact
from kiln_core.admission.source import index_lines


def parse_corpus(data: bytes) -> ParsedCorpus:
    """Parse corpus bytes (already checked to be UTF-8) into a ``ParsedCorpus``.

    Raises:
        AdmissionError: ``invalid_json``, ``not_an_object`` or ``invalid_record`` at the first bad line.
    """
    lines = index_lines(data)
    parsed = columnar.parse_columnar(data, lines)
    if parsed is None:
        parsed = parse_exact(data, lines)
    return parsed
