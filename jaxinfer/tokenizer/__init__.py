"""Text <-> token ids from a checkpoint's own files: the `Tokenizer` (encode,
decode, chat templates; `tokenizer`), the GGUF tokenizer conversion (`gguf`),
the streaming `IncrementalDetokenizer` (`detokenizer`) and stop strings
(`stop`).

Importing this package installs a filter on the "transformers" logger that
drops transformers' import-time advice "PyTorch was not found. Models won't
be available...": the tokenizer path never needs torch, and with core
dependencies only that line reads as an error before the answer. Every
other transformers message is kept.
"""

import logging

from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer.stop import StopMatcher
from jaxinfer.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopMatcher", "Tokenizer"]


def _not_torch_advice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("PyTorch was not found.")


if _not_torch_advice not in logging.getLogger("transformers").filters:
    logging.getLogger("transformers").addFilter(_not_torch_advice)
