"""Everything ranks do together outside attention, in one place (docs/architecture.md): joining the
process group (`init_distributed` for training, `torchrun_world` for inference), which device a
rank and its collectives use, a group's size and rank, broadcasts of arrays and text (tensors, no
pickling), and failure agreement (`fail_together`, `together`): a rank whose own I/O raised never
leaves the others waiting at the collective that follows (until the process group's timeout).

    codes, error = None, None
    try:
        codes = encode_my_part()
    except Exception as e:
        error = e
    fail_together(error, group)  # e on its rank, RankFailedError("rank 1 failed ...") elsewhere
    codes = broadcast_array(codes, src=0, group=group)

A message with several parts is a typed record, a frozen dataclass sent whole by
`broadcast_record` (one int64 array, its fields tagged; the receiver checks the record's type):

    @dataclass(frozen=True)
    class TrialCodes:
        length: int
        trial: int
        codes: np.ndarray

    got = broadcast_record(TrialCodes(16, 3, codes) if mine else None, TrialCodes, src=1)

The ring's point-to-point exchange is attention's own (longvideo.parallel.comm).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import zlib
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

_MESSAGE_BYTES = 2048
_MAX_DIMS = 6
R = TypeVar("R")


class RankFailedError(RuntimeError):
    """Another rank's I/O raised; the message names that rank and its error."""


# ---- process groups ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float) -> None:
    """Join the process group the launcher describes (torchrun, deepspeed, accelerate all set
    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); a plain `python` start is a world of one.
    A rank that dies or hangs makes the others fail after `timeout_s` instead of waiting forever.
    The group stays until the process leaves it (training: the CLI's exit)."""
    if dist.is_initialized():
        # started by a test harness or a notebook: DeepSpeed still wants LOCAL_RANK (one node)
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        return
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    if torch.cuda.is_available():
        # tear the process down when a collective times out or fails, so it cannot hang
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def local_device(arg: str | None = None) -> torch.device:
    """`arg`, else this rank's GPU (LOCAL_RANK) when there is one, else the CPU."""
    if arg is not None:
        return torch.device(arg)
    return torch.device(
        f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    )


@contextlib.contextmanager
def torchrun_world(device: torch.device, timeout: timedelta) -> Iterator[bool]:
    """Whether this is one rank of several (WORLD_SIZE > 1, or the caller's process group);
    torchrun's world joined (nccl on a GPU, else gloo) unless the caller has, and left after.
    `timeout` bounds a collective: the other ranks wait in one while rank 0 reads the next input."""
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized()
    owns = distributed and not dist.is_initialized()
    if distributed and device.type == "cuda":
        torch.cuda.set_device(device)
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    try:
        yield distributed
    finally:
        if owns:
            dist.destroy_process_group()


def group_size_rank(group) -> tuple[int, int]:
    """(W, r) of a process group; None means the default group, or a world of one when
    torch.distributed is not initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def comm_device(group=None) -> torch.device:
    """Where tensors for collectives must live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- broadcasts -------------------------------------------------------------------------------


def broadcast_array(arr: np.ndarray | None, src: int = 0, group=None) -> np.ndarray:
    """Rank `src`'s integer or float array on every rank of `group` (src a global rank, as in
    torch.distributed; sent as int64 / float64 tensors, no pickling)."""
    dev = comm_device(group)
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.long, device=dev)
    if dist.get_rank() == src:
        arr = np.asarray(arr)
        if arr.ndim > _MAX_DIMS:
            raise ValueError(f"broadcast_array handles up to {_MAX_DIMS} dims, got {arr.ndim}")
        header[0] = 1 if np.issubdtype(arr.dtype, np.floating) else 0
        header[1] = arr.ndim
        header[2 : 2 + arr.ndim] = torch.tensor(arr.shape, dtype=torch.long)
    dist.broadcast(header, src=src, group=group)
    dtype = torch.float64 if int(header[0]) else torch.long
    shape = tuple(int(x) for x in header[2 : 2 + int(header[1])])
    if dist.get_rank() == src:
        data = torch.from_numpy(
            np.ascontiguousarray(arr, np.float64 if dtype == torch.float64 else np.int64)
        )
        data = data.to(dev)
    else:
        data = torch.empty(shape, dtype=dtype, device=dev)
    dist.broadcast(data, src=src, group=group)
    return data.cpu().numpy()


