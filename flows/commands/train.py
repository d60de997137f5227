"""``kiln-flows train``: train a LoRA student from a Kiln ``OpdRequest`` file.

    $ kiln-flows train --request opd-request.json --adapter offline-distilled --student ./student
    $ kiln-flows train --request opd-request.json --adapter offline-distilled --student ./student \\
          --resume-checkpoint offline-distilled-checkpoint-step-00000025.kiln-checkpoint --json

The request runs through the same engine as the pipeline (``kiln_core.engine.run_pipeline``): outputs
go under ``<out>/runs/<adapter>/<run key>/`` (periodic ``.kiln-checkpoint`` directories, the PEFT
``adapter/``, ``train_receipt.json``) and ``<out>/runs/<adapter>/latest.json`` points at the newest
published run. An unknown request key (``learnign_rate``) is refused, naming the closest field;
``--kiln-lenient`` ignores it as Kiln does, prints it and records it in the receipt
(``ignored_request_keys``). Running the same request again returns the finished run; a run interrupted part-way
is resumed with ``--resume-checkpoint`` (the refusal without it prints the exact command). With
``--json`` the last stdout line is the run summary (``status``, ``adapter``, ``receipt``, ``run``,
``latest``, ``latest_checkpoint``, ``final_loss``, ``gate``, …) or the error object. Exit codes: 0 success
(published, or kept by the gate), 2 rejected input (request, config, ``post_eval``, admission, resume
checkpoint), 3 failed or cancelled run (``training_diverged``: the publish guard refused a run whose
weights or loss diverged, docs/publish-guard.md), 4 trained but held back by the gate (``post_eval`` or
``quality_gate``: regression, demoted, inconclusive, error — the run did not fail, its adapter and
receipt with the evidence are kept, ``latest.json`` did not move; ``--json`` says ``"status":
"success"`` with ``gate.outcome``).

With the request's ``post_eval`` (Kiln's field), the adapter is evaluated on the registered suite
after training and only a promoted one moves ``latest.json`` (docs/post-eval.md). A held-out watch
(docs/eval-watch.md) is set on the command line::

    $ kiln-flows train --request opd-request.json --adapter demo --student ./student \
          --eval-corpus heldout.jsonl --eval-every 25 --stop-on-divergence

One run per run key at a time (``kiln_core.engine.run_lock``): while an identical run is in progress, a
second one exits 3 with ``run_in_progress`` naming the holder (host, pid, since when, UTC), or waits for
it with ``--wait-for-lock SECONDS`` (and then finds it finished, or is told how to resume it). A holder
that died (its process is gone; on object stores, its heartbeat older than the lease) is taken over
(docs/concurrent-runs.md).

Ctrl-C (or SIGTERM) stops the run at the next step boundary after publishing a checkpoint (exit 3);
a second Ctrl-C stops at once.

An on-policy request (Kiln's default ``training_mode``) sends ``prompts`` instead of ``dataset_path`` and
names a teacher registered with ``kiln-flows teachers register``; the student samples its own answers,
the teacher scores them and the same engine trains, stores rollouts under the run directory, publishes
and resumes. The progress bar then counts candidates and shows rollouts/s and teacher tokens scored;
the receipt records ``training_mode: "on_policy"`` and the effective ``samples_per_prompt``. With
``--vllm-rollouts URL`` a vLLM server serving the student base model (``--enable-lora``) samples the
rollouts, the LoRA reloaded there after every step (``--vllm-sync-dir``: a directory it can read); with
``--vllm-teacher URL`` a vLLM server serving the pinned teacher scores them; the receipt says which.

Several processes on this machine (data parallel on ``torch.distributed``)::

    $ kiln-flows train --request opd-request.json --adapter demo --student ./student --nproc 4 --json

validates and admits here, then launches ``python -m torch.distributed.run --standalone
--nproc-per-node 4 -m kiln_core.training.distributed.worker`` (gloo on CPU, nccl on CUDA: one GPU per rank).
Several machines: ``--nproc 16 --write-job s3://bucket/kiln/jobs/opd-1.json`` validates, admits and plans
the run for 16 ranks, writes their job there and prints the ``torchrun`` command every node runs.
Each optimizer step takes ``4 × sequences_per_step`` candidates; rank 0 publishes checkpoints, the
adapter and the receipt. A checkpoint resumes only with the ``--nproc`` that wrote it. With
``--strategy fsdp`` (GPUs only) the student's base weights are sharded across the ranks instead of
copied to each, for students that do not fit one GPU; the adapter is the one ddp trains.

On a Ray cluster (``pip install 'kiln-flows[ray]'``; docs/distributed.md)::

    $ kiln-flows train --request opd-request.json --adapter demo --student ./student --ray local --workers 2
    $ kiln-flows train ... --out s3://bucket/kiln --ray auto --workers 8 --gpus-per-worker 1 --max-failures 3

validates and admits here, then runs the same job on ``--workers`` Ray Train workers (``local`` starts a
Ray instance for the run and stops it after). A worker that dies makes Ray restart the group from the
newest checkpoint (up to ``--max-failures`` times); an unreachable cluster exits 3.
"""

