"""pipeline/losses.py against numbers worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from pipeline.losses import (
    center_loss,
    dpo_loss,
    entropy_from_logits,
    gae,
    ipo_loss,
    kl_per_token,
    lm_loss,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    pairwise_loss,
    policy_loss,
    shaped_rewards,
    value_loss,
)


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


# --------------------------------------------------------------------------- reward-model losses


def test_pairwise_loss_hand_values():
    r_c, r_r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    # -log sigmoid(2) = log(1 + e^-2) = 0.126928; -log sigmoid(0) = log 2 = 0.693147
    assert close(pairwise_loss(r_c, r_r), (0.126928 + 0.693147) / 2)
    # margin 1 on the first pair: -log sigmoid(2 - 1) = log(1 + e^-1) = 0.313262
    assert close(pairwise_loss(r_c, r_r, torch.tensor([1.0, 0.0])), (0.313262 + 0.693147) / 2)


def test_pairwise_loss_is_stable_for_large_differences():
    loss = pairwise_loss(torch.tensor([-200.0]), torch.tensor([0.0]))
    assert torch.isfinite(loss) and close(loss, 200.0)


def test_center_loss_hand_values():
    # (1 + 0.5)^2 = 2.25, (-2 + 1)^2 = 1 -> mean 1.625
    assert close(center_loss(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0])), 1.625)


def test_lm_loss_shifts_and_masks():
    one = math.log(1.0)
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0],  # uniform, predicts labels[1] = 0: CE = log 3 = 1.098612
          [one, one, math.log(2.0)],  # probs (.25, .25, .5), predicts labels[2] = 2: CE = log 2
          [99.0, -99.0, 5.0]]]  # last position predicts nothing: ignored
    )
    labels = torch.tensor([[1, 0, 2]])
    assert close(lm_loss(logits, labels, torch.tensor([[0, 1, 1]])), (1.098612 + 0.693147) / 2)
    assert close(lm_loss(logits, labels, torch.tensor([[1, 0, 1]])), 0.693147)


# --------------------------------------------------------------------------- log-probs, entropy


def test_logprobs_from_logits_with_temperature():
    logits = torch.log(torch.tensor([[[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]]]))  # (1, 2, 3)
    tokens = torch.tensor([[2, 1]])
    assert close(logprobs_from_logits(logits, tokens), [[math.log(0.7), math.log(0.25)]])
    # T = 2: softmax(log p / 2) is proportional to sqrt(p): sqrt(.1), sqrt(.2), sqrt(.7) =
    # .316228, .447214, .836660, sum 1.600102 -> p(2) = .522879, log = -0.648418
    assert close(logprobs_from_logits(logits, tokens, temperature=2.0)[0, 0], -0.648418)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [3.0, 3.0, -1e4, -1e4]]])
    assert close(entropy_from_logits(logits), [[math.log(4), math.log(2)]])


# --------------------------------------------------------------------------- masked statistics

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])  # selects 1, 2, 4


def test_masked_mean():
    assert close(masked_mean(X, M), 7 / 3)
    assert close(masked_mean(X, M, dim=1), [1.5, 4.0])
    assert close(masked_mean(X, torch.zeros_like(M)), 0.0)  # empty mask: 0, not NaN


def test_masked_var():
    # deviations from 7/3: -4/3, -1/3, 5/3; squares sum to 42/9 = 14/3
    assert close(masked_var(X, M, unbiased=False), 14 / 9)
    assert close(masked_var(X, M), 7 / 3)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_masked_whiten():
    std = math.sqrt(7 / 3)
    w = masked_whiten(X, M)
    assert close(w[0, 0], (1 - 7 / 3) / std) and close(w[1, 0], (4 - 7 / 3) / std)
    assert close(masked_mean(w, M), 0.0)
    assert close(masked_whiten(X, M, shift_mean=False)[0, 1], (2 - 7 / 3) / std + 7 / 3)


# --------------------------------------------------------------------------- KL and rewards


def test_kl_estimators():
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert close(kl_per_token(logp, ref, "k1"), [[0.5, -1.0]])
    # k3: r = exp(ref - logp); r = e^-0.5 = .606531 -> (r - 1) - log r = -.393469 + .5 = .106531
    #                          r = e^1 = 2.718282 -> 1.718282 - 1 = .718282
    assert close(kl_per_token(logp, ref, "k3"), [[0.106531, 0.718282]])
    assert (kl_per_token(torch.randn(4, 8), torch.randn(4, 8), "k3") >= 0).all()
    with pytest.raises(ValueError, match="k2"):
        kl_per_token(logp, ref, "k2")


def test_shaped_rewards_put_score_on_last_real_token():
    score = torch.tensor([1.0, 2.0, 3.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    expected = [[-0.05, -0.1 + 1.0, 0.0], [-0.2, -0.25, -0.3 + 2.0], [0.0, 0.0, 0.0]]
    assert close(shaped_rewards(score, kl, 0.5, mask), expected)


# --------------------------------------------------------------------------- GAE


def test_gae_hand_values():
    # t=1: delta = 1 + 0 - .2 = .8, A1 = .8; t=0: delta = 0 + .2 - .5 = -.3, A0 = -.3 + .5*.8 = .1
    rewards, values = torch.tensor([[0.0, 1.0, 5.0]]), torch.tensor([[0.5, 0.2, 9.0]])
    adv, ret = gae(rewards, values, torch.tensor([[1, 1, 0]]), gamma=1.0, lam=0.5)
    assert close(adv, [[0.1, 0.8, 0.0]]) and close(ret, [[0.6, 1.0, 0.0]])


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain python, one row and one real token at a time."""
    adv = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        n = int(sum(mask[b]))
        running = 0.0
        for t in reversed(range(n)):
            next_value = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    ret = [[adv[b][t] + (values[b][t] if mask[b][t] else 0.0) for t in range(len(rewards[b]))] for b in range(len(rewards))]
    return adv, ret


