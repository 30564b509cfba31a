"""The megatron model on this rank and what every part of a megatron backend reads of it.

One :class:`MegatronNet` is built per backend (:func:`build_net`) and handed to its parts — the weights in HF
names (:class:`~relax_train.backends.megatron.weights.MegatronWeights`), the forward
(:class:`~relax_train.backends.megatron.forward.MegatronForward`) and the training step
(:class:`~relax_train.backends.megatron.training.MegatronTraining`) — so each part receives the state it
reads instead of reaching for it through a shared ``self``. The policy backend and the critic build theirs
alike (:mod:`~relax_train.backends.megatron.backend`, :mod:`~relax_train.backends.megatron.value`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from relax_core.config import RelaxConfig
from relax_core.models import media_token_ids
from relax_train.backends.logprobs import TokenScorer
from relax_train.backends.megatron import multimodal as mm
from relax_train.backends.megatron.layout import MegatronLayout
from relax_train.backends.megatron.norms import use_sequence_parallel_norms
from relax_train.backends.megatron.shims import host_tensors_stay
from relax_train.backends.megatron.startup import init_parallel, rope_theta_of, transformer_config
from relax_train.backends.replay import ReplayCounts


@dataclasses.dataclass
class MegatronNet:
    """A megatron-core ``GPTModel`` on this rank, its config and this rank's place in the parallel groups."""

    cfg: RelaxConfig
    """The run's config."""
    model_path: str
    """The HF directory the model's config (and, unless given, its weights) come from."""
    hf_config: Any
    """The HF config (Qwen3, Qwen3-MoE, Qwen3-VL or Qwen3-Omni)."""
    layout: MegatronLayout
    """The text decoder's shapes, as the weight converter names and cuts them."""
    mcfg: Any
    """megatron's ``TransformerConfig``."""
    model: Any
    """This rank's ``GPTModel`` (its pipeline stage, its TP / EP shards)."""
    front: mm.MediaFront | None
    """Qwen3-VL / Omni's media encoders in front of the decoder; None for a text model."""
    device: torch.device | None
    """The GPU this rank runs on; None on CPU."""
    tp: int
    """Tensor-parallel size."""
    ep: int
    """Expert-parallel size."""
    cp: int
    """Context-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    pre: bool
    """This rank holds the first pipeline stage (the embedding)."""
    post: bool
    """This rank holds the last pipeline stage (the output layer: the logits)."""
    layer_offset: int
    """Global index of this stage's first decoder layer."""
    pad_token_id: int
    """What right-pads the rows."""
    scorer: TokenScorer
    """Log-probs and entropies from logits, at the rollout's temperature, media placeholders masked."""
    routing: Any = None
    """Routing replay (R3) through megatron's router (a MoE model with ``--routing-replay``), or None."""
    r3: ReplayCounts = dataclasses.field(default_factory=ReplayCounts)
    """Routing replay's counts of the step in progress."""


def build_net(config: RelaxConfig, model_path: str) -> MegatronNet:
    """Process groups from the environment, then the model of ``model_path``'s HF config on this rank, with
    random weights (the caller loads them: :meth:`MegatronWeights.load_weights`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from transformers import AutoConfig

    t = config.train
    init_parallel(config)
    torch.manual_seed(t.seed)
    hf_config = AutoConfig.from_pretrained(model_path)
    text = hf_config.get_text_config()
    mm.check_supported(hf_config, model_path)
    layout = MegatronLayout.from_hf_config(text)
    multimodal = mm.is_multimodal(hf_config)
    if multimodal:  # Qwen3-VL / Omni keep tie_word_embeddings at the top of their config
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        layout = dataclasses.replace(layout, tie_word_embeddings=tied)
    tp, cp, pp = t.tensor_model_parallel_size, t.context_parallel_size, t.pipeline_model_parallel_size
    if t.expert_tensor_parallel_size not in (None, tp):
        raise ValueError(
            "--expert-tensor-parallel-size other than --tensor-model-parallel-size is not supported by "
            "the weight converter yet; leave it unset"
        )
    mcfg = transformer_config(hf_config, layout, config)
    if multimodal:
        mcfg.mrope_section = mm.mrope_section(text)
    pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    spec = get_gpt_decoder_block_spec(mcfg, use_transformer_engine=False, normalization="RMSNorm")
    use_sequence_parallel_norms(spec)  # (torch's own norms refuse --sequence-parallel)
    if cp > 1:  # megatron's own CP needs Transformer Engine: ours gathers keys and values
        from relax_train.backends.megatron.context_parallel import use_context_parallel_attention

        use_context_parallel_attention(spec)
    with host_tensors_stay():  # (tied embeddings under PP: megatron syncs the two copies on CUDA)
        model = GPTModel(
            mcfg,
            transformer_layer_spec=spec,
            vocab_size=layout.padded_vocab_size(tp),
            max_sequence_length=int(getattr(text, "max_position_embeddings", 4096)),
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=layout.tie_word_embeddings,
            position_embedding_type="mrope" if multimodal else "rope",
            rotary_base=rope_theta_of(text),
        )
    # Qwen3-VL / Omni: the media encoders, interleaved M-RoPE and DeepStack hooks go onto the model
    front = mm.MediaFront(hf_config, model, tp, pre) if multimodal else None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is not None:
        model.cuda()
    routing = None
    if config.algo.routing_replay and layout.is_moe:
        from relax_train.backends.megatron.routing import MegatronRouting

        routing = MegatronRouting(model, layout.moe_layers, int(text.num_experts_per_tok))
    return MegatronNet(
        cfg=config,
        model_path=model_path,
        hf_config=hf_config,
        layout=layout,
        mcfg=mcfg,
        model=model,
        front=front,
        device=device,
        tp=tp,
        ep=t.expert_model_parallel_size,
        cp=cp,
        pp=pp,
        pre=pre,
        post=post,
        layer_offset=int(get_transformer_layer_offset(mcfg)) if pp > 1 else 0,
        pad_token_id=getattr(text, "pad_token_id", None) or 0,
        scorer=TokenScorer(
            config.rollout.rollout_temperature, media_token_ids(hf_config) if multimodal else []
        ),
        routing=routing,
    )
