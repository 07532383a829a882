"""grpo.py's ALGO functions against numbers worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch
from torch.testing import assert_close

from fsdp import lr_lambda
from grpo import Args, aggregate, check_args, clipped_policy_loss, group_advantages, grpo_loss, kl_penalty
from preflight import InputError

# ----------------------------------------------------------------------------------------------
# group_advantages


def test_group_advantages_scaled_uses_unbiased_std():
    """Centred by the group mean, divided by the unbiased (n-1) std + eps; equal rewards give 0, not NaN."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0],
                            [2.0, 2.0, 2.0, 2.0]])
    # group 0: mean 0.5 -> centred [0.5, -0.5, -0.5, 0.5]
    #          unbiased var = (4 * 0.25) / (4 - 1) = 1/3 -> std = 0.57735
    #          0.5 / (0.57735 + 1e-6) = 0.866024
    # group 1: mean 2 -> centred all 0; std 0 -> 0 / (0 + 1e-6) = 0
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([[a, -a, -a, a],
                             [0.0, 0.0, 0.0, 0.0]])
    adv = group_advantages(rewards, scale=True)
    assert_close(adv, expected)
    assert not adv.isnan().any()


def test_group_advantages_unscaled_is_only_centred():
    """scale=False (Dr.GRPO): rewards minus the group mean, nothing else."""
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0],
                            [3.0, 1.0, 2.0, 2.0]])
    # group 0: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]
    # group 1: mean 8/4 = 2 -> [1, -1, 0, 0]
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5],
                             [1.0, -1.0, 0.0, 0.0]])
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

VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                       [5.0, 6.0, 7.0, 8.0],
                       [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0],   # 3 tokens, masked sum 1 + 2 + 3 = 6
                     [1.0, 1.0, 0.0, 0.0],   # 2 tokens (then padding), masked sum 5 + 6 = 11
                     [0.0, 0.0, 0.0, 0.0]])  # fully masked (e.g. an overlong-filtered response): 0
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
    assert f(0) == pytest.approx(0.5)   # warm-up: 1/2
    assert f(2) == pytest.approx(1.0)   # progress 0: 0.1 + 0.9 * 0.5 * (1 + cos 0) = 1
    assert f(7) == pytest.approx(0.55)  # progress (7-2)/(12-2) = 0.5: 0.1 + 0.9 * 0.5 * (1 + cos pi/2) = 0.55
    assert f(12) == pytest.approx(0.1)  # progress 1: 0.1 + 0.9 * 0.5 * (1 + cos pi) = 0.1
    assert f(50) == pytest.approx(0.1)  # progress clamped at 1
    values = [f(i) for i in range(2, 13)]
    assert all(a > b for a, b in zip(values, values[1:]))  # strictly decreasing after warm-up


def test_lr_linear_halfway():
    """Linear decay: halfway between 1 and min_lr_ratio at the midpoint."""
    f = lr_lambda(0, "linear", 0.2, 10)
    assert f(0) == pytest.approx(1.0)
    assert f(5) == pytest.approx(0.6)   # 0.2 + 0.8 * (1 - 5/10) = 0.6
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
    from preflight import InputError

    with pytest.raises(InputError) as e:
        check_args(Args(async_rollout=True, rollout_url=("localhost:30000",), tis_cap=-1.0), world_size=1)
    message = str(e.value)
    assert "--async-rollout True must be with --rollout-mode server" in message
    assert "--rollout-url ('localhost:30000',) must be http://HOST:PORT of each server, with --rollout-mode server;" in message
    assert "--tis-cap -1.0 must be >= 0" in message
    with pytest.raises(InputError, match=r"--rollout-url \(\) must be .* takes these or --rollout-gpus k"):
        check_args(Args(rollout_mode="server"), world_size=1)
    with pytest.raises(InputError, match=r"--rollout-url \('http://h:1',\) must be .*not both"):
        check_args(Args(rollout_mode="server", rollout_url=("http://h:1",), rollout_gpus=1), world_size=1)
    with pytest.raises(InputError, match="--rollout-tp 2 must be 1 with --rollout-url"):
        check_args(Args(rollout_mode="server", rollout_url=("http://h:1",), rollout_tp=2), world_size=2)
    check_args(Args(rollout_mode="server", rollout_url=("http://h:1", "http://h:2"), async_rollout=True), world_size=1)
    # servers of the job's own: the GPUs must be there beside the training ranks (this machine has none)
    with pytest.raises(InputError, match=r"--rollout-gpus 1 must be with --rollout-mode server, .* 0 GPUs of this node"):
        check_args(Args(rollout_mode="server", rollout_gpus=1), world_size=1)
    with pytest.raises(InputError, match=r"--rollout-gpus 1 must be with --rollout-mode server"):
        check_args(Args(rollout_gpus=1), world_size=1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    check_args(Args(rollout_mode="server", rollout_gpus=2, rollout_tp=2, async_rollout=True, prompts_per_step=36), world_size=6)
    with pytest.raises(InputError, match=r"--rollout-gpus 2 must be .* the 8 GPUs of this node less its 7 .*nproc_per_node 6"):
        check_args(Args(rollout_mode="server", rollout_gpus=2, prompts_per_step=35), world_size=7)


def test_rollout_tp_stays_within_a_node(monkeypatch):
    """An engine's TP group is GPUs of one node (CUDA IPC weight sync): 2 nodes of 1 rank can't share one."""
    from preflight import InputError

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(InputError, match=r"--rollout-tp 2 must be a divisor of the 1 ranks of each node .*--nproc_per_node"):
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
    mb = SimpleNamespace(loss_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]),
                         old_logprobs=logp.clone(), ref_logprobs=logp - 0.2,
                         advantages=torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]))
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
    """The sampler (an older policy, --async-rollout) gave the tokens log-probs `rollout`; each token's
    loss is weighted by min(p_old / p_sampler, cap), with no gradient through the weight."""
    from types import SimpleNamespace

    old = torch.log(torch.tensor([[0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5]]))  # weights 2.0 and 1.0
    mb = SimpleNamespace(loss_mask=torch.ones(1, 2), old_logprobs=old, rollout_logprobs=rollout,
                         advantages=torch.ones(1, 2))
    logp = old.clone().requires_grad_()
    common = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.0, kl_estimator="k1", loss_agg="token-mean", num_seqs=1.0,
                  num_tokens=2.0, max_len=2)
    loss, stats = grpo_loss(logp, torch.ones(1, 2), mb, tis_cap=1.5, **common)
    # token losses -1 * min(2, 1.5) and -1 * 1 -> mean -1.25; the weight sum 2.5, one token capped
    assert_close(loss, torch.tensor(-1.25))
    assert_close(stats["tis_weight"], torch.tensor(2.5)) and assert_close(stats["tis_capped"], torch.tensor(1.0))
    loss.backward()  # d/dlogp of -A * ratio * w at ratio 1: -w / num_tokens
    assert_close(logp.grad, torch.tensor([[-0.75, -0.5]]))
    off, off_stats = grpo_loss(old, torch.ones(1, 2), mb, tis_cap=0.0, **common)
    assert_close(off, torch.tensor(-1.0)) and "tis_weight" not in off_stats
