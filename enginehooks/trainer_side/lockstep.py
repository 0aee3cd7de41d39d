"""Lockstep streams for sharded trainers, and the go/no-go handshake that keeps them safe.

Producing a full tensor from a sharded trainer is a collective (FSDP2
`DTensor.full_tensor()`, FSDP1 `summon_full_params`, Megatron-Bridge's TP/PP gathers),
so every trainer rank must iterate the adapter's stream in the same order while only
the sender rank (where `WeightSync` lives) transmits. The danger is a rank left inside
a collective that its peers will never enter: the push failed on the sender before
the transfer (a replica refused the manifest), or a rank stopped iterating.

The handshake: before the first tensor, and again after every `flag_elements` streamed
elements (~256 MiB in bf16 by default; None: once per push), never per tensor, the sender
broadcasts a small fixed-size *flag* (256 bytes of JSON, no pickle) over the trainer's
own process group, from the sender rank, through the one channel between trainer ranks
(`trainer_side/channel.py`): `Go` (with the tensor index, the stream's fingerprint and
the wire dtype) or `Stop` (with the reason). The sender never reads its flag back (no
host sync on its hot path); every rank computes the same flag positions from the plan
(`flag_points`). Followers read a flag before they enter the collectives that follow
it, so:

- a push that fails before streaming sends STOP at tensor 0 (`cancel()`): followers
  raise `PushAborted` with the sender's reason at once, no collective left hanging;
- a push that fails mid-stream closes the stream: the sender finishes the collectives
  up to the next flag position (the followers are in them already), and sends STOP
  there;
- a rank that stops iterating leaves its peers in a flag broadcast or a gather that
  ends with the process group's timeout (or `timeout_s`), turned here into a
  `LockstepError` that says which tensor and why: never a silent hang;
- followers check the sender's fingerprint (names and shapes) before the first
  gather, so ranks that would stream different tensors fail clearly instead of
  mismatching collectives.

Several senders (`owners` set: every rank sends its own part, `control/senders.py`)
learn a push's outcome over the command channel, not from a flag at the end of the
stream, which they never read: there a rank whose consumer stopped early (its own
sender failed) goes on with the stream's collectives, dropping the tensors and reading
the flags on the way, until a STOP or the end; and the STOP of a failed push is sent only
at a flag position inside the stream (never at its end, where nobody waits for it).
"""

from __future__ import annotations

import math
import zlib
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from enginehooks.core.dtypes import dtype_name, torch_dtype
from enginehooks.core.errors import EngineHooksError
from enginehooks.core.manifest import TensorSpec
from enginehooks.trainer_side.channel import Go, MalformedMessage, Message, Stop, TrainerRanks
from enginehooks.trainer_side.choose import adapter_for
from enginehooks.trainer_side.contract import TrainerAdapter


class LockstepError(EngineHooksError):
    """Trainer ranks fell out of lockstep: a rank stopped iterating, died, or would
    stream different tensors. Raised on the ranks that noticed, within the timeout."""


