"""data.py: the addition task, GSM8K files and their errors, the prompt sampler, sharding, padded batches."""

import json
import os
import random
import re
import sys

import pytest
import torch

from data import (
    GSM8K_PROMPT,
    MATH_PROMPT,
    Example,
    PromptSampler,
    Sample,
    addition_task,
    ask,
    collate,
    load_examples,
    load_task,
    read_rows,
    seed_for,
    shard,
    tokenize_prompts,
)
from common import InputError

# The GSM8K copy in ../shared beside the checkout (CI has it there), or wherever GSM8K_DIR points.
GSM8K_DIR = os.environ.get("GSM8K_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "gsm8k"))


def write_jsonl(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def row(question="How many?", answer="2 + 2 = 4\n#### 4") -> str:
    return json.dumps({"question": question, "answer": answer})


# ----------------------------------------------------------------------------------------------
# The addition task


def test_addition_task_sizes_split_and_answers():
    """90 * 90 = 8100 pairs: 500 held out, 7600 to train on, disjoint, every pair once, a + b correct."""
    train, test = addition_task(seed=0)
    assert (len(train), len(test)) == (7600, 500)
    pairs = []
    for ex in train + test:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Put the final answer after ####\.", ex.prompt).groups())
        assert ex.answer == str(a + b)
        pairs.append((a, b))
    assert len(set(pairs)) == 8100 and all(10 <= a <= 99 and 10 <= b <= 99 for a, b in pairs)
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in test}


def test_addition_task_is_deterministic_by_seed():
    assert addition_task(seed=3) == addition_task(seed=3)
    assert addition_task(seed=3)[1] != addition_task(seed=4)[1]
    assert len(addition_task(seed=0, num_test=100)[1]) == 100


# ----------------------------------------------------------------------------------------------
# Files


def test_read_rows_bad_json_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [row(), "", '{"question": "cut off', row()])
    with pytest.raises(ValueError) as e:
        read_rows(path)
    assert path in str(e.value) and "line 3" in str(e.value)  # the blank line 2 still counts


def test_read_rows_non_object_and_wrong_suffix(tmp_path):
    with pytest.raises(ValueError, match="line 2: expected a JSON object, got list"):
        read_rows(write_jsonl(tmp_path / "a.jsonl", [row(), "[1, 2]"]))
    with pytest.raises(ValueError, match="expected a .jsonl or .parquet"):
        read_rows(write_jsonl(tmp_path / "a.csv", ["question,answer"]))


def test_load_examples_file_parses_gsm8k_rows(tmp_path):
    """The final answer is what follows '####', commas removed; the prompt is GSM8K_PROMPT; the source the file's name."""
    path = write_jsonl(tmp_path / "mine.jsonl", [row(" How much? ", "1000 + 234\n#### 1,234"), "", row()])
    examples = load_examples(path, "train")
    assert examples == [
        Example(GSM8K_PROMPT.format(question="How much?"), "1234", "gsm8k", "mine"),
        Example(GSM8K_PROMPT.format(question="How many?"), "4", "gsm8k", "mine"),
    ]


def test_missing_field_names_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [row(), json.dumps({"question": "no answer"})])
    with pytest.raises(ValueError) as e:
        load_examples(path, "train")
    assert path in str(e.value) and "line 2" in str(e.value) and "'answer'" in str(e.value)


def test_missing_field_line_number_counts_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [row(), "", json.dumps({"question": "no answer"})])
    with pytest.raises(ValueError, match="line 3"):
        load_examples(path, "train")


def test_answer_without_final_number_raises(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [row(answer="the answer is 4")])
    with pytest.raises(InputError, match="line 1: field 'answer' has no final number: end it with '#### <number>'"):
        load_examples(path, "train")


def test_answer_may_be_just_the_number(tmp_path):
    """Own data: {"answer": 72} or {"answer": "72"} is the final answer itself."""
    path = write_jsonl(tmp_path / "train.jsonl", [row(answer=72), row(answer="1,500"), row(answer=-2.5)])
    assert [ex.answer for ex in load_examples(path, "train")] == ["72", "1500", "-2.5"]


