"""HF <-> megatron-core conversion for Qwen3 and Qwen3-MoE: exact round trips over TP/EP and both expert
namings, megatron-core's QKV / gated-fc1 / expert / vocab layouts checked by computing with the shards,
and a megatron-style forward over the converted weights that reproduces the HF model's logits."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from relax_testing import tiny_qwen3_config  # noqa: E402
from relax_train.backends.megatron.convert import (  # noqa: E402
    ConversionError,
    MegatronLayout,
    hf_state_shapes,
    hf_to_megatron,
    hf_to_megatron_rank,
    megatron_shard_shapes,
    megatron_to_hf,
)

TINY = tiny_qwen3_config()  # vocab 300: padding is exercised
HIDDEN, HEADS, KV_HEADS = TINY["hidden_size"], TINY["num_attention_heads"], TINY["num_key_value_heads"]
HEAD_DIM, VOCAB, FFN = TINY["head_dim"], TINY["vocab_size"], TINY["intermediate_size"]
MOE_FFN, EXPERTS = 32, 8


def _randomize(model, integer: bool = False):
    """Every parameter random (norms too, so swapped norms would be caught); ``integer`` makes all
    products and sums exact in float32, so matmul results do not depend on summation order."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if integer:
                p.copy_(torch.randint(-3, 4, p.shape, generator=gen).to(p.dtype))
            elif p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def dense_config(tied: bool = False):
    return transformers.Qwen3Config(**TINY, tie_word_embeddings=tied)


def moe_config():
    return transformers.Qwen3MoeConfig(
        **TINY,
        moe_intermediate_size=MOE_FFN,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        mlp_only_layers=[1],  # layer 0 MoE, layer 1 dense
    )


def build(kind: str, integer: bool = False):
    torch.manual_seed(0)
    if kind == "moe":
        cfg = moe_config()
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = dense_config(tied=kind == "tied")
        model = transformers.Qwen3ForCausalLM(cfg)
        if kind == "tied":  # one tensor, whatever transformers' tying state is (it varied with test order)
            model.lm_head.weight = model.model.embed_tokens.weight
    return cfg, _randomize(model, integer)


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {kind: build(kind) for kind in ("dense", "tied", "moe")}


@pytest.fixture(scope="module")
def int_models():
    torch.set_num_threads(1)
    return {kind: build(kind, integer=True) for kind in ("dense", "moe")}


