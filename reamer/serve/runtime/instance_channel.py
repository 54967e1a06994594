"""What an instance's parent and its worker process share: the pipe, the shared-memory arenas that carry
large tensors, and the flag that says a worker began answering a client itself.

Both sides import this light module (standard library only; numpy inside the functions that need it): the
worker imports it before it pins itself.
"""
from __future__ import annotations

import mmap
import os
import pickle
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


class Pipe(Connection):
    """multiprocessing's Connection with plain pickle: its ForkingPickler builds a pickler with a copied
    dispatch table for every message, which cost more CPU than the rest of a small batch's round trip."""

    def send(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return pickle.loads(self.recv_bytes())



class Arena:
    """A growable shared-memory file (memfd) that parent and worker both map; holds one batch's tensors.

    Tensors go through it instead of being pickled through the pipe: a 600 KB image batch pickled over
    a socket takes several fills of the socket buffer, and so several cross-cpu wake-ups of a process on
    a busy core, per request. The pipe now carries only a small message naming offsets and shapes.
    One batch at a time per instance (the parent's lock), so the writer never overwrites what the reader
    still uses.
    """

    ALIGN = 64

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map: mmap.mmap | None = None
        self._size = 0
        self.refresh()

    @classmethod
    def create(cls, name: str, size: int = 1 << 20) -> "Arena":
        fd = os.memfd_create(name)
        os.ftruncate(fd, size)
        return cls(fd)

    def refresh(self) -> None:
        """Map the file again if the other side grew it."""
        size = os.fstat(self.fd).st_size
        if size != self._size:
            # The old map is not closed: numpy views of it may still live; it goes when they do.
            self._map, self._size = mmap.mmap(self.fd, size), size

    def write(self, arrays: dict[str, np.ndarray]) -> list[tuple[str, str, tuple, int]]:
        """Copy `arrays` in (growing the file when needed); the layout to send to the other side."""
        import numpy as np

        layout, end = [], 0
        for name, arr in arrays.items():
            layout.append((name, arr.dtype.str, arr.shape, end))
            end += -(-arr.nbytes // self.ALIGN) * self.ALIGN
        if end > self._size:
            os.ftruncate(self.fd, max(end, 2 * self._size))
            self.refresh()
        for (name, dtype, shape, offset) in layout:
            np.copyto(np.ndarray(shape, np.dtype(dtype), buffer=self._map, offset=offset), arrays[name],
                      casting="no")
        return layout

    def read(self, layout: list[tuple[str, str, tuple, int]], copy: bool) -> dict[str, np.ndarray]:
        """The arrays of `layout`: views (valid until the next write) or copies."""
        import numpy as np

        out = {}
        for name, dtype, shape, offset in layout:
            try:
                view = np.ndarray(shape, np.dtype(dtype), buffer=self._map, offset=offset)
            except TypeError:  # beyond the mapping: the other side grew the file
                self.refresh()
                view = np.ndarray(shape, np.dtype(dtype), buffer=self._map, offset=offset)
            out[name] = view.copy() if copy else view
        return out

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


# Tensors up to this size go inline in the pipe message: for a few KB (BERT's token ids, most models'
# outputs) pickling costs less than the arena's per-tensor views and copies.
INLINE_MAX_BYTES = 64 << 10


class ReplyFlag(Arena):
    """One shared byte, set by the worker when it starts writing a response to a client: after a crash
    the parent can tell a request the client got nothing of (503) from a half-sent answer (close)."""

    def set(self, value: bool) -> None:
        self._map[0] = 1 if value else 0

    def is_set(self) -> bool:
        return self._map[0] == 1


def shareable(arrays: dict[str, np.ndarray]) -> bool:
    """Worth sending through the arena: plain numeric tensors, more than INLINE_MAX_BYTES in all."""
    total = 0
    for a in arrays.values():
        if getattr(a, "dtype", None) is None or a.dtype.hasobject:
            return False
        total += a.nbytes
    return total > INLINE_MAX_BYTES
