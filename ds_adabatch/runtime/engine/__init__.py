"""The data-parallel engines: ``train_batch`` (one call, one optimizer step) and the
forward/backward/step loop, each holding the step core and the DeepSpeed engine it drives."""
