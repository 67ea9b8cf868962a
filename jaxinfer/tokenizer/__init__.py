"""Text <-> token ids from a checkpoint's own files: the `Tokenizer` (encode,
decode, chat templates; `tokenizer`), the GGUF tokenizer conversion (`gguf`),
the streaming `IncrementalDetokenizer` (`detokenizer`) and stop strings
(`stop`)."""

from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer
from jaxinfer.tokenizer.stop import StopMatcher
from jaxinfer.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "StopMatcher", "Tokenizer"]
