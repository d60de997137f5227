"""When a Prefect task may retry: never for a rejected input (it would fail the same way again).

Every task with ``retries`` passes ``retry_condition_fn=retry_unless_rejected``: a ``Rejection``
(``kiln_core.errors``) fails the task on its first attempt; an ``EnvironmentFailure`` or any other
exception is retried within the task's bounded ``retries``.
"""

from __future__ import annotations

from kiln_core.errors import Rejection


def retry_unless_rejected(task, task_run, state) -> bool:
    """``retry_condition_fn`` for every retrying task: False for a ``Rejection``, True otherwise."""
    try:
        state.result()
    except Rejection:
        return False
    except Exception:  # noqa: BLE001 - storage, network, or a bug: worth another attempt
        return True
    return False
