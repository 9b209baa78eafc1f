"""The pipeline program (``commviz.launch.programs.pipeline``, one stage per rank) with one
stage made slow on purpose: on rank ``args.slow_rank`` every ``nn.Linear`` first sleeps
``args.sleep_s`` in its forward (a global forward pre-hook), so that stage's forward compute
takes longer by ``layers_per_stage`` x ``sleep_s`` per micro-batch, and the other stages wait
for it. ``slow_rank: -1``: no stage is slow.
"""

import time

from torch import nn

from commviz.launch import programs


def build(ctx):
    step = programs.pipeline(ctx)
    if ctx.rank == ctx.args.get("slow_rank", -1):
        def slow(module, args):
            if isinstance(module, nn.Linear):
                time.sleep(ctx.args["sleep_s"])
        nn.modules.module.register_module_forward_pre_hook(slow)
    return step
