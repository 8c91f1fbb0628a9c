"""One byte stream: a sequence of pieces (an object, its offset in the stream, its bytes) cut
into the plan's shares. Saved activations (``offload.Group``: one piece per saved storage) and
a unit's weights, gradients and optimizer state (``streaming.UnitStatic``: one piece per
tensor) are both such streams; each piece is checksummed on its own when it goes to a file
(``files.Sums`` keys checksums by the piece's offset)."""
from __future__ import annotations


class ByteStream:
    """Pieces ``(item, offset, nbytes)`` laid end to end, in a fixed order."""

    def __init__(self, items=(), size_of=None):
        self.items: list = []
        self.size = 0
        for it in items:
            self.append(it, size_of(it))

    def append(self, item, nbytes: int) -> int:
        """Add a piece at the end; its offset in the stream."""
        off = self.size
        self.items.append((item, off, nbytes))
        self.size += nbytes
        return off

    def span(self, fa: float, fb: float) -> tuple[int, int]:
        """The real bytes of the planned fraction range [fa, fb): shares are fractions of the
        planned bytes applied to the real ones (a short last batch moves proportionally less);
        the last share reaches the end exactly."""
        a = int(round(fa * self.size))
        b = self.size if fb >= 1.0 - 1e-12 else int(round(fb * self.size))
        return a, b

    def parts(self, a: int, b: int, by: str):
        """(index, item, offset, nbytes) of the whole pieces the share [a, b) moves: a piece goes
        with the share its first byte falls in (``by="start"``: sends, which free it) or its
        last byte (``by="end"``: fetches, which allocate it). The shares tile the stream, so
        each piece moves once and the runtime never holds more than the plan's fractional
        count (it frees no later and allocates no earlier)."""
        if by not in ("start", "end"):
            raise ValueError(f"by={by!r}: 'start' (sends) or 'end' (fetches)")
        for k, (it, off, n) in enumerate(self.items):
            if n and (a <= off < b if by == "start" else a < off + n <= b):
                yield k, it, off, n
