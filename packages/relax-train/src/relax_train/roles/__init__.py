"""The train roles, one module each: the trainer and the bus consumers around it.

Each role reads what it needs from the bus, writes what it computes back, and acknowledges; nothing else
connects the roles. The classes run in-process (colocate) or as Ray actors (fully async), where ``run`` loops
until the bus closes.

- :mod:`.actor` — ``ActorWorker``, the trainer; :mod:`.actor_checkpoint` its checkpoints and bus snapshot,
  :mod:`.prox` the exact proximal policy, :mod:`.metrics` the step's metrics.
- :mod:`.forward` — ``ForwardWorker``: ActorFwd, Reference and Teacher log-probs.
- :mod:`.advantages` — ``AdvantagesWorker`` and the KL-shaped rewards.
- :mod:`.base` — the bus loop and the device turns the roles share.

Nothing is imported here, so that a role loads only what it needs (the Advantages role no model code):
import from the module, e.g. ``relax_train.roles.actor:ActorWorker``.
"""
