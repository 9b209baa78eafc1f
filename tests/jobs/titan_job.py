"""torchtitan's own Trainer under commviz, as a user would run it on CPU: torchrun, gloo.

``python -m torch.distributed.run --nproc_per_node 4 titan_job.py RUN_DIR LAYOUT STEPS``
trains llama3 "debugmodel" (torchtitan's model, ``parallelize_llama``, pipeline split,
loss, optimizer and LR schedule untouched) on random tokens for STEPS steps, each rank under
``commviz.start`` + ``commviz.profile``, and leaves torch's Flight Recorder dump beside the
record (``RUN_DIR/fr/fr_rank{R}``; set ``TORCH_FR_BUFFER_SIZE``). LAYOUT is one of
``LAYOUTS``: FSDP2 x TP with full activation checkpointing, or PP x TP with torch's
``1F1B`` or ``Interleaved1F1B``. Beside RUN_DIR, ``titan_{LAYOUT}_rank{R}.json`` holds
torchtitan's module tree and this rank's layers and stages (``_tree``: the test's expected
unit names).

What torchtitan 0.3.0 needs to run on torch 2.13's CPU build, and nothing more, is set here
(each marked "torch 2.13 CPU"); the data, tokenizer and logging are stand-ins (random tokens,
no tokenizer files, no TensorBoard).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch._utils
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fr_dump  # noqa: E402

# torch 2.13 CPU: torchtitan reads the device type once at import and takes "cuda" where torch
# reports no accelerator; it is "cpu" here (torch's own lookup restored at once)
_available = torch._utils._get_available_device_type
torch._utils._get_available_device_type = lambda: "cpu"
try:
    import torchtitan.tools.utils  # noqa: F401
finally:
    torch._utils._get_available_device_type = _available

from torchtitan.components import metrics  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed.activation_checkpoint import FullAC  # noqa: E402
from torchtitan.models.common.attention import (FlexAttention,  # noqa: E402
                                                ScaledDotProductAttention)
from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: E402

import commviz  # noqa: E402

LAYOUTS = {
    "fsdp_tp": dict(data_parallel_shard_degree=2, tensor_parallel_degree=2),
    "pp_1f1b": dict(data_parallel_shard_degree=1, tensor_parallel_degree=2,
                    pipeline_parallel_degree=2, pipeline_parallel_schedule="1F1B"),
    "pp_interleaved": dict(data_parallel_shard_degree=1, tensor_parallel_degree=2,
                           pipeline_parallel_degree=2,
                           pipeline_parallel_schedule="Interleaved1F1B"),
}
SEQ_LEN, BATCH, MICROBATCHES = 32, 2, 4


class RandomTokens(BaseDataLoader):
    """Random token batches (a stand-in for torchtitan's Hugging Face dataset loader)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, *, dp_rank: int, local_batch_size: int, seq_len: int,
                 **_: Any) -> None:
        self.vocab, self.shape = config.vocab_size, (local_batch_size, seq_len + 1)
        self.generator = torch.Generator().manual_seed(dp_rank)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens = torch.randint(0, self.vocab, self.shape, generator=self.generator)
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class NoTokenizer(BaseTokenizer):
    """Stands in for the tokenizer files torchtitan's assets would hold (tokens are random)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, **_: Any) -> None:
        super().__init__()
        self.vocab = config.vocab_size

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        return []

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return ""

    def get_vocab_size(self) -> int:
        return self.vocab


class CpuMemory(metrics.DeviceMemoryMonitor):
    """torchtitan's memory monitor reads the accelerator's allocator, which the CPU has not
    (torch 2.13 CPU): it reports nothing here (its logging is all that reads it)."""

    def __init__(self) -> None:
        self.device, self.device_name, self.device_capacity = torch.device("cpu"), "cpu", 1

    def get_peak_stats(self) -> metrics.DeviceMemStats:
        return metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def _summing(parallelize: Any) -> Any:
    """torchtitan's parallelize function, then FSDP's reductions as plain sums: gloo has no
    ``PREMUL_SUM`` (torch 2.13 CPU)."""
    from torch.distributed.fsdp import FSDPModule

    def parallelize_fn(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        model = parallelize(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model
    return parallelize_fn


def _whole_batch(schedule: Any) -> None:
    """torchtitan 0.3.0 hands its schedule micro-batches (``arg_mbs=``...), which torch
    2.13's ``step`` does not take: the same micro-batches joined into the whole batch that
    ``step`` splits again (along dim 0, as many as before)."""
    step = schedule.step

    def stepped(*, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
                target_mbs: list | None = None, **kwargs: Any) -> Any:
        args = [torch.cat(parts) for parts in zip(*arg_mbs)] if arg_mbs else []
        joined = {k: torch.cat([mb[k] for mb in kwarg_mbs]) for k in (kwarg_mbs or [{}])[0]}
        target = torch.cat(target_mbs) if target_mbs else None
        return step(*args, target=target, **joined, **kwargs)
    schedule.step = stepped


def _set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
    """torchtitan's ``set_pg_timeouts`` as it runs on torch 2.13 CPU: the barrier without
    CUDA's ``device_ids`` (gloo takes none) and torch's ``_set_pg_timeout``, as this torch
    has no ``dist.set_timeout``."""
    dist.barrier()
    for mesh in parallel_dims.get_all_one_dimensional_meshes().values():
        dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group())
    dist.distributed_c10d._set_pg_timeout(timeout, None)


def config(layout: str, steps: int, out: Path) -> Any:
    """torchtitan's llama3 debugmodel config, set for this machine and LAYOUT."""
    cfg = llama3_debugmodel()
    spec = cfg.model_spec
    # torch 2.13 CPU: FlexAttention has no backward on CPU uncompiled; SDPA (causal) instead
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    spec.parallelize_fn = _summing(spec.parallelize_fn)
    pp = "pipeline_parallel_degree" in LAYOUTS[layout]
    # torch 2.13 CPU: torch's fully_shard rejects the spmd_types backend's plain parameters
    cfg.parallelism = ParallelismConfig(spmd_backend="partial_dtensor",
                                        pipeline_parallel_microbatch_size=1,
                                        **LAYOUTS[layout])
    cfg.training = TrainingConfig(local_batch_size=MICROBATCHES if pp else BATCH,
                                  seq_len=SEQ_LEN, steps=steps, disable_cuda_graphs=True,
                                  mixed_precision_param="float32")
    cfg.activation_checkpoint = None if pp else FullAC.Config()
    cfg.dataloader = RandomTokens.Config()
    cfg.tokenizer = NoTokenizer.Config()
    cfg.validator.enable = False
    cfg.checkpoint.enable = False
    cfg.dump_folder = str(out)
    return cfg


