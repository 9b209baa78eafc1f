"""A launch entrypoint that fails on purpose: rank ``args.rank`` at its call ``args.at`` raises
(``how: raise``), SIGKILLs (``kill``) or SIGTERMs (``term``) itself, or sleeps ``args.sleep_s``
before its all_reduce (``stuck``: its peers time out); ``how: none`` runs clean.
Each step is an all_reduce and (unless ``broadcast: false``) a broadcast on the world group."""

import os
import signal
import time

import torch


def build(ctx):
    t = torch.ones(16)
    calls = [0]

    def step():
        calls[0] += 1
        how = ctx.args["how"]
        if ctx.rank == ctx.args["rank"] and calls[0] == ctx.args["at"] and how == "stuck":
            time.sleep(ctx.args.get("sleep_s", 120))
        ctx.dist.all_reduce(t, group=ctx.group("world"))
        if ctx.args.get("broadcast", True):
            ctx.dist.broadcast(t, src=0, group=ctx.group("world"))
        if ctx.rank == ctx.args["rank"] and calls[0] == ctx.args["at"] and how in (
                "raise", "kill", "term"):
            if how in ("kill", "term"):
                os.kill(os.getpid(), getattr(signal, "SIG" + how.upper()))
            raise RuntimeError(f"injected failure in call {calls[0]}")
    return step