from __future__ import annotations

import argparse

from flows.commands._options import (add_dtype_argument, add_json_argument, add_out_argument, add_quiet_argument,
                                     require_at_least)

from kiln_core.contracts.spec_blocks import DEFAULT_MAX_TRAINING_HOURS

NAME = "train"
HELP = "Train a LoRA student from a Kiln OPD request file (teacher-scored corpus, or on-policy prompts)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--request", required=True, metavar="FILE", help="OpdRequest JSON (dataset_path or prompts, teacher, config)")
    parser.add_argument("--adapter", required=True, metavar="NAME", help="adapter name (the run directory and checkpoint prefix)")
    parser.add_argument("--student", required=True, metavar="DIR", help="student model directory")
    add_out_argument(parser)
    parser.add_argument("--resume-checkpoint", metavar="BASENAME",
                        help="resume exactly from <adapter>-checkpoint-step-<8 digits>.kiln-checkpoint of this run")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    add_dtype_argument(parser, help="training precision (default: bf16 on cuda, fp32 on cpu)", aliases=("--precision",))
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute activations in backward (less memory, same result)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="data-parallel processes on this machine, launched with torchrun (default 1); each "
                        "optimizer step takes N × sequences_per_step candidates")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="torch.distributed backend with --nproc > 1 (default: gloo on cpu, nccl on cuda)")
    parser.add_argument("--write-job", metavar="URI",
                        help="several machines: validate, admit and plan the run for --nproc ranks in all, write "
                        "their job to URI (storage every node reads) and print the torchrun command each node "
                        "runs; trains nothing here")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                        help="with --nproc > 1 or --ray: ddp (every rank holds the whole student) or fsdp (the "
                        "student's base weights sharded across the ranks' GPUs; same adapter; needs GPUs)")
    parser.add_argument("--ray", metavar="ADDRESS",
                        help="train on a Ray cluster instead: local (a Ray instance on this machine for the run), "
                        "auto (the running cluster, RAY_ADDRESS) or ray://host:10001; needs kiln-flows[ray]")
    parser.add_argument("--workers", type=int, metavar="N", help="with --ray: training workers (ranks); each "
                        "optimizer step takes N × sequences_per_step candidates (default 1)")
    parser.add_argument("--gpus-per-worker", type=float, metavar="G",
                        help="with --ray: GPUs per worker (default 0: CPU, gloo)")
    parser.add_argument("--max-failures", type=int, metavar="F",
                        help="with --ray: worker-group restarts after a worker dies, each resuming from the newest "
                        "checkpoint (default 3)")
    parser.add_argument("--eval-corpus", metavar="FILE",
                        help="held-out teacher-scored JSONL to score during training (the watch; off by default)")
    parser.add_argument("--eval-every", type=int, metavar="N", help="score the held-out slice every N optimizer steps")
    parser.add_argument("--stop-on-divergence", action="store_true",
                        help="stop cleanly (checkpoint, failed receipt) when a watch rule fires")
    parser.add_argument("--vllm-rollouts", metavar="URL",
                        help="on-policy: sample rollouts on this vLLM server (the student base model served with "
                        "--enable-lora; the LoRA is reloaded there after every step)")
    parser.add_argument("--vllm-teacher", metavar="URL",
                        help="on-policy: score rollouts on this vLLM server serving the pinned teacher")
    parser.add_argument("--vllm-sync-dir", metavar="DIR",
                        help="directory the rollout server can read, for the per-step LoRA (default: "
                        "vllm-sync in the run directory)")
    parser.add_argument("--admit-workers", type=int, default=1, metavar="N",
                        help="when dataset_path names a set of shards (a directory or an index): shards admitted "
                        "at once, each in its own process (default 1)")
    parser.add_argument("--kiln-lenient", action="store_true",
                        help="ignore unknown request keys as Kiln does (each one is printed and recorded in the "
                        "receipt); without it an unknown key is refused, naming the closest field")
    parser.add_argument("--max-training-hours", type=_hours, default=DEFAULT_MAX_TRAINING_HOURS, metavar="HOURS",
                        help="refuse the run (training_too_long, exit 2) when, at the pace of its first steps, it "
                        f"would train longer than HOURS (default {DEFAULT_MAX_TRAINING_HOURS:g}); 'none' for no bound")
    parser.add_argument("--wait-for-lock", type=_seconds, default=0.0, metavar="SECONDS",
                        help="when an identical run (same run key) is in progress, wait up to SECONDS for it "
                        "instead of exiting 3 with run_in_progress (default 0)")
    add_json_argument(parser)
    add_quiet_argument(parser)


