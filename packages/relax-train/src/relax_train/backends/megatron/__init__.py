"""Megatron-core support for relax-train.

:mod:`relax_train.backends.megatron.convert` converts Hugging Face Qwen3 / Qwen3-MoE state dicts to and from
megatron-core's GPT layout (tensor- and expert-parallel shards). It is pure torch: nothing in this
package imports megatron-core, so it works (and is tested) without it.
"""
