"""grpo.py's ALGO functions against numbers worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from fsdp import lr_lambda
from grpo import (
    Args,
    advantages,
    aggregate,
    check_args,
    cispo_policy_loss,
    clipped_policy_loss,
    group_advantages,
    grpo_loss,
    gspo_policy_loss,
    kl_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    rollout_correction,
    sapo_policy_loss,
    variant_defaults,
    variant_line,
)
from common import InputError

# ----------------------------------------------------------------------------------------------
# group_advantages


def test_group_advantages_scaled_uses_unbiased_std():
    """Centred by the group mean, divided by the unbiased (n-1) std + eps; equal rewards give 0, not NaN."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # group 0: mean 0.5 -> centred [0.5, -0.5, -0.5, 0.5]
    #          unbiased var = (4 * 0.25) / (4 - 1) = 1/3 -> std = 0.57735
    #          0.5 / (0.57735 + 1e-6) = 0.866024
    # group 1: mean 2 -> centred all 0; std 0 -> 0 / (0 + 1e-6) = 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([[a, -a, -a, a], [0.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, scale=True)
    assert_close(adv, expected)
    assert not adv.isnan().any()


def test_group_std_scaling_blows_near_ties_up_to_full_size():
    """The std's 1e-6 epsilon is no floor (issue 54, item 6; docs/variants.md says so): rewards 0, 0, 0, 1e-4 have mean
    2.5e-5 and unbiased std sqrt((3 x 2.5e-5^2 + 7.5e-5^2) / 3) = 5e-5, so advantages -2.5e-5 / 5.1e-5 = -0.4902 and
    7.5e-5 / 5.1e-5 = 1.4706: the size of one right answer among three wrong ones (1.5, -0.5). Unscaled: 1e-4's size."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1e-4]])
    assert_close(
        group_advantages(rewards, True), torch.tensor([[-0.4902, -0.4902, -0.4902, 1.4706]]), atol=1e-4, rtol=0
    )
    assert_close(
        group_advantages(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), True),
        torch.tensor([[-0.5, -0.5, -0.5, 1.5]]),
        atol=1e-5,
        rtol=0,
    )
    assert_close(group_advantages(rewards, False), torch.tensor([[-2.5e-5, -2.5e-5, -2.5e-5, 7.5e-5]]))


def test_group_advantages_unscaled_is_only_centred():
    """scale=False (Dr.GRPO): rewards minus the group mean, nothing else."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    # group 0: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]
    # group 1: mean 8/4 = 2 -> [1, -1, 0, 0]
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])
    assert_close(group_advantages(rewards, scale=False), expected)


def test_group_advantages_sum_to_zero_per_group():
    """Each group's advantages sum to 0, scaled or not (the group mean is the baseline)."""
    rewards = torch.tensor([[0.2, 1.5, 0.0, 0.7, 1.0], [5.0, -1.0, 2.0, 2.0, 0.0]])
    for scale in (True, False):
        assert_close(group_advantages(rewards, scale).sum(dim=1), torch.zeros(2), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------
# kl_penalty

LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF_LOGP = torch.tensor([[-1.5, -2.0, -0.25]])
# log_ratio = logp - ref_logp = [0.5, 0.0, -0.25]


def test_kl_k1_is_the_log_ratio():
    assert_close(kl_penalty(LOGP, REF_LOGP, "k1"), torch.tensor([[0.5, 0.0, -0.25]]))


def test_kl_k2_is_half_the_squared_log_ratio():
    # 0.5 * [0.25, 0, 0.0625] = [0.125, 0, 0.03125]
    assert_close(kl_penalty(LOGP, REF_LOGP, "k2"), torch.tensor([[0.125, 0.0, 0.03125]]))


def test_kl_k3_by_hand():
    """k3 = exp(ref - logp) - (ref - logp) - 1, with samples from the policy: Schulman's unbiased estimator."""
    # d = ref - logp = [-0.5, 0, 0.25]
    # exp(-0.5) - (-0.5) - 1 = 0.6065307 + 0.5 - 1 = 0.1065307
    # exp(0)    - 0      - 1 = 0
    # exp(0.25) - 0.25   - 1 = 1.2840254 - 1.25  = 0.0340254
    expected = torch.tensor([[0.1065307, 0.0, 0.0340254]])
    k3 = kl_penalty(LOGP, REF_LOGP, "k3")
    assert_close(k3, expected)
    assert (k3 >= 0).all()


def test_kl_all_estimators_zero_when_policy_equals_reference():
    logp = torch.tensor([[-0.3, -4.0, -1.2]])
    for estimator in ("k1", "k2", "k3"):
        assert_close(kl_penalty(logp, logp.clone(), estimator), torch.zeros(1, 3))


def test_kl_k3_nonnegative_and_finite_on_outliers():
    """k3 >= 0 for any log ratio; the exponent is clamped to [-20, 20], so an outlier token stays finite."""
    logp = torch.tensor([[-0.1, -3.0, -200.0, -0.001]])
    ref = torch.tensor([[-5.0, -0.2, -0.1, -300.0]])
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all()
    # token 2: d = ref - logp = 199.9, clamped to 20 -> exp(20) - 20 - 1
    assert_close(k3[0, 2], torch.tensor(math.exp(20) - 21.0))


def test_kl_unknown_estimator_raises():
    with pytest.raises(ValueError):
        kl_penalty(LOGP, REF_LOGP, "k4")


# ----------------------------------------------------------------------------------------------
# clipped_policy_loss


def _loss(ratio, adv, clip_low, clip_high):
    ratio = torch.tensor([ratio])
    logp = ratio.log().requires_grad_()
    loss, clipped = clipped_policy_loss(logp, torch.zeros_like(logp), torch.tensor([adv]), clip_low, clip_high)
    loss.sum().backward()
    return loss.detach(), clipped, logp.grad


def test_clip_high_with_positive_advantage():
    """r = 1.5 > 1 + 0.2, A = +1: loss = -A (1 + clip_high) = -1.2, clipped, and no gradient flows."""
    # unclipped -1 * 1.5 = -1.5 ; clipped -1 * 1.2 = -1.2 ; max = -1.2
    loss, clipped, grad = _loss([1.5], [1.0], 0.2, 0.2)
    assert_close(loss, torch.tensor([[-1.2]]))
    assert clipped.tolist() == [[True]]
    assert_close(grad, torch.zeros(1, 1))


def test_clip_low_with_negative_advantage():
    """r = 0.5 < 1 - 0.2, A = -2: loss = -A (1 - clip_low) = 2 * 0.8 = 1.6, clipped."""
    # unclipped 2 * 0.5 = 1.0 ; clipped 2 * 0.8 = 1.6 ; max = 1.6
    loss, clipped, grad = _loss([0.5], [-2.0], 0.2, 0.2)
    assert_close(loss, torch.tensor([[1.6]]))
    assert clipped.tolist() == [[True]]
    assert_close(grad, torch.zeros(1, 1))


def test_inside_the_band_is_unclipped():
    """r = 1.1, A = 2: loss = -A r = -2.2; d loss / d logp = -A r = -2.2 (ratio = exp(logp - old))."""
    loss, clipped, grad = _loss([1.1], [2.0], 0.2, 0.2)
    assert_close(loss, torch.tensor([[-2.2]]))
    assert clipped.tolist() == [[False]]
    assert_close(grad, torch.tensor([[-2.2]]))


def test_clip_is_pessimistic_outside_the_band_in_the_wrong_direction():
    """The clip only removes incentive, never penalty: r = 1.5 with A < 0, r = 0.5 with A > 0 stay unclipped."""
    # r 1.5, A -1: unclipped +1.5, clipped +1.2 -> max 1.5 (unclipped)
    # r 0.5, A +1: unclipped -0.5, clipped -0.8 -> max -0.5 (unclipped)
    ratio = torch.tensor([[1.5, 0.5]])
    loss, clipped = clipped_policy_loss(ratio.log(), torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), 0.2, 0.2)
    assert_close(loss, torch.tensor([[1.5, -0.5]]))
    assert clipped.tolist() == [[False, False]]


