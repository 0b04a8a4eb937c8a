"""A reward worker process: resolves the reward spec itself, then scores chunks of samples sent over a pipe.

Started by `executor._WorkerPool` as `python -m hybridflow.rewards._worker FD` (not multiprocessing's
spawn/fork: those re-import the parent's __main__, which inside a Ray actor or an unguarded user
script would re-run it). Protocol on the duplex connection FD:
  parent -> worker: (spec, fn_kwargs, batched) once, then a list of items per chunk, None to stop.
  worker -> parent: ("ready", pid) | ("init_error", traceback), then per sample ("ok", i, score) or
                    ("err", i, traceback); per batched chunk ("batch", [i...], [scores] | None, traceback | None).
One message per sample lets the parent time each sample: its clock restarts at every message.
An item is (index, data_source, solution_str, ground_truth, extra_info).
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection

from hybridflow.rewards.registry import load_reward_fn, run_batched, run_per_sample


def serve(conn: Connection) -> None:
    try:
        spec, fn_kwargs, batched = conn.recv()
        fn, declared_batched = load_reward_fn(spec)
        batched = declared_batched if batched is None else batched
    except Exception:
        conn.send(("init_error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            items = conn.recv()
        except EOFError:  # the parent went away
            return
        if items is None:
            return
        if batched:
            idx = [it[0] for it in items]
            try:
                conn.send(("batch", idx, run_batched(fn, items, fn_kwargs), None))
            except Exception:
                conn.send(("batch", idx, None, traceback.format_exc()))
            continue
        for item in items:
            try:
                conn.send(("ok", item[0], run_per_sample(fn, item, fn_kwargs)))
            except Exception:
                conn.send(("err", item[0], traceback.format_exc()))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
