"""The optimizer steps an update takes (issue 54, items 1 and 2), on the tiny model in one process: a mini-batch with
no loss token anywhere takes no step (AdamW's momentum alone moved every weight by most of a step), and ppo.py cuts a
batch into exactly --num-minibatches mini-batches (torch.chunk made 2 of 4 rows in 3), the LR schedule moving on by
--num-minibatches each epoch whatever happens."""

import pytest
import torch

from data import Batch


def tiny_batch(rows: int, masked: bool) -> Batch:
    """`rows` rows of 6 tokens (2 prompt, 4 response), their loss masks all 0 where `masked`; every field the two
    losses read, with old log-probs 0.1 below zero (ratios near 1) and advantages +-1."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 60, (rows, 6), generator=g)
    response = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]).repeat(rows, 1)  # [B, T-1]
    batch = Batch(
        input_ids=input_ids,
        attention_mask=torch.ones(rows, 6, dtype=torch.long),
        response_mask=response,
        rollout_logprobs=-0.1 * response,
    )
    batch.loss_mask = response * (0.0 if masked else 1.0)
    batch.old_logprobs = batch.ref_logprobs = -0.1 * response
    batch.advantages = torch.tensor([1.0, -1.0]).repeat(rows // 2)[:, None] * response
    batch.values, batch.returns = torch.zeros(rows, 5), response.clone()
    return batch


def adamw_with_momentum(model):
    """AdamW (the scripts' betas) whose moments are not zero: one real step taken, as after any step of a run."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 - k / 100)
    sum(p.float().pow(2).sum() for p in model.parameters()).backward()
    optimizer.step(), optimizer.zero_grad(set_to_none=True)
    return optimizer, scheduler


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def moved(before, model) -> float:
    return max((a - b).abs().max().item() for a, b in zip(before, model.parameters()))


def load(path: str, head=None):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if head:
        return AutoModelForTokenClassification.from_pretrained(path, num_labels=1, torch_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)


def test_grpo_takes_no_optimizer_step_on_a_mini_batch_without_loss_tokens(tiny_model_dir):
    """Every row masked (--overlong-filter, MIS, IcePop): before, the zero gradient still went to optimizer.step and
    AdamW's momentum moved the weights by ~0.8 of a step (lr 1e-3: 7.7e-4); now no weight moves, the schedule moves on
    by the two planned steps, and the row says so. A batch with loss tokens still trains (the same call)."""
    import grpo

    torch.manual_seed(0)
    policy = load(tiny_model_dir)
    optimizer, scheduler = adamw_with_momentum(policy)
    args = grpo.Args(num_minibatches=2, micro_batch_size=2, lr=1e-3)
    before = weights(policy)
    out = grpo.update(policy, optimizer, scheduler, tiny_batch(4, masked=True), args, step=1, device="cpu")
    assert moved(before, policy) == 0.0
    assert out["train/empty_minibatches"] == 2 and out["train/grad_norm"] == 0.0
    assert scheduler.last_epoch == 2 and scheduler.get_last_lr() == pytest.approx([1e-3 * 0.98])
    out = grpo.update(policy, optimizer, scheduler, tiny_batch(4, masked=False), args, step=2, device="cpu")
    assert moved(before, policy) > 1e-4 and out["train/empty_minibatches"] == 0 and out["train/grad_norm"] > 0
    assert scheduler.last_epoch == 4


def test_ppo_takes_every_planned_step_and_none_without_loss_tokens(tiny_model_dir):
    """ppo.py: 4 rows in 3 mini-batches are 2, 1 and 1 rows, three optimizer steps each for the actor and the critic
    (torch.chunk cut them 2 and 2: two steps of the three the schedule plans); 2 rows in 3 leave one mini-batch with no
    row, skipped like an all-masked one: no weight moves in it, the schedules move on."""
    import ppo

    torch.manual_seed(0)
    policy, critic = load(tiny_model_dir), load(tiny_model_dir, head=True)
    (optimizer, scheduler), (critic_optimizer, critic_scheduler) = (
        adamw_with_momentum(policy),
        adamw_with_momentum(critic),
    )
    args = ppo.Args(num_minibatches=3, micro_batch_size=2, lr=1e-3, critic_lr=1e-3)
    actor, value = (policy, optimizer, scheduler), (critic, critic_optimizer, critic_scheduler)
    steps = lambda opt: int(next(iter(opt.state.values()))["step"])  # AdamW's own count of the steps it took  # noqa: E731
    out = ppo.update(actor, value, tiny_batch(4, masked=False), args, step=1, device="cpu", update_actor=True)
    assert steps(optimizer) == steps(critic_optimizer) == 1 + 3 and out["train/empty_minibatches"] == 0
    assert scheduler.last_epoch == critic_scheduler.last_epoch == 3
    out = ppo.update(actor, value, tiny_batch(2, masked=False), args, step=2, device="cpu", update_actor=True)
    assert steps(optimizer) == steps(critic_optimizer) == 4 + 2 and out["train/empty_minibatches"] == 1
    assert scheduler.last_epoch == critic_scheduler.last_epoch == 6
    before, before_critic = weights(policy), weights(critic)
    out = ppo.update(actor, value, tiny_batch(4, masked=True), args, step=3, device="cpu", update_actor=True)
    assert moved(before, policy) == 0.0 and moved(before_critic, critic) == 0.0 and out["train/empty_minibatches"] == 3
    assert steps(optimizer) == 6 and scheduler.last_epoch == critic_scheduler.last_epoch == 9


def test_an_optimizer_built_after_a_no_grad_forward_still_trains_every_weight(gloo, tiny_model_dir):
    """FSDP2 in one process: a forward under no_grad leaves the root's gathered embedding and final norm registered in
    place of their shards, and an AdamW built on model.parameters() then held those copies, so the embedding and norm
    never trained, silently. lora.trainable (the scripts' optimizers, grpo_minimal.py's, train_rm.py's) reshards
    first: every parameter it gives is a shard, and one step moves the embedding."""
    from torch.distributed.tensor import DTensor

    from fsdp import shard_model
    from lora import trainable

    model = load(tiny_model_dir)
    shard_model(model, param_dtype=torch.float32)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert not isinstance(model.model.embed_tokens.weight, DTensor)  # the trap: what model.parameters() holds now
    params = trainable(model)
    assert all(isinstance(p, DTensor) for p in params) and len(params) == len(list(model.parameters()))
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    before = model.model.embed_tokens.weight.full_tensor().clone()
    model(torch.tensor([[1, 2, 3]])).logits.float().pow(2).mean().backward()
    optimizer.step()
    assert (model.model.embed_tokens.weight.full_tensor() - before).abs().max() > 1e-4