class PushAborted(LockstepError):
    """The sender rank told this follower that the push will not (or did not) happen;
    `reason` carries the sender's error. The trainer's process group is still healthy."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


#: Elements streamed between two lockstep flags by default (~256 MiB in bf16, a bucket):
#: how late a follower can learn that the push is off mid-stream, at one flag per stretch.
FLAG_ELEMENTS = 128 << 20


def fingerprint(specs: Sequence[TensorSpec], flag_elements: int | None = None) -> int:
    """crc32 of names and shapes (not dtypes: followers learn the dtype from the sender),
    and of where the flags are (`flag_elements`): ranks must agree on both."""
    text = ";".join(f"{s.name}:{','.join(map(str, s.shape))}" for s in specs)
    if flag_elements != FLAG_ELEMENTS:
        text += f"|flags:{flag_elements}"
    return zlib.crc32(text.encode())


def flag_points(specs: Sequence[TensorSpec], every: int | None) -> list[int]:
    """The tensor indices a flag precedes: 0, then the first tensor after each stretch
    of at least `every` elements (None: 0 only, one flag per push). Computed from the
    plan alone, so every rank finds the same ones."""
    points = [0] if specs else []
    run = 0
    for i, spec in enumerate(specs):
        if every is not None and i and run >= every:
            points.append(i)
            run = 0
        run += math.prod(spec.shape)
    return points


class Lockstep:
    """The go/no-go channel: broadcasts of one flag from `sender` over `group`.

    Args:
        group: the trainer's process group holding every rank that iterates the stream
            (None: the default group). The sender must be a member.
        sender: the sender's rank *within* `group`.
        timeout_s: bound of each flag wait; None uses the group's own timeout.
        start_timeout_s: bound of the first flag's wait on followers, which covers the
            sender's plan, group and check phases (None: `timeout_s`).
    """

    def __init__(self, group: Any = None, sender: int = 0, timeout_s: float | None = None,
                 start_timeout_s: float | None = None) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.group: Any = group if group is not None else (dist.group.WORLD if self.active else None)
        self.sender = sender
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s if start_timeout_s is not None else timeout_s
        self.channel = TrainerRanks(self.group, root=sender)
        self.rank, self.world = self.channel.rank, self.channel.size
        if not 0 <= sender < self.world:
            raise LockstepError(f"sender rank {sender} is outside the group of {self.world}")

    @property
    def is_sender(self) -> bool:
        return self.rank == self.sender

    @property
    def alone(self) -> bool:
        return self.world == 1

    def _flag(self, message: Message | None, timeout_s: float | None, what: str) -> Message:
        try:
            return self.channel.flag(message, timeout_s)
        except MalformedMessage as e:
            raise LockstepError(f"received a malformed lockstep flag ({e}): the trainer "
                                "ranks are not running the same enginehooks stream") from None
        except RuntimeError as e:
            bound = f"{timeout_s}s" if timeout_s is not None else "the process group's timeout"
            raise LockstepError(
                f"trainer rank {self.rank}: {what} failed within {bound}: {e}. Every trainer "
                "rank must iterate the stream in lockstep (the sender through WeightSync.push, "
                "the others through enginehooks.trainer_side.follow)") from e

    def go(self, index: int, count: int, fp: int, dtype: torch.dtype | None) -> None:
        if not self.alone:
            self._flag(Go(index, count, fp, dtype_name(dtype) if dtype else ""),
                       self.timeout_s, f"GO for tensor {index}")

    def stop(self, index: int, reason: str) -> None:
        """Sender: tell every follower waiting for flag `index` that the push is off."""
        if not self.alone:
            self._flag(Stop(index, reason), self.timeout_s, f"STOP at tensor {index}")

    def wait(self, index: int, what: str, first: bool = False) -> Go:
        """Follower: the sender's flag for position `index`; raise `PushAborted` on
        `Stop`. `first`: this wait also covers the sender's non-streaming phases."""
        timeout = self.start_timeout_s if (first or index == 0) else self.timeout_s
        flag = self._flag(None, timeout, f"waiting for the sender's go for {what}")
        if isinstance(flag, Stop):
            raise PushAborted(f"trainer rank {self.rank}: the sender (rank {self.sender}) "
                              f"aborted the push: {flag.reason}", flag.reason)
        if not isinstance(flag, Go):
            raise LockstepError(f"received a {flag.op!r} message where a lockstep flag "
                                "belongs: the trainer ranks are not running the same "
                                "enginehooks stream")
        if flag.index != index:
            raise LockstepError(f"trainer rank {self.rank}: out of step: expected the go for "
                                f"tensor {index}, the sender sent {flag.index}")
        return flag