@pytest.mark.parametrize("answer, found", [(None, "'answer': 'NoneType'"), ([4], "'answer': 'list'"), (True, "'bool'")])
def test_answer_of_the_wrong_type_says_what_was_found(tmp_path, answer, found):
    path = write_jsonl(tmp_path / "train.jsonl", [row(answer=answer)])
    with pytest.raises(InputError, match="line 1: needs a 'question' string and an 'answer'") as e:
        load_examples(path, "train")
    assert found in str(e.value)


def test_empty_file_names_the_file(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [""])
    with pytest.raises(InputError, match=f"{path} has no rows"):
        load_examples(path, "train")


def test_load_examples_folder(tmp_path):
    """A folder is searched for {split}.jsonl / {split}.parquet; a missing split is an InputError."""
    write_jsonl(tmp_path / "train.jsonl", [row(), row("Why?", "#### 7")])
    examples = load_examples(str(tmp_path), "train")
    assert [ex.answer for ex in examples] == ["4", "7"]
    with pytest.raises(InputError, match="test.jsonl or test.parquet"):
        load_examples(str(tmp_path), "test")


@pytest.mark.parametrize("name", ["missing", "./missing", "missing/a/b"])
def test_load_examples_missing_path(tmp_path, name):
    """A path that exists nowhere, and does not look like a hub id, never reaches the hub."""
    target = name if name.startswith("./") or "/" in name else str(tmp_path / name)
    with pytest.raises(InputError, match="no such file or folder"):
        load_examples(target, "train")


def test_one_file_without_eval_dataset_holds_out_a_seeded_part(tmp_path):
    """One file and no --eval-dataset: 1 in 10 rows (at most num_eval) are held out, never trained on,
    the same ones for the same seed, and the note says how many."""
    path = write_jsonl(tmp_path / "my.jsonl", [row(f"Q{i}?", f"#### {i}") for i in range(3795)])
    train, held, note = load_task(path, None, seed=0, num_eval=256)
    assert (len(train), len(held)) == (3795 - 256, 256) and note.startswith(f"held out 256 of 3795 rows of {path}")
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in held}
    assert load_task(path, None, seed=0, num_eval=256)[1] == held != load_task(path, None, seed=1, num_eval=256)[1]
    small = write_jsonl(tmp_path / "small.jsonl", [row(f"Q{i}?", f"#### {i}") for i in range(100)])
    assert [len(part) for part in load_task(small, None, seed=0, num_eval=256)[:2]] == [90, 10]


def test_too_small_file_or_own_eval_file(tmp_path):
    tiny = write_jsonl(tmp_path / "tiny.jsonl", [row() for _ in range(9)])
    with pytest.raises(InputError, match="has 9 rows, too few to hold 1 in 10 out for evaluation: pass --eval-dataset"):
        load_task(tiny, None, seed=0, num_eval=256)
    own = write_jsonl(tmp_path / "own.jsonl", [row("Other?", "#### 1")] * 3)
    train, held, note = load_task(tiny, own, seed=0, num_eval=256)
    assert (len(train), len(held)) == (9, 3) and own in note


