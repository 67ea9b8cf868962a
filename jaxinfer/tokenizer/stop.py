"""Stop strings matched across token boundaries, with streaming hold-back.

Text arrives piece by piece (one detokenized chunk per token or per decode
chunk). A stop string may arrive split over several pieces, so any suffix of
the text that is still a prefix of some stop string is held back until it is
known not to be one. The stop string itself is never emitted (OpenAI / vLLM
convention), so streamed output equals non-streamed output.
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Incremental stop-string matcher for one row.

    Attributes:
      text: all text released so far (what the caller has emitted).
      stopped: a stop string has matched; nothing more is released.
    """

    def __init__(self, stop_strings: Sequence[str] = ()):
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop_strings)!r}")
        self.stop_strings = tuple(stop_strings)
        self.text = ""
        self.stopped = False
        self._held = ""

    def push(self, new_text: str, match: bool = True) -> tuple[str, bool]:
        """Add text; returns (text safe to emit now, whether a stop string matched).
        With match=False the text (and anything held back) is released without
        looking for stop strings (a request's first `min_tokens` tokens)."""
        if self.stopped:
            return "", True
        pending = self._held + new_text
        if not match:
            self._held = ""
            return self._release(pending), False
        cut = self._first_match(pending)
        if cut is not None:
            self.stopped = True
            self._held = ""
            return self._release(pending[:cut]), True
        keep = self._partial_suffix(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return self._release(pending[:len(pending) - keep]), False

    def flush(self) -> str:
        """Release held-back text at the end of generation (no match came)."""
        held, self._held = self._held, ""
        return "" if self.stopped else self._release(held)

    def _release(self, piece: str) -> str:
        self.text += piece
        return piece

    def _first_match(self, text: str):
        hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        return min(hits) if hits else None

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
