"""Every mistake in the user's files through the real `hybridflow train`: exit 2, one line naming the file
(and row), no traceback, and nothing started: each fails while the config, data, tokenizer and reward
code are checked, before Ray or any worker (README, "Using it")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.cli import main as cli_main


def _row(q: str, gt: str | None = "2") -> dict:
    row = {"data_source": "synthetic:arithmetic", "prompt": [{"role": "user", "content": q}]}
    if gt is not None:
        row["reward_model"] = {"ground_truth": gt}
    return row


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("user_errors")
    (root / "good.jsonl").write_text("".join(json.dumps(_row(f"{i}+1=")) + "\n" for i in range(8)))
    config = root / "grpo.yaml"
    config.write_text(
        "algorithm: {name: grpo}\n"
        f"model: {{path: {tiny_model_dir}}}\n"
        f"data: {{train_files: ['{root / 'good.jsonl'}'], max_prompt_length: 16, train_batch_size: 4}}\n"
        "actor: {ppo_mini_batch_size: 4}\n"
        "rollout: {n: 2, response_length: 4}\n"
        "reward: {num_workers: 0, startup_timeout_s: 3}\n"
        "resources: {device: cpu, n_gpus_per_node: 1}\n"
        f"trainer: {{output_dir: '{root / 'runs'}', total_steps: 1, loggers: [jsonl]}}\n"
    )
    return root, config


def _write(root: Path, name: str, text: str | bytes) -> Path:
    path = root / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _model_copy(src: str, root: Path, name: str) -> Path:
    dst = root / name
    if not dst.exists():
        shutil.copytree(src, dst)
    return dst


def _cases(root: Path, model: str) -> list[tuple[str, list[str], str]]:
    """(name, overrides, expected text of the one line)."""
    bad_row = _write(root, "bad_row.jsonl", json.dumps(_row("1+1=")) + "\n{not json\n")
    latin1 = _write(
        root, "latin1.jsonl", json.dumps(_row("1+1=")).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n'
    )
    no_gt = _write(root, "no_gt.jsonl", "".join(json.dumps(_row(f"{i}+1=", None)) + "\n" for i in range(8)))
    parquet = _write(root, "broken.parquet", b"PAR1 this is not parquet")
    unscored = [
        {**_row(f"{i}+1="), "data_source": "synthetic:arithmetc" if i == 5 else "arithmetic"}
        for i in range(8)
    ]
    typo = _write(root, "typo.jsonl", "".join(json.dumps(r) + "\n" for r in unscored))
    (root / "dir.jsonl").mkdir(exist_ok=True)
    if not (root / "fifo.jsonl").exists():
        os.mkfifo(root / "fifo.jsonl")
    exits = _write(root, "exits.py", "import sys\nsys.exit(5)\n")
    hangs = _write(root, "hangs.py", "import time\ntime.sleep(600)\n")
    raises = _write(root, "raises.py", "x = 1\ny = x / 0\n")
    corrupt = _model_copy(model, root, "corrupt_model")
    (corrupt / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    no_template = _model_copy(model, root, "no_template")
    broken = {}  # a model directory per damaged file, everything else intact
    for name, damage in [
        ("tokenizer.json", lambda b: b[: len(b) // 2]),  # truncated mid-file
        ("tokenizer_config.json", lambda b: b'{"bos_token": <bos>}'),
        ("model.safetensors", lambda b: b[:8] + b"{garbage" + b[16:]),  # the header's JSON
        ("model.safetensors ", lambda b: b[: len(b) // 2]),  # truncated: the header outruns the file
        ("tokenizer.json ", lambda b: b'{"version": "1.0"}'),  # valid JSON, not a tokenizer
    ]:
        d = broken[name] = _model_copy(model, root, f"broken_{len(broken)}")
        f = d / name.strip()
        f.write_bytes(damage(f.read_bytes()))
    no_heads = _model_copy(model, root, "no_heads")  # used to fail in the tokenizer's checks, blamed on it
    cfg = json.loads((no_heads / "config.json").read_text())
    (no_heads / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    weights_only = _model_copy(model, root, "weights_only")  # model.save_pretrained without the tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (weights_only / name).unlink(missing_ok=True)
    return [
        ("missing data file", [f"data.train_files=[{root}/nope.jsonl]"], "nope.jsonl' does not exist"),
        ("directory as data file", [f"data.train_files=[{root}/dir.jsonl]"], "is a directory"),
        # reading one used to block until a writer came
        ("FIFO as data file", [f"data.train_files=[{root}/fifo.jsonl]"], "fifo.jsonl' is not a regular file"),
        ("corrupt parquet", [f"data.train_files=[{parquet}]"], "broken.parquet: not a readable Parquet file"),
        ("malformed row", [f"data.train_files=[{bad_row}]"], "bad_row.jsonl, row 2: not valid JSON"),
        ("non-UTF-8 row", [f"data.train_files=[{latin1}]"], "latin1.jsonl, row 2: not UTF-8 text (byte 0xe9"),
        # skipped as asked: the run then fails on the next problem, a batch larger than what is left
        (
            "non-UTF-8 skipped",
            [f"data.train_files=[{latin1}]", "data.on_malformed=skip"],
            "fewer than one batch",
        ),
        ("missing ground truth", [f"data.train_files=[{no_gt}]"], "no_gt.jsonl, row 1: no ground truth"),
        # used to fail in step 1's reward, after Ray and the workers started
        (
            "data_source without a reward",
            [f"data.train_files=[{typo}]"],
            f"{typo}, prompt 6: no reward function registered for data_source 'synthetic:arithmetc' (did you mean",
        ),
        (
            "unknown dataset",
            ["data.train_files=[]", "data.dataset=synthetic:arithmetc"],
            "did you mean 'synthetic:arithmetic'",
        ),
        (
            "unknown dataset kwarg",
            [
                "data.train_files=[]",
                "data.dataset=synthetic:arithmetic",
                "data.dataset_kwargs={num_sample: 8}",
            ],
            "takes no argument 'num_sample' (did you mean 'num_samples'?)",
        ),
        ("reward spec not python", ["reward.fn=/etc/passwd:fn"], "/etc/passwd is not a Python file"),
        ("reward missing file", [f"reward.fn={root}/none.py:fn"], "none.py does not exist"),
        # startup_timeout_s: 3 (the YAML) is for the hang case; a loaded machine may take longer to start a worker
        (
            "reward exits at import",
            [f"reward.fn={exits}:fn", "reward.startup_timeout_s=60"],
            "importing it called sys.exit(5) (exits.py:2)",
        ),
        (
            "reward raises at import",
            [f"reward.fn={raises}:fn", "reward.startup_timeout_s=60"],
            "ZeroDivisionError: division by zero (raises.py:2)",
        ),
        ("reward hangs at import", [f"reward.fn={hangs}:fn"], "did not finish importing it within 3s"),
        (
            "corrupt config.json",
            [f"model.path={corrupt}"],
            f"{corrupt}/config.json is not a readable JSON file",
        ),
        ("no chat template", [f"model.path={no_template}"], "has no chat template"),
        (
            "no attention heads",
            [f"model.path={no_heads}"],
            f"model.path: {no_heads}/config.json has num_attention_heads=0; each must be an integer >= 1",
        ),
        (
            "no tokenizer files",
            [f"model.path={weights_only}"],
            f"{weights_only} has no tokenizer files",
        ),
        *[
            (f"broken {name}", [f"model.path={d}"], f"model.path: {d}/{name.strip()} {expected}")
            for (name, d), expected in zip(
                list(broken.items())[:4],
                [
                    "is not a readable JSON file (Expecting",
                    "is not a readable JSON file (Expecting value",
                    "has an unreadable safetensors header (Expecting property name",
                    f"is truncated: its header needs {(Path(model) / 'model.safetensors').stat().st_size} bytes",
                ],
            )
        ],
        (
            "tokenizer.json not a tokenizer",
            [f"model.path={broken['tokenizer.json ']}"],
            f"{broken['tokenizer.json ']}: its tokenizer files do not load (",
        ),
        (
            "prompt too long",
            ["data.max_prompt_length=4"],
            "good.jsonl, row 1: prompt: 6 tokens exceed the limit of 4",
        ),
        (
            "batch larger than data",
            ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16"],
            "fewer than one batch of 16",
        ),
        ("missing model dir", [f"model.path={root}/no_model"], "model.path:"),
        (
            "error fraction",
            ["reward.max_error_fraction=2"],
            "reward.max_error_fraction: must be in [0, 1], got 2.0",
        ),
        ("skipped steps", ["trainer.max_skipped_steps=0"], "trainer.max_skipped_steps: must be >= 1, got 0"),
    ]


def test_each_bad_user_file_is_one_line_exit_2_before_anything_starts(setup, tiny_model_dir, capsys):
    import ray

    root, config = setup
    ray_was_up = ray.is_initialized()  # a session cluster of an earlier test; then the check below is moot
    for name, overrides, expected in _cases(root, tiny_model_dir):
        rc = cli_main(["train", str(config), *overrides])
        err = capsys.readouterr().err
        ours = [line for line in err.splitlines() if line.startswith("hybridflow train:")]
        assert rc == 2, (name, err[-2000:])
        assert len(ours) == 1 and expected in ours[0], (name, ours)
        assert "Traceback" not in err, name
        assert ray_was_up or not ray.is_initialized(), f"{name}: Ray was started"


def test_config_show_checks_the_data_files(setup, capsys):
    _, config = setup
    assert cli_main(["config", "show", str(config), "data.val_files=[/no/such/val.parquet]"]) == 2
    assert "data.val_files[0]: '/no/such/val.parquet' does not exist" in capsys.readouterr().err


def test_console_script_prints_one_line_for_a_bad_reward_spec(setup):
    """The installed entry point (a fresh interpreter, as a user runs it), not only main()."""
    _, config = setup
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run(
        [sys.executable, "-m", "hybridflow.cli", "train", str(config), "reward.fn=/etc/passwd:fn"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "hybridflow train: reward.fn='/etc/passwd:fn': /etc/passwd is not a Python file (.py)"
    )


def _bad_values(root: Path) -> list[tuple[str, list[str], str]]:
    """(name, overrides, expected text of the one line): settings that used to train, or fail after Ray
    started with a traceback."""
    (root / "a_file").write_text("x")
    tp4 = ["resources.n_gpus_per_node=4", "actor.parallel.tp=4"]
    return [
        ("lr nan", ["actor.optim.lr=nan"], "actor.optim.lr: must be a finite number >= 0, got nan"),
        ("lr inf", ["actor.optim.lr=inf"], "actor.optim.lr: must be a finite number >= 0, got inf"),
        ("temperature nan", ["rollout.temperature=nan"], "rollout.temperature: must be a finite number >= 0"),
        ("save minutes nan", ["trainer.save_every_minutes=nan"], "trainer.save_every_minutes: must be in [0, 16666666], got nan"),
        ("reward timeout 0", ["reward.timeout_s=0"], "reward.timeout_s: must be in (0, 1000000000], got 0"),
        ("eps -1", ["actor.optim.eps=-1"], "actor.optim.eps: must be a finite number > 0, got -1.0"),
        ("top_k -7", ["rollout.top_k=-7"], "rollout.top_k: must be >= -1, got -7"),
        ("output dir a file", [f"trainer.output_dir={root / 'a_file'}"],
         f"trainer.output_dir: cannot create the run directory {root / 'a_file'}/default (Not a directory"),
        ("output dir unwritable", ["trainer.output_dir=/proc/self/runs"],  # root may write anywhere else
         "trainer.output_dir: cannot create the run directory /proc/self/runs/default ("),
        ("tp over kv heads", tp4, "actor.parallel.tp=4 does not divide the model's 2 key/value heads"),
        ("cuda without one", ["resources.device=cuda"], "resources.device: cuda, but torch finds no CUDA device"),
        ("devices beyond the machine", ["resources.n_gpus_per_node=60000"],  # used to wait in Ray's reservation
         "resources.n_gpus_per_node=60000 x nnodes=1 asks for 60000 CPU worker processes"),
    ]  # fmt: skip


def test_bad_values_are_one_line_exit_2_before_ray_starts(setup, capsys):
    import ray

    root, config = setup
    ray_was_up = ray.is_initialized()
    for name, overrides, expected in _bad_values(root):
        rc = cli_main(["train", str(config), *overrides])
        err = capsys.readouterr().err
        ours = [line for line in err.splitlines() if line.startswith("hybridflow train:")]
        assert rc == 2, (name, err[-2000:])
        assert len(ours) == 1 and expected in ours[0], (name, ours)
        assert "Traceback" not in err and "Exception ignored" not in err, (name, err[-2000:])
        assert ray_was_up or not ray.is_initialized(), f"{name}: Ray was started"


def test_resuming_another_algorithm_is_one_line_before_ray_starts(setup, capsys):
    """A checkpoint written by PPO resumed by name by a GRPO run (same directory): refused before any
    worker (trainer.resume=auto would leave it alone and start from_ppo-2)."""
    import ray

    from hybridflow.checkpoint import CheckpointManager, save_trainer_state

    root, config = setup
    manager = CheckpointManager(root / "runs" / "from_ppo")
    with manager.writing(1, meta={"algorithm": "ppo"}) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "weights.bin").write_bytes(b"w")
        save_trainer_state(tmp, {"global_step": 1, "algorithm": "ppo"})
    ray_was_up = ray.is_initialized()
    overrides = ["trainer.experiment_name=from_ppo", "trainer.total_steps=2", "trainer.resume=1"]
    assert cli_main(["train", str(config), *overrides]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("hybridflow train:")]
    assert f"{manager.step_dir(1)} was written by algorithm.name=ppo, this run is grpo" in line, line
    assert "Traceback" not in err and (ray_was_up or not ray.is_initialized())


def test_resuming_a_checkpoint_by_name_with_another_lr_says_which_lr_applies(setup, capsys):
    """actor.optim.lr changed, the checkpoint resumed by name: one warning line, before Ray, naming the
    changed key and saying the saved optimizer settings apply (as verl's resume does), not only a hash."""
    import ray

    from hybridflow.checkpoint import CheckpointManager, atomic_write_text, save_trainer_state
    from hybridflow.config import load_config
    from hybridflow.config.cli import to_yaml
    from hybridflow.trainers.run_dir import hashed_config

    root, config = setup
    before = load_config(str(config), ["trainer.experiment_name=new_lr", "actor.optim.lr=1e-3"])
    Path(before.run_dir).mkdir(parents=True)
    atomic_write_text(Path(before.run_dir) / "config.yaml", to_yaml(before) + "\n")
    manager = CheckpointManager(before.run_dir, config=hashed_config(before))
    with manager.writing(1, meta={"algorithm": "grpo"}) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "weights.bin").write_bytes(b"w")
        save_trainer_state(tmp, {"global_step": 1, "algorithm": "grpo"})
    ray_was_up = ray.is_initialized()
    overrides = ["trainer.experiment_name=new_lr", "actor.optim.lr=5e-3", "trainer.resume=1"]
    assert cli_main(["train", str(config), *overrides]) == 0  # step 1 of total_steps 1: finished, no Ray
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("hybridflow train: warning: step_1:")]
    assert "its config differs: actor.optim.lr; optimizers resume as saved (their lr," in line, line
    assert "Traceback" not in err and (ray_was_up or not ray.is_initialized())


def test_resuming_a_grpo_checkpoint_as_ppo_names_the_algorithm_not_a_missing_part(setup, capsys):
    """PPO needs a critic part the GRPO checkpoint never had: the line says the algorithm differs."""
    from hybridflow.checkpoint import CheckpointManager, save_trainer_state

    root, config = setup
    manager = CheckpointManager(root / "runs" / "from_grpo")
    with manager.writing(1, meta={"algorithm": "grpo"}) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "weights.bin").write_bytes(b"w")
        save_trainer_state(tmp, {"global_step": 1, "algorithm": "grpo"})
    overrides = [
        "algorithm.name=ppo",
        "trainer.experiment_name=from_grpo",
        "trainer.total_steps=2",
        "trainer.resume=1",
    ]
    assert cli_main(["train", str(config), *overrides]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("hybridflow train:")]
    assert f"{manager.step_dir(1)} was written by algorithm.name=grpo, this run is ppo" in line, line