def test_repeated_rows_are_held_out_with_every_copy(tmp_path):
    """Split by prompt: 12 rows, Q0..Q3 three times each. 1 in 10 of 12 rows is 1 row: by row, 1 copy was held out and
    its 2 copies trained on. Now the first prompt of the seeded order of the 4 (random.Random(0).sample(range(4), 4) is
    [3, 1, 0, 2]: Q3) is held out whole, its 3 rows, and the 9 rows of Q0, Q1, Q2 train."""
    path = write_jsonl(tmp_path / "rep.jsonl", [row(f"Q{i % 4}?", f"#### {i % 4}") for i in range(12)])
    train, held, note = load_task(path, None, seed=0, num_eval=256)
    assert [e.answer for e in held] == ["3"] * 3 and [e.answer for e in train] == ["1"] * 3 + ["0"] * 3 + ["2"] * 3
    assert note.startswith(f"held out 3 of 12 rows (every copy of 1 prompt) of {path} for evaluation (seed 0")
    # 40 rows: Q0..Q3, P? ten times, Q4..Q29. Seed 1's order of the 31 prompts starts at the 5th, P?: its 10 rows are
    # held out (1 in 10 is 4 rows: the whole prompt goes), num_eval=3 of them evaluated, none trained on
    rows = [row(f"Q{i}?", "#### 1") for i in range(4)] + [row("P?", "#### 2")] * 10
    rows += [row(f"Q{i}?", "#### 1") for i in range(4, 30)]
    train, held, note = load_task(write_jsonl(tmp_path / "p.jsonl", rows), None, seed=1, num_eval=3)
    assert ([e.answer for e in held], len(train), {e.answer for e in train}) == (["2"] * 3, 30, {"1"})
    assert note.startswith("held out 10 of 40 rows (every copy of 1 prompt)")
    with pytest.raises(InputError, match="has 10 rows, 1 of them distinct prompts, too few to hold 1 in 10 out"):
        load_task(write_jsonl(tmp_path / "same.jsonl", [row()] * 10), None, seed=0, num_eval=256)


def test_a_file_without_repeated_rows_splits_as_it_did_by_row(tmp_path):
    """No copies: the same split as the row split it replaced (the first 1 in 10 of a seeded shuffle of the rows, the
    rest in that order), so a run resumed across the change trains on the same data in the same order."""
    path = write_jsonl(tmp_path / "my.jsonl", [row(f"Q{i}?", f"#### {i}") for i in range(40)])
    train, held, _ = load_task(path, None, seed=3, num_eval=256)
    order = random.Random(3).sample(range(40), 40)
    assert [e.answer for e in held] == [str(i) for i in order[:4]]
    assert [e.answer for e in train] == [str(i) for i in order[4:]]


def test_a_built_in_task_with_an_eval_file_is_evaluated_on_the_file(tmp_path):
    """--dataset addition --eval-dataset capitals.jsonl: the file was ignored without a word (addition's own pairs were
    evaluated). Now its rows are the held-out prompts, judged as text; addition trains on its 7600 train pairs as ever."""
    caps = write_jsonl(
        tmp_path / "capitals.jsonl",
        [
            json.dumps({"prompt": f"Name the capital of {c}.", "answer": a})
            for c, a in (("Australia", "Canberra"), ("Canada", "Ottawa"))
        ],
    )
    train, held, note = load_task("addition", caps, seed=0, num_eval=256)
    assert train == load_task("addition", None, seed=0, num_eval=256)[0] and note == f"eval prompts from {caps}"
    assert [(e.answer, e.kind, e.source) for e in held] == [
        ("Canberra", "text", "capitals"),
        ("Ottawa", "text", "capitals"),
    ]


def test_a_hub_dataset_without_the_hub_is_read_from_the_cache_at_once(monkeypatch):
    """The hub can't be reached: datasets is told it is offline before it is asked (it reads its cache at once,
    instead of after half a minute of retries); with the hub, it is asked as it is."""
    import types

    import data

    seen = []

    def load_dataset(path, name=None, split=None):
        seen.append((path, name, split, fake.config.HF_HUB_OFFLINE))
        return [{"question": "How many?", "answer": "2 + 2 = 4\n#### 4"}]

    fake = types.SimpleNamespace(config=types.SimpleNamespace(HF_HUB_OFFLINE=False), load_dataset=load_dataset)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr(data, "hub_unreachable", lambda name, flag, repo_type: None)
    assert load_examples("openai/gsm8k", "train")[0].answer == "4" and seen[-1] == (
        "openai/gsm8k",
        "main",
        "train",
        False,
    )
    monkeypatch.setattr(data, "hub_unreachable", lambda name, flag, repo_type: "ConnectError: no route")
    assert load_examples("openai/gsm8k", "test")[0].answer == "4" and seen[-1][-1] is True


