"""Corpus admission: a teacher-scored JSONL corpus in, admitted tables (or one ``AdmissionError``) out.

Public surface:

* ``admit_corpus``: the whole workflow (read, parse, check, tokenize, materialize).
* ``AdmissionResult``: what an admitted corpus looks like to callers.
"""

from kiln_core.admission.admit import AdmissionResult, admit_corpus

__all__ = ["AdmissionResult", "admit_corpus"]