def test_asymmetric_clip_higher():
    """clip_low 0.2, clip_high 0.28 (DAPO): the band is [0.8, 1.28]."""
    ratio = torch.tensor([[1.25, 1.5, 0.75, 0.85]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    # r 1.25, A +1: inside [0.8, 1.28] -> -1.25, unclipped (with a symmetric 0.2 it would be -1.2, clipped)
    # r 1.5,  A +1: above 1.28 -> -1.28, clipped
    # r 0.75, A -1: below 0.8  -> +0.8, clipped
    # r 0.85, A -1: inside     -> +0.85, unclipped
    loss, clipped = clipped_policy_loss(ratio.log(), torch.zeros(1, 4), adv, 0.2, 0.28)
    assert_close(loss, torch.tensor([[-1.25, -1.28, 0.8, 0.85]]))
    assert clipped.tolist() == [[False, True, True, False]]
    sym_loss, sym_clipped = clipped_policy_loss(ratio.log(), torch.zeros(1, 4), adv, 0.2, 0.2)
    assert_close(sym_loss[0, :2], torch.tensor([-1.2, -1.2]))
    assert sym_clipped.tolist() == [[True, True, True, False]]


def test_clipped_flag_is_strictly_larger():
    """The flag is True exactly where the clipped term is strictly larger than the unclipped one:
    A = 0 (both terms 0) and r inside the band (equal terms) are not clipped."""
    ratio = torch.tensor([[2.0, 2.0, 1.0, 0.1]])
    adv = torch.tensor([[0.0, 3.0, 3.0, -0.5]])
    # r 2,   A 0:    0 vs 0             -> equal, False, loss 0
    # r 2,   A 3:   -6 vs -3.6          -> clipped larger, True, loss -3.6
    # r 1,   A 3:   -3 vs -3            -> equal, False, loss -3
    # r 0.1, A -0.5: 0.05 vs 0.5 * 0.8 = 0.4 -> clipped larger, True, loss 0.4
    loss, clipped = clipped_policy_loss(ratio.log(), torch.zeros(1, 4), adv, 0.2, 0.2)
    assert_close(loss, torch.tensor([[0.0, -3.6, -3.0, 0.4]]))
    assert clipped.tolist() == [[False, True, False, True]]
    unclipped = -adv * ratio
    assert torch.equal(clipped, loss > unclipped)


# ----------------------------------------------------------------------------------------------
# aggregate

VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor(
    [
        [1.0, 1.0, 1.0, 0.0],  # 3 tokens, masked sum 1 + 2 + 3 = 6
        [1.0, 1.0, 0.0, 0.0],  # 2 tokens (then padding), masked sum 5 + 6 = 11
        [0.0, 0.0, 0.0, 0.0],
    ]
)  # fully masked (e.g. an overlong-filtered response): 0
# whole mini-batch: num_seqs = 3, num_tokens = 5, max_len = 4


def test_aggregate_token_mean():
    # (6 + 11 + 0) / 5 = 3.4
    assert_close(aggregate(VALUES, MASK, "token-mean", 3, 5, 4), torch.tensor(3.4))


def test_aggregate_seq_mean_token_mean():
    # per sequence: 6 / 3 = 2, 11 / 2 = 5.5, 0 / clamp(0, min=1) = 0 -> (2 + 5.5 + 0) / 3 = 2.5
    assert_close(aggregate(VALUES, MASK, "seq-mean-token-mean", 3, 5, 4), torch.tensor(2.5))


def test_aggregate_seq_mean_token_sum_norm():
    # Dr.GRPO: (6 + 11) / (3 sequences * 4 max_len) = 17 / 12
    assert_close(aggregate(VALUES, MASK, "seq-mean-token-sum-norm", 3, 5, 4), torch.tensor(17 / 12))


def test_aggregate_all_masked_is_zero_not_nan():
    """A mini-batch with no loss token: the max(.., 1) guards keep the loss 0."""
    zero = torch.zeros_like(MASK)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert_close(aggregate(VALUES, zero, mode, 3, 0, 4), torch.tensor(0.0))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_micro_batches_add_up_to_the_mini_batch(mode):
    """grpo.py's gradient accumulation: micro-batch losses normalized by the whole mini-batch's counts
    sum to the mini-batch loss, also when each micro-batch is trimmed to its own longest row."""
    whole = aggregate(VALUES, MASK, mode, 3, 5, 4)
    # micro-batch A = row 0 (all 4 columns), micro-batch B = rows 1, 2 trimmed to 2 columns (as Batch.select does)
    part_a = aggregate(VALUES[:1], MASK[:1], mode, 3, 5, 4)
    part_b = aggregate(VALUES[1:, :2], MASK[1:, :2], mode, 3, 5, 4)
    assert_close(part_a + part_b, whole)
    # token-mean by hand: 6/5 + 11/5 = 17/5
    if mode == "token-mean":
        assert_close(part_a, torch.tensor(6 / 5))
        assert_close(part_b, torch.tensor(11 / 5))


def test_aggregate_unknown_mode_raises():
    with pytest.raises(ValueError, match="seq-sum"):
        aggregate(VALUES, MASK, "seq-sum", 3, 5, 4)


# ----------------------------------------------------------------------------------------------
# lr_lambda


def test_lr_warmup_then_constant():
    """Linear warm-up (i + 1) / warmup_steps, then 1.0 forever."""
    f = lr_lambda(4, "constant", 0.0, 10)
    # (0+1)/4, (1+1)/4, (2+1)/4, (3+1)/4, then 1
    assert [f(i) for i in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert f(1000) == 1.0


def test_lr_cosine_decays_to_min_lr_ratio():
    """Cosine from 1 after warm-up down to min_lr_ratio at total_optimizer_steps, and flat beyond."""
    f = lr_lambda(2, "cosine", 0.1, 12)
    assert f(0) == pytest.approx(0.5)  # warm-up: 1/2
    assert f(2) == pytest.approx(1.0)  # progress 0: 0.1 + 0.9 * 0.5 * (1 + cos 0) = 1
    assert f(7) == pytest.approx(0.55)  # progress (7-2)/(12-2) = 0.5: 0.1 + 0.9 * 0.5 * (1 + cos pi/2) = 0.55
    assert f(12) == pytest.approx(0.1)  # progress 1: 0.1 + 0.9 * 0.5 * (1 + cos pi) = 0.1
    assert f(50) == pytest.approx(0.1)  # progress clamped at 1
    values = [f(i) for i in range(2, 13)]
    assert all(a > b for a, b in zip(values, values[1:]))  # strictly decreasing after warm-up


def test_lr_linear_halfway():
    """Linear decay: halfway between 1 and min_lr_ratio at the midpoint."""
    f = lr_lambda(0, "linear", 0.2, 10)
    assert f(0) == pytest.approx(1.0)
    assert f(5) == pytest.approx(0.6)  # 0.2 + 0.8 * (1 - 5/10) = 0.6
    assert f(10) == pytest.approx(0.2)  # 0.2 + 0.8 * 0 = 0.2


# ----------------------------------------------------------------------------------------------
# check_args


def test_check_args_accepts_defaults():
    assert check_args(Args(), world_size=8) is None  # 32 prompts / 8 ranks * 8 completions: fine


def test_check_args_prompts_not_divisible_by_world_size():
    with pytest.raises(InputError) as e:
        check_args(Args(prompts_per_step=6), world_size=4)
    assert "--prompts-per-step 6" in str(e.value) and "4 ranks" in str(e.value)


def test_check_args_group_size_one():
    with pytest.raises(InputError) as e:
        check_args(Args(group_size=1), world_size=1)
    assert "--group-size 1" in str(e.value)


def test_check_args_lists_every_problem():
    """All problems in one message, so one failed launch shows them all."""
    with pytest.raises(InputError) as e:
        check_args(Args(prompts_per_step=6, group_size=1, num_minibatches=0), world_size=4)
    message = str(e.value)
    assert "--prompts-per-step" in message and "--group-size" in message and "--num-minibatches" in message


def test_decoupled_rollout_flags_are_checked_together(monkeypatch):
    from common import InputError

    with pytest.raises(InputError) as e:
        check_args(Args(async_rollout=True, rollout_url=("localhost:30000",), tis_cap=-1.0), world_size=1)
    message = str(e.value)
    assert "--async-rollout True must be with --rollout-mode server" in message
    assert (
        "--rollout-url ('localhost:30000',) must be http://HOST:PORT of each server, with --rollout-mode server;"
        in message
    )
    assert "--tis-cap -1.0 must be > 0" in message
    with pytest.raises(InputError, match=r"--rollout-url \(\) must be .* takes these or --rollout-gpus k"):
        check_args(Args(rollout_mode="server"), world_size=1)
    with pytest.raises(InputError, match=r"--rollout-url \('http://h:1',\) must be .*not both"):
        check_args(Args(rollout_mode="server", rollout_url=("http://h:1",), rollout_gpus=1), world_size=1)
    with pytest.raises(InputError, match="--rollout-tp 2 must be 1 with --rollout-url"):
        check_args(Args(rollout_mode="server", rollout_url=("http://h:1",), rollout_tp=2), world_size=2)
    check_args(Args(rollout_mode="server", rollout_url=("http://h:1", "http://h:2"), async_rollout=True), world_size=1)
    # servers of the job's own: the GPUs must be there beside the training ranks (this machine has none)
    with pytest.raises(
        InputError, match=r"--rollout-gpus 1 must be with --rollout-mode server, .* 0 GPUs of this node"
    ):
        check_args(Args(rollout_mode="server", rollout_gpus=1), world_size=1)
    with pytest.raises(InputError, match=r"--rollout-gpus 1 must be with --rollout-mode server"):
        check_args(Args(rollout_gpus=1), world_size=1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    check_args(
        Args(rollout_mode="server", rollout_gpus=2, rollout_tp=2, async_rollout=True, prompts_per_step=36), world_size=6
    )
    with pytest.raises(
        InputError, match=r"--rollout-gpus 2 must be .* the 8 GPUs of this node less its 7 .*nproc_per_node 6"
    ):
        check_args(Args(rollout_mode="server", rollout_gpus=2, prompts_per_step=35), world_size=7)


def test_rollout_tp_stays_within_a_node(monkeypatch):
    """An engine's TP group is GPUs of one node (CUDA IPC weight sync): 2 nodes of 1 rank can't share one."""
    from common import InputError

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(
        InputError, match=r"--rollout-tp 2 must be a divisor of the 1 ranks of each node .*--nproc_per_node"
    ):
        check_args(Args(rollout_tp=2), world_size=2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 2 nodes of 4: two engines per node
    check_args(Args(rollout_tp=2), world_size=8)
    with pytest.raises(InputError, match=r"--rollout-tp 8 must be a divisor of the 4 ranks of each node"):
        check_args(Args(rollout_tp=8), world_size=8)


# ----------------------------------------------------------------------------------------------
# grpo_loss: one micro-batch


def test_grpo_loss_by_hand():
    """At the sampling policy (ratio 1) the PPO-clip loss is -A per token; with k1 KL at coefficient
    0.5 each token adds 0.5 * (logp - ref). Token-mean over 4 loss tokens of the mini-batch."""
    from types import SimpleNamespace

    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.5, 0.5]]))
    mb = SimpleNamespace(
        loss_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]),
        old_logprobs=logp.clone(),
        ref_logprobs=logp - 0.2,
        advantages=torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]),
        is_weight=None,
    )
    entropy = torch.ones(2, 3)
    common = dict(clip_low=0.2, clip_high=0.2, loss_agg="token-mean", num_seqs=2.0, num_tokens=4.0, max_len=3)
    loss, stats = grpo_loss(logp, entropy, mb, kl_coef=0.0, kl_estimator="k1", **common)
    # tokens: -1, -1 (row 0), +2, +2 (row 1) -> sum 2 / 4 tokens = 0.5
    assert_close(loss, torch.tensor(0.5))
    assert_close(stats["tokens"], torch.tensor(4.0))
    assert_close(stats["clip_frac"], torch.tensor(0.0))
    assert_close(stats["entropy"], torch.tensor(4.0))
    assert_close(stats["approx_kl"], torch.tensor(0.0))
    assert "kl" not in stats
    loss, stats = grpo_loss(logp, entropy, mb, kl_coef=0.5, kl_estimator="k1", **common)
    # each of the 4 tokens adds 0.5 * 0.2 = 0.1: (2 + 0.4) / 4 = 0.6; the KL sum is 4 * 0.2 = 0.8
    assert_close(loss, torch.tensor(0.6))
    assert_close(stats["kl"], torch.tensor(0.8))


