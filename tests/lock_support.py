"""A process that holds a run lock (``kiln_core.engine.run_lock``) until its stdin closes: the "other run"
of the concurrency tests, on local disk and on S3.

    python tests/lock_support.py RUN_URI [--wait SECONDS] [--lease SECONDS]

prints one JSON line once it holds the lock (``{"held": true, "pid": ...}``) or, when a live run holds it,
the ``run_in_progress`` error object and exits 3 (the CLI's exit code for it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("run")
    parser.add_argument("--wait", type=float, default=0.0)
    parser.add_argument("--lease", type=float, default=120.0)
    args = parser.parse_args()

    from kiln_core.engine.run_lock import RunInProgress, RunLock
    from kiln_core.storage import resolve

    lock = RunLock(wait_seconds=args.wait, lease_seconds=args.lease)
    try:
        lock.acquire(resolve(args.run))
    except RunInProgress as error:
        print(json.dumps(error.to_json()), flush=True)
        sys.exit(error.exit_code)
    print(json.dumps({"held": True, "pid": os.getpid(), "since": lock.holder.since}), flush=True)
    sys.stdin.read()  # hold until the test closes our stdin (or kills us)
    lock.release()
    print(json.dumps({"released": True, "lost": lock.lost}), flush=True)
