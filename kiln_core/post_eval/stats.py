"""The numbers behind the gate: per-completion seeds, the exact sign test, the Wilson interval.

Source: crates/kiln-eval/src/result.rs · derive_eval_completion_seed, sign_test,
pass_rate_confidence_interval. Arithmetic is f64 as in Kiln; the Wilson bounds are returned as the
f32 values Kiln stores (``x as f32``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from kiln_core.serde_json import to_f32

__all__ = ["SEED_DERIVATION_V1", "derive_eval_completion_seed", "sign_test_p_value", "WilsonInterval",
           "wilson_interval", "WILSON_Z", "CONFIDENCE_LEVEL"]

SEED_DERIVATION_V1 = "kiln.eval-seed.v1"
WILSON_Z = 1.959963984540054
CONFIDENCE_LEVEL = 0.95


def derive_eval_completion_seed(effective_seed: int, example_id: str, completion_index: int) -> int:
    """The decoder seed of one completion: SHA-256 over the v1 tag, seed, example id and index.

    Both arms of a comparison get the same seeds, so sampling noise pairs up example by example.

    Example:
        >>> derive_eval_completion_seed(42, "example-7", 3)
        1961911680962343893
    """
    identifier = example_id.encode("utf-8")
    digest = hashlib.sha256(
        SEED_DERIVATION_V1.encode() + b"\0" + (effective_seed % 2**64).to_bytes(8, "little")
        + len(identifier).to_bytes(8, "little") + identifier + completion_index.to_bytes(8, "little")
    ).digest()
    return int.from_bytes(digest[:8], "little")


def sign_test_p_value(improved: int, regressed: int) -> float:
    """Two-sided exact binomial sign test over the discordant pairs (1.0 when there are none).

    p = min(1, 2·Σ_{i≤k} C(m, i) / 2^m) with m = improved + regressed and k = min(improved, regressed),
    summed in log space so large suites do not underflow.

    Example:
        >>> abs(sign_test_p_value(9, 2) - 134 / 2048) < 1e-12
        True
    """
    m = improved + regressed
    if m == 0:
        return 1.0
    k = min(improved, regressed)
    log_terms = []
    log_choose = 0.0  # ln C(m, 0)
    for i in range(k + 1):
        log_terms.append(log_choose - m * math.log(2.0))
        log_choose += math.log(m - i) - math.log(i + 1)
    peak = max(log_terms)
    tail = sum(math.exp(term - peak) for term in log_terms) * math.exp(peak)
    return min(2.0 * tail, 1.0)


@dataclass(frozen=True)
class WilsonInterval:
    lower: float
    upper: float
    confidence_level: float = CONFIDENCE_LEVEL


def wilson_interval(num_pass: int, num_examples: int) -> WilsonInterval:
    """95 % Wilson score interval of a pass rate, clamped to [0, 1]; (0, 0) for no examples.

    Example:
        >>> round(wilson_interval(20, 20).lower, 4)
        0.8389
    """
    if num_examples == 0:
        return WilsonInterval(0.0, 0.0)
    z, n = WILSON_Z, float(num_examples)
    phat = num_pass / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = phat + z2 / (2.0 * n)
    margin = z * math.sqrt((phat * (1.0 - phat) + z2 / (4.0 * n)) / n)
    lower = min(max((center - margin) / denom, 0.0), 1.0)
    upper = min(max((center + margin) / denom, 0.0), 1.0)
    return WilsonInterval(to_f32(lower), to_f32(upper), to_f32(CONFIDENCE_LEVEL))