@pytest.mark.skipif(not os.path.isdir(GSM8K_DIR), reason=f"no local GSM8K copy at {GSM8K_DIR}")
def test_real_gsm8k_copy_loads():
    train = load_examples(GSM8K_DIR, "train")
    assert len(train) == 7473
    assert train[0].answer == "72"
    assert train[0].prompt.startswith("Natalia sold clips")
    assert len(load_examples(GSM8K_DIR, "test")) == 1319


# ----------------------------------------------------------------------------------------------
# Tokenizing prompts


def test_tokenize_prompts_drops_long_prompts(tiny_model_dir):
    """Prompts over max_prompt_len (after the chat template) are dropped, never truncated, and counted."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    short, long = Example("What is 1 + 2?", "3"), Example("What is 1 + 2? " * 40, "3")
    ids, kept, dropped = tokenize_prompts(tokenizer, [short, long, short], max_prompt_len=64)
    assert kept == [short, short] and dropped == 1
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": short.prompt}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert ids[0] == ids[1] == tokenizer.encode(text, add_special_tokens=False)
    n = len(ids[0])
    # the limit is inclusive: exactly n tokens is kept, n - 1 drops it
    assert tokenize_prompts(tokenizer, [short], max_prompt_len=n)[2] == 0
    with pytest.raises(
        InputError,
        match=rf"all 1 prompts of my.jsonl are longer than --max-prompt-len {n - 1} tokens "
        rf"\(the shortest: {n}\): raise it",
    ):
        tokenize_prompts(tokenizer, [short], max_prompt_len=n - 1, source="my.jsonl")


# ----------------------------------------------------------------------------------------------
# PromptSampler and shard


def test_sampler_is_deterministic_by_seed():
    a, b, c = PromptSampler(10, seed=1), PromptSampler(10, seed=1), PromptSampler(10, seed=2)
    draws_a = [a.draw(4) for _ in range(5)]
    assert draws_a == [b.draw(4) for _ in range(5)]
    assert draws_a != [c.draw(4) for _ in range(5)]


def test_sampler_covers_each_prompt_once_per_epoch():
    s = PromptSampler(10, seed=0)
    epoch0 = s.draw(4) + s.draw(4) + s.draw(2)
    assert sorted(epoch0) == list(range(10)) and (s.epoch, s.index) == (0, 10)
    epoch1 = s.draw(10)
    assert sorted(epoch1) == list(range(10)) and (s.epoch, s.index) == (1, 10)
    assert epoch1 != epoch0  # a new shuffle each epoch


def test_sampler_crosses_epoch_boundaries():
    s = PromptSampler(10, seed=0)
    first = s.draw(7)
    second = s.draw(7)  # 3 from the end of epoch 0, then 4 from epoch 1
    assert (s.epoch, s.index) == (1, 4)
    assert sorted(first + second[:3]) == list(range(10))
    assert len(set(second[3:])) == 4
    big = PromptSampler(10, seed=0).draw(25)  # epochs 0 and 1 whole, 5 of epoch 2
    assert big[:7] == first and big[7:14] == second
    assert sorted(big[:10]) == sorted(big[10:20]) == list(range(10)) and len(set(big[20:])) == 5


def test_sampler_state_dict_round_trip():
    """A sampler restored from a state dict (as after a resume) continues with the same draws."""
    a = PromptSampler(10, seed=5)
    a.draw(7), a.draw(6)
    state = json.loads(json.dumps(a.state_dict()))  # plain data, as saved in a checkpoint
    assert state == {"epoch": 1, "index": 3, "num_prompts": 10, "seed": 5}
    b = PromptSampler(10, seed=5)
    b.load_state_dict(state)
    assert [b.draw(6) for _ in range(4)] == [a.draw(6) for _ in range(4)]


def test_sampler_load_with_other_pool_size_raises():
    state = PromptSampler(10, seed=0).state_dict()
    with pytest.raises(InputError, match="10 training rows .*, this run has 9: the data changed since"):
        PromptSampler(9, seed=0).load_state_dict(state)


def test_sampler_empty_pool_raises():
    with pytest.raises(ValueError, match="prompt pool is empty"):
        PromptSampler(0, seed=0)


def test_shard_contiguous_slices():
    items = list(range(8))
    assert shard(items, rank=1, world_size=4) == [2, 3]
    assert sum((shard(items, r, 4) for r in range(4)), []) == items
    assert shard(items, 0, 1) == items


# ----------------------------------------------------------------------------------------------
# collate and Batch.select

SAMPLES = [
    Sample(prompt_ids=[11, 12, 13], response_ids=[21, 22], rollout_logprobs=[-0.1, -0.2], truncated=False),  # p 3, r 2
    Sample(prompt_ids=[14, 15], response_ids=[23, 24, 25, 26], rollout_logprobs=[-0.3] * 4, truncated=True),  # p 2, r 4
    Sample(prompt_ids=[16], response_ids=[27], rollout_logprobs=[-0.4], truncated=False),  # p 1, r 1
]


def test_collate_by_hand():
    """Right padding to T = 6; response_mask[i, p-1 : p-1+r] = 1 lines up with targets input_ids[:, 1:]."""
    batch = collate(SAMPLES, pad_id=0)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22, 0], [14, 15, 23, 24, 25, 26], [16, 27, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]
    # [B, T-1]: row 0 p=3 r=2 -> positions 2, 3; row 1 p=2 r=4 -> 1..4; row 2 p=1 r=1 -> 0
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    # position t predicts input_ids[:, t+1]: the masked targets are exactly the response tokens
    targets = batch.input_ids[:, 1:]
    for i, s in enumerate(SAMPLES):
        assert targets[i][batch.response_mask[i].bool()].tolist() == s.response_ids
    assert len(batch) == 3 and batch.loss_mask is None


def test_select_trims_to_longest_selected_row():
    batch = collate(SAMPLES, pad_id=0)
    batch.loss_mask = batch.response_mask.clone()
    batch.old_logprobs = torch.arange(15, dtype=torch.float).view(3, 5)
    mb = batch.select(torch.tensor([0, 2]))  # lengths 5 and 2 -> T = 5, per-token fields T-1 = 4
    assert mb.input_ids.tolist() == [[11, 12, 13, 21, 22], [16, 27, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert mb.response_mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert mb.old_logprobs.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert mb.ref_logprobs is None and mb.advantages is None
    one = batch.select(torch.tensor([2]))  # length 2 -> T = 2, T-1 = 1
    assert one.input_ids.tolist() == [[16, 27]] and one.response_mask.tolist() == [[1]]
    full = batch.select(torch.arange(3))  # the longest row is 6: nothing cut
    assert torch.equal(full.input_ids, batch.input_ids) and torch.equal(full.response_mask, batch.response_mask)


def test_collate_keeps_the_samplers_logprobs_where_the_response_mask_is():
    batch = collate(SAMPLES, pad_id=0)
    assert torch.equal(
        batch.rollout_logprobs, torch.tensor([[0, 0, -0.1, -0.2, 0], [0, -0.3, -0.3, -0.3, -0.3], [-0.4, 0, 0, 0, 0]])
    )


def test_select_carries_a_field_the_script_adds():
    """A researcher's own field needs no edit of data.py: [B, T-1] fields are cut like the masks,
    [B] fields follow their rows."""
    batch = collate(SAMPLES, pad_id=0)
    batch.token_weights = torch.arange(15, dtype=torch.float).view(3, 5)  # [B, T-1]
    batch.seq_bonus = torch.tensor([1.0, 2.0, 3.0])  # [B]
    mb = batch.select(torch.tensor([0, 2]))
    assert mb.token_weights.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]] and mb.seq_bonus.tolist() == [1.0, 3.0]
    assert batch.token_weights.shape == (3, 5)  # the batch itself is untouched


def test_seed_for_gives_each_use_its_own_seed():
    """Deterministic, in range, and no collision where the old update-shuffle formula collided:
    seed * 1000 + step * 10 + epoch made (step 1, epoch 10) and (step 2, epoch 0) one seed."""
    assert seed_for(0, "update", 1, 10) != seed_for(0, "update", 2, 0)
    assert seed_for(0, "update", 3, 1) == seed_for(0, "update", 3, 1) != seed_for(1, "update", 3, 1)
    assert seed_for(0, "sample", 1, 0, 0, 5) != seed_for(0, "update", 1, 0, 0, 5)
    seeds = [seed_for(7, "sample", step, k) for step in range(50) for k in range(20)]
    assert all(0 <= s < 2**31 for s in seeds) and len(set(seeds)) == len(seeds)


# ----------------------------------------------------------------------------------------------
# Own tasks, MATH, templates, several sources


def write_rows(path, rows: list[dict]) -> str:
    return write_jsonl(path, [json.dumps(r) for r in rows])


def test_own_rows_text_and_numeric_answers(tmp_path):
    """{"prompt", "answer"} rows: text answers are kind 'text', all-number answers 'gsm8k'; the text after a
    '####' is the answer; the default template is GSM8K_PROMPT, {prompt} filled."""
    text = load_examples(
        write_rows(
            tmp_path / "capitals.jsonl",
            [
                {"prompt": " Capital of France? ", "answer": "Paris"},
                {"prompt": "Of Peru?", "answer": "Think.\n#### Lima"},
            ],
        ),
        "train",
    )
    assert text == [
        Example(GSM8K_PROMPT.format(question="Capital of France?"), "Paris", "text", "capitals"),
        Example(GSM8K_PROMPT.format(question="Of Peru?"), "Lima", "text", "capitals"),
    ]
    numbers = load_examples(
        write_rows(tmp_path / "n.jsonl", [{"prompt": "a?", "answer": "1,500"}, {"prompt": "b?", "answer": 2}]),
        "train",
        "{prompt} Answer after ####.",
    )
    assert [(e.prompt, e.answer, e.kind) for e in numbers] == [
        ("a? Answer after ####.", "1500", "gsm8k"),
        ("b? Answer after ####.", "2", "gsm8k"),
    ]


def test_own_columns_kind_and_system_prompt(tmp_path):
    path = write_rows(tmp_path / "own.jsonl", [{"instruction": "Say 1/2.", "output": "\\frac{1}{2}"}])
    [ex] = load_examples(
        path,
        "train",
        "{question}!",
        prompt_field="instruction",
        answer_field="output",
        kind="math",
        system_prompt="Be brief.",
    )
    assert ex == Example(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 1/2.!"}],
        "\\frac{1}{2}",
        "math",
        "own",
    )
    with pytest.raises(
        InputError, match=r"line 1: needs a 'prompt' string and an 'output' .*'instruction': 'str'.*--prompt-field"
    ):
        load_examples(path, "train", answer_field="output")
    with pytest.raises(InputError, match="kind 'latex' .* is unknown"):
        load_examples(path, "train", prompt_field="instruction", answer_field="output", kind="latex")


def test_chat_message_prompts(tmp_path):
    """A prompt given as chat messages: the template fills the last user message; a system prompt goes first,
    unless the row has its own (an error); a list that is not chat messages is an error naming the line."""
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
    ]
    path = write_rows(tmp_path / "chat.jsonl", [{"prompt": chat, "answer": "4"}])
    [ex] = load_examples(path, "train", "{prompt} Answer after ####.")
    assert (
        ex.prompt == chat[:2] + [{"role": "user", "content": "2+2? Answer after ####."}]
        and chat[2]["content"] == "2+2?"
    )
    system = [{"role": "system", "content": "Mine."}] + chat
    with pytest.raises(InputError, match="line 1: has a system message, and --system-prompt adds another"):
        load_examples(
            write_rows(tmp_path / "sys.jsonl", [{"prompt": system, "answer": "4"}]), "train", system_prompt="Yours."
        )
    with pytest.raises(InputError, match="line 2: needs a 'prompt' string .* list of chat messages"):
        load_examples(
            write_rows(
                tmp_path / "bad.jsonl",
                [{"prompt": chat, "answer": "4"}, {"prompt": [{"role": "assistant", "content": "x"}], "answer": "4"}],
            ),
            "train",
        )


def test_math_rows(tmp_path, monkeypatch):
    """MATH: the answer is the last \\boxed{} of the solution (nested braces); MATH-500's 'answer' is taken as is and
    wins over its 'solution'; the default template is MATH_PROMPT, and a literal \\boxed{} in a template stays."""
    rows = [
        {"problem": "Half?", "solution": "First \\boxed{1}, no: $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Interval?", "solution": "\\fbox{(0,1]}"},
    ]
    examples = load_examples(write_rows(tmp_path / "math.jsonl", rows), "train")
    assert [(e.prompt, e.answer, e.kind) for e in examples] == [
        (ask("Half?", MATH_PROMPT), "\\frac{1}{2}", "math"),
        (ask("Interval?", MATH_PROMPT), "(0,1]", "math"),
    ]
    assert MATH_PROMPT.endswith("\\boxed{}.")
    m500 = write_rows(tmp_path / "m500.jsonl", [{"problem": "P?", "solution": "\\boxed{2}", "answer": "\\sqrt{4}"}])
    [ex] = load_examples(m500, "test", "{prompt} Box it: \\boxed{}.")
    assert (ex.prompt, ex.answer) == ("P? Box it: \\boxed{}.", "\\sqrt{4}")
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed: loading says so, before any training
    with pytest.raises(InputError, match="pip install math-verify"):
        load_examples(m500, "test")
    monkeypatch.undo()
    for solution in ("no box here", "\\boxed{\\frac{1}{2}"):
        with pytest.raises(InputError, match=r"line 1: field 'solution' has no answer in a \\boxed"):
            load_examples(write_rows(tmp_path / "bad.jsonl", [{"problem": "P?", "solution": solution}]), "train")


def test_template_without_a_slot_is_an_error(tmp_path):
    with pytest.raises(InputError, match="has no {prompt}"):
        load_examples(write_jsonl(tmp_path / "a.jsonl", [row()]), "train", "Answer after ####.")
    assert addition_task(0, template="Q: {prompt}")[1][0].prompt.startswith("Q: What is ")


@pytest.mark.parametrize(
    "template, refused",
    [
        ("{prompt} (hint: {answer})", "{answer}"),  # issue 40: it reached the model as written
        ("{prompt} {0} {x:.2f}", "{0}, {x:.2f}"),  # str.format's fields, none filled in
        ("Answer after ####.", None),  # no {prompt}: refused as ask() refuses it
        (None, ""),
        ("{question}", ""),
        (MATH_PROMPT, ""),  # the defaults; MATH's \boxed{} is no placeholder
        ('{prompt} as \\boxed{answer}, x^{n}, \\frac{a}{b}, {{ok}}, or JSON {"answer": 1}', ""),  # LaTeX, escapes, JSON
    ],
)
def test_a_template_placeholder_other_than_prompt_is_refused(template, refused):
    from data import template_rule

    flag, shown, holds, must = template_rule(template)
    assert (flag, shown, holds) == ("--prompt-template", repr(template), refused == "")
    if refused:
        assert must.startswith(f"text whose only placeholder is {{prompt}} (the row's question): {refused} would reach")
    elif refused is None:
        assert must.startswith("text with {prompt} in it")


def test_several_sources(tmp_path):
    """Train examples concatenated, each source's held-out part (num_eval each), tagged with their source."""
    gsm = write_jsonl(tmp_path / "gsm.jsonl", [row(f"Q{i}?", f"#### {i}") for i in range(50)])
    mth = write_rows(tmp_path / "math.jsonl", [{"problem": f"P{i}?", "answer": f"{i}"} for i in range(30)])
    train, held, note = load_task([gsm, mth, "addition"], None, seed=0, num_eval=4)
    assert len(train) == 46 + 27 + 7600 and [(e.source, e.kind) for e in held] == (
        [("gsm", "gsm8k")] * 4 + [("math", "math")] * 3 + [("addition", "int")] * 4
    )
    assert note.startswith(f"held out 4 of 50 rows of {gsm}") and "addition: 500 held-out pairs" in note
    assert load_task([gsm], None, seed=0, num_eval=4) == load_task(gsm, None, seed=0, num_eval=4)
    with pytest.raises(InputError, match=r"share a short name \(\['gsm', 'gsm'\]\)"):
        load_task([gsm, str(tmp_path / "gsm.jsonl")], None, seed=0, num_eval=4)
    with pytest.raises(InputError, match="goes with one dataset"):
        load_task([gsm, mth], gsm, seed=0, num_eval=4)