def _hours(value: str) -> float | None:
    """A positive number of hours, or ``none`` (argparse type)."""
    if value.strip().lower() == "none":
        return None
    try:
        hours = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of hours (or none): {value!r}") from None
    if not hours > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be more than 0 hours, not {value!r}")
    return hours


def _seconds(value: str) -> float:
    """A number of seconds, 0 or more (argparse type)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not seconds >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, not {value!r}")
    return seconds


def resume_command(args: argparse.Namespace, checkpoint: str | None) -> str:
    """The exact command that resumes this run from ``checkpoint`` (None: the run has none yet, so the same
    command again starts it afresh)."""
    import shlex

    argv = ["kiln-flows", "train", "--request", args.request, "--adapter", args.adapter, "--student", args.student,
            "--out", args.out]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype)):
        if value:
            argv += [flag, value]
    if args.gradient_checkpointing:
        argv.append("--gradient-checkpointing")
    if args.kiln_lenient:
        argv.append("--kiln-lenient")
    if args.max_training_hours != DEFAULT_MAX_TRAINING_HOURS:
        argv += ["--max-training-hours", "none" if args.max_training_hours is None else f"{args.max_training_hours:g}"]
    if args.eval_corpus:
        argv += ["--eval-corpus", args.eval_corpus, "--eval-every", str(args.eval_every)]
        if args.stop_on_divergence:
            argv.append("--stop-on-divergence")
    if args.nproc != 1:
        argv += ["--nproc", str(args.nproc), "--backend", args.backend]
    if args.strategy != "ddp":
        argv += ["--strategy", args.strategy]
    if args.ray is not None:
        argv += ["--ray", args.ray]
        for flag, value in (("--workers", args.workers), ("--gpus-per-worker", args.gpus_per_worker),
                            ("--max-failures", args.max_failures)):
            if value is not None:
                argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    for flag, value in (("--vllm-rollouts", args.vllm_rollouts), ("--vllm-teacher", args.vllm_teacher),
                        ("--vllm-sync-dir", args.vllm_sync_dir)):
        if value:
            argv += [flag, value]
    return shlex.join(argv + (["--resume-checkpoint", checkpoint] if checkpoint else []))


def run(args: argparse.Namespace) -> int:
    """Run the request through the engine; rejections (exit 2) and failures (exit 3) go to the guard."""
    import sys

    from flows.commands._progress import ProgressBar
    from kiln_core.engine import ResumeRequired, run_pipeline, spec_from_request

    require_at_least(args, 1, "nproc", "admit_workers")  # flags are named as flags, not as request fields
    if args.write_job is not None:
        check_write_job(args)
    prepared = spec_from_request(args.request, adapter=args.adapter, student_dir=args.student, out_root=args.out,
                                 resume_checkpoint=args.resume_checkpoint, nproc=args.nproc, backend=args.backend,
                                 eval_watch=watch_from_arguments(args), vllm=vllm_from_arguments(args),
                                 kiln_lenient=args.kiln_lenient, admit_workers=args.admit_workers,
                                 ray=ray_from_arguments(args), strategy=args.strategy,
                                 max_training_hours=args.max_training_hours)
    for warning in prepared.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.write_job is not None:
        return write_job(prepared, args)
    bar = ProgressBar(enabled=not (args.quiet or args.json), config=prepared.spec.config)
    try:
        on_train_start = None if args.quiet else (
            lambda settings: print(f"training {args.adapter}: {settings}", file=sys.stderr, flush=True))
        stages = prepared.stages(on_progress=bar.update, on_train_start=on_train_start)
        args.resume_hint = lambda: _resume_after_interrupt(args, stages.plan)  # for a second Ctrl-C (flows.cli)
        result = run_pipeline(prepared.spec, stages,
                              resume=prepared.resume,
                              device=args.device, precision=args.dtype,
                              gradient_checkpointing=args.gradient_checkpointing, wait_for_lock=args.wait_for_lock)
    except ResumeRequired as error:
        error.message += f": {resume_command(args, error.newest)}"
        raise
    finally:
        bar.close()
    print_result(result, args.adapter, as_json=args.json, quiet=args.quiet)
    if result.status != "success" and result.latest_checkpoint and not args.json:
        print(f"  resume with: {resume_command(args, result.latest_checkpoint)}", file=sys.stderr)
    return exit_code(result)


def check_write_job(args: argparse.Namespace) -> None:
    """``--write-job`` is torchrun's: refused with ``--ray`` and below two ranks, before the request is read.

    Raises:
        ConfigError: ``unsupported`` on ``ray`` or ``nproc``.
    """
    from kiln_core.contracts.opd_config import ConfigError

    if args.ray is not None:
        raise ConfigError("--write-job is for torchrun on several machines; Ray starts its own workers: remove one",
                          "ray", code="unsupported")
    if args.nproc < 2:
        raise ConfigError(f"--write-job needs --nproc N of at least 2, the ranks of all nodes together; got "
                          f"{args.nproc}", "nproc", code="unsupported")


def write_job(prepared, args: argparse.Namespace) -> int:
    """``--write-job URI``: the job every rank of a multi-node run executes, written where every node reads it,
    and the ``torchrun`` command each node runs (``kiln_core.training.distributed.worker``)."""
    import json
    import shlex

    from kiln_core.storage import resolve, write_bytes_atomic
    from kiln_core.training.distributed.launcher import WORKER_MODULE

    job = prepared.job(device=args.device, precision=args.dtype, gradient_checkpointing=args.gradient_checkpointing)
    location = resolve(args.write_job)
    write_bytes_atomic(location, job.model_dump_json().encode("utf-8"))
    command = ["torchrun", "--nnodes", "NODES", "--nproc-per-node", "RANKS_PER_NODE", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", "HEAD:29500", "--rdzv-id", job.plan.run_key, "-m", WORKER_MODULE,
               "--job", location.uri]
    if args.json:
        print(json.dumps({"job": location.uri, "world_size": job.plan.settings.world_size, "run": job.plan.run_uri,
                          "command": command}))
    else:
        print(f"job for {job.plan.settings.world_size} ranks written to {location.uri} (run {job.plan.run_uri})\n"
              f"on every node, with NODES × RANKS_PER_NODE = {job.plan.settings.world_size}:\n  {shlex.join(command)}")
    return 0
def _resume_after_interrupt(args: argparse.Namespace, plan) -> str | None:
    """The command that resumes a run a second Ctrl-C stopped at once: from its newest committed checkpoint,
    or the same command again when it had none (None before training started: nothing to resume)."""
    if plan is None:
        return None
    from kiln_core.engine.runs import newest_checkpoint

    return resume_command(args, newest_checkpoint(plan.run_uri, plan.adapter))


def print_result(result, label: str, *, as_json: bool, quiet: bool = False) -> None:
    """How a training command ends its output: the summary as one JSON line (``--json``), else what was trained
    and where (and the gate's verdict), or on stderr why it failed and its newest checkpoint. With ``--quiet`` a
    success (exit 0) prints nothing; an adapter the gate held back (exit 4) is still told, with its evidence."""
    import json
    import sys

    if as_json:
        print(json.dumps(result.summary(), ensure_ascii=False))
    elif result.status == "success":
        if quiet and not result.held_back:
            return
        verb = "already trained" if result.reused else "trained"
        print(f"{verb} {label}: {result.steps} steps, final loss {result.final_loss:.6f}\n"
              f"  adapter: {result.adapter}\n  receipt: {result.receipt}\n  latest.json: {result.latest or 'not moved'}")
        if result.gate is not None:
            from kiln_core.engine.gate import describe_gate

            print("\n".join(describe_gate(result.gate)))
    else:
        # "cancelled: …", not "cancelled (cancelled): …": the reason only when it says more than the status
        reason = f" ({result.failure_reason})" if result.failure_reason not in (None, result.status) else ""
        print(f"{result.status}{reason}: {result.failure_message}\n"
              f"  latest checkpoint: {result.latest_checkpoint}\n  receipt: {result.receipt}", file=sys.stderr)


def exit_code(result) -> int:
    """0 success, 3 failed or cancelled, 4 trained but held back by the gate (not a failure)."""
    from kiln_core.errors import EXIT_FAILED, EXIT_HELD_BACK, EXIT_OK

    if result.status != "success":
        return EXIT_FAILED
    return EXIT_HELD_BACK if result.held_back else EXIT_OK


def watch_from_arguments(args: argparse.Namespace) -> dict | None:
    """The spec's ``eval:`` block from ``--eval-corpus/--eval-every/--stop-on-divergence`` (None: no watch).

    Raises:
        ConfigError: ``--eval-every`` or ``--stop-on-divergence`` without ``--eval-corpus`` and vice versa.
    """
    from kiln_core.contracts.opd_config import ConfigError

    if args.eval_corpus is None:
        if args.eval_every is not None or args.stop_on_divergence:
            raise ConfigError("--eval-every and --stop-on-divergence need --eval-corpus FILE", "eval.corpus")
        return None
    if args.eval_every is None:
        raise ConfigError("--eval-corpus needs --eval-every N", "eval.every_steps")
    return {"corpus": args.eval_corpus, "every_steps": args.eval_every, "stop_on_divergence": args.stop_on_divergence}


def ray_from_arguments(args: argparse.Namespace) -> dict | None:
    """The Ray fields of the spec's ``distributed:`` block from ``--ray/--workers/--gpus-per-worker/--max-failures``
    (None: no Ray).

    Raises:
        ConfigError: ``--workers``, ``--gpus-per-worker`` or ``--max-failures`` without ``--ray``.
    """
    from kiln_core.contracts.opd_config import ConfigError

    given = {"workers": args.workers, "gpus_per_worker": args.gpus_per_worker, "max_failures": args.max_failures}
    if args.ray is None:
        for name, value in given.items():
            if value is not None:
                raise ConfigError(f"--{name.replace('_', '-')} needs --ray ADDRESS (local, auto or ray://host:port)",
                                  f"distributed.{name}")
        return None
    check_ray_flag(args.ray)
    require_at_least(args, 1, "workers")
    require_at_least(args, 0, "gpus_per_worker", "max_failures")
    return {"address": args.ray, **given, "workers": 1 if args.workers is None else args.workers}


def check_ray_flag(address: str) -> None:
    """``--ray ADDRESS`` is an address Ray can be given (``local``, ``auto``, ``ray://host:port``, ``host:port``),
    checked before any work: refused naming the flag, not the request file.

    Raises:
        ConfigError: ``invalid_ray_address``, field ``--ray``.
    """
    from kiln_core.contracts.opd_config import ConfigError
    from kiln_core.contracts.spec_blocks import check_ray_address

    try:
        check_ray_address(address)
    except ValueError as error:
        raise ConfigError(str(error).replace("`distributed.address`: ", ""), "--ray", code="invalid_ray_address") from None


def vllm_from_arguments(args: argparse.Namespace) -> dict | None:
    """The spec's ``vllm:`` block from ``--vllm-rollouts/--vllm-teacher/--vllm-sync-dir`` (None: all local).

    Raises:
        ConfigError: ``--vllm-sync-dir`` without ``--vllm-rollouts``.
    """
    from kiln_core.contracts.opd_config import ConfigError

    if args.vllm_rollouts is None and args.vllm_teacher is None:
        if args.vllm_sync_dir is not None:
            raise ConfigError("--vllm-sync-dir needs --vllm-rollouts URL", "vllm.sync_dir")
        return None
    return {"rollouts_url": args.vllm_rollouts, "teacher_url": args.vllm_teacher, "sync_dir": args.vllm_sync_dir}
