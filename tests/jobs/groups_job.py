"""A ``commviz launch`` entrypoint where every rank sits in several groups (4 ranks): the
world, the config's named ``tp`` pair, and one of two groups made with plain
``dist.new_group(ranks)`` and no ``group_desc`` (torch calls them "undefined").

Each step: an all_reduce on ``tp``, one on the rank's unnamed group, one on the world. At its
call ``args.at`` rank ``args.rank`` sleeps ``args.sleep_s`` before the unnamed group's
all_reduce (``args.how: stuck``; ``none``: runs clean), so its partner there waits until the
gloo timeout, and the others wait in the world's.

Each rank writes what torch itself says of each of its groups (``args.groups_dir``:
``groups_rank{R}.json``): its name, ``group_desc`` and ``dist.get_process_group_ranks``, the
test's expectation.
"""

import json
import time

import torch
import torch.distributed as dist


def build(ctx):
    args = ctx.args
    unnamed = [dist.new_group([0, 2]), dist.new_group([1, 3])]     # no group_desc
    mine = unnamed[ctx.rank % 2]
    if args.get("groups_dir"):
        pgs = (dist.group.WORLD, ctx.group("tp"), mine)
        with open(f"{args['groups_dir']}/groups_rank{ctx.rank}.json", "w") as f:
            json.dump([{"name": dist.distributed_c10d._get_process_group_name(pg),
                        "desc": pg.group_desc, "ranks": dist.get_process_group_ranks(pg)}
                       for pg in pgs], f)
    t = torch.ones(16)
    calls = [0]

    def step() -> None:
        calls[0] += 1
        ctx.dist.all_reduce(t, group=ctx.group("tp"))
        if args.get("how") == "stuck" and ctx.rank == args["rank"] and calls[0] == args["at"]:
            time.sleep(args["sleep_s"])
        ctx.dist.all_reduce(t, group=mine)
        ctx.dist.all_reduce(t, group=ctx.group("world"))
    return step
