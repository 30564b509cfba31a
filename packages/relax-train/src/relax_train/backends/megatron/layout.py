"""The shape facts of a Qwen3 / Qwen3-MoE decoder that the HF <-> megatron conversion needs, and the errors it
raises. Apart from :mod:`~relax_train.backends.megatron.convert` because the backend reads them too (to build
the megatron model) without converting anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

ExpertFormat = Literal["fused", "per_expert"]


TEXT_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_omni_moe_text")
"""HF ``model_type``s of the decoders this converter maps (Qwen3-VL's and Qwen3-Omni's text models have
Qwen3's and Qwen3-MoE's layers)."""


class ConversionError(ValueError):
    """A state dict, layout or parallel size that the conversion cannot handle (the message says why)."""


@dataclass(frozen=True)
class MegatronLayout:
    """The shape facts the conversion needs, read from an HF config by :meth:`from_hf_config`.

    ``moe_layers`` lists the (0-based) layers whose MLP is a mixture of experts; the others are dense
    with ``ffn_hidden_size``. ``num_experts == 0`` means a dense model.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_layernorm: bool = True
    num_experts: int = 0
    moe_ffn_hidden_size: int | None = None
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim"):
            _require_positive(name, getattr(self, name))
        _require_positive("ffn_hidden_size", self.ffn_hidden_size)
        _require_positive("vocab_size", self.vocab_size)
        if self.num_attention_heads % self.num_query_groups:
            raise ConversionError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups (num_key_value_heads)={self.num_query_groups}"
            )
        moe_layers = tuple(sorted(set(int(i) for i in self.moe_layers)))
        object.__setattr__(self, "moe_layers", moe_layers)
        bad = [i for i in moe_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConversionError(f"moe_layers {bad} out of range for num_layers={self.num_layers}")
        if moe_layers:
            _require_positive("num_experts (MoE layers are set)", self.num_experts)
            _require_positive("moe_ffn_hidden_size (MoE layers are set)", self.moe_ffn_hidden_size or 0)

    def transformer_sizes(self) -> dict[str, int]:
        """The sizes under megatron's ``TransformerConfig`` names (``kv_channels``: the head dimension)."""
        names = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")
        return {**{n: getattr(self, n) for n in names}, "kv_channels": self.head_dim}

    @classmethod
    def from_hf_config(cls, config: Any) -> MegatronLayout:
        """Read a ``transformers`` ``Qwen3Config`` / ``Qwen3MoeConfig`` (or its ``config.json`` dict)."""

        def get(name: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                value = config.get(name, default)
            else:
                value = getattr(config, name, default)
            return default if value is None else value

        def need(name: str) -> int:
            value = get(name)
            if value is None:
                raise ConversionError(f"HF config has no {name}; is it a Qwen3 / Qwen3-MoE config?")
            return int(value)

        model_type = get("model_type")
        if model_type is not None and model_type not in TEXT_MODEL_TYPES:
            raise ConversionError(
                f"model_type={model_type!r}: only Qwen3, Qwen3-MoE and the decoders of Qwen3-VL and Qwen3-Omni "
                f"({', '.join(TEXT_MODEL_TYPES)}) are supported by the megatron backend; train other models "
                "(Qwen3-VL-MoE, ...) with --train-backend torch"
            )
        if get("hidden_act", "silu") != "silu":
            raise ConversionError(
                f"hidden_act={get('hidden_act')!r}: only SwiGLU ('silu') MLPs are supported"
            )
        if get("attention_bias", False):
            raise ConversionError("attention_bias=True: biases are not supported by this converter")
        num_layers = need("num_hidden_layers")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        num_experts = int(get("num_experts", 0) or get("num_local_experts", 0) or 0)
        moe_layers: tuple[int, ...] = ()
        if num_experts > 0:
            # transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and
            # (layer_idx + 1) % decoder_sparse_step == 0
            mlp_only = set(get("mlp_only_layers", []) or [])
            step = int(get("decoder_sparse_step", 1))
            moe_layers = tuple(i for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0)
        return cls(
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            ffn_hidden_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qk_layernorm=True,  # Qwen3 always has per-head q_norm / k_norm
            num_experts=num_experts,
            moe_ffn_hidden_size=need("moe_intermediate_size") if num_experts > 0 else None,
            moe_layers=moe_layers,
        )

    @property
    def heads_per_group(self) -> int:
        """Query heads per query group (``np/ng`` in megatron-core)."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """megatron-core's ``moe_layer_freq`` as a list: 1 for a MoE layer, 0 for a dense one."""
        moe = set(self.moe_layers)
        return [1 if i in moe else 0 for i in range(self.num_layers)]

    def padded_vocab_size(self, tp_size: int = 1, vocab_divisible_by: int = 128) -> int:
        """The vocab size megatron pads to: a multiple of ``vocab_divisible_by * tp_size``."""
        _require_positive("vocab_divisible_by", vocab_divisible_by)
        _require_positive("tp_size", tp_size)
        multiple = vocab_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple


def _require_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConversionError(f"{name} must be a positive int, got {value!r}")


def check_parallel_sizes(layout: MegatronLayout, tp_size: int = 1, ep_size: int = 1) -> None:
    """Raise :class:`ConversionError` naming the dimension when ``tp_size``/``ep_size`` cannot split it."""
    _require_positive("tp_size", tp_size)
    _require_positive("ep_size", ep_size)
    divisible = [
        ("num_attention_heads", layout.num_attention_heads, "tp_size", tp_size),
        ("num_query_groups (num_key_value_heads)", layout.num_query_groups, "tp_size", tp_size),
        ("ffn_hidden_size (intermediate_size)", layout.ffn_hidden_size, "tp_size", tp_size),
    ]
    if layout.is_moe:
        assert layout.moe_ffn_hidden_size is not None, "__post_init__ requires it once MoE layers are set"
        divisible += [
            ("num_experts", layout.num_experts, "ep_size", ep_size),
            ("moe_ffn_hidden_size (moe_intermediate_size)", layout.moe_ffn_hidden_size, "tp_size", tp_size),
        ]
    elif ep_size > 1:
        raise ConversionError(f"ep_size={ep_size} needs a MoE model, but the layout has no MoE layers")
    for what, n, size_name, size in divisible:
        if n % size:
            hint = ""
            if what.startswith("num_query_groups"):
                hint = (
                    " (megatron-core can replicate KV heads when tp_size > num_query_groups, but this "
                    "converter only places whole query groups on each rank)"
                )
            raise ConversionError(
                f"{what}={n} is not divisible by {size_name}={size}: choose a {size_name} that divides "
                f"{n}{hint}"
            )
