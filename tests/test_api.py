"""hybridflow.Run's construction: datasets mapped to verl rows with their columns kept, reward callables
checked against their convention and the dataset's columns, args checked -- all before Ray starts; then
runs after runs in one process, as a user's script or notebook makes them (the README's example trains in
tests/test_readme_api.py)."""

from __future__ import annotations

import json
import os

import pytest

from hybridflow import Run
from hybridflow.checkpoint import CheckpointError
from hybridflow.config.schema import reward_fn_name
from hybridflow.errors import ConfigError, DatasetError, RewardSpecError

ROWS = [{"question": f"{a}+1=", "answer": str(a + 1), "level": a % 3} for a in range(6)]


def exact(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)


def needs_hint(prompts, completions, hint):
    return [0.0] * len(completions)


def make(tmp_path, model=None, **kwargs):
    args = {
        "rollout.n": 2,
        "trainer.output_dir": str(tmp_path),
        "trainer.experiment_name": "api",
        **kwargs.pop("args", {}),
    }
    args = {k: v for k, v in args.items() if v is not None}  # None: the key left to its default
    return Run("grpo", model=kwargs.pop("model", model), args=args, **kwargs)


def test_rows_columns_and_rewards_become_the_config(tmp_path, tiny_model_dir):
    run = make(tmp_path, tiny_model_dir, reward_funcs=[exact, verl_style, "format"], reward_weights=[1, 0.5, 0.1],
               train_dataset=ROWS, prompt_column="question")  # fmt: skip
    cfg = run.config
    fns = [(reward_fn_name(e), e.weight) for e in cfg.reward.fns]
    assert fns == [("exact", 1.0), ("verl_style", 0.5), ("format", 0.1)]
    # recorded by value in the run directory, so config.yaml names it for `hybridflow eval` and resumes
    assert cfg.reward.fns[0].fn == f"{tmp_path / 'api' / 'rewards' / 'exact.reward.pkl'}:exact"
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


def test_a_callable_is_found_from_the_config_alone(tmp_path, tiny_model_dir):
    """A reward callable defined in a function (nothing to import it by) reaches a process where no Run
    registered it, as `hybridflow eval RUN_DIR` and a resumed `hybridflow train` start: through the copy
    that run.config names."""
    import subprocess
    import sys

    answer = "42"

    def right(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() in (ground_truth, answer))

    run = make(tmp_path, tiny_model_dir, reward_funcs=[right], train_dataset=ROWS, prompt_column="question")
    code = (
        "import sys; from hybridflow.rewards import RewardConfig, RewardExecutor\n"
        "with RewardExecutor(RewardConfig(fn=sys.argv[1], num_workers=1)) as ex:\n"
        "    print(ex.score('src', ['42', '3', 'no'], ['1', '3', '3']).scores.tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code, run.config.reward.fns[0].fn], capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    assert out.strip() == "[1.0, 1.0, 0.0]"


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


# ---- runs after runs ---------------------------------------------------------------------------------
TRAIN = {"data.train_batch_size": 2, "actor.ppo_mini_batch_size": 2, "data.max_prompt_length": 16,
         "rollout.response_length": 2, "reward.num_workers": 0, "trainer.total_steps": 1,
         "trainer.val_before_train": False, "trainer.loggers": ["jsonl"], "resources.device": "cpu"}  # fmt: skip


def trained(tmp_path, model, rows=ROWS[:4], weight=1.0, **args) -> Run:
    run = make(tmp_path, model, reward_funcs=[exact], reward_weights=[weight], train_dataset=rows,
               prompt_column="question", args={**TRAIN, **args})  # fmt: skip
    run.history = run.train()
    return run


def test_a_second_run_in_the_same_process_starts_fresh(ray_cluster, tmp_path, tiny_model_dir):
    """TRL's trainers start a new run each time: so does a second Run with the same arguments, in a
    directory of its own (named by algorithm and time), not raising RunFinished on the first."""
    first = trained(tmp_path, tiny_model_dir, **{"trainer.experiment_name": None})
    second = trained(tmp_path, tiny_model_dir, **{"trainer.experiment_name": None})
    assert first.run_dir != second.run_dir and os.path.basename(first.run_dir).startswith("grpo-")
    assert [h["step"] for h in second.history if h["step"]] == [1]
    for run in (first, second):
        assert sorted(os.listdir(os.path.join(run.run_dir, "checkpoints"))) == ["latest", "step_1"]


def another_runs_checkpoint(run_dir, dataset_len: int) -> None:
    """A checkpoint at step 1 as another config's run leaves it (its parts, state and manifest)."""
    from hybridflow.checkpoint import CheckpointManager, save_trainer_state

    with CheckpointManager(run_dir, config={"another": "config"}).writing(
        1, meta={"algorithm": "grpo"}
    ) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "weights.bin").write_bytes(b"w")
        save_trainer_state(
            tmp, {"global_step": 1, "algorithm": "grpo", "loader": {"dataset_len": dataset_len}}
        )


