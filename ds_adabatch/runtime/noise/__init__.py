"""The gradient noise scale: measured in Adam's geometry from the passes a step already runs (or from
a split step at one pass), for the noise-driven schedules. Imports only the door below it."""
