"""vLLM's CPU tensor-parallel all-reduce segments (rollout/vllm_engine.clear_stale_cpu_shm): a rank's
leftover from a killed engine is removed before the next engine creates the same name; a segment a live
process has mapped, and other ranks' segments, are kept. Runs without vLLM (file handling only)."""

from __future__ import annotations

import mmap

from hybridflow.rollout.vllm_engine import clear_stale_cpu_shm


def test_only_this_ranks_unmapped_segments_are_removed(tmp_path):
    stale = tmp_path / "-tp:0-[0-1]-cpushm_0"
    other_rank = tmp_path / "-tp:0-[0-1]-cpushm_1"
    live = tmp_path / "run2-tp:0-[0-1]-cpushm_0"
    unrelated = tmp_path / "psm_c4e21707"
    for f in (stale, other_rank, live, unrelated):
        f.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):  # a live engine's mapping
        removed = clear_stale_cpu_shm(0, str(tmp_path))
        assert removed == [str(stale)]
        assert not stale.exists() and live.exists() and other_rank.exists() and unrelated.exists()
    assert clear_stale_cpu_shm(0, str(tmp_path)) == [str(live)]  # unmapped now: a leftover
