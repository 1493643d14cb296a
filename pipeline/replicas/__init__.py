"""Replica groups under torchft: the step protocol, coordinator, record, heals, launcher."""
