"""A stateful data loader: seeded per-epoch shuffles and a position, so resume is exact.

The order of epoch e is a pure function of (seed, e), so the state is just (epoch, position):
`state_dict()` after k batches + `load_state_dict()` in a fresh process yields exactly the batches
the uninterrupted run would have yielded next. No RNG state needs saving.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hybridflow.batch import Batch
from hybridflow.errors import DatasetError


class StatefulDataLoader:
    """Batches of `batch_size` samples from a dataset with a `collate(samples, epoch)` method.

    drop_last=True keeps every training batch the same size (the trailing partial batch of an
    epoch is skipped); validation uses drop_last=False.
    """

    def __init__(
        self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise DatasetError(
                f"the dataset has {len(dataset)} samples, fewer than one batch of {batch_size}; "
                "lower data.train_batch_size or add data"
            )
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # samples of this epoch already yielded

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _end(self) -> int:
        return len(self) * self.batch_size if self.drop_last else len(self.dataset)

    def next_batch(self) -> Batch:
        """The next batch, rolling over into the next epoch (for step-based training loops)."""
        if self.position >= self._end():
            self.epoch, self.position = self.epoch + 1, 0
        idx = self.order(self.epoch)[self.position : self.position + self.batch_size]
        self.position += len(idx)
        return self.dataset.collate([self.dataset[int(i)] for i in idx], epoch=self.epoch)

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch (all of it when starting fresh); then the epoch advances."""
        if self.position >= self._end():
            self.epoch, self.position = self.epoch + 1, 0
        while self.position < self._end():
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_len": len(self.dataset),
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        # a different dataset or batch size would silently shift every later batch: refuse
        for key, mine in (("dataset_len", len(self.dataset)), ("batch_size", self.batch_size)):
            if state.get(key, mine) != mine:
                raise ValueError(
                    f"cannot resume the data loader: checkpoint has {key}={state[key]}, this run has {mine} "
                    "(resume needs the same data and data.train_batch_size)"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed, self.shuffle = int(state.get("seed", self.seed)), bool(state.get("shuffle", self.shuffle))