def test_truncated_importance_sampling_by_hand():
    """The sampler (an older policy, --async-rollout) gave the tokens log-probs `rollout`; rollout_correction's tis
    weight min(p_old / p_sampler, cap) multiplies each token's loss in grpo_loss, with no gradient through it."""
    from types import SimpleNamespace

    old = torch.log(torch.tensor([[0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5]]))  # weights 2.0 and 1.0
    weight, keep, touched = rollout_correction(old, rollout, torch.ones(1, 2), "tis", tis_cap=1.5, bounds=None)
    mb = SimpleNamespace(loss_mask=keep, old_logprobs=old, is_weight=weight, advantages=torch.ones(1, 2))
    logp = old.clone().requires_grad_()
    common = dict(
        clip_low=0.2,
        clip_high=0.2,
        kl_coef=0.0,
        kl_estimator="k1",
        loss_agg="token-mean",
        num_seqs=1.0,
        num_tokens=2.0,
        max_len=2,
    )
    loss, stats = grpo_loss(logp, torch.ones(1, 2), mb, **common)
    # token losses -1 * min(2, 1.5) and -1 * 1 -> mean -1.25; one token capped
    assert_close(loss, torch.tensor(-1.25))
    assert touched.tolist() == [[True, False]]
    loss.backward()  # d/dlogp of -A * ratio * w at ratio 1: -w / num_tokens
    assert_close(logp.grad, torch.tensor([[-0.75, -0.5]]))
    mb.is_weight = None  # --rollout-correction none
    off, _ = grpo_loss(old, torch.ones(1, 2), mb, **common)
    assert_close(off, torch.tensor(-1.0))


# ----------------------------------------------------------------------------------------------
# --advantage: rloo and reinforce++ (grpo: group_advantages above)

# two groups of G = 3: group 0 one right of three, group 1 all equal (no signal)
REWARDS = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


def test_rloo_leaves_each_sample_out_of_its_baseline():
    """baseline of sample i = mean of the other G - 1 = 2 rewards of its group.
    group 0: sample 0: others (0 + 0) / 2 = 0   -> 1 - 0   = +1
             sample 1: others (1 + 0) / 2 = 0.5 -> 0 - 0.5 = -0.5, sample 2 the same
             (= G / (G - 1) * (r - mean) = 1.5 * (1 - 1/3) = 1: GRPO's unscaled advantage x 1.5)
    group 1: others (1 + 1) / 2 = 1 -> 1 - 1 = 0 for all: a group of equal rewards has no signal"""
    expected = torch.tensor([[1.0, -0.5, -0.5], [0.0, 0.0, 0.0]])
    assert_close(rloo_advantages(REWARDS), expected)
    assert_close(rloo_advantages(REWARDS), 1.5 * group_advantages(REWARDS, scale=False))
    assert_close(advantages(REWARDS, "rloo", scale=True), expected)  # --scale-rewards is grpo's only


def test_reinforce_pp_whitens_over_the_whole_batch():
    """group means subtracted: group 0 mean 1/3 -> [2/3, -1/3, -1/3]; group 1 -> [0, 0, 0].
    Then over all 6 samples: mean (2/3 - 1/3 - 1/3 + 0) / 6 = 0; unbiased variance
    (4/9 + 1/9 + 1/9) / (6 - 1) = (2/3) / 5 = 2/15, std sqrt(2/15) = 0.365148 (+ 1e-6).
    -> group 0: (2/3) / 0.365148 = 1.825742, (-1/3) / 0.365148 = -0.912871; group 1 stays 0 (equal rewards).
    GRPO's per-group std would give group 0 +1.1547 / -0.5774: here the scale is the batch's, not the group's."""
    std = math.sqrt(2 / 15) + 1e-6
    expected = torch.tensor([[2 / 3 / std, -1 / 3 / std, -1 / 3 / std], [0.0, 0.0, 0.0]])
    assert_close(reinforce_pp_advantages(REWARDS), expected)
    assert_close(advantages(REWARDS, "reinforce++", scale=True), expected)