def test_gae_matches_reference_loop():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    lengths = [9, 1, 4, 7, 0]
    mask = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.9)
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.99, 0.9)
    assert close(adv, ref_adv) and close(ret, ref_ret)


# --------------------------------------------------------------------------- PPO losses


def test_policy_loss_hand_values():
    # ratios 1.5, 0.5, 1.1 (+ a masked token with a wild ratio), advantages 1, 1, -1; eps = 0.2
    # tok0: max(-1.5, -1.2) = -1.2 (clipped); tok1: max(-.5, -.8) = -.5; tok2: max(1.1, 1.1) = 1.1
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 50.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, 7.0]])
    loss, stats = policy_loss(logp, old, adv, torch.tensor([[1, 1, 1, 0]]), cliprange=0.2)
    assert close(loss, (-1.2 - 0.5 + 1.1) / 3)
    assert close(stats["clipfrac"], 1 / 3)
    # 0.5 * mean(log(1.5)^2, log(.5)^2, log(1.1)^2) = 0.5 * (.164402 + .480453 + .009085) / 3
    assert close(stats["approxkl"], 0.108990)
    assert close(stats["ratio_mean"], (1.5 + 0.5 + 1.1) / 3)


def test_policy_loss_gradient_is_zero_when_clipped():
    logp = torch.log(torch.tensor([[1.5]])).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2)
    loss.backward()
    assert logp.grad.abs().item() == 0.0


def test_value_loss_hand_values():
    # tok0: V_clip = .5 + .2 = .7; (1-2)^2 = 1 < (.7-2)^2 = 1.69 -> clipped; tok1: both 1
    values, old = torch.tensor([[1.0, 0.0, 3.0]]), torch.tensor([[0.5, 0.0, -3.0]])
    returns, mask = torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([[1, 1, 0]])
    loss, clipfrac = value_loss(values, old, returns, mask, cliprange_value=0.2)
    assert close(loss, 0.5 * (1.69 + 1.0) / 2) and close(clipfrac, 0.5)


def test_logprobs_and_entropy_in_chunks_equal_the_one_piece_result_and_gradients():
    # chunks of 3 and 7 positions (chunk_elements / V) against log_softmax over the whole tensor
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 20, 50, generator=g) * 4).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 50, (2, 20), generator=g)
    whole = torch.log_softmax(logits.float() / 0.7, -1)
    ref_lp = whole.gather(2, tokens[..., None]).squeeze(2)
    z = logits.float()
    ref_h = torch.logsumexp(z, -1) - (z.softmax(-1) * z).sum(-1)
    ref_grad, = torch.autograd.grad(ref_lp.sum() + ref_h.sum(), logits)
    for elements in (150, 350, 1 << 24):
        lp = logprobs_from_logits(logits, tokens, 0.7, chunk_elements=elements)
        h = entropy_from_logits(logits, chunk_elements=elements)
        torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
        torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=0)
        grad, = torch.autograd.grad(lp.sum() + h.sum(), logits)
        torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-2, rtol=0)
    with torch.no_grad():  # no gradients: the plain loop, the same numbers
        torch.testing.assert_close(logprobs_from_logits(logits, tokens, 0.7, chunk_elements=150), ref_lp,
                                   atol=2e-5, rtol=0)


# --------------------------------------------------------------------------- DPO and IPO

