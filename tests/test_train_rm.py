"""train_rm.py: the Bradley-Terry loss by hand, preference rows (bad ones counted, bad files in one line), and the
script on the tiny model: it learns a learnable preference, its checkpoint is a reward model grpo.py reads and that
scores as in training, --resume continues exactly, two torchrun ranks take the steps of one process."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from data import load_pairs, split_pairs
from fsdp import compute_dtype
from common import InputError
from train_rm import pairwise_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 16 pairs a step in micro-batches of 8: under torchrun each rank's 8 are one of the plain run's micro-batches.
# Warm-up 4: steps 1-4 have the same learning rates in a run of 3 steps as in one of 20 (fsdp.lr_lambda).
COMMON = [
    "--pairs-per-step",
    "16",
    "--micro-batch-size",
    "8",
    "--lr",
    "2e-3",
    "--warmup-steps",
    "4",
    "--max-len",
    "64",
    "--run-name",
    "r",
]


def run_rm(model, out_dir, *extra, nproc=1, expect_ok=True):
    launcher = [sys.executable] + ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] * (
        nproc > 1
    )
    cmd = [*launcher, "train_rm.py", "--model", model, "--output-dir", str(out_dir), *COMMON, *map(str, extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def rows(run_dir):
    """(train rows, eval rows) of a run's metrics.jsonl."""
    out = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return [r for r in out if "train/loss" in r], [r for r in out if "eval/pair_acc" in r]


def write_pairs(path, prompts: int = 60, bad: bool = True) -> str:
    """Per prompt 'What is a + b?' (asked as text, and as chat messages), two pairs: '#### <sum>' over "I don't know."
    (group "format": learnable at once) and over '#### <sum + 1>' (group "number": the sides differ only in the number,
    beyond a tiny model). With `bad`: 2 rows with an empty side and 3 with identical sides, to be skipped."""
    rng, out = random.Random(0), []
    for _ in range(prompts):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        q = f"What is {a} + {b}?"
        out.append({"prompt": q, "chosen": f"#### {a + b}", "rejected": "I don't know.", "group": "format"})
        out.append(
            {
                "prompt": [{"role": "user", "content": q}],
                "chosen": f"#### {a + b}",
                "rejected": f"#### {a + b + 1}",
                "group": "number",
            }
        )
    out += [
        {"prompt": "Hi", "chosen": "", "rejected": "Hello"},
        {"prompt": "Hi", "chosen": "Hello", "rejected": "  "},
    ] * bad
    out += [{"prompt": "Hi", "chosen": "Hello", "rejected": "Hello "}] * 3 * bad
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in out)
    return str(path)


def test_pairwise_loss_by_hand():
    """chosen [3, 0, 1], rejected [1, 1, 1]: margins [2, -1, 0]. -log sigmoid(m) = log(1 + e^-m): 0.126928, 1.313262,
    0.693147 (sum 2.133337); over num_pairs 6 (the step's pairs on all ranks): 0.355556. Correct: 1 + 0 + 0.5 (a tie
    counts half) = 1.5; margin sum 1. d loss / d chosen_i = -sigmoid(-m_i) / 6: -0.119203 / 6, -0.731059 / 6,
    -0.5 / 6 = -0.019867, -0.121843, -0.083333; d / d rejected_i the opposite."""
    chosen = torch.tensor([3.0, 0.0, 1.0], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0, 1.0], requires_grad=True)
    loss, stats = pairwise_loss(chosen, rejected, num_pairs=6)
    assert loss.item() == pytest.approx(0.355556, abs=1e-6)
    assert stats["loss"].item() == pytest.approx(2.133337, abs=1e-6)
    assert stats["correct"].item() == 1.5 and stats["margin"].item() == 1.0
    loss.backward()
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.019867, -0.121843, -0.083333]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rejected.grad, -chosen.grad)
    # a margin of 100 either way: finite (logsigmoid, not log(sigmoid)), ~0 and ~100
    big, _ = pairwise_loss(torch.tensor([100.0, -100.0]), torch.zeros(2), num_pairs=1)
    assert big.item() == pytest.approx(100.0, rel=1e-6)


