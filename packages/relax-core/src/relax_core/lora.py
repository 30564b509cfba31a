"""LoRA RL, the part every side shares: the adapter's configuration and the names its tensors travel under.

Why in relax-core: the trainer (relax-train) trains the adapter, the rollout engines (relax-rollout: the
torch engine, SGLang) serve it, and both must build the same adapter from the same ``--lora-*`` flags and
agree on what a weight update holds. peft is imported only inside the functions that need it.

The wire format of an adapter update (``--lora-sync-mode adapter``): the tensors of
``peft.get_peft_model_state_dict`` under their names in peft's saved format
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, no adapter name in them), i.e. exactly
what ``adapter_model.safetensors`` holds, with :func:`peft_config_dict` as its ``adapter_config.json``. The
torch engine, SGLang's ``/load_lora_adapter_from_tensors`` and ``PeftModel.from_pretrained`` all read that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_core.config_lora import LoraConfig

ADAPTER_NAME = "relax_policy_lora"
"""The adapter's name in an engine (upstream Relax's); SGLang gets ``{ADAPTER_NAME}_v{version}`` per version,
since it refuses to reload a name it holds."""


def peft_config_dict(lora: LoraConfig) -> dict[str, Any]:
    """``adapter_config.json``'s fields for ``lora`` (what ``peft.LoraConfig(**d)`` takes, and SGLang's
    ``config_dict``). ``all-linear`` stays peft's string shortcut."""
    modules = lora.lora_target_modules
    target: str | list[str] = "all-linear" if modules == ["all-linear"] else list(modules)
    out: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.lora_rank,
        "lora_alpha": lora.lora_alpha,
        "lora_dropout": lora.lora_dropout,
        "target_modules": target,
        "bias": "none",
    }
    if lora.lora_target_parameters:
        out["target_parameters"] = list(lora.lora_target_parameters)
    return out


MEDIA_TOWERS = (
    "visual",
    "vision_tower",
    "vision_model",
    "audio_tower",
    "audio_model",
    "multi_modal_projector",
)
"""Module names of the vision and audio encoders of the multimodal models we train (Qwen-VL's ``visual``,
the Omni thinker's ``visual`` and ``audio_tower``, LLaVA-style towers): adapters go on the language model
only, as veRL and slime do; the towers stay the base model's."""

_EXCLUDE = r"(.*\.)?(" + "|".join(MEDIA_TOWERS) + r")(\..*)?"
"""peft's ``exclude_modules`` (a regex matched against each module's full name): every module inside a tower."""


def linear_targets(model: Any) -> list[str]:
    """``all-linear`` resolved here: the leaf names of the model's ``nn.Linear`` layers outside the media
    towers, the output head excepted. Why not peft's own resolution: on transformers 5 MoE models it maps the
    v4 names onto the fused expert weights *and the router* (``gate.weight``), so a router would be trained
    (changing which experts a token goes to, which slime refuses too) and the experts would get adapters
    nobody asked for (``--lora-target-parameters`` names those)."""
    import re

    import torch

    tower = re.compile(_EXCLUDE)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {
        n.rpartition(".")[2]
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and not tower.fullmatch(n)
    }
    return sorted(names - {"lm_head"})


def _peft_dict(lora: LoraConfig | dict[str, Any]) -> dict[str, Any]:
    d = peft_config_dict(lora) if isinstance(lora, LoraConfig) else dict(lora)
    if d.get("target_parameters") and d.get("lora_dropout", 0.0):
        raise ValueError(
            f"--lora-dropout {d['lora_dropout']} with --lora-target-parameters: peft's adapters on parameters "
            "(MoE experts) cannot apply dropout; set --lora-dropout 0"
        )
    return d


def wrap(model: Any, lora: LoraConfig | dict[str, Any]) -> Any:
    """``model`` with LoRA adapters (a ``peft.PeftModel``, adapter ``default``, B = 0: it computes what the
    base computes until trained). ``lora``: the run's :class:`LoraConfig`, or its :func:`peft_config_dict`
    (what an engine is given). Vision and audio towers get none (:data:`MEDIA_TOWERS`). Only the adapters
    require grad afterwards (peft freezes the base)."""
    import re

    import peft

    d = _peft_dict(lora)
    tower = re.compile(_EXCLUDE)
    if any(
        tower.fullmatch(n) for n, _ in model.named_modules() if n
    ):  # (multimodal: adapters on the LM only)
        d.setdefault("exclude_modules", _EXCLUDE)
    if d.get("target_modules") == "all-linear":
        d["target_modules"] = linear_targets(model)
    d.pop("peft_type", None)
    return peft.get_peft_model(model, peft.LoraConfig(**d))


