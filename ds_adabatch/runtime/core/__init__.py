"""The step core: decide (the schedule, agreed over ranks) -> plan (micro-batch, GAS, per-rank
counts) -> account (samples, tokens, the step record), framework-neutral, held by every entry point
(the engines, the forward/backward/step loop, the pipeline engine and the Trainer). Also the pieces a
step is made of: the passes and their weights, the step's loss, its host synchronisation, its times
and the coupled learning rate."""
