"""Checkpoints: saving and loading an adaptive engine's state beside DeepSpeed's, checking a
checkpoint before it is loaded, and converting one to DeepSpeed's universal format for another world
size. Imports the core below it (the plan-change record)."""
