"""The ``ds_adabatch`` logger under the Hugging Face Trainer: shown where transformers' own lines show.

A Trainer script sets the verbosity of transformers' logging (``TrainingArguments(log_level=...)``,
``--log_level info`` in ``run_clm.py``, ``transformers.utils.logging.set_verbosity_info()``), and
transformers prints its records with its own handler (stderr by default, the script's format where
it sets one). Records of the ``ds_adabatch`` logger — a plan change at INFO, a warning — are handed to
transformers' library logger, so they appear with the same handler and at the same verbosity: a plan
change shows where ``***** Running training *****`` shows, and stays quiet where that is quiet.

This holds while ``trainer.train()`` runs. A ``ds_adabatch`` logger the user configured (a handler or a
level of its own) is left alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["follow_transformers_logging"]

_PREFIX = "[ds_adabatch] "


class _ToTransformers(logging.Handler):
    """Hands ``ds_adabatch`` records to transformers' library logger at its current verbosity."""

    def emit(self, record: logging.LogRecord) -> None:
        from transformers.utils import logging as hf_logging

        # transformers 5.23: the library's root logger ("transformers") holds its handler and the level
        # set_verbosity sets; get_verbosity reads it. Checked per record, so a later change applies.
        if record.levelno < hf_logging.get_verbosity():
            return
        target = logging.getLogger("transformers")
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args = _PREFIX + record.getMessage(), None
        target.handle(copy)


@contextlib.contextmanager
def follow_transformers_logging() -> Iterator[None]:
    """Route the ``ds_adabatch`` logger through transformers' logging while the block runs (a training
    run); afterwards the logger is as it was."""
    logger = logging.getLogger("ds_adabatch")
    if logger.handlers or logger.level != logging.NOTSET:
        yield  # the user configured it (or a run is already routing it): their handler and level decide
        return
    handler, propagate = _ToTransformers(), logger.propagate
    logger.addHandler(handler)
    # Every record reaches the handler, which applies transformers' verbosity; not propagated, so a
    # root handler (run_clm.py's logging.basicConfig) does not print it a second time.
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = propagate