def adapter_state(model: Any) -> dict[str, Any]:
    """The adapter's tensors in the wire format (see the module docstring), detached."""
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model: Any, tensors: dict[str, Any]) -> None:
    """Copy an adapter update (wire format) into ``model``'s adapter, in place. Refuses (before copying
    anything) what :func:`check_adapter_update` refuses."""
    check_adapter_update(model, tensors)
    _copy_adapter(model, tensors)


def _copy_adapter(model: Any, tensors: dict[str, Any]) -> None:
    """The copy of :func:`load_adapter_state`, for a caller that checked ``tensors`` already."""
    import torch
    from peft import set_peft_model_state_dict

    with torch.no_grad():
        set_peft_model_state_dict(model, {k: torch.as_tensor(v) for k, v in tensors.items()})


def check_adapter_update(model: Any, tensors: dict[str, Any]) -> None:
    """Refuse an adapter update ``model``'s adapter cannot take whole: names it does not have, names it has
    that the update lacks, shape mismatches (another --lora-rank or --lora-target-modules on the sender)."""
    expected = adapter_state(model)
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise KeyError(
            f"adapter update does not match this adapter (same --lora-* flags on both sides?): "
            f"{len(unknown)} unknown name(s) {unknown[:3]}, {len(missing)} missing {missing[:3]}"
        )
    bad = [k for k, v in tensors.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if bad:
        raise ValueError(
            f"adapter update shapes differ (another --lora-rank?): {bad[0]} is {tuple(tensors[bad[0]].shape)}, "
            f"this adapter's {tuple(expected[bad[0]].shape)}"
        )


def base_parameters(model: Any) -> list[tuple[str, Any]]:
    """The base model's parameters of a peft ``model`` under their HF names (peft's ``.base_layer`` taken
    out, the adapters' own left out): what the un-wrapped model's ``named_parameters`` gives."""
    out = []
    for name, p in model.get_base_model().named_parameters():
        parts = name.split(".")
        if not any(part.startswith("lora_") for part in parts):  # (lora_A, lora_B, lora_embedding_A ...)
            out.append((".".join(part for part in parts if part != "base_layer"), p))
    return out


def merged_weights(model: Any) -> list[tuple[str, Any]]:
    """Every base parameter under its HF name (as the un-wrapped model's ``named_parameters`` gives them)
    with the active adapters' deltas added: new tensors, the model is left as it is (no ``merge_adapter``,
    which would change the weights the trainer keeps training). Adapters on parameters (MoE experts,
    ``target_parameters``) included."""
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    deltas: dict[int, Any] = {}
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, LoraLayer):
                continue
            param = module.get_param() if isinstance(module, ParamWrapper) else module.get_base_layer().weight
            for name in module.active_adapters:
                if name in module.lora_A:
                    # peft: every concrete LoraLayer (Linear, Embedding, ParamWrapper ...) defines
                    # get_delta_weight; the base class does not declare it
                    d = module.get_delta_weight(name).to(param.dtype)  # type: ignore[attr-defined]
                    deltas[id(param)] = deltas[id(param)] + d if id(param) in deltas else d
        return [
            (n, p.detach() + deltas[id(p)] if id(p) in deltas else p.detach())
            for n, p in base_parameters(model)
        ]


def _skeleton(model_path: str | Path) -> Any:
    """The model of ``model_path``'s config.json on the meta device: its module and parameter names, no
    weights read and no memory taken."""
    import torch
    import transformers

    from relax_core.models import architecture

    config = transformers.AutoConfig.from_pretrained(str(model_path))
    arch = architecture(model_path)
    cls = transformers.AutoModelForCausalLM if arch.endswith("ForCausalLM") else getattr(transformers, arch)
    with torch.device("meta"):
        return cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)


