"""GRPO math against hand-computed numbers: advantages, each loss aggregation, clipping, k3 KL, filters,
and the one-update gradient == REINFORCE with a group baseline (softmax gradient written out by hand)."""

import math

import pytest
import torch

from grpo import group_advantages, k3_kl, policy_loss, tis_weights, token_weights


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 1.0, 1.0]])
    a = group_advantages(r, "none")
    assert torch.allclose(a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [1.0, -1.0, 0.0, 0.0]]))
    s = group_advantages(r, "group", eps=1e-4)
    # sample std of (1,0,0,1) = sqrt(1/3); of (2,0,1,1) = sqrt(2/3); of zeros = 0 -> 0 / eps = 0
    assert s[0, 0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4), rel=1e-6)
    assert s[2, 1].item() == pytest.approx(-1.0 / (math.sqrt(2 / 3) + 1e-4), rel=1e-6)
    assert torch.equal(s[1], torch.zeros(4))


@pytest.mark.parametrize("scale", ["group", "none"])
def test_equal_rewards_give_exactly_zero(scale):
    # the fp32 mean of twelve 1.1s is not 1.1; / (0 + eps) used to make that a -1.19e-3 advantage on every row
    r = torch.full((2, 12), 1.1)
    r[1, 0] = 0.0  # the other group is not all-equal: it keeps its advantages
    a = group_advantages(r, scale)
    assert torch.equal(a[0], torch.zeros(12))
    assert a[1, 0].item() < 0 < a[1, 1].item()


