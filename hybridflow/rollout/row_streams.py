"""Decode a batch's rows as parallel streams on threads of one process (CPU), instead of splitting every op
over OpenMP threads.

Why (docs/bench/generation.md, "Row streams"): a decode step of a 25M model is ~50 small GEMMs and ~250
other ops on 4-32 rows. Split over 2 OpenMP threads, each of those ops is a fork/join: the small ops and
the Python between them run on one core while the other spins, and when another process takes a core
for a moment every barrier waits for it (on a shared 2-core machine a step then costs several times its
1-thread time). As streams, each thread runs all ops of its own rows with one intra-op thread, and the
threads meet once per step (the sampling runs on the whole batch, so the random stream is unchanged).
torch ops release the GIL, so the GEMMs and attention of the streams run at the same time; only the
Python between them is serialised.

Exactness: each stream runs the same ops on its rows as the whole batch would, and every op of the
decode step computes a row independently of the others, so outputs are bit-identical to one stream as
long as each stream has >= MIN_STREAM_ROWS rows (MKL picks other kernels below 4 rows, a different
rounding; tests/rollout/test_row_streams.py checks equality).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

MIN_STREAM_ROWS = 4
"""Fewest rows a stream decodes: MKL's GEMM gives a row the same bits for any row count from 4 on."""


class RowStreams:
    """`n` streams of `threads` intra-op threads each: the caller's thread runs the first part of the rows,
    n - 1 pool threads the others."""

    def __init__(self, n: int, threads: int = 1):
        if n < 2:
            raise ValueError(f"RowStreams needs >= 2 streams, got {n}")
        self.n, self.threads = n, threads
        self.widest = 0
        """Most parts one run() has had since the engine last reset it: whether the streams ran at all."""
        # The pool threads set their own intra-op threads once (torch's thread count is per thread under
        # OpenMP); the caller's is set around the decode loop (BuiltinEngine._generate).
        self.pool = ThreadPoolExecutor(
            n - 1, "row-stream", initializer=torch.set_num_threads, initargs=(threads,)
        )

    def parts(self, rows: int) -> list[tuple[int, int]] | None:
        """[lo, hi) row ranges, one per stream that has >= MIN_STREAM_ROWS rows; None for one stream."""
        k = min(self.n, rows // MIN_STREAM_ROWS)
        if k < 2:
            return None
        cuts = [rows * i // k for i in range(k + 1)]
        return list(zip(cuts[:-1], cuts[1:]))

    def run(self, fn: Callable[[int, int], torch.Tensor], parts: list[tuple[int, int]]) -> torch.Tensor:
        """fn(lo, hi) -> (hi - lo, ...) for every part at once; their outputs concatenated in row order."""
        # Grad mode is per thread: the pool's parts run in the caller's (no_grad: the cache is written in
        # place through views made under it).
        mode = _GradMode(torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        self.widest = max(self.widest, len(parts))
        futures = [self.pool.submit(mode.call, fn, lo, hi) for lo, hi in parts[1:]]
        try:
            first = fn(*parts[0])
        finally:  # the pool's parts write the shared cache: never return (or raise) before they end
            rest = [f.exception() or f.result() for f in futures]
        for r in rest:
            if isinstance(r, BaseException):
                raise r
        return torch.cat([first, *rest])

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _GradMode:
    __slots__ = ("grad", "inference")

    def __init__(self, grad: bool, inference: bool):
        self.grad, self.inference = grad, inference

    def call(self, fn, *args):
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
            return fn(*args)