def test_reinforce_pp_is_global_over_ranks():
    """Two ranks, one group each: world_sum (all_reduce under torchrun) adds the other rank's
    (count, sum, sum of squares), so each rank's share equals the whole batch's advantages."""
    whole = reinforce_pp_advantages(REWARDS)

    def stats(rows):
        adv = rows - rows.mean(dim=1, keepdim=True)
        return torch.stack([torch.tensor(float(adv.numel())), adv.sum(), (adv**2).sum()]).double()

    rank0 = reinforce_pp_advantages(REWARDS[:1], world_sum=lambda mine: mine + stats(REWARDS[1:]))
    rank1 = reinforce_pp_advantages(REWARDS[1:], world_sum=lambda mine: mine + stats(REWARDS[:1]))
    assert_close(torch.cat([rank0, rank1]), whole)
    # rank 0 alone (no sum over ranks) would scale its one group by that group's std: GRPO's 1.1547 / -0.5774, not 1.8257
    assert_close(reinforce_pp_advantages(REWARDS[:1], world_sum=lambda mine: mine), group_advantages(REWARDS[:1], True))


def test_advantages_unknown_kind_raises():
    with pytest.raises(ValueError, match="ppo"):
        advantages(REWARDS, "ppo", scale=True)


# ----------------------------------------------------------------------------------------------
# --policy-loss: gspo and cispo (ppo-clip: clipped_policy_loss above)

# two sequences of 3 tokens: sequence 0 of group 0 (A = +1), sequence 1 of group 1 (A = -1), its 3rd token padding
P_OLD = torch.tensor([[0.4, 0.5, 0.5], [0.5, 0.4, 0.3]])
P_NOW = torch.tensor([[0.6, 0.5, 0.4], [0.25, 0.5, 0.9]])  # ratios r = [[1.5, 1.0, 0.8], [0.5, 1.25, (3.0, masked)]]
ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
SEQ_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_gspo_one_clipped_ratio_per_sequence():
    """s = geometric mean of the ratios over the sequence's loss tokens:
    sequence 0: (1.5 * 1.0 * 0.8)^(1/3) = 1.2^(1/3) = 1.062659;  sequence 1: (0.5 * 1.25)^(1/2) = 0.625^(1/2) = 0.790569
    (the padding's 3.0 left out). With the band [0.8, 1.2]:
      sequence 0, A = +1: s inside -> each token -A s = -1.062659, unclipped; d/dlogp_t = -A s = -1.062659
      sequence 1, A = -1: s < 0.8 -> max(0.790569, 0.8) = 0.8 per token, clipped, no gradient
    (PPO-clip per token would clip sequence 0's first token and keep sequence 1's second: the unit is the sequence.)
    With the paper's band [1 - 3e-4, 1 + 4e-4] both sequences are clipped: -1.0004 and 0.9997 per token, no gradient."""
    logp = P_NOW.log().requires_grad_()
    loss, clipped = gspo_policy_loss(logp, P_OLD.log(), ADV, SEQ_MASK, 0.2, 0.2)
    s0, s1 = 1.2 ** (1 / 3), 0.625**0.5
    assert_close(loss * SEQ_MASK, torch.tensor([[-s0, -s0, -s0], [0.8, 0.8, 0.0]]))
    assert clipped.tolist() == [[False] * 3, [True] * 3] and s1 < 0.8
    (loss * SEQ_MASK).sum().backward()
    assert_close(logp.grad, torch.tensor([[-s0, -s0, -s0], [0.0, 0.0, 0.0]]))
    paper, paper_clipped = gspo_policy_loss(P_NOW.log(), P_OLD.log(), ADV, SEQ_MASK, 3e-4, 4e-4)
    assert_close(paper * SEQ_MASK, torch.tensor([[-1.0004, -1.0004, -1.0004], [0.9997, 0.9997, 0.0]]))
    assert paper_clipped.all()


def test_gspo_edges_fully_masked_sequence_and_a_ratio_at_the_bound():
    """A fully masked sequence (e.g. overlong-filtered): s = exp(0 / clamp(0, min=1)) = 1, finite, and it adds
    nothing once masked. A sequence whose tokens all have ratio 1 sits exactly on the lower bound 1 - 0 = 1:
    not clipped (the flag is strict), so its gradient -A s = -1 per token flows."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -0.1]]).requires_grad_()
    old = torch.tensor([[-1.0, -2.0, -0.5], [-5.0, -9.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    loss, clipped = gspo_policy_loss(logp, old, torch.ones(2, 3), mask, 0.0, 4e-4)
    assert torch.isfinite(loss).all() and not clipped[0].any()
    assert_close(loss[0], torch.tensor([-1.0, -1.0, -1.0]))
    (loss * mask).sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]]))


def test_cispo_clipped_tokens_keep_their_gradient():
    """loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log p_now, here clip_low 1 (no lower bound, as the
    paper), clip_high 0.2: weights w = [[min(1.5, 1.2) = 1.2, 1.0, 0.8], [0.5, min(1.25, 1.2) = 1.2, -]].
      sequence 0, A = +1: -1.2 ln 0.6 = 0.612991, -1.0 ln 0.5 = 0.693147, -0.8 ln 0.4 = 0.733033
      sequence 1, A = -1: +0.5 ln 0.25 = -0.693147, +1.2 ln 0.5 = -0.831777
    d loss / d log p = -w A: [[-1.2, -1.0, -0.8], [0.5, 1.2]]. The first token (r = 1.5 > 1.2) is clipped and still
    gets -1.2, where PPO-clip gives it 0; sequence 1's r = 0.5 is not clipped at all (no lower bound)."""
    logp = P_NOW.log().requires_grad_()
    loss, clipped = cispo_policy_loss(logp, P_OLD.log(), ADV, 1.0, 0.2)
    expected = torch.tensor(
        [[-1.2 * math.log(0.6), -math.log(0.5), -0.8 * math.log(0.4)], [0.5 * math.log(0.25), 1.2 * math.log(0.5), 0.0]]
    )
    assert_close(loss * SEQ_MASK, expected)
    assert (clipped & (SEQ_MASK > 0)).tolist() == [[True, False, False], [False, True, False]]
    (loss * SEQ_MASK).sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.2, -1.0, -0.8], [0.5, 1.2, 0.0]]))
    ppo_logp = P_NOW.log().requires_grad_()
    ppo, _ = clipped_policy_loss(ppo_logp, P_OLD.log(), ADV, 0.2, 0.2)
    (ppo * SEQ_MASK).sum().backward()
    assert ppo_logp.grad[0, 0] == 0  # the same token under PPO-clip: no gradient


def test_cispo_ratio_exactly_at_the_bound_is_not_clipped():
    """r = exp(0) = 1 exactly, band [1 - 0, 1 + 0.2]: the weight is 1 = r, so not marked clipped."""
    logp = torch.tensor([[-0.7]])
    loss, clipped = cispo_policy_loss(logp, logp.clone(), torch.tensor([[2.0]]), 0.0, 0.2)
    assert_close(loss, torch.tensor([[1.4]])) and clipped.tolist() == [[False]]  # -1 * 2 * -0.7


def test_sapo_gates_the_ratio_softly():
    """loss = -A * 4 s / tau with s = sigmoid(tau (r - 1)); tau 1 where A > 0, 1.05 where A < 0 (the paper's); the
    gradient d loss / d log p = -A * 4 s (1 - s) r.
      sequence 0, A = +1, r = 1.5, 1.0, 0.8: s = sigmoid(0.5) = 0.622459, 0.5, sigmoid(-0.2) = 0.450166
        loss -2.489837, -2.0, -1.800664; gradient -1.410022, -1.0, -0.792053
      sequence 1, A = -1, r = 0.5, 1.25: s = sigmoid(-0.525) = 0.371684, sigmoid(0.2625) = 0.565251
        loss 4 s / 1.05 = 1.415938, 2.153336; gradient 4 s (1 - s) r = 0.467070, 1.228712
    At r = 1 the gradient is -A, PPO-clip's; at r = 1.5 PPO-clip gives none (clipped), SAPO -1.41. Nothing is clipped."""
    logp = P_NOW.log().requires_grad_()
    loss, clipped = sapo_policy_loss(logp, P_OLD.log(), ADV, 1.0, 1.05)
    assert_close(
        loss * SEQ_MASK, torch.tensor([[-2.489837, -2.0, -1.800664], [1.415938, 2.153336, 0.0]]), atol=1e-6, rtol=0
    )
    (loss * SEQ_MASK).sum().backward()
    assert_close(logp.grad, torch.tensor([[-1.410022, -1.0, -0.792053], [0.467070, 1.228712, 0.0]]), atol=1e-6, rtol=0)
    assert not clipped.any()


