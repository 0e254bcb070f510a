"""What a step optimises: flow.py (flow matching: sigmas, noise, targets, loss weights), schedules.py
(learning rate), preservation.py (DOP and regularisation images)."""
