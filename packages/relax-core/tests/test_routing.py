"""Routing replay (R3): recording a tiny Qwen3-MoE's experts and replaying them reproduces its forward
exactly, the router keeps its gradient, forced experts are used with the router's own (renormalised)
weights, and models, names and outputs are otherwise unchanged."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.routing import install_routing  # noqa: E402

LAYERS, EXPERTS, TOP_K = 2, 8, 2


def tiny_moe(norm_topk_prob=True, seed=0):
    import relax_testing as testing

    torch.set_num_threads(1)
    return testing.tiny_moe(LAYERS, TOP_K, seed, num_experts=EXPERTS, norm_topk_prob=norm_topk_prob).eval()


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


IDS = torch.randint(1, 300, (3, 11), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("norm", [True, False])
def test_replaying_the_recorded_routing_reproduces_the_forward_and_trains_the_router(norm):
    model = tiny_moe(norm)
    routing = install_routing(model)
    assert (routing.num_layers, routing.top_k, routing.num_experts) == (LAYERS, TOP_K, EXPERTS)
    with torch.no_grad(), routing.record() as rec:
        ref = model(input_ids=IDS).logits
    assert len(rec.forwards) == 1 and len(rec.forwards[0]) == LAYERS
    assert rec.forwards[0][0].dtype == torch.int16 and rec.forwards[0][0].shape == (3 * 11, TOP_K)
    experts = rec.stacked(0).view(3, 11, LAYERS, TOP_K)
    with routing.replay(experts) as stats:
        out = model(input_ids=IDS).logits
    assert torch.equal(out, ref)
    assert routing.stats() == {
        "total": 66.0,
        "replayed": 66.0,
        "differ": 0.0,
        "replayed_frac": 1.0,
        "differ_frac": 0.0,
    }
    assert stats.as_dict() == routing.stats()
    out.logsumexp(-1).sum().backward()
    for block in routing.blocks:
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_install_keeps_names_and_outputs_and_dense_models_get_none():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = tiny_moe()
    names = list(model.state_dict())
    with torch.no_grad():
        before = model(input_ids=IDS).logits
    routing = install_routing(model)
    assert install_routing(model) is routing
    assert list(model.state_dict()) == names
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, before)
    dense = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    assert install_routing(dense) is None


def test_forced_experts_are_used_with_the_routers_renormalised_weights():
    model = tiny_moe(norm_topk_prob=True)
    routing = install_routing(model)
    block = routing.blocks[0]
    hidden = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), routing.record() as rec:
        block(hidden)
    natural = rec.stacked(0)[:, 0].long()  # [5, k]
    forced = (natural + 1) % EXPERTS  # never the natural set
    forced[0] = -1  # no record: routes normally
    with torch.no_grad(), routing.replay(forced.view(1, 5, 1, TOP_K).expand(1, 5, LAYERS, TOP_K)):
        with routing.record() as used:
            got = block(hidden)
    used = used.stacked(0)[:, 0].long()
    assert torch.equal(used[0], natural[0]) and torch.equal(used[1:], forced[1:])
    s = routing.stats()
    assert (s["total"], s["replayed"], s["differ"]) == (5.0, 4.0, 4.0)
    # the reference: the block's own router probabilities at the used ids, renormalised
    flat = hidden.view(5, 32)
    probs = torch.softmax(flat @ block.gate.weight.T, dim=-1)
    w = probs.gather(-1, used)
    w = w / w.sum(-1, keepdim=True)
    want = block.experts(flat, used, w).view(1, 5, 32)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_replay_checks_shapes_and_ids():
    model = tiny_moe()
    routing = install_routing(model)
    with pytest.raises(ValueError, match="shape"):
        with routing.replay(torch.zeros(3, 11, LAYERS + 1, TOP_K, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="num_experts"):
        with routing.replay(torch.full((3, 11, LAYERS, TOP_K), EXPERTS)):
            pass
    with pytest.raises(ValueError, match="whole sequence"), torch.no_grad():
        with routing.replay(torch.zeros(3, 10, LAYERS, TOP_K, dtype=torch.long)):
            model(input_ids=IDS)
    with torch.no_grad():  # the failed replay left no state behind
        with routing.record() as rec:
            model(input_ids=IDS)
    assert len(rec.forwards) == 1