def test_task_prompts_of_several_sources_and_chat_prompts(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from data import prompt_tokens, task_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    mth = write_rows(tmp_path / "math.jsonl", [{"problem": f"P{i}?", "answer": f"{i}"} for i in range(30)])
    train, held, line = task_prompts(
        tokenizer, ["addition", mth], None, seed=0, num_eval=5, max_prompt_len=256, system_prompt="Be brief."
    )
    assert (len(train.ids), len(held.ids), held.sources) == (7600 + 27, 8, ["addition", "math"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ask("P0?", MATH_PROMPT)}]
    assert prompt_tokens(tokenizer, messages) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert held.examples[5].prompt[1]["content"].endswith("\\boxed{}.") and held.ids[5] == prompt_tokens(
        tokenizer, held.examples[5].prompt
    )


def test_a_parquet_file_pyarrow_cannot_read_is_one_line(tmp_path, monkeypatch):
    """pyarrow's own error (ArrowInvalid for a file cut short or not parquet) becomes an InputError naming the file."""
    import types

    from data import read_rows

    def read_table(path):
        raise ValueError(
            "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file."
        )

    fake = types.ModuleType("pyarrow.parquet")
    fake.read_table = read_table
    monkeypatch.setitem(sys.modules, "pyarrow", types.ModuleType("pyarrow"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", fake)
    (tmp_path / "bad.parquet").write_text("garbage")
    with pytest.raises(InputError, match=r"bad.parquet' can't be read as parquet \(ValueError: Parquet magic bytes"):
        read_rows(str(tmp_path / "bad.parquet"))


def test_sample_seeds_are_distinct_by_construction():
    """31-bit hashes collide: at 1024 prompts x 16 samples, seed 0's steps 9, 11 and 49 of 60 each gave two samples one
    seed (issue 54, item 3). `distinct` moves a taken seed to the next free value up, so every seed of a draw differs,
    the others stay as they were (the golden runs' seeds did not move), and a rank's share is the whole draw's slice."""
    from data import distinct, sample_seeds, seed_for, shard

    M = 2**31 - 1
    assert distinct([5, 7, 5, 6, M, M, 0]) == [5, 7, 6, 8, M, 0, 1]  # by hand: 5 -> 6; 6 -> 7 (taken) -> 8; M -> 0 ...
    for step in (9, 11, 49):
        raw = [seed_for(0, "sample", step, 0, p, j) for p in range(1024) for j in range(16)]
        seeds = sample_seeds(0, "sample", step, 0, prompts=1024, group_size=16)
        assert len(set(raw)) < len(raw) and len(set(seeds)) == len(seeds)  # a collision, then none
        assert sum(a != b for a, b in zip(raw, seeds)) == len(raw) - len(set(raw))  # only the later of a pair moved
    assert shard(seeds, 1, 4) == seeds[4096:8192]
