"""What a step optimises: flow.py (flow matching: sigmas, noise, targets, loss weights), schedules.py
(learning rate), preservation.py (DOP and regularisation images)."""

from ..moved import forward

__getattr__ = forward(__name__, "objective")  # the old trainer/objective.py's names, one release
