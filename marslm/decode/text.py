"""Token ids to text, incrementally, with stop strings: one place for streaming and for stopping.

Decoding a growing list of ids again at every step costs O(length) per step; :class:`TextStream`
decodes a short window instead and emits what it adds beyond the previous window (TGI's and
vLLM's scheme). Text is held back while it could still change: a trailing U+FFFD is a multi-byte
character cut across steps, and a tail that could be the start of a stop string must wait for the
next tokens. A stop string ends the text just before it (OpenAI semantics: the stop string is not
part of the output), also when a step accepted several tokens at once or the stop string spans
two steps; nothing after it is ever emitted.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # decoded so far (may run past a stop string until it is found)
        self.emitted = ""  # handed out so far
        self.stopped = False  # a stop string was found; ``text`` ends before it
        self._prefix_offset = self._read_offset = 0
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        """Add a step's tokens; return the text that can be shown now (possibly empty)."""
        if self.stopped:
            return ""
        self.ids += ids
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.ids[self._prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            searched = max(0, len(self.text) - self._hold)
            self.text += after[len(before) :]
            self._find_stop(searched)
        safe = len(self.text) if self.stopped else len(self.text) - self._hold
        return self._emit(safe)

    def finish(self) -> str:
        """The sequence ended: reconcile with a full decode and return the rest of the text."""
        if not self.stopped:
            full = self._decode(self.ids)
            if full.startswith(self.text):
                searched = max(0, len(self.text) - self._hold)
                self.text = full
                self._find_stop(searched)
        return self._emit(len(self.text))

    def found_stop(self, ids: list[int]) -> bool:
        """Add a step's tokens; whether the text now holds a stop string (the row can end)."""
        self.push(ids)
        return self.stopped

    def close(self, token_ids: list[int]) -> list[int]:
        """The row ended with ``token_ids`` (all of them, those pushed before included): take the
        rest, finish, and return the ids the final :attr:`text` covers (a stop string cuts both)."""
        self.push(token_ids[len(self.ids) :])
        self.finish()
        return token_ids[: self.token_count()]

    def token_count(self) -> int:
        """How many of the ids the final text covers: the longest prefix whose text fits inside it."""
        if not self.stopped:
            return len(self.ids)
        count = len(self.ids)
        while count and not self.text.startswith(self._decode(self.ids[:count])):
            count -= 1
        return count

    @staticmethod
    def cut(text: str, stop) -> str:
        """``text`` before the first of the ``stop`` strings in it (all of it if none is)."""
        at = _first_stop(text, stop)
        return text if at is None else text[:at]

    def _find_stop(self, start: int) -> None:
        at = _first_stop(self.text, self.stop, start)
        if at is not None:
            self.text = self.text[:at]
            self.stopped = True

    def _emit(self, upto: int) -> str:
        if upto <= len(self.emitted):
            return ""
        delta = self.text[len(self.emitted) : upto]
        self.emitted += delta
        return delta


def _first_stop(text: str, stop, start: int = 0) -> int | None:
    """Where the first of the ``stop`` strings found at or after ``start`` begins (None: none is)."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None