class LockstepAdapter(TrainerAdapter):
    """Base of the sharded adapters: a stream every trainer rank iterates in lockstep.

    Subclasses provide `_plan()` (specs, in stream order, without gathering) and
    `_items()` (the lazy `(name, tensor)` iterator whose `next()` may run collectives;
    tensors built with `to_wire`). This class adds the go/no-go flags, the fingerprint
    check, `cancel()` and clear errors. Followers learn the wire dtype from the
    sender's first flag (only the sender talks to the engines).
    """

    name = "lockstep"

    def __init__(self, model: Any, *, group: Any = None, sender: int = 0,
                 timeout_s: float | None = None, start_timeout_s: float | None = None,
                 flag_elements: int | None = FLAG_ELEMENTS, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)  # dtype, and the next base's options
        self._group, self._sender = group, sender
        #: elements between two lockstep flags (None: one flag per push; `flag_points`)
        self.flag_elements = flag_elements
        #: flags this rank sent or read in its last stream (the outcome flag excluded)
        self.flags = 0
        self._timeouts = (timeout_s, start_timeout_s)
        self._lockstep: Lockstep | None = None
        self._specs: list[TensorSpec] | None = None
        self._state = "idle"  # idle -> planned -> streaming -> streamed | cancelled
        self._gen: Iterator[tuple[str, torch.Tensor]] | None = None
        self._reason = ""

    # -- subclass API -----------------------------------------------------------------
    @abstractmethod
    def _plan(self) -> list[TensorSpec]:
        """Names, wire dtypes and shapes, in stream order; nothing gathered."""

    @abstractmethod
    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, full tensor in wire dtype)`; `next()` may be a collective."""

    def default_group(self) -> Any:
        return None

    def precast_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a module-layout tensor is cast to before its gather (a collective:
        every rank must agree). Followers learn it from the sender's first flag; the
        sender casts early only when every floating tensor travels in `self.dtype`
        (no per-tensor exceptions), since exceptions name checkpoint tensors, which
        exist only after the conversion."""
        early = self.dtype if not self.dtypes else None
        return early if (early is not None and dtype.is_floating_point) else dtype

    # -- the contract -------------------------------------------------------------------
    @property
    def lockstep(self) -> Lockstep:
        if self._lockstep is None:
            group = self._group if self._group is not None else self.default_group()
            self._lockstep = Lockstep(group, self._sender, *self._timeouts)
        return self._lockstep

    @property
    def state(self) -> str:
        return self._state

    @property
    def planned(self) -> int:
        """Tensors in the current plan (0 before `specs()`)."""
        return len(self._specs or [])

    def specs(self) -> list[TensorSpec]:
        """Plan one push (every call starts a new one). No tensor is gathered."""
        self._specs = self._plan()
        self._state, self._gen, self._reason = "planned", None, ""
        return list(self._specs)

    def _stream_owners(self) -> dict[str, int] | None:
        """`owners` if set (several senders); else, with followers, the lockstep sender
        sends every tensor: the followers only contribute their shards to each gather,
        and assemble, convert and cast nothing."""
        if self.owners is not None:
            return self.owners
        ls = self.lockstep
        if ls.alone or not ls.active:
            return None
        sender = ls.channel.global_rank(ls.sender)
        return dict.fromkeys((s.name for s in self._specs or []), sender)

    def reuse_plan(self, other: TrainerAdapter, specs: Sequence[TensorSpec]) -> bool:
        """Take a kept plan (`TrainerAdapter.reuse_plan`), and be ready to stream it."""
        if not (isinstance(other, LockstepAdapter)
                and other.flag_elements == self.flag_elements
                and super().reuse_plan(other, specs)):
            return False
        self._specs = list(specs)
        self._state, self._gen, self._reason = "planned", None, ""
        return True

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._specs is None or self._state not in ("planned", "idle"):
            self.specs()
        self._gen = self._run()
        return self._gen

    def cancel(self, reason: str) -> None:
        """The push failed on the sender: release the followers (idempotent).

        Before streaming: STOP at tensor 0. While streaming: close the stream, which sends
        STOP at the next tensor. After the stream completed: STOP at the outcome flag, so
        followers waiting for it raise with the reason. On a follower: nothing.
        """
        ls = self.lockstep
        if not ls.is_sender:
            return
        self._reason = reason or "the push failed on the sender"
        if self._state == "streamed" and self.owners is not None:
            # several senders: the other ranks' streams ended without an outcome flag
            # (module docstring); they hear of the failure from the coordinator
            self._state = "cancelled"
        elif self._state == "planned":
            self._state = "cancelled"
            ls.stop(0, self._reason)
        elif self._state == "streaming" and self._gen is not None:
            self._gen.close()  # type: ignore[attr-defined]
        elif self._state == "streamed":
            self._state = "cancelled"
            ls.stop(self.planned, self._reason)

    def finish(self) -> None:
        """Sender, after the whole push succeeded: tell the followers waiting for the
        outcome (`push` on every rank returns together)."""
        if self._state != "streamed":
            self.cancel("the transport did not consume the whole stream")
            raise LockstepError("the push returned before the stream was consumed")
        self.lockstep.go(self.planned, self.planned, 0, None)

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        ls = self.lockstep
        specs = self._specs or []
        n, fp = len(specs), fingerprint(specs, self.flag_elements)
        points = flag_points(specs, self.flag_elements)
        flagged = set(points)
        self._state = "streaming"
        self.flags = 0
        items: Iterator[tuple[str, torch.Tensor]] | None = None
        index = 0
        try:
            for index in range(n):
                what = f"tensor {index} ({specs[index].name})"
                if index in flagged and not ls.alone:
                    self.flags += 1
                    if ls.is_sender:
                        ls.go(index, n, fp, None if self.dtypes else self.dtype)
                    else:
                        flag = ls.wait(index, what)
                        if index == 0:
                            if (flag.count, flag.fingerprint) != (n, fp):
                                raise LockstepError(
                                    f"trainer rank {ls.rank} would stream {n} tensors (fingerprint "
                                    f"{fp:08x}) but the sender streams {flag.count} "
                                    f"({flag.fingerprint:08x}): "
                                    "every rank must build its adapter with the same model and "
                                    "options (flag_elements included)")
                            self.dtype = torch_dtype(flag.dtype) if flag.dtype else None
                if items is None:
                    items = self._items()
                try:
                    name, t = next(items)
                except StopIteration:
                    raise LockstepError(f"the stream ended at tensor {index} of the {n} planned") from None
                except EngineHooksError:
                    raise
                except Exception as e:
                    raise LockstepError(
                        f"trainer rank {ls.rank}: gathering {what} failed: {type(e).__name__}: {e}. "
                        "Every trainer rank must iterate the stream in lockstep; a rank that "
                        "stopped iterating or died leaves the others in the collective until "
                        "the process group's timeout") from e
                yield name, t
                del t
            self._state = "streamed"
        except GeneratorExit:
            # The consumer stopped early: on the sender, the push failed mid-transfer.
            # Followers have gone on with the collectives up to the next flag position
            # (or to the outcome flag, at `n`): run those too, then say STOP there.
            if ls.is_sender and self._state == "streaming" and not ls.alone:
                stop_at = next((p for p in points if p > index), n)
                if (self._drain(items, index + 1, stop_at)
                        and (stop_at < n or self.owners is None)):
                    ls.stop(stop_at, self._reason or "the sender stopped streaming")
            elif self.owners is not None and self._state == "streaming" and not ls.alone:
                self._follow_out(items, index + 1, n, flagged)
            self._state = "cancelled"
            raise
        except BaseException:
            self._state = "cancelled"
            raise
        finally:
            if items is not None:
                items.close()  # type: ignore[attr-defined]

    def _follow_out(self, items: Iterator[tuple[str, torch.Tensor]] | None, first: int,
                    n: int, flagged: set[int]) -> None:
        """Several senders, a follower whose consumer stopped early: enter the rest of
        the stream's collectives (tensors dropped), reading each flag, until the sender's
        STOP or the end, so that no rank is left in a gather (module docstring)."""
        if items is None:
            return
        ls = self.lockstep
        try:
            for index in range(first, n):
                if index in flagged:
                    ls.wait(index, f"tensor {index}")  # PushAborted on STOP: done
                next(items)
        except Exception:
            return

    @staticmethod
    def _drain(items: Iterator[tuple[str, torch.Tensor]] | None, first: int, stop: int) -> bool:
        """Sender: produce (and drop) tensors `first` .. `stop - 1`, whose collectives
        the followers are in or will enter before the flag at `stop`. False if that
        failed (a rank is gone: a STOP would wait out the group's timeout)."""
        if items is None:
            return True
        try:
            for _ in range(first, stop):
                next(items)
        except Exception:
            return False
        return True


def follow(model: Any, **adapter_kwargs: Any) -> int:
    """Iterate the stream on a non-sender trainer rank, discarding every tensor.

    Call it on every rank but the sender, at the same point of the training loop where
    the sender calls `WeightSync.push`, with the same model and adapter options
    (`group`, `sender`, `include`, `rename`, `timeout_s`, `start_timeout_s`). Returns the
    number of tensors produced; raises `PushAborted` when the sender called the push
    off, `LockstepError` when ranks fell out of step. A plain (unsharded) model needs
    no follower: nothing happens and 0 is returned.
    """
    adapter = adapter_for(model, **adapter_kwargs)
    if not isinstance(adapter, LockstepAdapter):
        return 0
    adapter.specs()
    count = 0
    for _name, _t in adapter.stream():
        count += 1
        del _t
    return count


def push(model: Any, version: int | str, *, sync: Any = None, **adapter_kwargs: Any) -> Any:
    """One call for every trainer rank: the sender pushes, the others follow.

    `sync` is the sender's `WeightSync` (None on the other ranks). On the sender the push
    is guarded: if it fails, the followers are released with the sender's reason
    (`cancel()`); once the whole push finished, one more flag tells the followers
    whether it succeeded, so that every rank returns or raises together. Returns the
    sender's `PushReport`, None on followers.
    """
    adapter = adapter_for(model, **adapter_kwargs)
    if not isinstance(adapter, LockstepAdapter):
        return sync.push(adapter, version) if sync is not None else None
    ls = adapter.lockstep
    if not ls.is_sender:
        if sync is not None:
            raise LockstepError(f"trainer rank {ls.rank} holds a WeightSync but the sender is "
                                f"rank {ls.sender} of the group")
        count = follow(adapter)
        ls.wait(count, "the push's outcome", first=True)  # raises PushAborted if the push failed after
        return None
    if sync is None:
        raise LockstepError(f"trainer rank {ls.rank} is the sender: pass sync=WeightSync(...)")
    if adapter.dtype is None and not adapter.dtypes:
        adapter.dtype, adapter.dtypes = sync.wire_dtypes()
    try:
        report = sync.push(adapter, version)
    except BaseException as e:
        adapter.cancel(f"{type(e).__name__}: {e}")
        raise
    adapter.finish()
    return report
