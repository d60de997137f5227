"""Data-parallel OPD training on ``torch.distributed``.

``world`` (rank, size and collectives; imported by the trainer), ``launcher`` (torchrun from one
process; imports the trainer's result type), ``ray_launcher`` (Ray Train workers from one process; every
``ray`` import inside its functions), ``worker`` (one rank under torchrun: reads a job, imports
the launcher's job type and the trainer), ``ray_worker`` (one Ray Train worker: the same ``run_job``). This package file imports nothing, so importing one of them
never imports the others.
"""