def broadcast_text(text: str | None, src: int = 0, group=None) -> str:
    """Rank `src`'s string on every rank of `group` (src a global rank)."""
    raw = (
        np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
        if dist.get_rank() == src
        else None
    )
    return bytes(broadcast_array(raw, src, group).astype(np.uint8).tolist()).decode("utf-8")


# ---- typed records ---------------------------------------------------------------------------

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _TEXT, _INTS, _FLOATS, _TUPLE = range(9)
_INT64 = np.iinfo(np.int64)
RECORD_VALUES = "None, bool, int, float, str, integer or float numpy arrays, and tuples of these"
"""What a field of a typed record may hold."""


def _fingerprint(kind: type) -> int:
    """A number for the record's type: its name and field names (a receiver expecting another
    type, or another version of it, refuses the array)."""
    names = ",".join(f.name for f in dataclasses.fields(kind))
    return zlib.crc32(f"{kind.__qualname__}({names})".encode())


def _encode_value(value, where: str, parts: list) -> None:
    """Append `value` to `parts` (int64 arrays) behind its tag; `where` names it in errors."""
    if value is None:
        parts.append(np.asarray([_NONE], np.int64))
    elif isinstance(value, (bool, np.bool_)):
        parts.append(np.asarray([_TRUE if value else _FALSE], np.int64))
    elif isinstance(value, (int, np.integer)):
        if not _INT64.min <= int(value) <= _INT64.max:
            raise ValueError(f"{where} = {value} does not fit in 64 bits")
        parts.append(np.asarray([_INT, int(value)], np.int64))
    elif isinstance(value, (float, np.floating)):
        parts.append(np.asarray([_FLOAT], np.int64))
        parts.append(np.asarray([value], np.float64).view(np.int64))
    elif isinstance(value, str):
        raw = np.frombuffer(value.encode("utf-8"), np.uint8).astype(np.int64)
        parts.append(np.asarray([_TEXT, len(raw)], np.int64))
        parts.append(raw)
    elif isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        floating = value.dtype.kind == "f"
        parts.append(
            np.asarray([_FLOATS if floating else _INTS, value.ndim, *value.shape], np.int64)
        )
        data = np.ascontiguousarray(value, np.float64 if floating else np.int64).reshape(-1)
        parts.append(data.view(np.int64))
    elif isinstance(value, tuple):
        parts.append(np.asarray([_TUPLE, len(value)], np.int64))
        for i, item in enumerate(value):
            _encode_value(item, f"{where}[{i}]", parts)
    else:
        raise TypeError(
            f"{where} holds a {type(value).__name__}: a rank record carries {RECORD_VALUES}"
        )


def _decode_value(arr: np.ndarray, pos: int):
    """The value whose tag is pos `arr[pos]`, and where the next one starts."""
    tag = int(arr[pos])
    if tag in (_NONE, _FALSE, _TRUE):
        return (None, False, True)[tag], pos + 1
    if tag == _INT:
        return int(arr[pos + 1]), pos + 2
    if tag == _FLOAT:
        return float(arr[pos + 1 : pos + 2].view(np.float64)[0]), pos + 2
    if tag == _TEXT:
        n = int(arr[pos + 1])
        return arr[pos + 2 : pos + 2 + n].astype(np.uint8).tobytes().decode("utf-8"), pos + 2 + n
    if tag in (_INTS, _FLOATS):
        ndim = int(arr[pos + 1])
        shape = tuple(int(x) for x in arr[pos + 2 : pos + 2 + ndim])
        start = pos + 2 + ndim
        size = int(np.prod(shape, dtype=np.int64))
        data = arr[start : start + size].copy()
        return (data.view(np.float64) if tag == _FLOATS else data).reshape(shape), start + size
    if tag == _TUPLE:
        items, pos = [], pos + 2
        for _ in range(int(arr[pos - 1])):
            item, pos = _decode_value(arr, pos)
            items.append(item)
        return tuple(items), pos
    raise ValueError(f"not a rank record: unknown tag {tag} pos {pos}")


