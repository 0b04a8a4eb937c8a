"""One spawn of N gloo processes runs every (layout, method) check; the test modules assert on the records.

Process start-up dominates on 2 cores, so a single launch per world size covers all scenarios: for each
training/generation layout and each switch method, switch twice with a plain SGD step on the training
shards in between, and record per rank: whether the generation shard equals the slices of the full
weights exactly, the greedy tokens of its replica, and the measured switch statistics.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.hybrid_engine import (
    METHODS,
    EngineGroups,
    HybridEngine,
    LlamaShape,
    TrainLayout,
    build_tp_context,
    build_training_shard,
    generate_greedy,
    generation_layout,
    llama_param_specs,
)
from hybridflow.hybrid_engine.sharding import reference_generation_shard, tp_slice

# tiny Llama with 4 KV heads and a vocab divisible by 8, so t=4 and the 8-way ZeRO slabs split evenly.
# initializer_range 0.2 (HF default 0.02): at 0.02 attention is nearly uniform and greedy tokens do not
# notice a broken RoPE or head layout; at 0.2 such a bug changes almost every token.
MODEL_OVERRIDES = dict(num_key_value_heads=4, vocab_size=96, initializer_range=0.2)
LR, MAX_NEW, BUCKET_BYTES = 0.5, 6, 64 << 10  # a bucket smaller than one layer: several buckets per switch


def materialize(chunks: list[torch.Tensor], split_dim: int | None) -> torch.Tensor:
    if split_dim is None:
        return torch.cat([c.reshape(-1) for c in chunks])
    return torch.cat(chunks, dim=split_dim)


def build_job(tmp: Path, scenarios: list[tuple[int, int, int, int, int]]) -> dict:
    """Full weights, an SGD step's gradients, prompts and HF greedy references (single process)."""
    from hybridflow.models.tiny import build_tiny_model

    model = build_tiny_model("tiny", "llama", seed=0, **MODEL_OVERRIDES)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(5, 96, (4, 12), generator=g)
    model(input_ids=batch, labels=batch).loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    updated = {k: state[k] - LR * grads[k] for k in state}
    lengths = [3, 7, 5, 8, 4, 6, 2, 7]
    prompts = [torch.randint(5, 96, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # left padded with pad id 0
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, pr in enumerate(prompts):
        ids[i, width - len(pr) :], mask[i, width - len(pr) :] = pr, 1
    refs = {}
    for phase, sd in (("before", state), ("after", updated)):
        model.load_state_dict(sd)
        rows = []
        for pr in prompts:  # one prompt at a time: no padding at all in the reference
            out = model.generate(
                pr[None], max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0, eos_token_id=2
            )
            resp = torch.full((MAX_NEW,), 0, dtype=torch.long)
            resp[: out.shape[1] - len(pr)] = out[0, len(pr) :]
            rows.append(resp)
        refs[phase] = torch.stack(rows)
    shape = LlamaShape.from_hf_config(model.config)
    return dict(
        shape=shape,
        state=state,
        grads=grads,
        updated=updated,
        ids=ids,
        mask=mask,
        refs=refs,
        scenarios=scenarios,
    )


def _worker(rank: int, world: int, init: str, job_path: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    job = torch.load(job_path, weights_only=False)
    shape, records = job["shape"], []
    for p, t, d, pg, tg in job["scenarios"]:
        train = TrainLayout(p, t, d)
        specs = llama_param_specs(shape, p)
        groups = EngineGroups(train, pg, tg)
        base = build_training_shard(job["state"], specs, train, rank)
        for method in METHODS:
            shard = {k: v.clone() for k, v in base.items()}
            gen = generation_layout(method, train, pg, tg)
            eng = HybridEngine(shape, shard, gen, method, groups, bucket_bytes=BUCKET_BYTES)
            stages, _ = gen.needed_pieces(rank)
            g_tp = gen.coords(rank)[2]
            rec = dict(
                layout=(p, t, d, pg, tg), method=method, rank=rank, expected=eng.expected_bytes_received()
            )
            rec["bucket_max_bytes"] = max(len(eng.plan.ranks) * b.numel for b in eng.plan.buckets) * 4
            for phase, full in (("before", job["state"]), ("after", job["updated"])):
                dist.barrier()
                weights = eng.to_generation()
                ref = reference_generation_shard(full, specs, train, stages, g_tp, tg)
                spec = {s.name: s for s in specs}
                rec[phase + "_exact"] = sorted(ref) == sorted(weights) and all(
                    torch.equal(materialize(weights[k], spec[k].split_dim), ref[k]) for k in ref
                )
                ctx = build_tp_context(shape, weights, gen, groups)
                rows = gen.replica_slice(rank, job["ids"].shape[0])
                tokens = generate_greedy(ctx, job["ids"][rows], job["mask"][rows], MAX_NEW, 2, 0)
                rec[phase + "_tokens"] = (rows.start, tokens) if rank in gen.collect_ranks() else None
                rec[phase + "_stats"] = eng.stats
                eng.to_training()
                if phase == "before":  # a plain SGD step on the training shard, in place
                    _, _, t_i = train.coords(rank)
                    for s in specs:
                        if s.name in shard:
                            shard[s.name].sub_(LR * tp_slice(job["grads"][s.name], s, t, t_i))
            records.append(rec)
    torch.save(records, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_job(world: int, scenarios: list[tuple[int, int, int, int, int]]) -> tuple[dict, list[dict]]:
    """Build the job, spawn `world` gloo ranks, return (job, all ranks' records)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = build_job(Path(tmp), scenarios)
        job_path = os.path.join(tmp, "job.pt")
        torch.save(job, job_path)
        init = "file://" + os.path.join(tmp, "rdzv")
        # forkserver: torch is imported once in the server, then every rank is a cheap fork of it
        mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", __name__])
        mp.start_processes(
            _worker, args=(world, init, job_path, tmp), nprocs=world, start_method="forkserver"
        )
        records = [
            r for k in range(world) for r in torch.load(os.path.join(tmp, f"rank{k}.pt"), weights_only=False)
        ]
    return job, records
