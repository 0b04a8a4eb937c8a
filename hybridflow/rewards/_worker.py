"""A reward worker process: imports the user's reward code (never the trainer), then scores chunks of samples.

Started by `pool._Worker` as `python -m hybridflow.rewards._worker FD PARENT_PID` (not multiprocessing's
spawn/fork: those re-import the parent's __main__, which inside a Ray actor or an unguarded user
script would re-run it). It dies with its parent: PR_SET_PDEATHSIG on Linux (the kernel kills it even
while it hangs in a C loop holding the GIL), a watchdog thread elsewhere. The kernel ties the signal to
the parent *thread* that started the worker, so an executor belongs to a long-lived thread (the
trainer's main thread).

Protocol on the duplex connection FD:
  parent -> worker: (spec, fn_kwargs) once; then per chunk ("seq", items) | ("fork", items, timeout_s)
                    | ("batch", items); None to stop.
  worker -> parent: ("ready", pid, declared_batched) | ("init_error", one_line, traceback); then per sample
                    ("ok", i, score) | ("err", i, traceback) | ("timeout", i, message) | ("died", i, message);
                    per batched chunk ("batch", [i...], [scores] | None, traceback | None).
"seq" scores one sample after another, one message each, so the parent times each sample (its clock
restarts at every message). "fork" (used after a sample of the batch timed out) scores every sample
of the chunk at once, each in a forked child that inherits the imported module, and the worker itself
kills a child after timeout_s: a batch of hanging samples costs about timeout_s, not one per sample.
An item is (index, data_source, solution_str, ground_truth, extra_info).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

# children of one "fork" chunk alive at once (more wait for a free slot)
MAX_FORKS = 64


def die_with_parent(parent_pid: int) -> None:
    """Be killed when the parent goes away, however this process is stuck."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:  # no kernel help: a thread that polls (cannot fire while C code holds the GIL)

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def summary(error: BaseException) -> str:
    """One line saying what went wrong and where in the user's code, e.g.
    "importing it raised ZeroDivisionError: division by zero (reward.py:3)"."""
    import traceback

    from hybridflow.errors import UserError

    if isinstance(error, UserError):  # ours, already phrased for the user (no function 'scroe', ...)
        return " ".join(str(error).split())
    if isinstance(error, SystemExit):
        what = f"importing it called sys.exit({error.code!r})"
    else:
        what = "importing it raised " + " ".join(f"{type(error).__name__}: {error}".split())
    ours = os.path.dirname(os.path.abspath(__file__)), "<frozen"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(ours)]
    return f"{what} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else what


def serve(conn, parent_pid: int) -> None:
    import traceback

    from hybridflow.rewards.registry import load_reward_fn, run_batched, run_per_sample

    try:
        spec, fn_kwargs = conn.recv()
        fn, declared_batched = load_reward_fn(spec)
    except BaseException as e:  # SystemExit / KeyboardInterrupt at import too: reported, not a silent exit
        conn.send(("init_error", summary(e), traceback.format_exc()))
        return
    conn.send(("ready", os.getpid(), declared_batched))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent went away
            return
        if msg is None:
            return
        mode, items = msg[0], msg[1]
        if mode == "batch":
            idx = [it[0] for it in items]
            try:
                conn.send(("batch", idx, run_batched(fn, items, fn_kwargs), None))
            except BaseException:
                conn.send(("batch", idx, None, traceback.format_exc()))
        elif mode == "fork":
            score_forked(conn, fn, items, fn_kwargs, msg[2])
        else:
            for item in items:
                conn.send(score_one(run_per_sample, fn, item, fn_kwargs))


def score_one(run_per_sample, fn, item, fn_kwargs) -> tuple:
    import traceback

    try:
        return ("ok", item[0], run_per_sample(fn, item, fn_kwargs))
    except BaseException:  # sys.exit() inside the function is this sample's error, not the worker's end
        return ("err", item[0], traceback.format_exc())


def score_forked(conn, fn, items: list, fn_kwargs: dict, timeout_s: float) -> None:
    """Every item in its own forked child, all at once (up to MAX_FORKS); a child past timeout_s is killed."""
    import pickle
    import select
    from collections import deque

    from hybridflow.rewards.registry import run_per_sample

    queue, running = deque(items), {}  # read fd -> [pid, index, start, received bytes]
    me = os.getpid()
    while queue or running:
        while queue and len(running) < MAX_FORKS:
            item = queue.popleft()
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: score, write the result, leave without running any cleanup
                try:
                    os.close(r)
                    os.setpgid(0, 0)  # its own group: a kill takes what it started too
                    die_with_parent(me)
                    data = pickle.dumps(score_one(run_per_sample, fn, item, fn_kwargs))
                    with os.fdopen(w, "wb") as out:
                        out.write(data)
                finally:
                    os._exit(0)
            os.close(w)
            try:
                os.setpgid(pid, pid)  # also from this side, so a kill right away finds the group
            except OSError:
                pass
            running[r] = [pid, item[0], time.monotonic(), []]
        wait = min(start + timeout_s for _, _, start, _ in running.values()) - time.monotonic()
        readable, _, _ = select.select(list(running), [], [], max(0.0, wait))
        for r in readable:
            data = os.read(r, 1 << 16)
            if data:
                running[r][3].append(data)
                continue
            pid, i, _, parts = running.pop(r)
            os.close(r)
            _, status = os.waitpid(pid, 0)
            try:
                conn.send(pickle.loads(b"".join(parts)))
            except Exception:  # no complete result: the child crashed (os._exit, a signal)
                code = os.waitstatus_to_exitcode(status)
                conn.send(("died", i, f"the sample's process died (exit code {code})"))
        now = time.monotonic()
        for r, (pid, i, start, _) in list(running.items()):
            if now - start >= timeout_s:
                _kill_group(pid)
                running.pop(r)
                os.close(r)
                conn.send(("timeout", i, f"no result within {timeout_s:g}s; its process was killed"))


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass
    os.waitpid(pid, 0)


if __name__ == "__main__":
    parent = int(sys.argv[2])
    die_with_parent(parent)
    from multiprocessing.connection import Connection

    serve(Connection(int(sys.argv[1])), parent)