def encode_record(record) -> np.ndarray:
    """A typed record (a dataclass instance whose fields hold RECORD_VALUES) as one int64 array:
    its type's fingerprint, then each field tagged with its kind, in field order."""
    if not dataclasses.is_dataclass(record) or isinstance(record, type):
        raise TypeError(f"a rank record is a dataclass instance, got {type(record).__name__}")
    kind = type(record)
    parts = [np.asarray([_fingerprint(kind)], np.int64)]
    for f in dataclasses.fields(kind):
        _encode_value(getattr(record, f.name), f"{kind.__name__}.{f.name}", parts)
    return np.concatenate(parts)


def decode_record(kind: type[R], arr: np.ndarray) -> R:
    """The `kind` record `encode_record` wrote into `arr`: integer arrays come back as int64,
    float arrays as float64, sequences as tuples. ValueError when `arr` holds another type."""
    arr = np.asarray(arr, np.int64)
    if len(arr) == 0 or int(arr[0]) != _fingerprint(kind):
        raise ValueError(
            f"the array is not a {kind.__name__} record (another record type, or another "
            "version of this one: the ranks run different code)"
        )
    values, pos = {}, 1
    for f in dataclasses.fields(kind):
        values[f.name], pos = _decode_value(arr, pos)
    if pos != len(arr):
        raise ValueError(
            f"{len(arr) - pos} values after the last field of a {kind.__name__} record"
        )
    return kind(**values)


def broadcast_record(record: R | None, kind: type[R], src: int = 0, group=None) -> R:
    """Rank `src`'s `kind` record on every rank of `group` (src a global rank, as in
    torch.distributed; `record` is read on src only). Every rank, src included, returns the record
    decoded from what was sent, so all hold the same values (decode_record's types)."""
    arr = None
    if dist.get_rank() == src:
        if not isinstance(record, kind):
            raise TypeError(f"expected a {kind.__name__} to send, got {type(record).__name__}")
        arr = encode_record(record)
    return decode_record(kind, broadcast_array(arr, src=src, group=group))


# ---- failure agreement ------------------------------------------------------------------------


def fail_together(error: BaseException | None, group=None) -> None:
    """Every rank of ``group`` (None: the default group) calls this with its own error (or None).
    Returns when none failed; otherwise re-raises this rank's error, or raises RankFailedError with
    the first failing rank's message on the others. Two collectives on failure, one otherwise.
    Without a process group (one process) there is no one to tell: it only re-raises ``error``."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    dev, world, my_rank = comm_device(group), dist.get_world_size(group), dist.get_rank(group)
    first = torch.tensor([my_rank if error is not None else world], dtype=torch.long, device=dev)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    src = int(first)
    if src == world:
        return
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=dev)
    if my_rank == src:
        raw = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[:_MESSAGE_BYTES]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)
    dist.broadcast(
        text, src=dist.get_global_rank(group, src) if group is not None else src, group=group
    )
    if error is not None:
        raise error
    message = bytes(text.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
    raise RankFailedError(f"rank {src} failed, so every rank stops: {message}")


def together(items: Iterable, group=None) -> Iterator:
    """The items of a per-rank iterator, the ranks agreeing after each step: one rank's error
    stops every rank at that step (:func:`fail_together`), and so does one rank running out of
    items while the others go on. ``group=None``: no ranks to agree with, the items unchanged."""
    if group is None:
        yield from items
        return
    iterator = iter(items)
    while True:
        item, error, done = None, None, False
        try:
            item = next(iterator)
        except StopIteration:
            done = True
        except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
            error = e
        fail_together(error, group)
        left = torch.tensor([int(done)], dtype=torch.long, device=comm_device(group))
        dist.all_reduce(left, group=group)
        if 0 < int(left) < dist.get_world_size(group):
            raise RankFailedError(
                f"{int(left)} of {dist.get_world_size(group)} ranks ran out of items while "
                "the others went on (their inputs differ)"
            )
        if done:
            return
        yield item