def test_pairs_bad_rows_counted_bad_files_named_split_by_prompt(tmp_path):
    pairs, skipped = load_pairs(write_pairs(tmp_path / "p.jsonl"))
    assert len(pairs) == 120 and skipped == {"empty": 2, "identical": 3}
    train, held, note = split_pairs(pairs, seed=0, num_eval=512, where="p.jsonl")
    asked = lambda p: p.prompt if isinstance(p.prompt, str) else p.prompt[0]["content"]  # noqa: E731
    assert len(held) == 12 and len(train) == 108 and "held out 12 pairs (6 prompts) of p.jsonl" in note
    assert not {asked(p) for p in held} & {asked(p) for p in train}  # a prompt, as text or as messages, on one side
    assert split_pairs(pairs, seed=0, num_eval=512, where="p")[1] == held  # seeded
    with pytest.raises(InputError, match="too few to hold 1 in 10 out"):
        split_pairs(pairs[:8], seed=0, num_eval=512, where="p")
    for text, message in [
        ("", "has no rows"),
        ('{"prompt": "a", "chosen": "b"}\n', r"line 1: needs a 'prompt'.*'rejected'"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c", "group": 3}\n', r"line 1: .*optionally a 'group'"),
        ('{"prompt": "a", "chosen": "b", "rejected": "c", "group": 0}\n', r"line 1: .*optionally a 'group'"),
        ("{nope\n", "line 1: not valid JSON"),
        ('{"prompt": "a", "chosen": "b", "rejected": "b"}\n', "all 1 pairs were skipped"),
    ]:
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(InputError, match=message):
            load_pairs(str(tmp_path / "bad.jsonl"))
    with pytest.raises(InputError, match=f"--dataset '{tmp_path}': is a folder: pass a .jsonl or .parquet file"):
        load_pairs(str(tmp_path))
    with pytest.raises(InputError, match="--eval-dataset 'nope.jsonl': no such file"):
        load_pairs("nope.jsonl", "--eval-dataset")
    (tmp_path / "same.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "b"}\n')
    with pytest.raises(InputError, match="all 1 pairs were skipped .*: nothing to evaluate"):
        load_pairs(str(tmp_path / "same.jsonl"), "--eval-dataset")
    (tmp_path / "null.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "group": null}\n' * 2)
    assert load_pairs(str(tmp_path / "null.jsonl"))[0][0].group == ""  # null: no group
    (tmp_path / "latin.jsonl").write_bytes(
        '{"prompt": "caf\u00e9", "chosen": "a", "rejected": "b"}\n'.encode("latin-1")
    )
    with pytest.raises(InputError, match="line 1: not UTF-8"):
        load_pairs(str(tmp_path / "latin.jsonl"))


@pytest.fixture(scope="module")
def rm_run(trained_tiny_model_dir, tmp_path_factory):
    """20 steps, evaluated before training and every 10 steps, saved every 10 (all kept): (run folder, its console)."""
    out = tmp_path_factory.mktemp("rm")
    data = write_pairs(out / "pairs.jsonl")
    proc = run_rm(
        trained_tiny_model_dir,
        out,
        "--dataset",
        data,
        "--steps",
        20,
        "--eval-every",
        10,
        "--eval-before-train",
        "--save-every",
        10,
        "--keep-checkpoints",
        0,
    )
    return out / "r", proc.stdout


def test_train_rm_learns_a_learnable_preference(rm_run):
    run_dir, console = rm_run
    assert (
        "data: 108 train pairs, 12 eval pairs (held out 12 pairs (6 prompts) of " in console
        and "| skipped 2 with an empty side, 3 with identical sides | cut to --max-len 64: 0 of 240 conversations, 0 pairs "
        "the same after it, skipped"
        in console
    )
    train, evals = rows(run_dir)
    assert [r["step"] for r in train] == list(range(1, 21)) and [r["step"] for r in evals] == [0, 10, 20]
    assert evals[0]["eval/pair_acc"] == 0.5 and evals[0]["eval/loss"] == pytest.approx(0.693147, abs=1e-6)  # zero head
    first, last = train[0]["train/loss"], sum(r["train/loss"] for r in train[-5:]) / 5
    assert first == pytest.approx(0.693147, abs=1e-6) and last < 0.55, [r["train/loss"] for r in train]
    assert evals[-1]["eval/pair_acc/format"] == 1.0 and evals[-1]["eval/pair_acc"] > 0.6  # "number": a coin toss
    assert evals[-1]["eval/margin"] > 0.3 and evals[-1]["eval/loss"] < 0.6
    assert "eval after step 20 | acc " in console and "| format 1.000 | number " in console
    from test_smoke import assert_console

    assert_console(console, run_dir, "train_rm.py", "acc", steps=20)
    assert os.path.getsize(run_dir / "curves.png") > 10_000


def test_checkpoint_is_a_reward_model_that_scores_as_in_training(rm_run, gloo):
    """grpo.py --reward-model's own checks and loading, computing as train_rm.py did (fsdp.compute_dtype: fp32 under
    the suite's pins): its held-out accuracy and margin are the final evaluation's, up to the bf16 rounding of the
    saved weights."""
    from reward_model import check_reward_model, conversation, load_reward_model, score_conversations

    run_dir, _ = rm_run
    model_dir = str(run_dir / "checkpoints" / "step_000020" / "model")
    config = json.load(open(os.path.join(model_dir, "config.json")))
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    tokenizer, template, _ = check_reward_model(model_dir)
    assert config["pad_token_id"] == tokenizer.pad_token_id is not None and "<|im_start|>" in template
    pairs, _ = load_pairs(str(run_dir.parent / "pairs.jsonl"))
    held = split_pairs(pairs, seed=0, num_eval=64, where="")[1]
    rm = load_reward_model(model_dir, torch.device("cpu"), compute_dtype(torch.device("cpu")))
    scores, _ = score_conversations(
        rm,
        [conversation(p.prompt, side) for p in held for side in (p.chosen, p.rejected)],
        tokenizer=tokenizer,
        template=template,
        max_len=64,
        micro_batch_size=8,
        device=torch.device("cpu"),
    )
    _, stats = pairwise_loss(scores[0::2], scores[1::2], num_pairs=1)
    final = rows(run_dir)[1][-1]
    assert stats["correct"].item() / len(held) == pytest.approx(final["eval/pair_acc"], abs=1.01 / len(held))
    assert stats["margin"].item() / len(held) == pytest.approx(final["eval/margin"], rel=0.05, abs=0.02)


@pytest.mark.slow
def test_resume_continues_exactly(rm_run, trained_tiny_model_dir, tmp_path):
    """The run's folder as it was after step 10 (the step-20 checkpoint gone), then --resume: steps 11-20 and the
    evaluations at 10 and 20 give the numbers of the run that never stopped, rows not duplicated."""
    run_dir, _ = rm_run
    shutil.copytree(run_dir, tmp_path / "r")
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "step_000020")
    proc = run_rm(
        trained_tiny_model_dir,
        tmp_path,
        "--dataset",
        run_dir.parent / "pairs.jsonl",
        "--steps",
        20,
        "--eval-every",
        10,
        "--eval-before-train",
        "--save-every",
        10,
        "--keep-checkpoints",
        0,
        "--resume",
    )
    assert "resumed from" in proc.stdout and "step_000010: step 10, data epoch 1 index 52" in proc.stdout
    drop = lambda rs: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rs]  # noqa: E731  seconds vary
    (train, evals), (again, evals_again) = rows(run_dir), rows(tmp_path / "r")
    assert drop(again) == drop(train) and evals_again == evals  # exactly; rows of steps 11-20 once each


@pytest.mark.slow
def test_torchrun_two_ranks_take_the_steps_of_one_process(rm_run, trained_tiny_model_dir, tmp_path):
    """16 pairs a step, 8 on each rank: the loss divided by the global count and FSDP's summed gradients give the
    plain run's steps (each rank's pairs are one of its micro-batches; summation order aside)."""
    run_dir, _ = rm_run
    proc = run_rm(
        trained_tiny_model_dir,
        tmp_path,
        "--dataset",
        run_dir.parent / "pairs.jsonl",
        "--steps",
        3,
        "--eval-every",
        3,
        nproc=2,
    )
    assert "| 2 ranks" in proc.stdout and "eval after step 3 |" in proc.stdout
    two, one = rows(tmp_path / "r")[0], rows(run_dir)[0][:3]
    for a, b in zip(two, one):
        for key in ("train/loss", "train/pair_acc", "train/margin", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=2e-3, abs=1e-5), (a["step"], key)


@pytest.mark.slow
def test_a_bad_pairs_file_stops_in_one_line_writing_nothing(trained_tiny_model_dir, tmp_path):
    (tmp_path / "bad.jsonl").write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n'
    )
    proc = run_rm(trained_tiny_model_dir, tmp_path, "--dataset", tmp_path / "bad.jsonl", expect_ok=False)
    last = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last[-1].startswith("train_rm.py: ") and "bad.jsonl, line 2: needs a 'prompt'" in last[-1]
    assert not os.path.exists(tmp_path / "r")