def test_a_named_run_leaves_another_run_alone(ray_cluster, tmp_path, tiny_model_dir, capfd):
    """trainer.experiment_name naming a directory that holds another run: resume=auto leaves it alone
    and starts <name>-2, in one line; a checkpoint named explicitly that cannot be resumed is one line
    naming the difference and the setting that starts a new run."""
    another_runs_checkpoint(tmp_path / "api", dataset_len=6)
    run = trained(tmp_path, tiny_model_dir, **{"trainer.total_steps": 2})
    assert run.run_dir == str(tmp_path / "api-2") and [h["step"] for h in run.history if h["step"]] == [1, 2]
    (line,) = [x for x in capfd.readouterr().err.splitlines() if "holds" in x]
    assert line == f"hybridflow train: {tmp_path / 'api'} holds another run (step_1 was written with a training " \
        f"set of 6 prompts, this run has 4 (data.train_files)); this run starts in {tmp_path / 'api-2'}", line  # fmt: skip
    assert (tmp_path / "api-2" / "report.png").is_file() and not (tmp_path / "api" / "metrics.jsonl").exists()
    with pytest.raises(CheckpointError) as e:  # forced onto a checkpoint of another training set
        trained(tmp_path, tiny_model_dir, **{"trainer.resume": "1"})
    assert "written with a training set of 6 prompts, this run has 4" in str(e.value)
    assert "trainer.resume=never" in str(e.value) and "\n" not in str(e.value)


# ---- TRL's reward idioms and arguments ---------------------------------------------------------------
CHAT = [
    {"prompt": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1), "kind": ("even", "odd")[a % 2]}
    for a in range(4)
]


def exact_chat(prompts, completions, answer, kind, **kwargs):
    """TRL's idioms: message lists in a conversational dataset, None where the function does not apply."""
    return [
        float(c[0]["content"].strip() == a) if k == "even" and p[-1]["role"] == "user" else None
        for p, c, a, k in zip(prompts, completions, answer, kind)
    ]


def step_and_length(completions, completion_ids, trainer_state, kind, **kwargs):
    """TRL's other keyword arguments: the response's token ids and the trainer's step, as a number."""
    state = 10 * trainer_state.global_step + trainer_state.max_steps
    return [state + len(ids) / 100 if k == "even" else None for ids, k in zip(completion_ids, kind)]


