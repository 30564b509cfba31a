"""The RMSNorm that lets megatron's local layer spec run with sequence parallelism."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from relax_train.backends.megatron.norms import SequenceParallelRMSNorm, use_sequence_parallel_norms  # noqa: E402


def _config(sequence_parallel: bool):
    """The two fields the norm reads (a TransformerConfig with sequence_parallel needs TP > 1)."""
    return SimpleNamespace(normalization="RMSNorm", sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("moe", [False, True])
def test_every_torch_norm_of_a_decoder_spec_is_swapped(moe):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec(
        num_experts=4 if moe else None, qk_layernorm=True, normalization="RMSNorm"
    )
    if layer.submodules.input_layernorm is not WrappedTorchNorm:
        pytest.skip("Apex is installed: megatron builds its own fused norms")
    spec = TransformerBlockSubmodules(layer_specs=[layer, layer], layer_norm=WrappedTorchNorm)
    use_sequence_parallel_norms(spec)
    assert "WrappedTorchNorm" not in repr(spec)
    sub = spec.layer_specs[0].submodules
    assert spec.layer_norm is SequenceParallelRMSNorm
    assert sub.input_layernorm is SequenceParallelRMSNorm
    assert sub.self_attention.submodules.q_layernorm is SequenceParallelRMSNorm


def test_the_norm_equals_torchs_and_marks_its_weight_for_the_tp_reduction():
    x = torch.randn(5, 2, 32)
    ours = SequenceParallelRMSNorm(_config(False), 32, eps=1e-6)
    ref = torch.nn.RMSNorm(32, eps=1e-6)
    torch.testing.assert_close(ours(x), ref(x))
    assert ours.weight.sequence_parallel is False
    assert SequenceParallelRMSNorm(_config(True), 32).weight.sequence_parallel is True
