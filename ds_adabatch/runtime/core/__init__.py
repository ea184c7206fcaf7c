"""The step core: decide (the schedule, agreed over ranks) -> plan (micro-batch, GAS, per-rank
counts) -> draw (the step's samples from the loader, an epoch's tail re-planned) -> account (samples,
tokens, the step record) -> state (checkpoints), framework-neutral, held by every entry point
(the engines, the forward/backward/step loop, the pipeline engine and the Trainer). Also the pieces a
step is made of: the passes and their weights, the step's loss, its host synchronisation, its times
and the coupled learning rate."""
