"""The ``sglang`` engine's LoRA requests, read by SGLang 0.5.23's own parsing code (the ``.venv-sglang``
install, or ``$RELAX_SGLANG_PYTHON``), and the checks made before anything reaches a server.

SGLang's HTTP server validates each body with pydantic against its ``io_struct`` structs (ignoring unknown
fields, hence the check that every field we send is one of theirs), its TP worker deserializes the tensors
with ``MultiprocessingSerializer`` and builds the adapter's ``LoRAConfig.from_dict``; its launcher parses
the flags with ``prepare_server_args``. One child process of that Python does all of it for our bodies.
"""

from __future__ import annotations

import json
import subprocess

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from relax_core.config_lora import LoraConfig  # noqa: E402
from relax_core.lora import ADAPTER_NAME, peft_config_dict  # noqa: E402
from relax_rollout.engines.base import SamplingParams  # noqa: E402
from relax_rollout.engines.processes import flag_args  # noqa: E402
from relax_rollout.engines.sglang.lora import (  # noqa: E402
    adapter_name,
    check_adapter,
    load_adapter_request,
    lora_server_args,
    serialize_adapter,
    unload_adapter_request,
    weight_version_request,
)
from relax_rollout.engines.wire import generate_body  # noqa: E402

CONFIG = peft_config_dict(LoraConfig(lora_rank=8, lora_target_modules=["q_proj", "v_proj"]))

READ = r"""
import json, sys
import pydantic
from sglang.srt.managers import io_struct
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.utils.common import MultiprocessingSerializer
from sglang.srt.server_args import prepare_server_args

job = json.load(sys.stdin)
out = {}
for key, (struct, body) in job["bodies"].items():
    cls = getattr(io_struct, struct)
    obj = pydantic.TypeAdapter(cls).validate_python(body)
    import dataclasses, msgspec
    fields = {f.name for f in (dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else msgspec.structs.fields(cls))}
    out[key] = {"unknown": sorted(set(body) - fields)}
    if struct == "LoadLoRAAdapterFromTensorsReqInput":
        tensors = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
        cfg = LoRAConfig.from_dict(obj.config_dict)
        out[key] |= {"ranks": len(obj.serialized_named_tensors), "r": cfg.r,
                     "targets": sorted(cfg.target_modules), "lora_name": obj.lora_name,
                     "tensors": {n: [str(t.dtype), list(t.shape), float(t.double().sum())]
                                 for n, t in tensors.items()}}
    if struct == "GenerateReqInput":
        obj.normalize_batch_and_arguments()
        out[key]["lora_path"] = obj.lora_path
sa = prepare_server_args(job["argv"])
out["server_args"] = {k: (sorted(v) if isinstance(v, set) else v) for k, v in
                      ((k, getattr(sa, k)) for k in ("enable_lora", "max_lora_rank", "lora_target_modules",
                                                       "lora_backend"))}
print("RESULT" + json.dumps(out))
"""


