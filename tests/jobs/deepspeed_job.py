"""DeepSpeed's own engine and ZeRO optimizers (stages 3, 2 and 1, then none) on gloo CPU ranks,
run under torchrun with ``commviz.start`` and ``commviz.profile``.

``python deepspeed_job.py RUN_DIR OUT_DIR``: each stage builds ``Net`` afresh, hands it to
``deepspeed.initialize`` with ``config(stage)`` (a torch AdamW as the client optimizer: DeepSpeed's
own optimizers are C++ ops it would build first) and trains ``STEPS`` steps on random data.
Each rank then leaves ``OUT_DIR/rank{R}.pkl``: torch's Flight Recorder entries and commviz's
records (``fr_compare.snapshot``), and where each phase's records start (``marks``: stage ->
[("init", n), ("forward", n), ("backward", n), ("step", n), ...]), the test's hand count of
what the program did when. ``TORCH_FR_BUFFER_SIZE`` must be set by the caller.
"""

import os
import pickle
import sys
from pathlib import Path

import torch

STEPS, STAGES, BATCH = 2, (3, 2, 1, 0), 2
# small buckets, so that a backward reduces several; no persistent parameters in ZeRO-3, so
# every module's parameters are gathered
ZERO = {"reduce_bucket_size": 600, "allgather_bucket_size": 600,
        "stage3_param_persistence_threshold": 0}


class Net(torch.nn.Module):
    """Three hidden layers and a head: the module names DeepSpeed's users see
    (``layers.0`` ... ``head``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 32),
                                           torch.nn.Linear(32, 32)])
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "steps_per_print": 10_000,
            "zero_optimization": {"stage": stage, **ZERO}, "zero_allow_untested_optimizer": True}


def main(run_dir: Path, out_dir: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    import commviz
    from fr_compare import snapshot

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    commviz.start(run_dir, flush_interval=None)
    marks: dict[int, list[tuple[str, int]]] = {}

    def mark(stage: int, phase: str) -> None:
        marks.setdefault(stage, []).append((phase, len(commviz.RECORDER.records())))

    torch.manual_seed(0)
    data = [(torch.randn(BATCH, 16), torch.randn(BATCH, 4)) for _ in range(STEPS)]
    with commviz.profile(run_dir):
        for stage in STAGES:
            torch.manual_seed(stage)
            mark(stage, "init")
            model = Net()
            engine, _, _, _ = deepspeed.initialize(
                model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                config=config(stage))
            for x, y in data:
                mark(stage, "forward")
                loss = torch.nn.functional.mse_loss(engine(x), y)
                mark(stage, "backward")
                engine.backward(loss)
                mark(stage, "step")
                engine.step()
            mark(stage, "end")
            engine.destroy()
    snap = snapshot()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps(dict(snap, marks=marks)))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/: fr_compare
    main(Path(sys.argv[1]), Path(sys.argv[2]))
