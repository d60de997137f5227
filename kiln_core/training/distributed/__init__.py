"""Data-parallel OPD training on ``torch.distributed``.

``world`` (rank, size and collectives; imported by the trainer), ``launcher`` (torchrun from one
process; imports the trainer's result type), ``ray_launcher`` (Ray Train workers from one process; every
``ray`` import inside its functions), ``worker`` (one rank; imports the launcher's job type,
the trainer and the request preparation). This package file imports nothing, so importing one of them
never imports the others.
"""
