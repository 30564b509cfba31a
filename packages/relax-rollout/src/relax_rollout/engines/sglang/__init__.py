"""The ``sglang`` rollout engine: SGLang servers launched and supervised here, driven over HTTP as one pool.

Why a package: the engine (:mod:`~relax_rollout.engines.sglang.engine`, :class:`SGLangEngine`), the
supervision of its servers (:mod:`~relax_rollout.engines.sglang.lifecycle`) and their weight updates
(:mod:`~relax_rollout.engines.sglang.weights`) change for different reasons; what they share is one
:class:`~relax_rollout.engines.sglang.state.SGLangServers` (:mod:`~relax_rollout.engines.sglang.state`), which
the engine owns and hands to the other two. The engine registry names ``relax_rollout.engines.sglang:SGLangEngine``.
"""

from relax_rollout.engines.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine"]
