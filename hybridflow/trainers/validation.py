"""A trainer's validation: generate for every validation prompt and score it (docs/metrics.md, the val/
metrics). `ValidationMixin` is part of `Trainer` (trainers/base.py); it uses the trainer's config,
validation dataset, actor group, scoring (`score`), timers and tracker.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from hybridflow.algorithms.eval_metrics import vote_metrics
from hybridflow.batch import Batch
from hybridflow.logging.backends import function_means
from hybridflow.trainers.dump import generation_rows, write_generations


class ValidationMixin:
    def validate(self) -> dict:
        """Generate for every validation prompt (rollout.val sampling) and score. With a rule reward:
        val/{data_source}/acc@1 (the first sample of each prompt: the reward fn's 'acc' when it returns
        one, else its score) and, when rollout.val.n > 1,
        mean@n (all samples), best@n (any sample right), maj@n (the majority answer right) and the
        unbiased pass@k for k = 2, 4, ... < n (algorithms/eval_metrics.py); with a reward model
        val/{data_source}/reward. Also val/reward/mean (and with weighted reward functions
        val/reward/<name>/mean, each one's own), a table of sample generations, and with
        trainer.validation_data_dir every generation in <dir>/<step>.jsonl (trainers/dump.py)."""
        if self.val_dataset is None:
            return {}
        v = self.cfg.rollout.val
        sampling = {"n": v.n, "temperature": v.temperature, "top_k": v.top_k, "top_p": v.top_p}
        size = self.cfg.data.val_batch_size or len(self.val_dataset)
        per_source, rows, dumped = defaultdict(list), [], []  # source -> [(n,) scores of one prompt]
        first = defaultdict(list)  # source -> each prompt's first sample right (its 'acc', else its score)
        votes = defaultdict(list)  # source -> [(answers, correct) of one prompt], for maj@n / pass@k
        fn_means = defaultdict(list)  # weighted reward function -> [(its mean, samples) of one batch]
        with self.timers("validate"):
            for start in range(0, len(self.val_dataset), size):
                samples = [
                    self.val_dataset[i] for i in range(start, min(start + size, len(self.val_dataset)))
                ]
                gen = self.actor.generate_sequences(self.val_dataset.collate(samples), sampling=sampling)
                scores, score_metrics = self.score(gen)
                scores = scores.float()
                for name, mean in function_means(score_metrics, "reward/").items():
                    fn_means[name].append((mean, len(scores)))
                extras = self.rule_reward.last_extras if self.rule_reward is not None else []
                for i, s in enumerate(scores.view(-1, v.n)):  # rows come interleaved: prompt i's n samples
                    per_source[gen["data_source"][i * v.n]].append(s)
                    first[gen["data_source"][i * v.n]].append(_acc(extras[i * v.n] if extras else {}, s[0]))
                    if extras:
                        votes[gen["data_source"][i * v.n]].append(_votes(gen, s, extras, i * v.n, v.n))
                rows += self._generation_rows(
                    gen, scores, self.cfg.trainer.val_generations_to_log - len(rows), extras
                )
                if self.cfg.trainer.validation_data_dir:
                    dumped += generation_rows(gen, scores, extras)
        if dumped:
            write_generations(self.cfg.trainer.validation_data_dir, self.global_step, dumped)
        if self.tracker is not None and rows:
            self.tracker.log_generations(rows, self.global_step)
        out = {}
        for src, groups in per_source.items():
            s = np.stack([g.numpy() for g in groups])  # (prompts, n)
            if self.rule_reward is None:
                out[f"val/{src}/reward"] = float(s.mean())
                continue
            out[f"val/{src}/acc@1"] = float(np.mean(first[src]))
            if v.n > 1:
                out[f"val/{src}/mean@{v.n}"] = float(s.mean())
                out[f"val/{src}/best@{v.n}"] = float(s.max(1).mean())
                out.update(vote_metrics(f"val/{src}", votes[src], v.n))
        for name, parts in fn_means.items():  # each weighted function's own mean, as in training
            out[f"val/reward/{name}/mean"] = sum(m * n for m, n in parts) / sum(n for _, n in parts)
        out["val/reward/mean"] = float(np.mean([float(g.mean()) for gs in per_source.values() for g in gs]))
        return out

    @staticmethod
    def _generation_rows(batch: Batch, scores, limit: int, extras=()) -> list[dict]:
        """Rows of the generations table: text, score, and the reward function's extra keys."""
        keys = [k for k in ("prompt_text", "response_text", "ground_truth") if k in batch]
        return [
            {
                **{k: str(batch[k][i]) for k in keys},
                "score": float(scores[i]),
                **(extras[i] if extras else {}),
            }
            for i in range(max(0, min(limit, len(batch))))
        ]


def _acc(extra: dict, score) -> float:
    """A sample's accuracy: the reward fn's 'acc' when it returns a number or bool, else its score (a
    shaped score, e.g. 0.1 for the format, is not an accuracy when the function says what is)."""
    acc = extra.get("acc")
    return float(acc) if isinstance(acc, (bool, int, float)) else float(score)


def _votes(batch: Batch, scores, extras: list[dict], first: int, n: int) -> tuple[list, list[bool]]:
    """One prompt's (answers, correct) over its n samples: the answer is the reward fn's 'pred' when it
    returns one, else the stripped response; correct is its 'acc' when returned, else full marks."""
    answers = [
        extras[first + j].get("pred", str(batch["response_text"][first + j]).strip()) for j in range(n)
    ]
    correct = [bool(extras[first + j].get("acc", float(scores[j]) >= 1.0)) for j in range(n)]
    return answers, correct
