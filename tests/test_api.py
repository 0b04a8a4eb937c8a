"""hybridflow.Run's construction: datasets mapped to verl rows with their columns kept, reward callables
checked against their convention and the dataset's columns, args checked -- all before Ray starts (no
training here: tests/test_readme_api.py trains through the README's example)."""

from __future__ import annotations

import json

import pytest

from hybridflow import Run
from hybridflow.config.schema import reward_fn_name
from hybridflow.errors import ConfigError, DatasetError, RewardSpecError

ROWS = [{"question": f"{a}+1=", "answer": str(a + 1), "level": a % 3} for a in range(6)]


def exact(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)


def needs_hint(prompts, completions, hint):
    return [0.0] * len(completions)


def make(tmp_path, model, **kwargs):
    args = {
        "rollout.n": 2,
        "trainer.output_dir": str(tmp_path),
        "trainer.experiment_name": "api",
        **kwargs.pop("args", {}),
    }
    return Run("grpo", model=model, args=args, **kwargs)


def test_rows_columns_and_rewards_become_the_config(tmp_path, tiny_model_dir):
    run = make(tmp_path, tiny_model_dir, reward_funcs=[exact, verl_style, "format"], reward_weights=[1, 0.5, 0.1],
               train_dataset=ROWS, prompt_column="question")  # fmt: skip
    cfg = run.config
    fns = [(reward_fn_name(e), e.weight) for e in cfg.reward.fns]
    assert fns == [("exact", 1.0), ("verl_style", 0.5), ("format", 0.1)]
    assert cfg.reward.fns[0].fn.startswith(f"{__name__}.exact")
    (path,) = cfg.data.train_files
    rows = [json.loads(line) for line in open(path)]
    assert rows[2] == {
        "prompt": "2+1=",
        "data_source": "dataset",
        "reward_model": {"ground_truth": "3"},
        "extra_info": {"answer": "3", "level": 2},
    }
    assert cfg.data.missing_ground_truth == "error"  # the rows have one: a row without it stays an error
    # the same rows again: the same file (named by content), not a second copy
    again = make(tmp_path, tiny_model_dir, reward_funcs=exact, train_dataset=ROWS, prompt_column="question")
    assert again.config.data.train_files == [path]


def test_a_file_and_rows_without_ground_truth(tmp_path, tiny_model_dir):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}?"}]}) + "\n" for i in range(4))
    )
    run = make(tmp_path, tiny_model_dir, reward_funcs=lambda completions, **kw: [1.0] * len(completions),
               train_dataset=str(path))  # fmt: skip
    assert (
        run.config.data.missing_ground_truth == "ignore"
    )  # nothing to compare against: rewards needing none
    assert run.config.reward.fns[0].name == "reward_0"  # a lambda's metrics name


def test_datasets_dataset(tmp_path, tiny_model_dir):
    import datasets  # the dev extra's

    ds = datasets.Dataset.from_list(ROWS)
    run = make(tmp_path, tiny_model_dir, reward_funcs=exact, train_dataset=ds, prompt_column="question")
    assert len(open(run.config.data.train_files[0]).readlines()) == len(ROWS)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"reward_funcs": [needs_hint]},
            RewardSpecError,
            r"requires column\(s\) \['hint'\] that the dataset lacks",
        ),
        ({"reward_funcs": [lambda text: 1.0]}, RewardSpecError, "neither TRL's convention"),
        (
            {"reward_funcs": [exact, exact], "reward_weights": [1.0]},
            ConfigError,
            "1 weights for 2 reward_funcs",
        ),
        (
            {"reward_funcs": [exact], "args": {"learning_rate": 1e-6}},
            ConfigError,
            "did you mean 'actor.optim.lr'",
        ),
        (
            {"reward_funcs": [exact], "args": {"reward.fns": [{"fn": "gsm8k"}]}},
            ConfigError,
            "reward_funcs and args",
        ),
        ({"prompt_column": "prompt"}, DatasetError, "row 1 has no 'prompt' column"),
        ({"train_dataset": 42}, DatasetError, "expected a datasets.Dataset, a list of dicts or a file path"),
    ],
)
def test_mistakes_are_one_line_at_construction(tmp_path, tiny_model_dir, kwargs, error, match):
    kwargs = {"train_dataset": ROWS, "prompt_column": "question", **kwargs}
    with pytest.raises(error, match=match) as e:
        make(tmp_path, tiny_model_dir, **kwargs)
    problems = getattr(e.value, "errors", None) or [str(e.value)]  # a ConfigError lists its problems
    assert len(problems) == 1 and "\n" not in problems[0]