@pytest.mark.parametrize("policy_loss", ["ppo-clip", "gspo", "cispo", "sapo"])
def test_grpo_loss_picks_the_policy_loss(policy_loss):
    """grpo_loss = the chosen policy loss, reduced by aggregate (token-mean over the 5 loss tokens)."""
    from types import SimpleNamespace

    mb = SimpleNamespace(loss_mask=SEQ_MASK, old_logprobs=P_OLD.log(), advantages=ADV, is_weight=None)
    loss, stats = grpo_loss(
        P_NOW.log(),
        torch.ones(2, 3),
        mb,
        clip_low=0.2,
        clip_high=0.2,
        kl_coef=0.0,
        kl_estimator="k3",
        loss_agg="token-mean",
        num_seqs=2.0,
        num_tokens=5.0,
        max_len=3,
        policy_loss=policy_loss,
    )
    token_loss, clipped = {
        "ppo-clip": lambda: clipped_policy_loss(P_NOW.log(), P_OLD.log(), ADV, 0.2, 0.2),
        "gspo": lambda: gspo_policy_loss(P_NOW.log(), P_OLD.log(), ADV, SEQ_MASK, 0.2, 0.2),
        "cispo": lambda: cispo_policy_loss(P_NOW.log(), P_OLD.log(), ADV, 0.2, 0.2),
        "sapo": lambda: sapo_policy_loss(P_NOW.log(), P_OLD.log(), ADV, 1.0, 1.05),
    }[policy_loss]()
    assert_close(loss, (token_loss * SEQ_MASK).sum() / 5)
    assert_close(stats["clip_frac"], (clipped.float() * SEQ_MASK).sum())
    with pytest.raises(ValueError, match="reinforce"):
        grpo_loss(
            P_NOW.log(),
            torch.ones(2, 3),
            mb,
            clip_low=0.2,
            clip_high=0.2,
            kl_coef=0.0,
            kl_estimator="k3",
            loss_agg="token-mean",
            num_seqs=2.0,
            num_tokens=5.0,
            max_len=3,
            policy_loss="reinforce",
        )


def test_the_default_path_is_todays_grpo_bit_for_bit():
    """--advantage grpo, --policy-loss ppo-clip, --rollout-correction none compute exactly what grpo.py computed
    before these flags: the same advantages, the same loss mask, no weight, the same loss and gradient (torch.equal)."""
    from types import SimpleNamespace

    rewards = torch.tensor([[0.2, 1.5, 0.0, 0.7], [5.0, -1.0, 2.0, 2.0]])
    assert torch.equal(advantages(rewards, "grpo", True), group_advantages(rewards, True))
    loss_mask = SEQ_MASK * torch.tensor([[1.0], [0.0]])  # sequence 1 overlong-filtered
    weight, keep, touched = rollout_correction(P_OLD.log(), P_NOW.log(), SEQ_MASK, "none", tis_cap=2.0, bounds=None)
    assert weight is None and torch.equal(loss_mask * keep, loss_mask) and not touched.any()
    mb = SimpleNamespace(loss_mask=loss_mask * keep, old_logprobs=P_OLD.log(), advantages=ADV, is_weight=weight)
    new_logp, old_logp = P_NOW.log().requires_grad_(), P_NOW.log().requires_grad_()
    loss, _ = grpo_loss(
        new_logp,
        torch.ones(2, 3),
        mb,
        clip_low=0.2,
        clip_high=0.28,
        kl_coef=0.0,
        kl_estimator="k3",
        loss_agg="seq-mean-token-mean",
        num_seqs=1.0,
        num_tokens=3.0,
        max_len=3,
    )
    before = aggregate(
        clipped_policy_loss(old_logp, P_OLD.log(), ADV, 0.2, 0.28)[0], loss_mask, "seq-mean-token-mean", 1.0, 3.0, 3
    )  # grpo_loss as it was, without KL and TIS
    loss.backward(), before.backward()
    assert torch.equal(loss, before) and torch.equal(new_logp.grad, old_logp.grad)


# ----------------------------------------------------------------------------------------------
# --rollout-correction, and the mismatch metrics logged every step

# two sequences of 3 tokens, sequence 1's 3rd token padding; r = p_old / p_sampler
P_SAMPLER = torch.tensor([[0.5, 0.1, 0.5], [0.25, 0.6, 0.9]])
P_TRAINER = torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.6, 0.1]])  # r = [[1, 3, 0.4], [1, 1, (1/9, masked)]]


def correct(kind, **kw):
    return rollout_correction(
        P_TRAINER.log(), P_SAMPLER.log(), SEQ_MASK, kind, **{"tis_cap": 2.0, "bounds": None, **kw}
    )


def test_gspo_clips_whole_sequences_even_at_the_bound():
    """Sequences whose s lies within 1e-6 of the upper bound, tokens of widely different log-probs: each sequence is
    clipped on all its tokens or on none (s computed once per sequence: the old form, PPO-clip with each token's old
    log-prob moved by log s, rounded per token and split 145 of 2000 such sequences)."""
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(2000, 64, generator=gen) * 30  # [N, T]
    log_s = math.log1p(4e-4) + (torch.rand(2000, 1, generator=gen) - 0.5) * 2e-6  # [N, 1]
    _, clipped = gspo_policy_loss(logp, logp - log_s, torch.ones(2000, 64), torch.ones(2000, 64), 3e-4, 4e-4)
    assert not (clipped.any(-1) & ~clipped.all(-1)).any() and 0 < clipped.all(-1).sum() < 2000


def test_rollout_correction_tis_caps_the_weight():
    """tis, cap 2: weights min(r, 2) = [[1, 2, 0.4], [1, 1, 1 (padding: log r masked to 0)]]; the r = 3 token is
    capped (1 of 5 model tokens); nothing masked."""
    weight, keep, touched = correct("tis")
    assert_close(weight, torch.tensor([[1.0, 2.0, 0.4], [1.0, 1.0, 1.0]]))
    assert torch.equal(keep, SEQ_MASK) and touched.tolist() == [[False, True, False], [False, False, False]]


def test_rollout_correction_mis_masks_tokens_outside_the_bounds():
    """mis, [0.5, 2]: r = 3 > 2 and r = 0.4 < 0.5 leave the loss: keep [[1, 0, 0], [1, 1, 0]], no weight.
    The bounds are inclusive: with [1, 2] the tokens of r = exactly 1 (log r = 0) stay."""
    weight, keep, touched = correct("mis", bounds=(0.5, 2.0))
    assert weight is None and keep.tolist() == [[1, 0, 0], [1, 1, 0]]
    assert touched.tolist() == [[False, True, True], [False, False, False]]
    _, at_bound, _ = correct("mis", bounds=(1.0, 2.0))
    assert at_bound.tolist() == [[1, 0, 0], [1, 1, 0]]


def test_rollout_correction_icepop_masks_and_weights():
    """icepop, [0.5, 5]: r = 0.4 < 0.5 is masked; the kept tokens are weighted by r: [[1, 3, 0], [1, 1, 0]]."""
    weight, keep, touched = correct("icepop", bounds=(0.5, 5.0))
    assert keep.tolist() == [[1, 1, 0], [1, 1, 0]] and touched.tolist() == [[False, False, True], [False, False, False]]
    assert_close(weight, torch.tensor([[1.0, 3.0, 0.0], [1.0, 1.0, 0.0]]))