def assert_same_state(got: dict, want: dict):
    assert set(got) == set(want), set(got) ^ set(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


# ---------------------------------------------------------------------------------------------- layout


def test_layout_from_configs():
    dense = MegatronLayout.from_hf_config(dense_config())
    assert (dense.num_layers, dense.hidden_size, dense.num_attention_heads, dense.num_query_groups) == (
        2,
        64,
        4,
        2,
    )
    assert (dense.head_dim, dense.ffn_hidden_size, dense.vocab_size, dense.heads_per_group) == (
        16,
        96,
        300,
        2,
    )
    assert not dense.tie_word_embeddings and not dense.is_moe and dense.qk_layernorm
    assert MegatronLayout.from_hf_config(dense_config(tied=True)).tie_word_embeddings

    moe = MegatronLayout.from_hf_config(moe_config())
    assert (moe.num_experts, moe.moe_ffn_hidden_size, moe.moe_layers) == (EXPERTS, MOE_FFN, (0,))
    assert moe.moe_layer_pattern == [1, 0]
    # the config.json dict gives the same layout; decoder_sparse_step and mlp_only_layers combine as in HF
    assert MegatronLayout.from_hf_config(moe_config().to_dict()) == moe
    sparse = moe_config().to_dict() | {
        "num_hidden_layers": 6,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    assert MegatronLayout.from_hf_config(sparse).moe_layers == (1, 5)


def test_layout_of_a_real_size_model_qwen3_30b_a3b():
    """Shapes only (no tensors): Qwen3-30B-A3B's config.json at TP=4, EP=8."""
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    layout = MegatronLayout.from_hf_config(cfg)
    shapes = megatron_shard_shapes(layout, tp_size=4, ep_size=8)
    assert shapes["embedding.word_embeddings.weight"] == (152064 // 4, 2048)  # 151936 -> 152064 (x 512)
    assert shapes["decoder.layers.47.self_attention.linear_qkv.weight"] == ((32 + 2 * 4) * 128 // 4, 2048)
    assert shapes["decoder.layers.0.self_attention.linear_proj.weight"] == (2048, 32 * 128 // 4)
    assert shapes["decoder.layers.0.mlp.router.weight"] == (128, 2048)
    assert shapes["decoder.layers.0.mlp.experts.local_experts.15.linear_fc1.weight"] == (2 * 768 // 4, 2048)
    assert "decoder.layers.0.mlp.experts.local_experts.16.linear_fc1.weight" not in shapes  # 128 / 8 per rank
    assert shapes["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"] == (2048, 768 // 4)


# ------------------------------------------------------------------------------------------ round trip

ROUND_TRIPS = [("dense", tp, 1, False) for tp in (1, 2)] + [("tied", tp, 1, False) for tp in (1, 2)]
ROUND_TRIPS += [("moe", tp, ep, grouped) for tp in (1, 2) for ep in (1, 2) for grouped in (False, True)]


@pytest.mark.parametrize(("kind", "tp", "ep", "grouped"), ROUND_TRIPS)
def test_round_trip_is_exact(models, kind, tp, ep, grouped):
    cfg, model = models[kind]
    layout = MegatronLayout.from_hf_config(cfg)
    hf = model.state_dict()
    shards = hf_to_megatron(hf, layout, tp_size=tp, ep_size=ep, grouped_experts=grouped)

    assert len(shards) == tp and all(len(row) == ep for row in shards)
    shapes = megatron_shard_shapes(layout, tp_size=tp, ep_size=ep, grouped_experts=grouped)
    padded = 384 if tp == 1 else 512  # 300 up to a multiple of 128 * tp
    for t in range(tp):
        for e in range(ep):
            sd = shards[t][e]
            assert {k: tuple(v.shape) for k, v in sd.items()} == shapes
            emb = sd["embedding.word_embeddings.weight"]
            assert emb.shape == (padded // tp, HIDDEN)
            assert ("output_layer.weight" in sd) == (kind != "tied")
    # the vocab padding rows are zero
    for name in ("embedding.word_embeddings.weight", "output_layer.weight")[: 1 if kind == "tied" else 2]:
        full = torch.cat([shards[t][0][name] for t in range(tp)])
        assert torch.equal(
            full[:VOCAB], hf["model.embed_tokens.weight" if "emb" in name else "lm_head.weight"]
        )
        assert not full[VOCAB:].any()

    back = megatron_to_hf(shards, layout)
    assert list(back) == list(hf)  # exactly the state_dict() keys, in the same order
    assert_same_state(back, hf)
    assert_same_state(megatron_to_hf(shards, layout, vocab_divisible_by=None), hf)  # padding inferred
    # and the converted state loads into a fresh HF model
    fresh = type(model)(cfg)
    fresh.load_state_dict(back, strict=True)


def test_round_trip_keeps_bf16(models):
    cfg, model = models["moe"]
    layout = MegatronLayout.from_hf_config(cfg)
    hf = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    shards = hf_to_megatron(hf, layout, tp_size=2, ep_size=2, grouped_experts=True)
    assert {t.dtype for row in shards for sd in row for t in sd.values()} == {torch.bfloat16}
    assert_same_state(megatron_to_hf(shards, layout), hf)


def test_megatron_names_match_megatron_core(models):
    """The names megatron-core's TE GPT spec gives, per layer kind (layer 0 MoE, layer 1 dense)."""
    cfg, model = models["moe"]
    layout = MegatronLayout.from_hf_config(cfg)
    sequential = hf_to_megatron(model.state_dict(), layout, ep_size=2)[0][1]
    grouped = hf_to_megatron(model.state_dict(), layout, ep_size=2, grouped_experts=True)[0][1]
    common = {
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    }
    for i in (0, 1):
        attn = f"decoder.layers.{i}.self_attention."
        common |= {
            attn + s for s in ("linear_qkv.weight", "linear_qkv.layer_norm_weight", "linear_proj.weight")
        }
        common |= {attn + "q_layernorm.weight", attn + "k_layernorm.weight"}
    common |= {f"decoder.layers.1.mlp.{s}" for s in ("linear_fc1.weight", "linear_fc1.layer_norm_weight")}
    common |= {"decoder.layers.1.mlp.linear_fc2.weight"}
    common |= {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.mlp.router.weight"}
    x = "decoder.layers.0.mlp.experts."
    assert set(sequential) == common | {
        f"{x}local_experts.{j}.{fc}.weight" for j in range(4) for fc in ("linear_fc1", "linear_fc2")
    }
    assert set(grouped) == common | {
        f"{x}{fc}.weight{j}" for j in range(4) for fc in ("linear_fc1", "linear_fc2")
    }
    # EP rank 1's local expert 0 is global expert 4 (contiguous split)
    gate_up = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(sequential[f"{x}local_experts.0.linear_fc1.weight"], gate_up[4])
    assert torch.equal(grouped[f"{x}linear_fc1.weight3"], gate_up[7])


def test_tied_checkpoint_without_lm_head(models):
    cfg, model = models["tied"]
    layout = MegatronLayout.from_hf_config(cfg)
    hf = model.state_dict()
    saved = {k: v for k, v in hf.items() if k != "lm_head.weight"}  # what a tied checkpoint file holds
    shards = hf_to_megatron(saved, layout, tp_size=2)
    assert "output_layer.weight" not in shards[0][0]
    assert_same_state(megatron_to_hf(shards, layout, include_tied_lm_head=False), saved)
    back = megatron_to_hf(shards, layout)
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]
    assert_same_state(back, hf)


def test_per_expert_hf_format(models):
    """Hub checkpoints keep one module per expert; they convert to the same shards as the fused form."""
    cfg, model = models["moe"]
    layout = MegatronLayout.from_hf_config(cfg)
    fused = model.state_dict()
    per_expert = megatron_to_hf(hf_to_megatron(fused, layout), layout, expert_format="per_expert")
    assert list(per_expert) == list(hf_state_shapes(layout, expert_format="per_expert"))
    gate_up = fused["model.layers.0.mlp.experts.gate_up_proj"]
    for j in range(EXPERTS):
        p = f"model.layers.0.mlp.experts.{j}."
        assert torch.equal(per_expert[p + "gate_proj.weight"], gate_up[j, :MOE_FFN])
        assert torch.equal(per_expert[p + "up_proj.weight"], gate_up[j, MOE_FFN:])
        assert torch.equal(
            per_expert[p + "down_proj.weight"], fused["model.layers.0.mlp.experts.down_proj"][j]
        )
    for grouped in (False, True):
        a = hf_to_megatron(per_expert, layout, tp_size=2, ep_size=2, grouped_experts=grouped)
        b = hf_to_megatron(fused, layout, tp_size=2, ep_size=2, grouped_experts=grouped)
        for t in range(2):
            for e in range(2):
                assert_same_state(a[t][e], b[t][e])
        assert_same_state(megatron_to_hf(a, layout), fused)
        assert_same_state(megatron_to_hf(a, layout, expert_format="per_expert"), per_expert)


def test_single_rank_conversion_equals_the_full_grid(models):
    cfg, model = models["moe"]
    layout = MegatronLayout.from_hf_config(cfg)
    hf = model.state_dict()
    grid = hf_to_megatron(hf, layout, tp_size=2, ep_size=2, grouped_experts=True)
    for t in range(2):
        for e in range(2):
            one = hf_to_megatron_rank(
                hf, layout, tp_rank=t, ep_rank=e, tp_size=2, ep_size=2, grouped_experts=True
            )
            assert_same_state(one, grid[t][e])
    # a list of per-TP-rank dicts (no EP) is accepted by megatron_to_hf too
    cfg, model = models["dense"]
    layout = MegatronLayout.from_hf_config(cfg)
    tp_only = [row[0] for row in hf_to_megatron(model.state_dict(), layout, tp_size=2)]
    assert_same_state(megatron_to_hf(tp_only, layout), model.state_dict())


# ------------------------------------------------------------------------------------------- semantics


def split_qkv_output(out, num_groups):
    """What SelfAttention.get_query_key_value_tensors does with linear_qkv's output on one rank."""
    per_group = out.view(out.shape[0], num_groups, -1)
    q, k, v = per_group.split([HEADS // KV_HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
    return q.reshape(out.shape[0], -1), k.reshape(out.shape[0], -1), v.reshape(out.shape[0], -1)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_shards_compute_what_hf_computes(int_models, kind):
    """Integer-valued weights and inputs: every product and sum is exact, so equality is exact."""
    cfg, model = int_models[kind]
    layout = MegatronLayout.from_hf_config(cfg)
    hf = model.state_dict()
    x = torch.randint(-3, 4, (5, HIDDEN), generator=torch.Generator().manual_seed(1)).float()
    one = hf_to_megatron(hf, layout)[0][0]
    ep = 2 if kind == "moe" else 1
    two = hf_to_megatron(hf, layout, tp_size=2, ep_size=ep)

    for i, layer in enumerate(model.model.layers):
        m = f"decoder.layers.{i}."
        attn = layer.self_attn
        # TP=1: per query group, the group's query heads, then one key head, then one value head
        q, k, v = split_qkv_output(x @ one[m + "self_attention.linear_qkv.weight"].T, KV_HEADS)
        assert (
            torch.equal(q, attn.q_proj(x))
            and torch.equal(k, attn.k_proj(x))
            and torch.equal(v, attn.v_proj(x))
        )
        # TP=2: each rank holds whole query groups; its heads concatenate to the TP=1 result
        per_rank = [
            split_qkv_output(x @ two[t][0][m + "self_attention.linear_qkv.weight"].T, 1) for t in range(2)
        ]
        for n, want in enumerate((q, k, v)):
            assert torch.equal(torch.cat([r[n] for r in per_rank], dim=-1), want)
        # row-parallel linear_proj: each rank multiplies its own heads' outputs; the sum is o_proj
        y = torch.randint(-3, 4, (5, HEADS * HEAD_DIM), generator=torch.Generator().manual_seed(2)).float()
        parts = y.chunk(2, dim=-1)
        summed = sum(parts[t] @ two[t][0][m + "self_attention.linear_proj.weight"].T for t in range(2))
        assert torch.equal(summed, attn.o_proj(y))
        assert torch.equal(one[m + "self_attention.linear_proj.weight"], attn.o_proj.weight)

        if i in layout.moe_layers:
            gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj
            assert torch.equal(x @ one[m + "mlp.router.weight"].T, F.linear(x, layer.mlp.gate.weight))
            per = EXPERTS // ep
            for j in range(EXPERTS):
                hf_gate, hf_up = F.linear(x, gate_up[j]).chunk(2, dim=-1)  # as Qwen3MoeExperts.forward
                fc1 = one[f"{m}mlp.experts.local_experts.{j}.linear_fc1.weight"]
                gate, up = (x @ fc1.T).chunk(2, dim=-1)  # as megatron's glu
                assert torch.equal(gate, hf_gate) and torch.equal(up, hf_up)
                local = f"{m}mlp.experts.local_experts.{j % per}."
                halves = [
                    (x @ two[t][j // per][local + "linear_fc1.weight"].T).chunk(2, dim=-1) for t in range(2)
                ]
                assert torch.equal(torch.cat([h[0] for h in halves], -1), gate)
                assert torch.equal(torch.cat([h[1] for h in halves], -1), up)
                z = torch.randint(-3, 4, (5, MOE_FFN), generator=torch.Generator().manual_seed(j)).float()
                hf_out = F.linear(z, down[j])
                assert torch.equal(z @ one[f"{m}mlp.experts.local_experts.{j}.linear_fc2.weight"].T, hf_out)
                zs = z.chunk(2, dim=-1)
                out = sum(zs[t] @ two[t][j // per][local + "linear_fc2.weight"].T for t in range(2))
                assert torch.equal(out, hf_out)
        else:
            mlp = layer.mlp
            gate, up = (x @ one[m + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
            assert torch.equal(gate, mlp.gate_proj(x)) and torch.equal(up, mlp.up_proj(x))
            halves = [(x @ two[t][0][m + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1) for t in range(2)]
            assert torch.equal(torch.cat([h[0] for h in halves], -1), gate)
            assert torch.equal(torch.cat([h[1] for h in halves], -1), up)
            z = torch.randint(-3, 4, (5, FFN), generator=torch.Generator().manual_seed(3)).float()
            zs = z.chunk(2, dim=-1)
            assert torch.equal(
                sum(zs[t] @ two[t][0][m + "mlp.linear_fc2.weight"].T for t in range(2)), mlp.down_proj(z)
            )
            # the fused layernorm weights are the HF norms
            assert torch.equal(
                one[m + "mlp.linear_fc1.layer_norm_weight"], layer.post_attention_layernorm.weight
            )
        assert torch.equal(
            one[m + "self_attention.linear_qkv.layer_norm_weight"], layer.input_layernorm.weight
        )

    # vocab-parallel output layer: the ranks' logits concatenate, padding columns are zero
    logits = torch.cat([x @ two[t][0]["output_layer.weight"].T for t in range(2)], dim=-1)
    assert logits.shape[-1] == 512
    assert torch.equal(logits[:, :VOCAB], model.lm_head(x)) and not logits[:, VOCAB:].any()


def megatron_style_forward(sd: dict, layout: MegatronLayout, cfg, ids):
    """A TP=1 forward written against megatron-core's names and conventions only."""
    eps, s = cfg.rms_norm_eps, ids.shape[0]
    nh, ng, hd, qpg = (
        layout.num_attention_heads,
        layout.num_query_groups,
        layout.head_dim,
        layout.heads_per_group,
    )

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.arange(s).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]

    def rope(t):  # non-interleaved rotary, megatron's default
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat([-t2, t1], dim=-1) * sin

    x = sd["embedding.word_embeddings.weight"][ids]
    for i in range(layout.num_layers):
        m = f"decoder.layers.{i}."
        h = rms(x, sd[m + "self_attention.linear_qkv.layer_norm_weight"])
        qkv = (h @ sd[m + "self_attention.linear_qkv.weight"].T).view(s, ng, (qpg + 2) * hd)
        q, k, v = qkv.split([qpg * hd, hd, hd], dim=-1)
        q = rope(rms(q.reshape(s, nh, hd), sd[m + "self_attention.q_layernorm.weight"]))
        k = rope(rms(k, sd[m + "self_attention.k_layernorm.weight"]))
        k, v = k.repeat_interleave(qpg, dim=1), v.repeat_interleave(qpg, dim=1)  # group g serves its q heads
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        x = x + attn.transpose(0, 1).reshape(s, nh * hd) @ sd[m + "self_attention.linear_proj.weight"].T
        if i in layout.moe_layers:
            h = rms(x, sd[m + "pre_mlp_layernorm.weight"])
            probs = torch.softmax(h @ sd[m + "mlp.router.weight"].T, dim=-1)
            top_p, top_i = probs.topk(cfg.num_experts_per_tok, dim=-1)
            if cfg.norm_topk_prob:
                top_p = top_p / top_p.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for tok in range(s):
                for p, j in zip(top_p[tok], top_i[tok].tolist()):
                    e = f"{m}mlp.experts.local_experts.{j}."
                    gate, up = (h[tok] @ sd[e + "linear_fc1.weight"].T).chunk(2)
                    out[tok] += p * ((F.silu(gate) * up) @ sd[e + "linear_fc2.weight"].T)
            x = x + out
        else:
            h = rms(x, sd[m + "mlp.linear_fc1.layer_norm_weight"])
            gate, up = (h @ sd[m + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ sd[m + "mlp.linear_fc2.weight"].T
    x = rms(x, sd["decoder.final_layernorm.weight"])
    out_w = sd["embedding.word_embeddings.weight" if layout.tie_word_embeddings else "output_layer.weight"]
    return (x @ out_w.T)[:, : layout.vocab_size]


@pytest.mark.parametrize("kind", ["dense", "tied", "moe"])
def test_megatron_style_forward_reproduces_hf_logits(models, kind):
    cfg, model = models[kind]
    layout = MegatronLayout.from_hf_config(cfg)
    sd = hf_to_megatron(model.state_dict(), layout)[0][0]
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids[None]).logits[0]
        got = megatron_style_forward(sd, layout, cfg, ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


# ---------------------------------------------------------------------------------------------- errors


def test_bad_parallel_sizes_name_the_numbers(models):
    dense_cfg, dense = models["dense"]
    moe_cfg, moe = models["moe"]
    dense_layout, moe_layout = (
        MegatronLayout.from_hf_config(dense_cfg),
        MegatronLayout.from_hf_config(moe_cfg),
    )
    with pytest.raises(ConversionError, match=r"num_attention_heads=4 is not divisible by tp_size=3"):
        hf_to_megatron(dense.state_dict(), dense_layout, tp_size=3)
    with pytest.raises(
        ConversionError, match=r"num_query_groups \(num_key_value_heads\)=2 is not divisible by tp_size=4"
    ):
        hf_to_megatron(dense.state_dict(), dense_layout, tp_size=4)
    with pytest.raises(ConversionError, match=r"num_experts=8 is not divisible by ep_size=3"):
        hf_to_megatron(moe.state_dict(), moe_layout, ep_size=3)
    with pytest.raises(ConversionError, match=r"ep_size=2 needs a MoE model"):
        hf_to_megatron(dense.state_dict(), dense_layout, ep_size=2)
    with pytest.raises(ConversionError, match=r"tp_size must be a positive int, got 0"):
        hf_to_megatron(dense.state_dict(), dense_layout, tp_size=0)
    with pytest.raises(ConversionError, match=r"tp_rank=2 is out of range for tp_size=2"):
        hf_to_megatron_rank(dense.state_dict(), dense_layout, tp_rank=2, tp_size=2)
    # a shard grid read back with an impossible shape
    shards = hf_to_megatron(moe.state_dict(), moe_layout, ep_size=2)
    with pytest.raises(ConversionError, match=r"num_experts=8 is not divisible by ep_size=3"):
        megatron_to_hf([shards[0] + [shards[0][0]]], moe_layout)
    with pytest.raises(
        ConversionError, match=r"num_attention_heads=4 is not a multiple of num_query_groups .*=3"
    ):
        MegatronLayout.from_hf_config(dense_config().to_dict() | {"num_key_value_heads": 3})


def test_bad_hf_state_names_the_key(models):
    cfg, model = models["moe"]
    layout = MegatronLayout.from_hf_config(cfg)
    hf = model.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ConversionError, match=r"HF state dict: missing 1 key\(s\): " + q):
        hf_to_megatron({k: v for k, v in hf.items() if k != q}, layout)
    with pytest.raises(ConversionError, match=r"unexpected 1 key\(s\): model.layers.0.self_attn.q_proj.bias"):
        hf_to_megatron(hf | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, layout)
    with pytest.raises(ConversionError, match=q + r" has shape \(64, 32\), expected \(64, 64\)"):
        hf_to_megatron(hf | {q: torch.zeros(64, 32)}, layout)
    # a layout that does not describe the checkpoint
    with pytest.raises(
        ConversionError, match=r"model.embed_tokens.weight has shape \(300, 64\), expected \(301, 64\)"
    ):
        hf_to_megatron(hf, MegatronLayout.from_hf_config(moe_config().to_dict() | {"vocab_size": 301}))
    tied_cfg, tied = models["tied"]
    bad = tied.state_dict() | {"lm_head.weight": torch.zeros(VOCAB, HIDDEN)}
    with pytest.raises(ConversionError, match=r"lm_head.weight differs from model.embed_tokens.weight"):
        hf_to_megatron(bad, MegatronLayout.from_hf_config(tied_cfg))
    with pytest.raises(ConversionError, match=r"model_type='llama'"):
        MegatronLayout.from_hf_config({"model_type": "llama"})


def test_bad_megatron_shards_name_the_rank_and_key(models):
    cfg, model = models["moe"]
    layout = MegatronLayout.from_hf_config(cfg)
    shards = hf_to_megatron(model.state_dict(), layout, tp_size=2, ep_size=2)

    def edited(t, e, change):
        grid = [[dict(sd) for sd in row] for row in shards]
        change(grid[t][e])
        return grid

    expert = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    with pytest.raises(ConversionError, match=r"shards\[1\]\[1\]: missing 1 key\(s\): " + expert):
        megatron_to_hf(edited(1, 1, lambda sd: sd.pop(expert)), layout)
    with pytest.raises(ConversionError, match=r"shards\[0\]\[1\]: unexpected 1 key\(s\): .*local_experts.4"):
        megatron_to_hf(edited(0, 1, lambda sd: sd.update({expert.replace(".3.", ".4."): sd[expert]})), layout)
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    with pytest.raises(
        ConversionError, match=r"shards\[1\]\[0\]: " + qkv + r" has shape \(63, 64\), expected \(64, 64\)"
    ):
        megatron_to_hf(edited(1, 0, lambda sd: sd.update({qkv: sd[qkv][:63]})), layout)
    norm = "decoder.final_layernorm.weight"
    with pytest.raises(ConversionError, match=r"shards\[1\]\[0\]: " + norm + r" differs from its replica"):
        megatron_to_hf(edited(1, 0, lambda sd: sd.update({norm: sd[norm] + 1})), layout)
    with pytest.raises(ConversionError, match=r"shards\[0\]\[1\]: " + qkv + r" differs from its replica"):
        megatron_to_hf(edited(0, 1, lambda sd: sd.update({qkv: sd[qkv] + 1})), layout)
    # Transformer Engine's _extra_state entries are not weights and are ignored
    extra = "decoder.layers.0.self_attention.linear_qkv._extra_state"
    back = megatron_to_hf(edited(0, 0, lambda sd: sd.update({extra: None})), layout)
    assert_same_state(back, model.state_dict())
    grouped_name = "decoder.layers.0.mlp.experts.linear_fc1.weight0"
    with pytest.raises(ConversionError, match=r"mix SequentialMLP .* and TEGroupedMLP"):
        megatron_to_hf(edited(0, 0, lambda sd: sd.update({grouped_name: sd[expert]})), layout)
