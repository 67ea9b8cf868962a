"""Prefix affinity for replicas, without Ray: the page hashes of a request's
prompt as the router computes them (`PromptPages`), and which replica was
sent which pages (`PrefixTable`).

    pages = PromptPages(tokenizer, page_size=16, max_pages=32)
    hashes = pages.of_request("/v1/completions", body_bytes)   # [] when none
    table = PrefixTable()
    table.match(hashes)             # {replica: pages matched from the start}
    table.record(hashes, replica)   # after routing the request there

The hashes are the prefix cache's own (`serving.pages.page_hashes`: chained
SHA-256 of each full page of token ids, rooted in the request's
cache_salt), so two requests match exactly where a replica's prefix cache
could serve one's pages to the other. The table is the router's memory of
where it sent each page, not the replicas' caches: a replica that evicted
a page still counts as holding it until the table drops it (least
recently routed first, past `max_pages`).
"""

from __future__ import annotations

import collections
import json
from typing import Hashable, Iterable, Optional, Sequence

from jaxinfer.serving.pages import page_hashes

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class PrefixTable:
    """Page hash -> the replicas a request holding that page was routed to.

    Args:
      max_pages: page hashes remembered at most (>= 1); past it the least
        recently routed page is forgotten.
    Raises:
      ValueError: max_pages < 1.
    """

    def __init__(self, max_pages: int = 1 << 20):
        if max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {max_pages}")
        self.max_pages = int(max_pages)
        self._holders: collections.OrderedDict[bytes, set] = collections.OrderedDict()
        self._held: collections.Counter = collections.Counter()   # replica -> pages it holds

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, hashes: Sequence[bytes]) -> dict[Hashable, int]:
        """replica -> how many of `hashes`, from the first, were routed to
        it (only replicas matching at least one page)."""
        matched: dict[Hashable, int] = {}
        alive: Optional[set] = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            alive = set(holders or ()) if alive is None else alive & (holders or set())
            if not alive:
                break
            for r in alive:
                matched[r] = i + 1
        return matched

    def record(self, hashes: Iterable[bytes], replica: Hashable) -> None:
        """Remember that `replica` now holds the pages `hashes`."""
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = set()
            else:
                self._holders.move_to_end(h)
            if replica not in holders:
                holders.add(replica)
                self._held[replica] += 1
        while len(self._holders) > self.max_pages:
            _, holders = self._holders.popitem(last=False)
            for r in holders:
                self._forget(r)

    def held(self, replica: Hashable) -> int:
        """Pages recorded for `replica`."""
        return self._held.get(replica, 0)

    def drop(self, replica: Hashable) -> None:
        """Forget every page of `replica` (it died or left)."""
        if not self._held.get(replica):
            return
        for h in [h for h, holders in self._holders.items() if replica in holders]:
            holders = self._holders[h]
            holders.discard(replica)
            if not holders:
                del self._holders[h]
        del self._held[replica]

    def _forget(self, replica: Hashable) -> None:
        self._held[replica] -= 1
        if self._held[replica] <= 0:
            del self._held[replica]


class PromptPages:
    """The page hashes of the first `max_pages` full pages of a request's
    prompt, tokenized on the router as the replica would: a completion's
    `prompt` (text, token ids, or the first of a list: a request goes to one
    replica), a chat request's `messages` (with `tools`) rendered with the
    chat template, salted with the request's `cache_salt`.

    Args:
      tokenizer: the model's `Tokenizer` (with the served chat template), or
        None: only prompts given as token ids are hashed.
      page_size: the replicas' KV page size, tokens (>= 1).
      max_pages: pages hashed at most (>= 1): the first pages decide where
        a prefix lives, and the rest would only cost tokenizer time.
    Raises:
      ValueError: page_size or max_pages < 1.
    """

    def __init__(self, tokenizer, page_size: int, max_pages: int = 32):
        if page_size < 1 or max_pages < 1:
            raise ValueError(f"page_size and max_pages must be >= 1, got {page_size}, {max_pages}")
        self.tokenizer, self.page_size, self.max_pages = tokenizer, int(page_size), int(max_pages)

    def of_request(self, path: str, body: bytes) -> list[bytes]:
        """The hashes for a POST of `body` to `path`; [] for another route, a
        body that is not a JSON object, or a prompt the router cannot
        tokenize (the replica answers such a request's error itself)."""
        if path not in (COMPLETIONS, CHAT):
            return []
        try:
            request = json.loads(body)
            ids = self.prompt_ids(path, request) if isinstance(request, dict) else None
        except Exception:  # noqa: BLE001 - routing falls back to load; the replica validates
            return []
        if not ids:
            return []
        salt = request.get("cache_salt")
        return page_hashes(ids[:self.page_size * self.max_pages], self.page_size,
                           salt if isinstance(salt, str) else None)

    def prompt_ids(self, path: str, request: dict) -> Optional[list[int]]:
        """The prompt's token ids (None: nothing to hash). Raises what the
        tokenizer or template raises for a malformed prompt."""
        if path == COMPLETIONS:
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]                  # several prompts: the first one's pages
            if isinstance(prompt, list):
                return [int(i) for i in prompt]
            if isinstance(prompt, str) and self.tokenizer is not None:
                return self.tokenizer.encode_prompt(prompt)
            return None
        messages = request.get("messages")
        if self.tokenizer is None or not isinstance(messages, list) or not messages:
            return None
        kwargs = {"tools": request["tools"]} if request.get("tools") else {}
        return self.tokenizer.apply_chat_template(messages, **kwargs)