def test_rollout_correction_decoupled_weights_by_the_behaviour_ratio_masked_above_the_cap():
    """decoupled (AReaL's decoupled PPO, --max-staleness >= 2), bounds (0, 2.5): p_old is the proximal policy the
    trainer recomputed, p_sampler the behaviour policy k versions back. r = p_old / p_sampler = [[1, 3, 0.4], [1, 1]]:
    the r = 3 token is above the cap and leaves the loss; the others weigh r, the low r = 0.4 too (no lower mask):
    weight [[1, 0, 0.4], [1, 1, 0]], keep [[1, 0, 1], [1, 1, 0]]."""
    weight, keep, touched = correct("decoupled", bounds=(0.0, 2.5))
    assert keep.tolist() == [[1, 0, 1], [1, 1, 0]] and touched.tolist() == [[False, True, False], [False, False, False]]
    assert_close(weight, torch.tensor([[1.0, 0.0, 0.4], [1.0, 1.0, 0.0]]))


def test_the_decoupled_loss_clips_against_the_proximal_policy_and_weighs_by_the_behaviour_ratio():
    """One token, A = 1, sampled by the behaviour policy with p_behav = 0.2; the proximal policy (the weights before
    this update, recomputed) gives it p_prox = 0.3, the policy now p = 0.39: the ratio against the proximal policy is
    1.3, clipped to 1.2 (clip 0.2), and the behaviour weight r = 0.3 / 0.2 = 1.5 (under the cap 5) scales it:
    loss = -1.5 * min(1.3, 1.2) = -1.8; d loss / d log p = 0 (the clipped branch has no gradient). At p = 0.33 (ratio
    1.1, inside the band): loss = -1.5 * 1.1 = -1.65, d loss / d log p = -1.5 * 1.1 = -1.65."""
    p_behav, p_prox = torch.tensor([[0.2]]), torch.tensor([[0.3]])
    weight, keep, _ = rollout_correction(
        p_prox.log(), p_behav.log(), torch.ones(1, 1), "decoupled", tis_cap=2.0, bounds=(0.0, 5.0)
    )
    assert_close(weight, torch.tensor([[1.5]]))
    for p_now, loss_want, grad_want in ((0.39, -1.8, 0.0), (0.33, -1.65, -1.65)):
        logp = torch.tensor([[math.log(p_now)]], requires_grad=True)
        token_loss, _ = clipped_policy_loss(logp, p_prox.log(), torch.ones(1, 1), 0.2, 0.2)
        loss = (token_loss * weight * keep).sum()
        loss.backward()
        assert_close(loss, torch.tensor(loss_want))
        assert_close(logp.grad, torch.tensor([[grad_want]]))


def test_max_staleness_sets_the_objective_and_async_rollout_is_staleness_one(monkeypatch):
    """--max-staleness 0: none; 1 (or --async-rollout): tis, one step off; >= 2: decoupled PPO with AReaL's cap, bounds
    (0, 5). One flag set, one meaning: --async-rollout becomes --max-staleness 1 and the other way round."""
    server = dict(rollout_mode="server", rollout_url=("http://h:1",))
    monkeypatch.setattr("sys.argv", ["grpo.py", "--max-staleness", "3"])
    a = variant_defaults(Args(**server, max_staleness=3))
    assert (a.rollout_correction, a.correction_bounds, a.async_rollout, a.max_staleness) == (
        "decoupled",
        (0.0, 5.0),
        False,
        3,
    )
    assert "staleness at most 3 (fully async: producer.py)" in variant_line(a)
    monkeypatch.setattr("sys.argv", ["grpo.py", "--max-staleness", "1"])
    a = variant_defaults(Args(**server, max_staleness=1))
    assert (a.rollout_correction, a.async_rollout) == ("tis", True)
    monkeypatch.setattr("sys.argv", ["grpo.py", "--async-rollout"])
    assert variant_defaults(Args(**server, async_rollout=True)).max_staleness == 1


def test_fully_async_flags_are_checked_in_one_line():
    server = dict(rollout_mode="server", rollout_url=("http://h:1",))
    check_args(Args(**server, max_staleness=2), world_size=1)
    for bad, words in (
        (dict(max_staleness=2), "--max-staleness 2 must be 0 without --rollout-mode server"),
        (dict(**server, max_staleness=-1), "--max-staleness -1 must be >= 0"),
        (dict(**server, max_staleness=2, deterministic_rollout=True), "--deterministic-rollout True must be without"),
        (dict(**server, max_staleness=2, async_rollout=True), "--async-rollout True must be not given with"),
    ):
        with pytest.raises(InputError) as e:
            check_args(Args(**bad), world_size=1)
        assert words in str(e.value), str(e.value)


def test_rollout_correction_seq_mask_drops_whole_sequences():
    """seq-mask, [0.999, 1.001]: sequence 0's geometric mean (1 * 3 * 0.4)^(1/3) = 1.2^(1/3) = 1.0627 > 1.001:
    all three tokens out; sequence 1's (1 * 1)^(1/2) = 1 (padding left out): kept. A fully masked sequence:
    exp(0 / clamp(0, min=1)) = 1, finite, nothing kept, nothing touched."""
    weight, keep, touched = correct("seq-mask", bounds=(0.999, 1.001))
    assert weight is None and keep.tolist() == [[0, 0, 0], [1, 1, 0]] and touched.sum() == 3
    empty = torch.zeros(1, 3)
    w, k, t = rollout_correction(
        P_TRAINER[:1].log(), P_SAMPLER[:1].log(), empty, "seq-mask", tis_cap=2.0, bounds=(0.999, 1.001)
    )
    assert w is None and not k.any() and not t.any()


def test_rollout_correction_ratio_exactly_at_the_cap():
    """tis with cap 1: r = 1 exactly (log r = 0) is not capped (strictly above only); r = 3 is; r = 0.4 is not."""
    weight, _, touched = correct("tis", tis_cap=1.0)
    assert_close(weight, torch.tensor([[1.0, 1.0, 0.4], [1.0, 1.0, 1.0]]))
    assert touched.tolist() == [[False, True, False], [False, False, False]]
    with pytest.raises(ValueError, match="is-cap"):
        correct("is-cap")


def test_mismatch_stats_by_hand():
    """Over the 5 model tokens, log r = [0, ln 3, ln 0.4, 0, 0]:
    mean |log r| = (1.098612 + 0.916291) / 5 = 0.402981
    k3 = r - 1 - log r: 3 - 1 - 1.098612 = 0.901388, 0.4 - 1 + 0.916291 = 0.316291 -> 1.217679 / 5 = 0.243536
    largest r = 3; tis at cap 2 touched 1 token of 5: 0.2. Without `touched` (ppo.py) no correction_frac."""
    from types import SimpleNamespace

    from rollout import mismatch_stats

    batch = SimpleNamespace(response_mask=SEQ_MASK, old_logprobs=P_TRAINER.log(), rollout_logprobs=P_SAMPLER.log())
    stats = mismatch_stats(batch, correct("tis")[2])
    assert stats == pytest.approx(
        {
            "rollout/logprob_abs_diff": 0.402981,
            "rollout/mismatch_kl": 0.243536,
            "rollout/mismatch_ratio_max": 3.0,
            "rollout/correction_frac": 0.2,
        },
        rel=1e-5,
    )
    assert "rollout/correction_frac" not in mismatch_stats(batch)


def test_a_non_finite_sampler_log_prob_is_bounded_or_dropped():
    """A sampler log-prob of -inf (a token it gave probability 0) makes r = inf: the mismatch metrics clamp log r at 20
    (KL e^20 - 21 on that token, not inf); tis caps it (weight 2). A NaN log-prob: tis weighs it 0 and counts it."""
    from types import SimpleNamespace

    from rollout import mismatch_stats

    sampler = P_SAMPLER.log().clone()
    sampler[0, 1] = -math.inf
    batch = SimpleNamespace(response_mask=SEQ_MASK, old_logprobs=P_TRAINER.log(), rollout_logprobs=sampler)
    stats = mismatch_stats(batch)
    assert all(math.isfinite(v) for v in stats.values()) and stats["rollout/mismatch_ratio_max"] == pytest.approx(
        math.exp(20)
    )
    weight, _, touched = rollout_correction(P_TRAINER.log(), sampler, SEQ_MASK, "tis", tis_cap=2.0, bounds=None)
    assert weight[0, 1] == 2.0 and touched[0, 1]
    sampler[0, 1] = math.nan
    weight, _, touched = rollout_correction(P_TRAINER.log(), sampler, SEQ_MASK, "tis", tis_cap=2.0, bounds=None)
    assert weight[0, 1] == 0.0 and touched[0, 1] and torch.isfinite(weight).all()