# A batch of 3 completions over 4 token slots, written out so each loss can be computed with plain floats.
LOGP = [[-1.0, -0.5, -2.0, 0.0], [-0.2, -0.3, 0.0, 0.0], [-1.5, -0.1, -0.4, -0.9]]
OLD = [[-1.1, -0.5, -1.0, 0.0], [-0.2, -0.9, 0.0, 0.0], [-1.0, -0.1, -0.4, -2.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
ADV = [1.0, -1.0, 0.5]
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _hand_token_loss(i, t, beta=0.0, ref=None):
    rho = math.exp(LOGP[i][t] - OLD[i][t])
    a = ADV[i]
    clipped = min(max(rho, 1 - EPS_LOW), 1 + EPS_HIGH)
    l = -min(rho * a, clipped * a)
    if beta:
        d = ref[i][t] - LOGP[i][t]
        l += beta * (math.exp(d) - d - 1)
    return l


def _tensors():
    return (torch.tensor(LOGP), torch.tensor(OLD), torch.tensor(MASK, dtype=torch.float32), torch.tensor(ADV)[:, None])


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
def test_each_loss_variant_by_hand(loss):
    logp, old, mask, adv = _tensors()
    l, st = policy_loss(logp, old, adv, mask, loss, EPS_LOW, EPS_HIGH)
    w = token_weights(mask, loss, n_seqs=3, n_tokens=9, n_rows=3, max_len=4)
    got = (l * w).sum().item()
    per_tok = [[_hand_token_loss(i, t) * MASK[i][t] for t in range(4)] for i in range(3)]
    if loss == "grpo":
        want = sum(sum(row) / sum(MASK[i]) for i, row in enumerate(per_tok)) / 3
    elif loss == "dapo":
        want = sum(map(sum, per_tok)) / 9
    else:
        want = sum(map(sum, per_tok)) / (3 * 4)
    assert got == pytest.approx(want, rel=1e-6)
    # clipping: row 0 t=2 (rho=e^-1 < 0.8, A>0) and row 1 t=1 (rho=e^0.6 > 1.28, A<0) stay unclipped, since min()
    # keeps the unclipped branch there; row 2 t=3 (rho=e^1.1 > 1.28, A>0) is clipped high.
    rho = torch.exp(logp - old)
    assert torch.equal(st["clip_high"], ((rho > 1 + EPS_HIGH) & (adv > 0)).float())
    assert st["clip_high"][2, 3].item() == 1.0  # rho = e^1.1 > 1.28 with A = 0.5 > 0
    assert st["clip_low"].sum().item() == 0.0
    # a token with rho < 1 - eps and A < 0 is clipped low
    l2, st2 = policy_loss(torch.tensor([[-2.0]]), torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1),
                          "dapo", 0.2, 0.28)  # fmt: skip
    assert st2["clip_low"].item() == 1.0
    assert l2.item() == pytest.approx(-(0.8 * -1.0))


def test_k3_kl_by_hand():
    logp, old, mask, adv = _tensors()
    ref = [[-1.2, -0.4, -2.5, 0.0], [-0.1, -0.3, 0.0, 0.0], [-1.5, -0.3, -0.2, -1.0]]
    l, _ = policy_loss(logp, old, adv, mask, "dapo", EPS_LOW, EPS_HIGH)
    kl = k3_kl(logp, torch.tensor(ref))
    for i in range(3):
        for t in range(4):
            assert (l + 0.04 * kl)[i, t].item() == pytest.approx(_hand_token_loss(i, t, 0.04, ref), rel=1e-5, abs=1e-7)
            d = ref[i][t] - LOGP[i][t]
            assert kl[i, t].item() == pytest.approx(math.exp(d) - d - 1, abs=1e-6)
    assert (kl >= 0).all()


def test_k3_kl_is_clamped_so_garbage_positions_stay_finite():
    """A padding position with a garbage log-ratio (ref - logp = 100: exp overflows fp32) and weight 0 must add
    nothing: unclamped, 0 * inf is NaN in the loss and the gradient. Clamped at +-20: exp(20) - 20 - 1."""
    logp = torch.tensor([[-0.5, -100.0]], requires_grad=True)
    ref = torch.tensor([[-0.7, 0.0]])
    kl = k3_kl(logp, ref)
    assert kl[0, 1].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    loss = (kl * torch.tensor([[1.0, 0.0]])).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    # the real position keeps its gradient: d/dlogp (e^d - d - 1) = 1 - e^d, d = ref - logp = -0.2
    assert logp.grad[0, 0].item() == pytest.approx(1 - math.exp(-0.2), rel=1e-6)
    assert logp.grad[0, 1].item() == 0.0


def test_filters_leave_the_denominator():
    # zero-std group and a truncated completion are removed from the mask -> from numerator and denominator
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
    keep = torch.tensor([True, False, True])  # row 1 filtered
    m = mask * keep[:, None]
    w = token_weights(m, "dapo", n_seqs=2, n_tokens=m.sum().item(), n_rows=3, max_len=3)
    assert torch.allclose(w, torch.tensor([[1 / 3, 1 / 3, 0], [0, 0, 0], [1 / 3, 0, 0]]))
    w = token_weights(m, "grpo", n_seqs=2, n_tokens=3, n_rows=3, max_len=3)
    assert torch.allclose(w, torch.tensor([[0.25, 0.25, 0], [0, 0, 0], [0.5, 0, 0]]))
    # dr_grpo: every completion of the batch (3, filtered or not) x max length (3), whatever was filtered
    w = token_weights(m, "dr_grpo", n_seqs=2, n_tokens=3, n_rows=3, max_len=3)
    assert torch.allclose(w, m / 9)
    # the KL term's weights: every completion counts (main passes the unfiltered mask and n_seqs = n_rows)
    w = token_weights(mask, "dapo", n_seqs=3, n_tokens=6, n_rows=3, max_len=3)
    assert torch.allclose(w, mask / 6)
    w = token_weights(mask, "grpo", n_seqs=3, n_tokens=6, n_rows=3, max_len=3)
    assert torch.allclose(w, torch.tensor([[1 / 6, 1 / 6, 0], [1 / 9, 1 / 9, 1 / 9], [1 / 3, 0, 0]]))


def test_one_update_gradient_is_reinforce_with_group_baseline():
    """Toy policy: independent softmax per position, logits theta (T, V). With old = logp.detach() (rho == 1),
    grad of the GRPO loss = -sum_i sum_t w_it * A_i * (onehot(a_it) - softmax(theta_t)) — written out by hand."""
    torch.manual_seed(0)
    T, V, G = 3, 5, 4
    theta = torch.randn(T, V, requires_grad=True)
    actions = torch.randint(0, V, (G, T))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    r = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    adv = group_advantages(r, "group").view(-1, 1)
    logp = torch.log_softmax(theta, -1)[torch.arange(T)[None, :], actions]  # (G, T)
    l, _ = policy_loss(logp, logp.detach(), adv, mask, "grpo", 0.2, 0.28)
    w = token_weights(mask, "grpo", n_seqs=G, n_tokens=mask.sum().item(), n_rows=G, max_len=T)
    (l * w).sum().backward()

    p = torch.softmax(theta.detach(), -1)
    want = torch.zeros(T, V)
    for i in range(G):
        for t in range(T):
            onehot = torch.zeros(V)
            onehot[actions[i, t]] = 1.0
            want[t] -= w[i, t] * adv[i, 0] * (onehot - p[t])
    assert torch.allclose(theta.grad, want, atol=1e-6)


def _grad(loss, eps, tis=None):
    """Total loss and its gradient w.r.t. the new log-probs, for LOGP/OLD/MASK/ADV."""
    logp, old, mask, adv = _tensors()
    logp.requires_grad_(True)
    l, st = policy_loss(logp, old, adv, mask, loss, eps, eps, tis)
    w = token_weights(mask, loss, n_seqs=3, n_tokens=9, n_rows=3, max_len=4)
    total = (l * w).sum()
    total.backward()
    return total.item(), logp.grad, st


def test_gspo_by_hand():
    """One ratio per sequence, s_i = exp(mean over its tokens of (new - old)), clipped per sequence; mean over
    sequences. eps = 0.1: row 2 (s = e^0.15 > 1.1, A > 0) is clipped high and loses its gradient."""
    eps = 0.1
    total, grad, st = _grad("gspo", eps)
    want, want_grad = 0.0, torch.zeros(3, 4)
    for i in range(3):
        toks = [t for t in range(4) if MASK[i][t]]
        s = math.exp(sum(LOGP[i][t] - OLD[i][t] for t in toks) / len(toks))
        a = ADV[i]
        unclipped, clipped = s * a, min(max(s, 1 - eps), 1 + eps) * a
        want += -min(unclipped, clipped) / 3
        if unclipped <= clipped:  # d(-s a / 3) / d logp_t = -a s / (3 |o_i|) for each of its tokens
            for t in toks:
                want_grad[i, t] = -a * s / (3 * len(toks))
    assert total == pytest.approx(want, rel=1e-5)
    assert torch.allclose(grad, want_grad, atol=1e-7)
    assert want_grad[2].abs().sum() == 0 and want_grad[0].abs().sum() > 0 and want_grad[1].abs().sum() > 0
    assert st["clip_high"][2].tolist() == [1.0] * 4 and st["clip_high"][:2].sum() == 0


def test_cispo_by_hand():
    """l_t = -sg(clip(rho_t, 1 - eps, 1 + eps)) A logp_t, token mean: clipped tokens keep a (capped) gradient."""
    eps = 0.1
    total, grad, st = _grad("cispo", eps)
    want, want_grad = 0.0, torch.zeros(3, 4)
    for i in range(3):
        for t in range(4):
            if MASK[i][t]:
                c = min(max(math.exp(LOGP[i][t] - OLD[i][t]), 1 - eps), 1 + eps)
                want += -c * ADV[i] * LOGP[i][t] / 9
                want_grad[i, t] = -c * ADV[i] / 9
    assert total == pytest.approx(want, rel=1e-5)
    assert torch.allclose(grad, want_grad, atol=1e-7)
    assert (grad[torch.tensor(MASK) > 0] != 0).all()  # every token keeps its gradient
    # rho = e^0.1 and e^-1 (row 0), e^0.6 (row 1), e^-0.5 and e^1.1 (row 2) are clipped, whatever A's sign
    assert st["clip_high"][0, 0] == st["clip_low"][0, 2] == st["clip_high"][1, 1] == 1
    assert st["clip_low"][2, 0] == st["clip_high"][2, 3] == 1
    assert st["clip_low"].sum() + st["clip_high"].sum() == 5


def test_tis_by_hand():
    """TIS: the policy term of each token times min(exp(trainer_old - sampler), cap), a constant weight."""
    old = torch.tensor(OLD)
    sampler = old + torch.tensor([[0.3, -0.2, 1.0, 0.0], [-2.0, 0.1, 0.0, 0.0], [0.0, 0.5, -0.4, 1000.0]])
    cap = 2.0
    tis = tis_weights(old, sampler, cap)
    for i in range(3):
        for t in range(4):
            assert tis[i, t].item() == pytest.approx(min(math.exp(OLD[i][t] - sampler[i, t].item()), cap), rel=1e-6)
    assert tis[1, 0].item() == cap  # e^2 capped
    total, grad, _ = _grad("dapo", 0.2, tis)
    want = sum(_hand_token_loss(i, t) * tis[i, t].item() * MASK[i][t] for i in range(3) for t in range(4)) / 9
    assert total == pytest.approx(want, rel=1e-5)
    assert torch.isfinite(grad).all()
    # a garbage sampler log-prob (1e30 below the trainer's) gives the cap, never inf
    assert tis_weights(torch.zeros(1, 1), torch.full((1, 1), -1e30), cap).item() == cap


@pytest.mark.parametrize("variant,base", [("gspo", "grpo"), ("cispo", "dapo")])
def test_on_policy_variants_reduce_to_their_base(variant, base):
    """With --mu 1 (old = new, every ratio 1) GSPO's gradient is GRPO's and CISPO's is DAPO's: REINFORCE with a
    group baseline, aggregated the same way."""
    logp, _, mask, adv = _tensors()
    grads = []
    for loss in (variant, base):
        x = logp.clone().requires_grad_(True)
        l, _ = policy_loss(x, x.detach(), adv, mask, loss, 0.2, 0.28)
        (l * token_weights(mask, loss, 3, 9, 3, 4)).sum().backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_bad_loss_name():
    with pytest.raises(ValueError, match="--loss"):
        token_weights(torch.ones(1, 1), "ppo", 1, 1, 1, 1)
