"""Kiln's ``post_eval`` wire formats: the gate configuration a request or pipeline spec carries
(``config``), the eval suite file and its generation settings (``suite``), the scorers a suite declares
(``scorers``, with ``answer_parsing``), Kiln's serde rendering of numbers and strings (``wire``) and the
post-eval rejection codes (``errors``). Running a suite and deciding a gate is ``kiln_core.post_eval``'s.
"""