# ----------------------------------------------------------------------------------------------
# the variants' flags: defaults that depend on other flags, and their checks


def test_variant_defaults_follow_the_papers_unless_given(monkeypatch):
    monkeypatch.setattr("sys.argv", ["grpo.py", "--policy-loss", "gspo", "--rollout-correction", "seq-mask"])
    a = variant_defaults(Args(policy_loss="gspo", rollout_correction="seq-mask"))
    assert (a.clip_low, a.clip_high, a.correction_bounds) == (3e-4, 4e-4, (0.999, 1.001))
    monkeypatch.setattr("sys.argv", ["grpo.py", "--policy-loss", "cispo", "--clip-high", "0.28"])
    a = variant_defaults(Args(policy_loss="cispo", clip_high=0.28))
    assert (a.clip_low, a.clip_high, a.rollout_correction) == (1.0, 0.28, "none")  # given: kept
    monkeypatch.setattr("sys.argv", ["grpo.py", "--policy-loss", "sapo", "--sapo-tau", "1", "2"])
    assert variant_defaults(Args(policy_loss="sapo", sapo_tau=(1.0, 2.0))).sapo_tau == (1.0, 2.0)  # given: kept
    monkeypatch.setattr("sys.argv", ["grpo.py"])
    a = variant_defaults(Args())
    assert (a.clip_low, a.clip_high, a.rollout_correction, a.correction_bounds, a.sapo_tau) == (
        0.2,
        0.2,
        "none",
        None,
        None,
    )


def test_variant_line_names_the_settings_in_force(monkeypatch):
    """The start-up line: each axis with the range it uses; one update a batch (ratio 1) said, not with 4."""
    monkeypatch.setattr("sys.argv", ["grpo.py", "--policy-loss", "gspo", "--rollout-correction", "icepop"])
    line = variant_line(variant_defaults(Args(policy_loss="gspo", rollout_correction="icepop")))
    assert line.startswith(
        "algorithm: advantage grpo | policy loss gspo (clip 0.0003 / 0.0004, seq-mean-token-mean) | "
        "rollout correction icepop (bounds 0.5 5) | lr 1e-06 | one update a batch: every ratio 1, nothing clips"
    )
    monkeypatch.setattr("sys.argv", ["grpo.py", "--rollout-correction", "tis", "--num-minibatches", "4"])
    line = variant_line(variant_defaults(Args(rollout_correction="tis", num_minibatches=4)))
    assert (
        line
        == "algorithm: advantage grpo | policy loss ppo-clip (clip 0.2 / 0.2, token-mean) | rollout correction tis (cap 2)"
        " | lr 1e-06"
    )
    monkeypatch.setattr("sys.argv", ["grpo.py", "--policy-loss", "sapo"])
    assert variant_line(variant_defaults(Args(policy_loss="sapo"))).startswith(
        "algorithm: advantage grpo | policy loss sapo (tau 1 / 1.05, token-mean) | rollout correction none | lr 1e-06 | "
        "one update"
    )
    monkeypatch.setattr("sys.argv", ["grpo.py", "--advantage", "rloo", "--epochs", "2"])
    assert variant_line(variant_defaults(Args(advantage="rloo", epochs=2))).endswith(
        "rollout correction none | lr 1e-06"
    )
    monkeypatch.setattr("sys.argv", ["grpo.py", "--lora-rank", "8", "--epochs", "2"])  # no --lr: LoRA's default
    assert variant_line(variant_defaults(Args(lora_rank=8, epochs=2))).endswith(
        "| lr 1e-05 (LoRA's default: 10x full fine-tuning's)"
    )


def test_async_rollout_still_corrects_with_tis_by_default(monkeypatch):
    """As before --rollout-correction: --async-rollout alone means tis with cap 2; --tis-cap 0 turns it off."""
    server = dict(rollout_mode="server", rollout_url=("http://h:1",), async_rollout=True)
    monkeypatch.setattr("sys.argv", ["grpo.py", "--async-rollout"])
    a = variant_defaults(Args(**server))
    assert (a.rollout_correction, a.tis_cap) == ("tis", 2.0)
    monkeypatch.setattr("sys.argv", ["grpo.py", "--async-rollout", "--tis-cap", "0"])
    assert variant_defaults(Args(**server, tis_cap=0.0)).rollout_correction == "none"
    monkeypatch.setattr("sys.argv", ["grpo.py", "--async-rollout", "--rollout-correction", "icepop"])
    a = variant_defaults(Args(**server, rollout_correction="icepop"))
    assert (a.rollout_correction, a.correction_bounds) == ("icepop", (0.5, 5.0))


def test_check_args_variant_flags():
    for fine in (
        Args(policy_loss="cispo", clip_low=1.0),
        Args(rollout_correction="tis", tis_cap=3.0),
        Args(rollout_correction="mis", correction_bounds=(0.8, 1.25)),
        Args(advantage="rloo"),
    ):
        check_args(fine, world_size=1)
    with pytest.raises(InputError) as e:
        check_args(
            Args(tis_cap=3.0, correction_bounds=(0.5, 2.0), advantage="reinforce++", scale_rewards=False, clip_low=1.5),
            world_size=1,
        )
    message = str(e.value)
    assert "--tis-cap 3.0 must be given with --rollout-correction tis or --async-rollout only" in message
    assert "--tis-cap 3.0 must be > 0" not in message  # the value is fine: only where it is given is not
    assert (
        "--correction-bounds (0.5, 2.0) must be LO HI with 0 <= LO <= 1 <= HI < inf, with --rollout-correction mis"
        in message
    )
    assert "--scale-rewards False must be with --advantage grpo" in message
    assert "--clip-low 1.5 must be in [0, 1] (1: no lower bound)" in message
    with pytest.raises(InputError, match=r"--correction-bounds \(1.2, 2.0\) must be"):
        check_args(Args(rollout_correction="mis", correction_bounds=(1.2, 2.0)), world_size=1)
    with pytest.raises(InputError, match=r"--tis-cap 0.0 must be > 0 \(0: no tis with --async-rollout"):
        check_args(Args(rollout_correction="tis", tis_cap=0.0), world_size=1)
    with pytest.raises(
        InputError, match=r"--correction-bounds \(0.0, inf\) must be LO HI with 0 <= LO <= 1 <= HI < inf"
    ):
        check_args(Args(rollout_correction="icepop", correction_bounds=(0.0, math.inf)), world_size=1)
    check_args(Args(policy_loss="sapo", sapo_tau=(1.0, 2.0)), world_size=1)
    for bad in (Args(sapo_tau=(1.0, 2.0)), Args(policy_loss="sapo", sapo_tau=(0.0, 1.0))):
        with pytest.raises(
            InputError, match=r"--sapo-tau \(.*\) must be POS NEG, finite and > 0, with --policy-loss sapo"
        ):
            check_args(bad, world_size=1)


# ----------------------------------------------------------------------------------------------
# The math audit (issue 38)


def test_opts_layerdrop_is_off_too():
    """OPT skips whole decoder layers at random in training mode (config.layerdrop, copied to its decoder): dropout_off
    left it on (issue 54, item 6). A tiny OPT with layerdrop 0.5 gives one output in training mode, twice."""
    from transformers import OPTConfig, OPTForCausalLM

    from fsdp import dropout_off

    config = OPTConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=4, ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16
    )
    config.layerdrop, config.dropout = 0.5, 0.0
    torch.manual_seed(0)
    model = OPTForCausalLM(config).train()
    ids = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        outs = [model(ids).logits for _ in range(8)]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])  # the hazard: layers skipped at random
    dropout_off(model)
    with torch.no_grad():
        outs = [model(ids).logits for _ in range(8)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]) and model.model.decoder.layerdrop == 0.0
    assert model.config.layerdrop == 0.0


