"""The train roles' former home, kept so that old imports still work: the roles live in
:mod:`relax_train.roles`, one module each (``relax_train.roles.actor:ActorWorker``,
``relax_train.roles.forward:ForwardWorker``, ``relax_train.roles.advantages:AdvantagesWorker``). Import
from there in new code.
"""

from relax_train.roles.actor import ActorWorker
from relax_train.roles.advantages import AdvantagesWorker, kl_shaped_sequence_rewards
from relax_train.roles.forward import FORWARD_FIELDS, ForwardWorker
from relax_train.roles.metrics import logp_absdiff, rollout_metrics

__all__ = [
    "FORWARD_FIELDS",
    "ActorWorker",
    "AdvantagesWorker",
    "ForwardWorker",
    "kl_shaped_sequence_rewards",
    "logp_absdiff",
    "rollout_metrics",
]