# Two pairs: summed log-probs of chosen / rejected under the policy (pc, pr) and the reference (rc, rr).
PC, PR = torch.tensor([-3.0, -10.0]), torch.tensor([-5.0, -2.0])
RC, RR = torch.tensor([-4.0, -6.0]), torch.tensor([-4.0, -4.0])


def test_dpo_loss_hand_values():
    # pair 1: (pc - rc) - (pr - rr) = 1 - (-1) = 2; beta 0.1 -> -log sigmoid(0.2) = log(1 + e^-0.2) = 0.598139
    # pair 2: (-10 + 6) - (-2 + 4) = -6 -> -log sigmoid(-0.6) = log(1 + e^0.6) = 1.037488
    assert close(dpo_loss(PC, PR, RC, RR, beta=0.1), (0.598139 + 1.037488) / 2)
    # policy == reference: every margin is 0 and the loss is log 2, whatever beta
    assert close(dpo_loss(RC, RR, RC, RR, beta=3.0), math.log(2))
    # the gradient raises the chosen log-prob and lowers the rejected one
    pc, pr = PC.clone().requires_grad_(), PR.clone().requires_grad_()
    dpo_loss(pc, pr, RC, RR, beta=0.1).backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()
    # d/dpc of -log sigmoid(0.1 x) / 2 = -0.1 * sigmoid(-0.1 x) / 2; pair 1: x = 2 -> -0.05 * 0.450166
    assert close(pc.grad[0], -0.05 * 0.450166)


def test_ipo_loss_hand_values_with_per_token_averages():
    nc, nr = torch.tensor([2.0, 3.0]), torch.tensor([4.0, 1.0])
    # pair 1: 1 / 2 - (-1) / 4 = 0.75; 1 / (2 * 0.1) = 5 -> (0.75 - 5)^2 = 18.0625
    # pair 2: -4 / 3 - 2 / 1 = -3.333333 -> (-3.333333 - 5)^2 = 69.444444
    assert close(ipo_loss(PC, PR, RC, RR, 0.1, nc, nr), (18.0625 + 69.444444) / 2, tol=1e-4)
    # beta 0.5: target margin 1; pair 1 alone: (0.75 - 1)^2 = 0.0625
    assert close(ipo_loss(PC[:1], PR[:1], RC[:1], RR[:1], 0.5, nc[:1], nr[:1]), 0.0625)
    # at the target the loss and its gradient are 0: the margin is not pushed further (unlike DPO)
    pc = torch.tensor([RC[0] + 2.0], requires_grad=True)  # per-token log-ratio 2 / 2 = 1 = 1 / (2 * 0.5)
    loss = ipo_loss(pc, RR[:1], RC[:1], RR[:1], 0.5, nc[:1], nr[:1])
    loss.backward()
    assert close(loss, 0.0) and close(pc.grad, [0.0])


def test_weighted_pairwise_loss_hand_values():
    from pipeline.losses import weighted_pairwise_loss

    r_c, r_r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    # weights (1.5, 0.5), mean 1: (1.5 * 0.126928 + 0.5 * 0.693147) / 2 = (0.190392 + 0.346574) / 2
    assert close(weighted_pairwise_loss(r_c, r_r, torch.tensor([1.5, 0.5])), 0.268483)
    # with margin 1 on the first pair: (1.5 * 0.313262 + 0.5 * 0.693147) / 2 = 0.408233
    assert close(weighted_pairwise_loss(r_c, r_r, torch.tensor([1.5, 0.5]), torch.tensor([1.0, 0.0])), 0.408233)
    # no weights is pairwise_loss itself, bit for bit; weights of 1 give the same number
    assert torch.equal(weighted_pairwise_loss(r_c, r_r, None), pairwise_loss(r_c, r_r))
    assert close(weighted_pairwise_loss(r_c, r_r, torch.ones(2)), pairwise_loss(r_c, r_r))
    # the gradient of a pair scales with its weight: d/dr_c of -w log sigmoid(d) / B = -w sigmoid(-d) / B
    rc = r_c.clone().requires_grad_()
    weighted_pairwise_loss(rc, r_r, torch.tensor([1.5, 0.5])).backward()
    # pair 1: -1.5 * sigmoid(-2) / 2 = -0.75 * 0.119203 = -0.089402; pair 2: -0.5 * 0.5 / 2 = -0.125
    assert close(rc.grad, [-0.089402, -0.125])