def test_none_scores_and_a_conversational_dataset_as_trl_gives_them(ray_cluster, tmp_path, tiny_model_dir):
    """Each function is summed over the samples it scored (None: not applicable); the odd rows, which
    no function scores, are counted and scored 0; completions of chat prompts are message lists."""
    run = make(tmp_path, tiny_model_dir, reward_funcs=[exact_chat, step_and_length], train_dataset=CHAT,
               args={**TRAIN, "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 4})  # fmt: skip
    (row,) = [h for h in run.train() if h["step"] == 1]
    assert row["reward/num_errors"] == 0 and row["reward/unscored_fraction"] == 0.5  # 2 of the 4 prompts
    assert 11 <= row["reward/step_and_length/mean"] <= 11.02 + 1e-5  # step 1 of 1, at most 2 tokens (float32)
    assert 0 <= row["reward/exact_chat/mean"] <= 1
    # the mean over 8 samples of the even ones' weighted sum, the odd ones' 0
    weighted = (row["reward/exact_chat/mean"] + row["reward/step_and_length/mean"]) / 2
    assert row["reward/mean"] == pytest.approx(weighted, rel=1e-5)


def test_trl_arguments_a_loaded_model_peft_config_and_tokenizer(tmp_path, tiny_model_dir):
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["v_proj", "q_proj"])
    run = make(tmp_path, model, reward_funcs=exact, train_dataset=ROWS, prompt_column="question",
               peft_config=lora, processing_class=tokenizer)  # fmt: skip
    m = run.config.model
    assert (m.lora.rank, m.lora.alpha, m.lora.dropout, m.lora.target_modules) == (
        4,
        8.0,
        0.05,
        ["q_proj", "v_proj"],
    )
    assert m.path == str(tmp_path / "api" / "model") and os.path.isfile(os.path.join(m.path, "config.json"))
    assert m.tokenizer_path == str(tmp_path / "api" / "tokenizer")
    assert (
        transformers.AutoTokenizer.from_pretrained(m.tokenizer_path)("1+1=").input_ids
        == tokenizer("1+1=").input_ids
    )
    for kwargs, match in [
        ({"model": torch.nn.Linear(2, 2)}, "model: expected a directory, a Hub id or a loaded transformers model, got Linear"),
        ({"peft_config": peft.LoraConfig(r=4, use_dora=True)}, "peft_config: use_dora=True has no model.lora equivalent"),
        ({"processing_class": object()}, "processing_class: expected a loaded transformers tokenizer or a path"),
    ]:  # fmt: skip
        kwargs = {"model": tiny_model_dir, "reward_funcs": exact, "train_dataset": ROWS, **kwargs}
        with pytest.raises(ConfigError) as e:
            make(tmp_path, prompt_column="question", **kwargs)
        (line,) = e.value.errors
        assert match in line and len(line) < 200, line


def test_ctrl_c_in_train_checkpoints_and_returns(ray_cluster, tmp_path, tiny_model_dir, capfd):
    """SIGINT during Run.train, as `hybridflow train` takes it: the step in flight and a checkpoint are
    finished, one line says so, train returns the rows so far; the same Run again resumes there."""
    import signal
    import threading
    import time

    scored = tmp_path / "scored"

    def exact_noting(completions, answer, **kwargs):  # reaches the reward worker by value
        scored.touch()
        return exact(completions, answer)

    def interrupt_once_a_step_runs():
        while not scored.exists():  # step 1 is in flight once its rewards are scored
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_a_step_runs, daemon=True).start()

    def the_run():
        return make(tmp_path, tiny_model_dir, reward_funcs=[exact_noting], train_dataset=ROWS[:4],
                    prompt_column="question", args={**TRAIN, "trainer.total_steps": 4})  # fmt: skip

    run = the_run()
    run.history = run.train()
    steps = [h["step"] for h in run.history if h["step"]]
    assert steps and steps == list(range(1, len(steps) + 1)) and len(steps) < 4
    checkpoints = os.listdir(os.path.join(run.run_dir, "checkpoints"))
    assert f"step_{steps[-1]}" in checkpoints
    (line,) = [x for x in capfd.readouterr().err.splitlines() if "stopped by SIGINT" in x]
    assert line.startswith(f"hybridflow: stopped by SIGINT after step {steps[-1]}; checkpoint "), line
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back
    again = the_run()  # the same Run again: resumed from that checkpoint
    assert again.run_dir == run.run_dir
    assert [h["step"] for h in again.train() if h["step"]] == list(range(steps[-1] + 1, 5))


# ---- offline algorithms ------------------------------------------------------------------------------
SFT_ROWS = [{"question": f"{a}+1=", "response": str(a + 1)} for a in range(4)]
DPO_ROWS = [{"prompt": [{"role": "user", "content": f"{a}+1="}], "chosen": str(a + 1), "rejected": str(a)}
            for a in range(4)]  # fmt: skip
OFFLINE = {k: v for k, v in TRAIN.items() if not k.startswith(("rollout.", "reward."))}


@pytest.mark.parametrize("algorithm, rows", [("sft", SFT_ROWS), ("dpo", DPO_ROWS)])
def test_sft_and_dpo_train_on_a_list_of_dicts_and_a_dataset(
    ray_cluster, tmp_path, tiny_model_dir, algorithm, rows
):
    """The rows `hybridflow train` reads from a file, given as a list (or a datasets.Dataset): the target
    columns stay beside the prompt, every other column rides along in extra_info."""
    import datasets

    args = {**OFFLINE, "trainer.output_dir": str(tmp_path), "trainer.experiment_name": algorithm}
    run = Run(
        algorithm, model=tiny_model_dir, train_dataset=rows, prompt_column=next(iter(rows[0])), args=args
    )
    written = json.loads(open(run.config.data.train_files[0]).readline())
    targets = ["response"] if algorithm == "sft" else ["chosen", "rejected"]
    assert {k: written[k] for k in targets} == {k: rows[0][k] for k in targets}
    assert not set(targets) & set(written["extra_info"])
    (row,) = [h for h in run.train() if h["step"] == 1]
    assert 0 < row[f"{algorithm}/loss"] < 1e3  # finite: the pairs reached the actor
    again = Run(algorithm, model=tiny_model_dir, train_dataset=datasets.Dataset.from_list(rows),
                prompt_column=next(iter(rows[0])), args=args)  # fmt: skip
    assert again.config.data.train_files == run.config.data.train_files  # the same rows, the same file
