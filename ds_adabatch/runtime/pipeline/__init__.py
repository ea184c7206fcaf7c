"""The pipeline engine: ``train_batch`` over DeepSpeed's ``PipelineEngine`` with a changing number of
micro-batches, and the feed that weighs its uneven micro-batches exactly."""