@pytest.mark.parametrize("kind", ["policy", "critic", "reward model"])
def test_no_dropout_survives_loading_even_from_the_config(tiny_model_dir, tmp_path, kind):
    """Llama applies config.attention_dropout functionally whenever the module is in training mode, and policy.train()
    stays on: the old log-probs and the update saw dropout noise (1.16 nats apart in the audit). A model whose config
    sets every dropout it has, loaded as the policy, a critic (token classification) or a reward model, gives the
    same outputs in training mode twice and in eval mode; transformers' own load does not."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    from fsdp import load_model

    folder = tmp_path / "dropout-model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(attention_dropout=0.3, classifier_dropout=0.3, num_labels=1)
    (folder / "config.json").write_text(json.dumps(config))
    model_class = {
        "policy": AutoModelForCausalLM,
        "critic": AutoModelForTokenClassification,
        "reward model": AutoModelForSequenceClassification,
    }[kind]
    ids = torch.tensor([[5, 17, 42, 9, 33, 7, 21, 12]])

    def outputs(model):
        torch.manual_seed(0)
        with torch.no_grad():
            model.train()
            first, second = model(ids).logits, model(ids).logits
            model.eval()
            return first, second, model(ids).logits

    plain = model_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    first, second, _ = outputs(plain)
    assert not torch.equal(first, second)  # the hazard is real: training mode samples dropout
    loaded = load_model(
        str(folder),
        torch.device("cpu"),
        torch.float32,
        attn_implementation="eager",
        model_class=model_class,
        new_head=kind != "policy",
    )
    first, second, evaluated = outputs(loaded)
    assert torch.equal(first, second) and torch.equal(first, evaluated)
    assert loaded.config.attention_dropout == 0.0 and loaded.model.layers[0].self_attn.attention_dropout == 0.0


def test_what_each_kl_estimators_gradient_follows_in_the_loss():
    """A 3-token policy and a reference, expectations taken exactly (each token weighted by its probability, held
    fixed: the loss sees the policy's own samples). k1 = log(p/ref): E_p[grad log p] = sum_x p_x (e_x - p) = 0. k2's
    expected gradient is that of KL(p || ref); k3's, (1 - ref/p) grad log p in expectation, is that of KL(ref || p)."""
    ref_logp = torch.log_softmax(torch.tensor([0.0, 0.4, -0.1]), -1)
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)

    def grad_of(loss_fn):
        return torch.autograd.grad(loss_fn(torch.log_softmax(theta, -1)), theta)[0]

    def expected_grad(estimator):
        return grad_of(lambda logp: (logp.exp().detach() * kl_penalty(logp, ref_logp, estimator)).sum())

    kl_p_ref = grad_of(lambda logp: (logp.exp() * (logp - ref_logp)).sum())  # grad KL(p || ref)
    kl_ref_p = grad_of(
        lambda logp: (ref_logp.exp() * (ref_logp - logp)).sum()
    )  # grad KL(ref || p) = -sum ref grad log p
    assert (kl_p_ref - kl_ref_p).abs().max() > 0.02  # the two differ here: the test tells them apart
    assert_close(expected_grad("k1"), torch.zeros(3), atol=1e-7, rtol=0)
    assert_close(expected_grad("k2"), kl_p_ref, atol=1e-6, rtol=0)
    assert_close(expected_grad("k3"), kl_ref_p, atol=1e-6, rtol=0)


def test_k1_in_the_loss_is_refused_and_k1_in_the_reward_is_not():
    with pytest.raises(
        InputError,
        match=r"--kl-estimator k1 must be k2 or k3 in the loss \(--beta > 0\): k1's gradient "
        r"there is that of log p, zero in expectation; k1 belongs in the reward \(--kl-in-reward\)",
    ):
        check_args(Args(beta=0.04, kl_estimator="k1"), world_size=1)
    check_args(Args(beta=0.04, kl_estimator="k1", kl_in_reward=True), world_size=1)
    check_args(Args(beta=0.0, kl_estimator="k1"), world_size=1)  # no KL at all: nothing to refuse
    check_args(Args(beta=0.04, kl_estimator="k2"), world_size=1)


def test_gspo_defaults_to_its_papers_objective_a_mean_per_sequence(monkeypatch):
    """GSPO's objective averages each sequence's tokens, then the sequences: seq-mean-token-mean, gspo's default now
    (token-mean's gradient was 29-35% off it in the audit); --loss-agg given keeps its value; the algorithm line says it."""
    monkeypatch.setattr("sys.argv", ["grpo.py", "--policy-loss", "gspo"])
    args = variant_defaults(Args(policy_loss="gspo"))
    assert args.loss_agg == "seq-mean-token-mean" and "seq-mean-token-mean" in variant_line(args)
    monkeypatch.setattr("sys.argv", ["grpo.py", "--policy-loss", "gspo", "--loss-agg", "token-mean"])
    assert variant_defaults(Args(policy_loss="gspo", loss_agg="token-mean")).loss_agg == "token-mean"
    monkeypatch.setattr("sys.argv", ["grpo.py"])
    assert variant_defaults(Args()).loss_agg == "token-mean"


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_samplers_log_probs_under_top_p_are_the_full_distributions_as_the_trainers(tiny_model_dir, deterministic):
    """--top-p < 1 samples from the nucleus, but the HF engine reports log_softmax(logits / T) of the whole
    vocabulary, as the trainer computes it and as SGLang 0.5.16 does (its sampler returns log(softmax(logits / T))
    before the top-p filter, which sorts a copy): TIS/MIS compare one quantity on either engine. The nucleus'
    own (renormalized) log-prob is larger, and every sampled token lies inside the nucleus (--deterministic-rollout's
    per-sample sampling too)."""
    from rollout import HFEngine, Sampling, stop_token_ids
    from transformers import AutoTokenizer

    engine = HFEngine(tiny_model_dir, deterministic=deterministic)
    stop = stop_token_ids(AutoTokenizer.from_pretrained(tiny_model_dir), tiny_model_dir)
    prompt, T, top_p = [5, 17, 42, 9], 0.7, 0.5
    out = engine.generate(
        [prompt],
        [Sampling(max_new_tokens=12, stop_ids=stop, temperature=T, top_p=top_p).params(3)],
        return_logprob=True,
    )[0]
    response = out["output_ids"]
    reported = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])  # [N]
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()  # [N, V]
    full = torch.log_softmax(logits / T, -1)  # [N, V]
    tokens = torch.tensor(response)
    assert_close(reported, full.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-4, rtol=0)
    probs, order = full.exp().sort(-1, descending=True)
    inside = (probs.cumsum(-1) - probs) < top_p  # the nucleus
    nucleus_mass = (probs * inside).sum(-1)  # [N]
    rank = (order == tokens[:, None]).float().argmax(-1)
    assert inside.gather(-1, rank[:, None]).all()  # sampled from the nucleus ...
    assert (
        reported < full.gather(-1, tokens[:, None]).squeeze(-1) - nucleus_mass.log() - 1e-3
    ).any()  # ... not its log-prob


def test_the_lr_schedule_counts_the_optimizer_steps_the_run_plans():
    """The schedule spans steps x epochs x --num-minibatches optimizer steps. Dynamic sampling's shrunken batch still
    makes --num-minibatches of them (torch.chunk made 3 of 6 rows in 4), and an update skipped whole (no group with
    differing rewards) or a NaN gradient moves the schedule on as if it had stepped: the LR follows the run's steps."""
    import warnings

    from fsdp import clip_and_step, skip_schedule

    rows = torch.arange(6)
    assert [len(m) for m in rows.tensor_split(4)] == [2, 2, 1, 1] and len(rows.chunk(4)) == 3
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / 10)  # 1.0, 0.9, 0.8, ...
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skip_schedule(scheduler, 4)  # a step of 4 optimizer steps skipped whole: 1 - 4/10
        assert scheduler.get_last_lr() == pytest.approx([0.6])
        before = [p.detach().clone() for p in layer.parameters()]
        (layer(torch.ones(1, 2)).sum() * float("nan")).backward()
        assert math.isnan(clip_and_step(layer, optimizer, scheduler, 1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))  # the NaN never reached the weights
    assert scheduler.get_last_lr() == pytest.approx([0.5]) and not caught  # ... and the schedule moved on, quietly
