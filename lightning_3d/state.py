"""Full (unsharded) views of a model's state, whatever the layout it was trained in.

The one implementation is :func:`lightning_3d.checkpoint.view.full_state_dict` (the per-parameter
view the checkpoint writers share); this is its public home outside the checkpoint package.
"""

from lightning_3d.checkpoint.view import full_state_dict

__all__ = ["full_state_dict"]
