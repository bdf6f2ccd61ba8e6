"""Exceptions a user catches, in a module that imports nothing heavy (the CLI loads it without torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StoreDamagedError(KeyError):
    """Keys of the store are lost or cut short (evicted under ``maxmemory``, deleted by hand).

    A subclass of ``KeyError``, which a store that is gone as a whole raises too. Nothing
    was read or written by the call that raised it; see ``tdstore._format.integrity``.
    """

    __module__ = "tdstore"  # its public home: pickles name it there

    def __init__(self, message: str, *, named: bool = True) -> None:
        super().__init__(message)
        self.named = named
        """False while the message is the server's bare detail (the engine then names the store)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ReadOnlyReplicaError(PermissionError):
    """A write reached a read-only replica; writes go to its primary."""

    def __init__(self, message: str, *, named: bool = True) -> None:
        super().__init__(message)
        self.named = named
        """False while the message does not name the server yet (the engine adds it)."""


class QueueOverrunError(RuntimeError):
    """Writers overwrote items of a ring no one had popped yet (``pop``): ``lost`` items are gone.

    The read cursor has moved past them, so the next ``pop`` goes on with the oldest item
    left. Queue mode (``set_queue(True)``) makes writers wait instead, so nothing is lost.
    """

    __module__ = "tdstore"  # its public home: pickles name it there

    def __init__(self, message: str, lost: int) -> None:
        super().__init__(message)
        self.lost = lost


class LeaseLostError(RuntimeError):
    """An ``ack`` came after its lease ran out and other pops took some of its items (``not_held``:
    their ring write numbers): work on those may be done twice. The others (``settled``) are settled.
    """

    __module__ = "tdstore"  # its public home: pickles name it there

    def __init__(self, message: str, *, settled: int, not_held: list[int]) -> None:
        super().__init__(message)
        self.settled = settled
        self.not_held = not_held


class MustWait(Exception):
    """The server held a ring call back (a ``WAIT`` reply): nothing was read or written.

    Internal: ``_ring.waiting`` catches it, waits for the store's next event and tries again,
    or raises ``TimeoutError`` with :attr:`message`.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class DenseShapeError(ValueError):
    """A write gives a key of a dense store rows of another shape than the key's (a ``ValueError``).

    A dense store keeps one shape per key; nothing was written. Ragged rows need a lazy
    store (``LazyStackedTensorDictStore``; in torchrl, ``replay_buffer(..., ragged=True)``).
    """

    __module__ = "tdstore"  # its public home: pickles name it there


class ShardedRingIdError(TypeError):
    """An opener of one-node stores (``LazyStackedTensorDictStore.from_store``, ``TensorDictStore.from_store``)
    was given the id of a sharded ring, which is a class of its own: ``tdstore.ShardedRing.from_store``
    opens it (a generic opener, ``tdstore.torchrl.attach`` for one, catches this and does)."""


class ShardUnavailableError(ConnectionError):
    """A call on one shard of a sharded ring (Redis Cluster, ``tdstore.ShardedRing``) could not reach the
    node holding it (a primary failing over, a node down). The message names the shard, its
    store id and its node; calls on the other shards go on, and this shard's once the cluster
    has a new primary for it. Nothing of the failed call was acknowledged.

    A pop or ack that ran on the shard's primary but that too few replicas acknowledged
    (``min_replicas``) says so ("may be lost") and carries :attr:`request_id` and :meth:`retry`:
    the same call sent again under that id, answered with what the first one took (the popped
    items) once the replicas have it; :attr:`taken` is what the primary answered meanwhile."""

    __module__ = "tdstore"  # its public home: pickles name it there

    def __init__(
        self, message: str, shard: int, *, request_id: str | None = None, resend: Callable[[float | None], Any] | None = None,
        taken: Any = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.shard = shard
        self.request_id = request_id
        """The id of a call that ran on the primary unacknowledged (None: the call did not run)."""
        self.taken = taken
        """What that call's primary answered (a pop's items), not yet on ``min_replicas`` replicas."""
        self._resend = resend

    def retry(self, timeout: float | None = None) -> Any:
        """Send the call again under :attr:`request_id` and return its reply (the first call's items)
        once the replicas acknowledge it; may raise this error again."""
        if self._resend is None:
            raise RuntimeError("this call did not run on the shard: send it again as a new call")
        return self._resend(timeout)

    def __reduce__(self) -> Any:  # a pickled error keeps its message, shard and id, not the resend (a closure)
        return (_unavailable, (type(self), str(self), self.shard, self.request_id))


class AmbiguousTimeoutError(TimeoutError):
    """A call's deadline passed after the call may have reached the server: it may have run.

    A plain ``TimeoutError`` says the call did not run. This one says it may have: its rows may
    be written, its items taken. It carries the id the call was sent under (:attr:`request_id`);
    :meth:`retry` sends the same call again under that id, and the server answers with the first
    call's reply when that one ran (the popped items, the ``RingWrite``), or runs it now when it
    did not: either way the call takes effect exactly once.
    """

    __module__ = "tdstore"  # its public home: pickles name it there

    def __init__(self, message: str, *, request_id: str, resend: Callable[[float | None], Any] | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        """The id the call was sent under; a resend under it is answered, never applied twice."""
        self._resend = resend

    def retry(self, timeout: float | None = None) -> Any:
        """Send the same call again under :attr:`request_id` (with ``timeout``: a new deadline) and
        return its reply: the first call's when it ran. May raise this error again (then retry again)."""
        if self._resend is None:
            raise RuntimeError(
                f"this error (unpickled, or made by hand) cannot resend its call: send the same call again "
                f"with request_id={self.request_id!r}"
            )
        return self._resend(timeout)

    def then(self, after: Callable[[Any], Any]) -> AmbiguousTimeoutError:
        """This error (message, id, cause) with a :meth:`retry` whose reply goes through ``after``: a
        front that reshapes the ring call's result (a dense store's rows) gives its own result on the resend."""
        resend = self._resend

        def again(timeout: float | None) -> Any:
            if resend is None:
                return self.retry(timeout)  # raises: nothing to resend
            try:
                got = resend(timeout)
            except AmbiguousTimeoutError as err:  # timed out again: its own retry reshapes too
                raise err.then(after) from err.__cause__
            return after(got)

        out = AmbiguousTimeoutError(str(self), request_id=self.request_id, resend=again)
        out.__cause__ = self.__cause__
        return out

    def __reduce__(self) -> Any:  # a pickled error keeps its message and id, not the resend (a closure)
        return (_ambiguous, (str(self), self.request_id))


def _ambiguous(message: str, request_id: str) -> AmbiguousTimeoutError:
    return AmbiguousTimeoutError(message, request_id=request_id)


def _unavailable(cls: type[ShardUnavailableError], message: str, shard: int, request_id: str | None) -> ShardUnavailableError:
    return cls(message, shard, request_id=request_id)