def _tree(trainer: Any) -> dict[str, Any]:
    """The model as torchtitan builds it before parallelizing (its config built on the meta
    device): every module's name; and the layers and pipeline stages this rank holds."""
    with torch.device("meta"):
        model = trainer.model_config.build()
    stages = getattr(getattr(trainer, "pp_schedule", None), "_stages", None) or [
        getattr(getattr(trainer, "pp_schedule", None), "_stage", None)]
    return {"modules": [name for name, _ in model.named_modules()],
            "layers": [list(part.layers.keys()) for part in trainer.model_parts],
            "stages": [s.stage_index for s in stages if s is not None]}


def _step_starts(trainer: Any) -> list[int]:
    """When each of the trainer's steps starts (``time.time_ns()``, the records' clock),
    noted as ``train`` calls ``train_step``."""
    starts: list[int] = []
    step = trainer.train_step

    def noted(data_iterator: Any) -> Any:
        starts.append(time.time_ns())
        return step(data_iterator)
    trainer.train_step = noted
    return starts


def main() -> None:
    run_dir, layout, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rank = int(os.environ["RANK"])
    dist_utils.set_pg_timeouts = _set_pg_timeouts
    metrics.build_device_memory_monitor = CpuMemory
    dist.init_process_group("gloo")         # torchtitan takes the group it finds
    fr = run_dir / "fr" / f"fr_rank{rank}"
    fr_dump.arm(fr)
    commviz.start(run_dir, flush_interval=None)
    trainer = config(layout, steps, run_dir.parent / f"titan_out_{layout}").build()
    if trainer.parallel_dims.pp_enabled:
        _whole_batch(trainer.pp_schedule)
    starts = _step_starts(trainer)
    with commviz.profile(run_dir):
        trainer.train()
    (run_dir.parent / f"titan_{layout}_rank{rank}.json").write_text(
        json.dumps(dict(_tree(trainer), steps=starts)))
    trainer.close()
    fr_dump.dump(fr)
    commviz.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
