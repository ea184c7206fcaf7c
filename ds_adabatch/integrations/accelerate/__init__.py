"""Custom training loops under Hugging Face accelerate: ``prepare(accelerator, *objects)``.

Replace ``accelerator.prepare(...)`` with :func:`prepare` and put an ``"adabatch"`` section in accelerate's
DeepSpeed config; the loop accelerate's examples write stays as it is::

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = prepare(
        accelerator, model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    for batch in train_dataloader:           # this rank's micro-batches of the current plan
        with accelerator.accumulate(model):  # sync_gradients: True on the plan's last micro-batch
            outputs = model(**batch)
            accelerator.backward(outputs.loss)   # weighted: the step is the mean over its global batch
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

Which module does what:

* ``prepare``: :func:`prepare`: finds the section and the training loader, lets accelerate prepare
  everything else, and builds the engine through :func:`ds_adabatch.initialize` in the place where
  accelerate calls ``deepspeed.initialize``.
* ``loop``: the training loader it returns (accelerate's gradient state follows the plan), the backward
  that replaces accelerate's DeepSpeed wrapper, and the LR scheduler stepped as accelerate steps it.

Importing this package imports neither accelerate nor DeepSpeed; :func:`prepare` needs both.
The long story is docs/accelerate.md.
"""

from __future__ import annotations

from .prepare import prepare

__all__ = ["prepare"]
