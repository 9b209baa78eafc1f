"""torchtitan's own Trainer on GPUs under commviz, for the GPU proof (``scripts/gpu_titan.sh``).

``torchrun --nproc_per_node N scripts/gpu_titan.py RUN_DIR [torchtitan's own flags ...]``

Runs torchtitan 0.2.2 (the newest release that runs on the GPU machines' torch 2.11) as its
users do: its ``Trainer``, its llama3 model and ``parallelize_llama``, pipeline split, loss,
optimizer and LR schedule untouched, configured by its own command-line flags. Only the data
and the tokenizer are stand-ins (random tokens; a tokenizer that knows an end-of-sequence id,
which flex attention's document mask reads): the machines reach no dataset hub. Each rank
records under ``commviz.start`` from the moment torchtitan has made its process groups,
profiles two steps with ``commviz.profile``, leaves torch's Flight Recorder dump beside its
record (``TORCH_FR_BUFFER_SIZE`` set by the caller) and gathers into RUN_DIR.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import torch


def _without_datasets() -> None:
    """torchtitan's llama3 module imports Hugging Face ``datasets`` for the loader this script
    replaces; where the GPU image lacks it (it needs a newer pyarrow than the image has), a
    module of the names imported stands in, each refusing to be used."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        import types

        def unused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("datasets is not installed: this run reads random tokens")
        stub, split = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.Dataset, stub.load_dataset, split.split_dataset_by_node = object, unused, unused
        stub.distributed = split
        sys.modules.update({"datasets": stub, "datasets.distributed": split})


_without_datasets()
from torchtitan import train as titan_train  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.protocols import train_spec as specs  # noqa: E402

import commviz  # noqa: E402
from commviz.launch import flight  # noqa: E402

SPEC = "llama3_commviz"


class RandomTokens(BaseDataLoader):
    """Random token batches in place of torchtitan's Hugging Face dataset loader."""

    def __init__(self, vocab: int, batch: int, seq_len: int, dp_rank: int) -> None:
        self.vocab, self.shape = vocab, (batch, seq_len + 1)
        self.generator = torch.Generator().manual_seed(dp_rank)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens = torch.randint(0, self.vocab, self.shape, generator=self.generator)
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class StandInTokenizer(BaseTokenizer):
    """What the trainer reads of a tokenizer: the vocabulary size and an end-of-sequence id."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.eos_id = vocab, vocab - 1

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        return []

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return ""

    def get_vocab_size(self) -> int:
        return self.vocab


def _spec() -> specs.TrainSpec:
    llama = specs.get_train_spec("llama3")
    vocab = next(iter(llama.model_args.values())).vocab_size
    return dataclasses.replace(
        llama,
        build_tokenizer_fn=lambda job_config: StandInTokenizer(vocab),
        build_dataloader_fn=lambda dp_world_size, dp_rank, tokenizer, job_config, **_: RandomTokens(
            vocab, job_config.training.local_batch_size, job_config.training.seq_len, dp_rank),
        build_validator_fn=None)


class Trainer(titan_train.Trainer):
    """torchtitan's Trainer, recorded from its process groups on and profiled step by step."""

    profiler: Any = None

    def init_distributed(self) -> Any:
        dims = super().init_distributed()
        commviz.start(RUN_DIR)
        return dims

    def train_step(self, data_iterator: Any) -> None:
        super().train_step(data_iterator)
        if self.profiler is not None:
            self.profiler.step()


RUN_DIR = Path(sys.argv[1])


def main() -> None:
    specs.register_train_spec(SPEC, _spec())
    flight.point_dumps_at(RUN_DIR)
    config = ConfigManager().parse_args([f"--model.name={SPEC}", *sys.argv[2:]])
    trainer = Trainer(config)
    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
    with commviz.profile(RUN_DIR, schedule=schedule) as prof:
        trainer.profiler = prof
        trainer.train()
    rank = torch.distributed.get_rank()
    flight.dump(RUN_DIR, rank)
    commviz.gather(RUN_DIR)
    trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")
    main()