PEFT_ADAPTS = {"Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "MultiheadAttention"}
"""The module kinds peft's LoRA adapts (by class name: transformers' Conv1D included)."""
TIED = ("embed_tokens", "lm_head")
"""The input and output embeddings, one weight where a model ties them (``tie_word_embeddings``)."""


def check_targets(model_path: str | Path, lora: LoraConfig) -> None:
    """Refuse, before any model loads, ``--lora-target-modules`` / ``--lora-target-parameters`` entries that
    name nothing in the policy's language model (a typo would otherwise train nothing there, or fail deep
    inside peft in every role): a ValueError naming each and listing some names the model has."""
    import re

    _peft_dict(lora)  # (dropout with target parameters)
    model = _skeleton(model_path)
    tower = re.compile(_EXCLUDE)
    modules = [n for n, _ in model.named_modules() if n and not tower.fullmatch(n)]
    every = model.named_parameters(remove_duplicate=False)  # (a tied lm_head.weight is listed too)
    params = [n for n, _ in every if not tower.fullmatch(n.rsplit(".", 1)[0])]

    def hits(names: list[str], t: str) -> bool:
        return any(n == t or n.endswith("." + t) for n in names)

    problems = []
    targets = [] if lora.lora_target_modules == ["all-linear"] else lora.lora_target_modules
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
    bad = [t for t in targets if not hits(modules, t)]
    if bad:
        problems.append(f"--lora-target-modules {bad}: no such module (its linear modules: {linear[:12]})")
    kinds = dict(model.named_modules())
    # (peft adapts a module of these kinds; a container (mlp), a norm, rotary or act_fn passed the check
    # above and failed in peft, in every role, once the model had loaded)
    cannot = {
        t: type(m).__name__
        for t in targets
        for n, m in kinds.items()
        if (n == t or n.endswith("." + t)) and type(m).__name__ not in PEFT_ADAPTS and not tower.fullmatch(n)
    }
    if cannot:
        what = ", ".join(f"{t!r} is a {k}" for t, k in cannot.items())
        problems.append(
            f"--lora-target-modules: {what}, which peft cannot adapt; name linear modules ({linear[:12]})"
        )
    tied = getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    )

    def on_tied(names: list[str], t: str) -> bool:
        return any(
            (n == t or n.endswith("." + t)) and n.split(".")[-1 - n.endswith(".weight")] in TIED
            for n in names
        )

    shared = [t for t in targets if on_tied(modules, t)] + [
        t for t in lora.lora_target_parameters if on_tied(params, t)
    ]
    shared = shared if tied else []
    if shared:  # (the engine merged the delta into the weight both share: it served another model)
        problems.append(
            f"{shared}: this model ties embed_tokens and lm_head to one weight (tie_word_embeddings), and an "
            "adapter on either changes both when served merged; leave them out of --lora-target-modules"
        )
    bad = [t for t in lora.lora_target_parameters if not hits(params, t)]
    if bad:
        tails = sorted({".".join(n.split(".")[-3:]) for n in params if n.endswith("proj") or "experts" in n})
        problems.append(f"--lora-target-parameters {bad}: no such parameter (it has e.g. {tails[:8]})")
    if problems:
        raise ValueError(f"{model_path}: " + "; ".join(problems))


class MergedServing:
    """An engine's adapted model served with the adapter merged into its base weights, so generating costs
    what the base model costs: peft's unmerged forward adds two small products per adapted layer, which on
    the CPU demo took the torch engine from ~9,000 to ~5,800 tokens/s.

    Exact across updates: each update restores the base weights from a host copy before merging the new
    adapter (unmerging would subtract the old delta in floating point, and the error would add up over a
    run). The copy is of the adapted layers' own weights, in host memory: device memory is as without LoRA.

    Not merged (:attr:`merged` False) where an adapted weight is shared with another module — an adapter on
    the LM head of a model whose input embeddings are tied to it: merging would change the embeddings too,
    so the engine would sample from another model than the trainer's; peft's unmerged forward is served.
    """

    def __init__(self, model: Any) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        self._owners = [
            (m.get_base_layer(), name)
            for m in model.modules()
            if isinstance(m, BaseTunerLayer)
            for name, _ in m.get_base_layer().named_parameters(recurse=False)
        ]
        uses: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
        self.merged = all(uses.get(id(getattr(o, n)), 1) == 1 for o, n in self._owners)
        self._base = [getattr(owner, name).detach().to("cpu", copy=True) for owner, name in self._owners]
        if self.merged:
            model.merge_adapter()

    def load(self, tensors: dict[str, Any]) -> None:
        """Serve the adapter update ``tensors`` (wire format; validated whole before anything changes)."""
        import torch

        check_adapter_update(self.model, tensors)
        with torch.no_grad():
            if not self.merged:
                _copy_adapter(self.model, tensors)
                return
            self.model.unmerge_adapter()
            for (owner, name), base in zip(self._owners, self._base):
                getattr(owner, name).copy_(base)
            _copy_adapter(self.model, tensors)  # (checked above, before anything changed)
            self.model.merge_adapter()