@pytest.mark.slow
def test_what_the_model_or_its_template_cannot_read_stops_in_one_line(trained_tiny_model_dir, tmp_path):
    """Before the model loads: a classifier of 2 labels as --model; one without a chat template (never said to read
    raw text first); a pair the chat template refuses (named by its number); pairs the cut to --max-len leaves the same
    on both sides (every one: nothing to learn)."""
    from test_reward_model import build_reward_model

    data = write_pairs(tmp_path / "pairs.jsonl", prompts=10, bad=False)
    two = build_reward_model(trained_tiny_model_dir, str(tmp_path / "two"), num_labels=2)
    bare = build_reward_model(trained_tiny_model_dir, str(tmp_path / "bare"), chat_template=False)
    refuses = (
        "{% for m in messages %}{% if m['content'] == 'Hi' %}{{ raise_exception('no Hi') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    (tmp_path / "hi.jsonl").write_text(
        open(data).read() + json.dumps({"prompt": "Hi", "chosen": "a", "rejected": "b"}) + "\n"
    )
    for model, extra, message in [
        (two, ["--dataset", data], f"--model '{two}' is a classifier of 2 labels: a reward model has one"),
        (
            bare,
            ["--dataset", data],
            f"--model '{bare}': its tokenizer has no chat template to read a conversation "
            f"with: pass --chat-template FILE.jinja",
        ),
        (
            trained_tiny_model_dir,
            ["--dataset", tmp_path / "hi.jsonl", "--chat-template", refuses],
            f"{tmp_path / 'hi.jsonl'}: a pair (roles user, assistant; it begins 'Hi'): the reward model's chat template "
            f"failed: TemplateError: no Hi",
        ),
        (
            trained_tiny_model_dir,
            ["--dataset", data, "--max-len", 2],
            f"every pair of {data} is the same on both sides after the cut to --max-len 2",
        ),
    ]:
        proc = run_rm(model, tmp_path, *extra, expect_ok=False)
        last = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(last) == 1 and message in last[0], proc.stderr[-3000:]
        assert not os.path.exists(tmp_path / "r") and "raw text" not in proc.stdout
