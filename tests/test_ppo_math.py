"""ppo.py's pure functions against hand-computed values: GAE, KL-in-reward, value clipping,
whitening with masks, the adaptive KL controller."""

import math

import pytest
import torch
from torch.testing import assert_close

from ppo import Args, actor_loss, adaptive_kl_coef, check_args, clipped_value_loss, gae, masked_whiten, token_rewards
from common import InputError


def test_gae_hand_example():
    """One row: a prompt position, then 3 response tokens; gamma 0.9, lambda 0.8 (gamma*lambda = 0.72).
    t=3: delta = 1 + 0.9*0 - 0.7 = 0.3                    A3 = 0.3
    t=2: delta = 0 + 0.9*0.7 - 0.6 = 0.03                 A2 = 0.03 + 0.72*0.3 = 0.246
    t=1: delta = 0 + 0.9*0.6 - 0.5 = 0.04                 A1 = 0.04 + 0.72*0.246 = 0.21712
    t=0: prompt, masked                                   A0 = 0; returns = A + V on the mask."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close(adv, torch.tensor([[0.0, 0.21712, 0.246, 0.3]]))
    assert_close(ret, torch.tensor([[0.0, 0.71712, 0.846, 1.0]]))


def test_gae_ignores_padding_after_the_response():
    """Values at padding positions (5.0) must not leak in: the episode ends at the last response token.
    gamma = lambda = 1: t=1: delta = 2 - 1 = 1, A1 = 1; t=0: delta = 0 + 1 - 1 = 0, A0 = 0 + 1 = 1."""
    adv, ret = gae(
        torch.tensor([[0.0, 2.0, 0.0, 0.0]]),
        torch.tensor([[1.0, 1.0, 5.0, 5.0]]),
        torch.tensor([[1.0, 1.0, 0.0, 0.0]]),
        gamma=1.0,
        lam=1.0,
    )
    assert_close(adv, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert_close(ret, torch.tensor([[2.0, 2.0, 0.0, 0.0]]))


def test_gae_gamma_lambda_one_is_reward_to_go_minus_values():
    """With gamma = lambda = 1, GAE telescopes to (sum of rewards from t on) - V(t)."""
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.float)
    adv, ret = gae(rewards * mask, values, mask, gamma=1.0, lam=1.0)
    to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    assert_close(adv, (to_go - values) * mask)
    assert_close(ret, to_go * mask)


def test_token_rewards_score_on_last_token_kl_on_every_token():
    """coef 0.1: row 0 pays 0.01/0.02/0.03 and gets its score 1 on position 2 (its last response token);
    row 1 pays 0.05 on positions 1-3 and gets 2 on position 3. Prompt/padding positions get nothing."""
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [9.0, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    expected = torch.tensor([[-0.01, -0.02, 0.97, 0.0], [0.0, -0.05, -0.05, 1.95]])
    assert_close(token_rewards(scores, kl, mask, kl_coef=0.1), expected)


def test_token_rewards_without_kl_is_the_sparse_score():
    r = token_rewards(torch.tensor([3.0]), torch.zeros(1, 3), torch.tensor([[0.0, 1.0, 1.0]]), kl_coef=0.0)
    assert_close(r, torch.tensor([[0.0, 0.0, 3.0]]))


def test_clipped_value_loss():
    """clip 0.2, old value 1.0:
    V=1.5, R=2: V_clip=1.2; (1.5-2)^2=0.25 < (1.2-2)^2=0.64 -> 0.5*0.64=0.32, clipped
    V=1.1, R=2: inside the band: both 0.81 -> 0.405, not clipped
    V=0.5, R=0: V_clip=0.8; 0.25 < 0.64 -> 0.32, clipped (the pessimistic side wins)
    V=1.5, R=1.6: V_clip=1.2; 0.01 < 0.16 -> 0.08, clipped: leaving the band is never rewarded"""
    values = torch.tensor([1.5, 1.1, 0.5, 1.5])
    old = torch.ones(4)
    returns = torch.tensor([2.0, 2.0, 0.0, 1.6])
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    assert_close(loss, torch.tensor([0.32, 0.405, 0.32, 0.08]))
    assert clipped.tolist() == [True, False, True, True]


def test_clipped_value_loss_gradient_vanishes_when_clipped():
    values = torch.tensor([1.5], requires_grad=True)
    loss, _ = clipped_value_loss(values, torch.ones(1), torch.tensor([2.0]), clip=0.2)
    loss.sum().backward()
    assert values.grad.item() == 0.0  # the clipped branch is constant in V


def test_masked_whiten_uses_only_masked_entries():
    """Entries 1, 2, 3, 4 count: mean 2.5, var (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25; the 100 is padding."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    s = math.sqrt(1.25)
    expected = torch.tensor([[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]])
    assert_close(masked_whiten(x, mask), expected, atol=1e-6, rtol=1e-6)


def test_masked_whiten_reduce_sums_over_ranks():
    """`reduce` stands for an all-reduce sum: doubling every sum (two identical ranks) changes nothing."""
    x, mask = torch.tensor([[1.0, 2.0, 4.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert_close(masked_whiten(x, mask, reduce=lambda t: 2 * t), masked_whiten(x, mask))


def test_adaptive_kl_coef():
    """error = clip(kl/target - 1, -0.2, 0.2); coef *= 1 + error * n / horizon."""
    assert adaptive_kl_coef(0.1, kl=2.0, target=1.0, horizon=1000, n=100) == pytest.approx(0.1 * 1.02)
    assert adaptive_kl_coef(0.1, kl=0.5, target=1.0, horizon=1000, n=100) == pytest.approx(0.1 * 0.98)
    assert adaptive_kl_coef(0.1, kl=1.1, target=1.0, horizon=1000, n=100) == pytest.approx(0.1 * 1.01)


def test_check_args(monkeypatch):
    check_args(Args(), world_size=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 2 nodes of 4 ranks: an engine's TP group stays on one
    with pytest.raises(InputError, match="--rollout-tp 8 must be a divisor of the 4 ranks of each node"):
        check_args(Args(rollout_tp=8), world_size=8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(InputError, match="--gamma 1.5"):
        check_args(Args(gamma=1.5), world_size=1)
    with pytest.raises(InputError, match="--prompts-per-step 32 must be >= 1 and divide by the 3 ranks"):
        check_args(Args(), world_size=3)


def test_actor_loss_tis_weights_by_hand():
    """tis_cap 2, old = new log-probs (ratio 1: PPO-clip's term is -A), sampler ratios p_old / p_sampler = [3, 0.5, NaN]:
    weights [2 (capped), 0.5, 0 (a NaN sampler log-prob)], A = 1, no entropy: loss = -(2 + 0.5 + 0) / 3 tokens."""
    from types import SimpleNamespace

    old = torch.log(torch.tensor([[0.3, 0.2, 0.5]]))
    sampler = torch.log(torch.tensor([[0.1, 0.4, 0.5]]))
    sampler[0, 2] = math.nan
    mb = SimpleNamespace(
        loss_mask=torch.ones(1, 3), old_logprobs=old, rollout_logprobs=sampler, advantages=torch.ones(1, 3)
    )
    loss, stats = actor_loss(
        old.clone(), torch.zeros(1, 3), mb, clip_low=0.2, clip_high=0.2, entropy_coef=0.0, num_tokens=3.0, tis_cap=2.0
    )
    assert loss.item() == pytest.approx(-2.5 / 3) and stats["tis_capped"].item() == 1.0
    assert stats["tis_weight"].item() == pytest.approx(2.5)


def test_a_kl_penalty_in_the_reward_gives_the_kl_gradient_with_k1_only():
    """The reward -kl(x) reaches the actor through the policy gradient E_p[grad log p(x) * -kl(x)] (exact expectation
    over a 3-token policy). With k1 = log(p/ref) that is -grad KL(p || ref): sum_x p_x grad log p_x log(p_x/ref_x) is
    KL's gradient (its other term, sum_x p_x grad log p_x, is 0). k2 and k3 give another vector (biased; the audit
    found 0.26 and 0.33 off a |grad KL| of 0.38 on its example): the Args docstring says so."""
    from ppo import kl_penalty

    ref_logp = torch.log_softmax(torch.tensor([0.0, 0.4, -0.1]), -1)
    theta = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    logp = torch.log_softmax(theta, -1)
    kl_grad = torch.autograd.grad((logp.exp() * (logp - ref_logp)).sum(), theta, retain_graph=True)[0]

    def policy_gradient(estimator):  # the penalty is a reward: a constant to the gradient, log p carries it
        penalty = kl_penalty(logp.detach(), ref_logp, estimator)
        return torch.autograd.grad((logp.exp().detach() * logp * -penalty).sum(), theta, retain_graph=True)[0]

    assert_close(policy_gradient("k1"), -kl_grad, atol=1e-6, rtol=0)
    for estimator in ("k2", "k3"):  # here 1.12 and 1.19 |grad KL| off: not even its direction
        assert (policy_gradient(estimator) + kl_grad).norm() > 0.5 * kl_grad.norm()