def test_grouped_pairwise_loss_hand_values():
    from pipeline.losses import group_mean, grouped_pairwise_loss

    # group 0: responses a, b, c scored 2, 0, 1 and pairs a>b, a>c, c>b; group 1: d, e scored 0, 0.5, pair e>d
    scores = torch.tensor([2.0, 0.0, 1.0, 0.0, 0.5])
    chosen, rejected, group = torch.tensor([0, 0, 2, 4]), torch.tensor([1, 2, 1, 3]), torch.tensor([0, 0, 0, 1])
    # -log sigmoid(d) = log(1 + e^-d): d = 2: 0.126928, d = 1: 0.313262, d = 0.5: 0.474077
    # group 0: (0.126928 + 0.313262 + 0.313262) / 3 = 0.251150; group 1: 0.474077; mean 0.362614
    assert close(grouped_pairwise_loss(scores, chosen, rejected, group), 0.362614)
    # weights (1.5, 0.5, 1, 2): (1.5 * 0.126928 + 0.5 * 0.313262 + 0.313262) / 3 = 0.220095, 2 * 0.474077
    weights = torch.tensor([1.5, 0.5, 1.0, 2.0])
    assert close(grouped_pairwise_loss(scores, chosen, rejected, group, weights), (0.220095 + 0.948154) / 2)
    # margin 1 on the first pair: d = 1, so group 0 is (1.5 + 0.5 + 1) * 0.313262 / 3 = 0.313262
    margin = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert close(grouped_pairwise_loss(scores, chosen, rejected, group, weights, margin), (0.313262 + 0.948154) / 2)
    # a ranking counts once: group 0's three pairs weigh as much as group 1's one
    assert close(group_mean(torch.tensor([1.0, 2.0, 3.0, 10.0]), group), (2.0 + 10.0) / 2)
    # one pair per group is the pairwise loss
    one = torch.arange(4)
    assert close(grouped_pairwise_loss(scores, chosen, rejected, one, weights),
                 torch.mean(weights * -torch.nn.functional.logsigmoid(scores[chosen] - scores[rejected])))
    # the gradient at a: -(sigmoid(-2) + sigmoid(-1)) / 3 / 2 = -(0.119203 + 0.268941) / 6 = -0.064691
    s = scores.clone().requires_grad_()
    grouped_pairwise_loss(s, chosen, rejected, group).backward()
    assert close(s.grad[0], -0.064691)
    with pytest.raises(ValueError, match="group ids must run 0..G-1"):
        group_mean(torch.ones(2), torch.tensor([0, 2]))


def test_dpo_and_ipo_weights_hand_values():
    w = torch.tensor([1.5, 0.5])  # mean 1, as the trainer normalises them
    # DPO: (1.5 * 0.598139 + 0.5 * 1.037488) / 2 = (0.897209 + 0.518744) / 2 = 0.707976
    assert close(dpo_loss(PC, PR, RC, RR, 0.1, weight=w), 0.707976)
    # IPO, beta 0.1 (pair losses 18.0625 and 69.444444): (1.5 * 18.0625 + 0.5 * 69.444444) / 2 = 30.907986
    nc, nr = torch.tensor([2.0, 3.0]), torch.tensor([4.0, 1.0])
    assert close(ipo_loss(PC, PR, RC, RR, 0.1, nc, nr, weight=w), 30.907986, tol=1e-4)
    # no weights is today's mean, bit for bit; weights of 1 give the same number
    assert torch.equal(dpo_loss(PC, PR, RC, RR, 0.1, weight=None), dpo_loss(PC, PR, RC, RR, 0.1))
    assert close(dpo_loss(PC, PR, RC, RR, 0.1, weight=torch.ones(2)), dpo_loss(PC, PR, RC, RR, 0.1))
    assert close(ipo_loss(PC, PR, RC, RR, 0.1, nc, nr, torch.ones(2)), ipo_loss(PC, PR, RC, RR, 0.1, nc, nr))
    # a pair's gradient scales with its weight: d/dpc of -w log sigmoid(0.1 x) / 2 = -0.05 w sigmoid(-0.1 x)
    pc = PC.clone().requires_grad_()
    dpo_loss(pc, PR, RC, RR, 0.1, weight=w).backward()
    # pair 1: x = 2: -0.05 * 1.5 * 0.450166 = -0.033762; pair 2: x = -6: -0.05 * 0.5 * 0.645656 = -0.016141
    assert close(pc.grad, [-0.033762, -0.016141])
    # IPO: d/dpc of w (h - 5)^2 / 2 with h's d/dpc = 1 / nc; pair 1: 1.5 * 2 * (0.75 - 5) / 2 / 2 = -3.1875
    # pair 2: 0.5 * 2 * (-3.333333 - 5) / 3 / 2 = -1.388889
    pc = PC.clone().requires_grad_()
    ipo_loss(pc, PR, RC, RR, 0.1, nc, nr, weight=w).backward()
    assert close(pc.grad, [-3.1875, -1.388889], tol=1e-4)