def adapter_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """peft's saved tensors of a rank-8 q/v adapter on a tiny Qwen3 built from its config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = peft.get_peft_model(Qwen3ForCausalLM(cfg), peft.LoraConfig(**CONFIG))
    return dict(peft.get_peft_model_state_dict(model))


@pytest.fixture(scope="module")
def sglang_read(sglang_python, tiny_model_dir):
    """What SGLang makes of our LoRA bodies and launch flags."""
    tensors = adapter_tensors()
    args = lora_server_args(CONFIG, {"device": "cpu"})
    gen = generate_body([[1, 2], [3]], SamplingParams(max_new_tokens=2), [0, 0], common={"lora_path": "x_v1"})
    job = {
        "bodies": {
            "load": [
                "LoadLoRAAdapterFromTensorsReqInput",
                load_adapter_request(adapter_name(3), CONFIG, serialize_adapter(tensors), 2),
            ],
            "unload": ["UnloadLoRAAdapterReqInput", unload_adapter_request(adapter_name(3))],
            "version": ["UpdateWeightVersionReqInput", weight_version_request(3)],
            "generate": ["GenerateReqInput", gen],
        },
        "argv": ["--model-path", tiny_model_dir, *flag_args(args)],
    }
    run = subprocess.run(
        [sglang_python, "-c", READ], input=json.dumps(job), capture_output=True, text=True, timeout=300
    )
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    return tensors, json.loads(lines[-1][len("RESULT") :])


def test_sglang_reads_our_adapter_load_as_sent(sglang_read):
    tensors, read = sglang_read
    load = read["load"]
    assert load["unknown"] == [] and load["ranks"] == 2 and load["lora_name"] == f"{ADAPTER_NAME}_v3"
    assert load["r"] == 8 and load["targets"] == ["q_proj", "v_proj"]
    assert set(load["tensors"]) == set(tensors)
    for name, (dtype, shape, total) in load["tensors"].items():
        t = tensors[name]
        assert (dtype, shape) == (str(t.dtype), list(t.shape))
        assert total == pytest.approx(float(t.double().sum()), abs=1e-9)


def test_sglang_reads_our_unload_version_and_generate_fields(sglang_read):
    _, read = sglang_read
    assert read["unload"]["unknown"] == read["version"]["unknown"] == read["generate"]["unknown"] == []
    assert read["generate"]["lora_path"] == ["x_v1", "x_v1"]  # one adapter for the whole batch


def test_sglang_parses_the_launch_flags_of_a_server_without_an_adapter(sglang_read):
    _, read = sglang_read
    assert read["server_args"] == {
        "enable_lora": True,
        "max_lora_rank": 8,
        "lora_target_modules": ["q_proj", "v_proj"],
        "lora_backend": "torch_native",
    }


def test_launch_flags_map_peft_s_shortcuts_and_keep_what_the_user_set():
    all_linear = peft_config_dict(LoraConfig(lora_rank=4))
    assert lora_server_args(all_linear, {})["lora_target_modules"] == ["all"]
    assert "lora_backend" not in lora_server_args(all_linear, {})  # a GPU keeps SGLang's default
    mine = lora_server_args(all_linear, {"--max-lora-rank": 16, "lora_backend": "triton"})
    assert "max_lora_rank" not in mine and mine["lora_backend"] == "triton"
    with pytest.raises(ValueError, match="below the adapter's rank"):
        lora_server_args(all_linear, {"max_lora_rank": 2})
    experts = peft_config_dict(LoraConfig(lora_rank=4, lora_target_parameters=["mlp.experts.gate_up_proj"]))
    with pytest.raises(ValueError, match="Triton MoE runner"):
        lora_server_args(experts, {"device": "cpu"})


def test_malformed_adapters_are_refused_naming_the_tensor():
    good = adapter_tensors()
    shapes = check_adapter(good, CONFIG)
    a = next(n for n in good if n.endswith("q_proj.lora_A.weight"))
    b = a.replace("lora_A", "lora_B")
    cases = {
        "rank 4": {**good, a: good[a][:4]},
        "not peft's saved name": {**good, "model.layers.0.q_proj.weight": good[a]},
        "without both": {n: t for n, t in good.items() if n != b},
        "2-D floating": {**good, a: good[a].long()},
        "not a target module": {**good, a.replace("q_proj", "k_proj"): good[a], b.replace("q_proj", "k_proj"): good[b]},
        "needs the adapter's tensors": {},
    }  # fmt: skip
    for why, tensors in cases.items():
        with pytest.raises(ValueError, match=why):
            check_adapter(tensors, CONFIG)
    extra = {**good, a.replace("layers.0", "layers.9"): good[a], b.replace("layers.0", "layers.9"): good[b]}
    with pytest.raises(ValueError, match="changed names or shapes"):
        check_adapter(extra, CONFIG, shapes)
