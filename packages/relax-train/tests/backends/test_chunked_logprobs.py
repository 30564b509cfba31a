"""Chunked log-probs and entropies (#51): the values and the gradients of the plain computation
(``TokenScorer.token_logp`` on the full logits) to float32 rounding, whatever the chunk size, with a
temperature, masked ids and bf16 inputs; the exact gradient by gradcheck in float64."""

import pytest

torch = pytest.importorskip("torch")

from relax_train.backends.chunked_logprobs import chunked_token_logp  # noqa: E402
from relax_train.backends.logprobs import TokenScorer  # noqa: E402

N, H, V = 37, 16, 300
MASKED = [3, 150, 299]


def _inputs(dtype=torch.float32, seed: int = 0):
    """Hidden [N, H], weight [V, H] at a scale that gives logits of a few units (peaked and flat rows),
    targets [N] none of them masked."""
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(N, H, generator=g) * 2.0).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[torch.isin(targets, torch.tensor(MASKED))] = 4  # never sampled, so never a target
    targets[0] = MASKED[0] + 1  # (a target next to a masked id)
    return hidden, weight, targets


def _plain(hidden, weight, targets, temperature, masked, with_entropy=True):
    """The trainer's plain computation on float32 logits."""
    logits = hidden.float() @ weight.float().T
    return TokenScorer(temperature, list(masked)).token_logp(logits, targets, with_entropy)


def _loss(logp, ent, seed: int = 1):
    """A loss mixing both outputs with random per-token weights (as a PPO loss and an entropy bonus do)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(logp.shape, generator=g), torch.randn(logp.shape, generator=g)
    return (a * logp).sum() + ((b * ent).sum() if ent is not None else 0.0)


def _grads(fn, hidden, weight, targets):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = fn(h, w, targets)
    _loss(logp, ent).backward()
    return logp.detach(), (ent.detach() if ent is not None else None), h.grad, w.grad


def _assert_close(got, want, tol: float = 1e-5):
    """Equal to ``tol`` relative to the larger of 1 and the reference's largest magnitude."""
    assert got.shape == want.shape
    scale = max(1.0, want.abs().max().item())
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * scale, f"max abs diff {err:.3g} > {tol:.0e} x {scale:.3g}"


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 64])
@pytest.mark.parametrize(("temperature", "masked"), [(1.0, []), (0.7, MASKED)])
def test_values_and_gradients_equal_the_plain_computation(chunk, temperature, masked):
    """Chunks that divide N and that do not (5, 16), one chunk of all rows and one larger than N."""
    hidden, weight, targets = _inputs()
    want = _grads(lambda h, w, t: _plain(h, w, t, temperature, masked), hidden, weight, targets)
    got = _grads(
        lambda h, w, t: chunked_token_logp(h, w, t, temperature, masked, chunk, with_entropy=True),
        hidden,
        weight,
        targets,
    )
    for g, w in zip(got, want):
        _assert_close(g, w)
    assert got[0].dtype == got[1].dtype == torch.float32
    if masked:  # a masked id's logit is a constant: no gradient reaches its row of the LM head
        assert torch.all(got[3][masked] == 0)


def test_a_masked_target_gets_no_gradient_into_its_logit():
    """The rollout never samples a masked id, but the plain path scores one (-1e9 / T) and, its logit
    being a constant, sends no gradient to its row of the LM head: the same here."""
    hidden, weight, targets = _inputs(seed=6)
    targets[:5] = MASKED[1]
    want = _grads(lambda h, w, t: _plain(h, w, t, 0.9, MASKED), hidden, weight, targets)
    got = _grads(
        lambda h, w, t: chunked_token_logp(h, w, t, 0.9, MASKED, 4, with_entropy=True),
        hidden,
        weight,
        targets,
    )
    for g, w in zip(got, want):
        _assert_close(g, w)
    assert torch.all(got[3][MASKED] == 0) and torch.all(want[3][MASKED] == 0)


def test_log_probs_alone_and_a_frozen_head():
    """with_entropy=False returns None and the log-prob's gradient; a weight that needs no gradient gets
    none (a frozen LM head), the hidden state still does."""
    hidden, weight, targets = _inputs(seed=2)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    logp, ent = chunked_token_logp(h1, weight, targets, 0.8, MASKED, 7)
    assert ent is None
    want, _ = _plain(h2, weight, targets, 0.8, MASKED, with_entropy=False)
    _assert_close(logp, want)
    _loss(logp, None).backward()
    _loss(want, None).backward()
    _assert_close(h1.grad, h2.grad)


def test_leading_dimensions_are_kept():
    """[B, R, H] hidden states and [B, R] targets, as response_logp's gather gives them."""
    hidden, weight, targets = _inputs(seed=3)
    h, t = hidden[:36].reshape(4, 9, H), targets[:36].reshape(4, 9)
    logp, ent = chunked_token_logp(h, weight, t, 1.3, MASKED, 10, with_entropy=True)
    want_logp, want_ent = _plain(h, weight, t, 1.3, MASKED)
    assert logp.shape == ent.shape == (4, 9)
    _assert_close(logp, want_logp)
    _assert_close(ent, want_ent)


def test_bf16_inputs_compute_in_float32():
    """bf16 hidden and weight: the values are the float32 computation on the same (bf16) numbers, and the
    gradients come back in bf16, equal to the float32 ones rounded to bf16."""
    hidden, weight, targets = _inputs(torch.bfloat16, seed=4)
    want = _grads(lambda h, w, t: _plain(h, w, t, 0.6, MASKED), hidden.float(), weight.float(), targets)
    got = _grads(
        lambda h, w, t: chunked_token_logp(h, w, t, 0.6, MASKED, 8, with_entropy=True),
        hidden,
        weight,
        targets,
    )
    assert got[0].dtype == got[1].dtype == torch.float32
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    _assert_close(got[0], want[0])
    _assert_close(got[1], want[1])
    _assert_close(got[2], want[2], tol=1e-2)  # bf16 keeps 8 bits: one rounding, 2^-8 relative
    _assert_close(got[3], want[3], tol=1e-2)


def test_wrong_shapes_and_settings_are_refused():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="do not fit"):
        chunked_token_logp(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logp(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logp(hidden, weight, targets, temperature=0.0)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_gradcheck_float64(with_entropy):
    """The hand-written backward is the derivative of the forward (finite differences, float64), through
    both outputs, a temperature, masked ids and uneven chunks."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 1, 3, 10, 5, 6, 1])  # (not the masked 2 and 7: a masked target's log-prob
    # is -1e9 / T, where float64's finite differences have no digits left)

    def fn(h, w):
        logp, ent = chunked_token_logp(h, w, targets, 0.9, [2, 7], 3, with_entropy)
        return (logp, ent) if ent is not None else logp

    assert torch.autograd.gradcheck(fn, (hidden, weight))
