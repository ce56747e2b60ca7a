"""The training loader: token shards -> shuffled, laid-out, packed batches, resumable exactly.

Epoch ``e`` visits the shards in an order permuted by ``(seed, e)``, dp rank ``r`` takes the
samples numbered ``r (mod dp_size)``; then a shuffle buffer, the layout (longvideo.data.templates)
and first-fit packing (longvideo.data.packing). The state holds references and cursors, never data.
Local shards are read by random access, URLs streamed (re-streamed up to the cursor on a resume).
docs/data.md, "Loader" (its example, and the "Resume guarantee").
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from longvideo.data.augment import flash_code_table, recolour_needle
from longvideo.data.packing import Packer, pack_row
from longvideo.data.shards import (
    ShardError,
    SkipStats,
    TokenShard,
    decode_token_sample,
    iter_token_tar,
)
from longvideo.data.streams import expand_sources, is_url
from longvideo.data.templates import Doc, LayoutOptions, build_docs, sample_rng
from longvideo.distributed import fail_together

log = logging.getLogger(__name__)
STATE_VERSION = 1


class _Forward(SkipStats):
    """Skip counts that go to ``sink`` once it is set, and nowhere before."""

    sink: SkipStats | None = None

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        if self.sink is not None:
            self.sink.skip(reason, where, detail)


class TokenLoader:
    """Infinite iterator of packed batches over token shards for one dp rank.

    Each batch: input_ids, targets, positions, segment_ids (long) and loss_weights (float32),
    all (batch_size, seq_len). ``seq_len`` defaults to ``cfg.seq_len``. ``group``: the process
    group of every rank that draws batches in step (see ``__next__``); None for one process.
    """

    def __init__(
        self,
        shards,
        tokenizer,
        vocab,
        cfg,
        *,
        batch_size: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int | None = None,
        seq_len: int | None = None,
        max_indexed_shards: int = 512,
        group=None,
    ):
        self.paths = expand_sources(shards if shards else cfg.train_shards)
        if not self.paths:
            raise FileNotFoundError(f"no token shards match {shards or cfg.train_shards!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got {dp_rank}, {dp_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokenizer, self.vocab, self.cfg, self.group = tokenizer, vocab, cfg, group
        self.opts = LayoutOptions.from_config(cfg)
        self.batch_size, self.dp_rank, self.dp_size = batch_size, dp_rank, dp_size
        self.seed = cfg.seed if seed is None else seed
        self.seq_len = cfg.seq_len if seq_len is None else seq_len
        self.pad_id = tokenizer.pad_id if hasattr(tokenizer, "pad_id") else 0
        self._indexed: OrderedDict[int, TokenShard] = OrderedDict()
        self._max_indexed = max_indexed_shards  # see _shard
        self._lengths: dict[int, int] = {}
        self._remote = [is_url(p) for p in self.paths]
        self._keys: dict[tuple[int, int], str] = {}  # keys of streamed samples
        self._stream = None  # the open stream of a remote shard ...
        self._stream_at: tuple[int, int] | None = (
            None  # ... and the (order index, sample) it reads next
        )
        self.stats = SkipStats()
        self.last_batch_keys: list[list[str]] = []
        self.last_batch_refs: list[list[tuple]] = []
        self.flash_codes: dict[str, np.ndarray] = {}
        if getattr(cfg, "needle_recolour", 0.0) > 0:
            self.flash_codes = flash_code_table(self._all_samples())
            log.info(
                "needle recolouring (%.2f of one-flash samples) over the flash codes of %s",
                cfg.needle_recolour,
                ", ".join(self.flash_codes) or "no colour",
            )
        self._reset()

    def _all_samples(self):
        """Every valid sample of every shard, front to back (one pass, for the flash code table)."""
        stats = SkipStats()  # counted again when the samples are drawn
        for path in self.paths:
            for key, parts in iter_token_tar(path, stats):
                try:
                    yield decode_token_sample(key, parts, self.vocab.codebook_size)
                except ShardError:
                    continue

    def _reset(self) -> None:
        self._start_epoch(0)
        self.buffer: list[tuple[int, int]] = []
        self.rng = np.random.default_rng([self.seed, self.dp_rank, 7919])
        self.packer: Packer[tuple] = Packer(self.seq_len, self.cfg.pack_bins)
        self.ready: list[list[tuple]] = []
        self._docs: dict[tuple, Doc] = {}
        self._data: dict[
            tuple[int, int], tuple[str, dict]
        ] = {}  # streamed samples not yet laid out

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.order = np.random.default_rng([self.seed, epoch]).permutation(len(self.paths)).tolist()
        self.pos = 0  # global sample number within the epoch (all ranks)
        self._epoch_docs = 0  # documents this rank laid out in the epoch
        self._cursor = (0, 0)  # (index into order, sample within that shard)
        self.stream_done = False
        self._close_stream()

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
            "num_shards": len(self.paths),
            "epoch": self.epoch,
            "pos": self.pos,
            "cursor": list(self._cursor),
            "stream_done": self.stream_done,
            "epoch_docs": self._epoch_docs,
            "buffer": [list(r) for r in self.buffer],
            "rng": self.rng.bit_generator.state,
            "packer": self.packer.state_dict(),
            "ready": [[list(r) for r in row] for row in self.ready],
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {STATE_VERSION}")
        for k in ("seed", "dp_rank", "dp_size", "seq_len"):
            if state[k] != getattr(self, k):
                raise ValueError(
                    f"loader state was saved with {k}={state[k]}, this loader has "
                    f"{getattr(self, k)}; an exact resume needs the same value"
                )
        if state["num_shards"] != len(self.paths):
            raise ValueError(
                f"loader state was saved over {state['num_shards']} shards, "
                f"now there are {len(self.paths)}"
            )
        self._reset()
        self._start_epoch(int(state["epoch"]))
        if (
            "cursor" in state
        ):  # where the epoch's stream stands: shard (index into the order) and sample
            self.pos, self._cursor = (
                int(state["pos"]),
                (int(state["cursor"][0]), int(state["cursor"][1])),
            )
        else:  # states written before the cursor was recorded
            self._seek(int(state["pos"]))
        self.stream_done = bool(state["stream_done"])
        self._epoch_docs = int(state["epoch_docs"])
        self.buffer = [tuple(r) for r in state["buffer"]]
        self.rng.bit_generator.state = state["rng"]
        self.packer.load_state_dict(state["packer"])
        self.ready = [[tuple(r) for r in row] for row in state["ready"]]
        self.stats = SkipStats(state["stats"])
        rows = [r for row in self.packer.open for r, _ in row] + [
            r for row in self.ready for r in row
        ]
        self._refetch({(r[0], r[1]) for r in rows} | set(self.buffer))
        for ref in rows:  # (shard, sample, epoch, document)
            self._docs[ref] = self._sample_docs(*ref[:3], count=False)[ref[3]]
        for ref in rows:
            if (ref[0], ref[1]) not in self.buffer:
                self._data.pop((ref[0], ref[1]), None)

    def _refetch(self, refs) -> None:
        """Re-read the streamed samples among ``refs`` (buffered or in open rows at the save)."""
        by_shard: dict[int, set[int]] = {}
        for s, i in refs:
            if self._remote[s]:
                by_shard.setdefault(s, set()).add(i)
        for s, want in sorted(by_shard.items()):
            last = max(want)
            for i, item in enumerate(iter_token_tar(self.paths[s], SkipStats())):
                if i in want:
                    self._data[(s, i)] = item
                    self._keys[(s, i)] = item[0]
                if i >= last:
                    break
            missing = sorted(want - {i for (t, i) in self._data if t == s})
            if missing:
                raise RuntimeError(
                    f"cannot resume exactly: samples {missing[:5]} of {self.paths[s]} could "
                    "not be read again (the stream failed or the shard changed)"
                )

    def _close_stream(self) -> None:
        if getattr(self, "_stream", None) is not None:
            self._stream.close()
        self._stream, self._stream_at = None, None

    def _stream_next(self, k: int, i: int) -> tuple[str, dict] | None:
        """Sample ``i`` of the remote shard ``order[k]`` as (key, parts), or None past its end."""
        if self._stream_at != (k, i):
            self._close_stream()
            counts = _Forward()  # what the part read before a resume held was counted then
            self._stream = iter_token_tar(self.paths[self.order[k]], counts)
            for _ in range(i):  # a shard now shorter than i ends at the read below
                next(self._stream, None)
            counts.sink = self.stats
        item = next(self._stream, None)
        if item is None:
            self._close_stream()
            return None
        self._stream_at = (k, i + 1)
        return item

    def _shard(self, s: int) -> TokenShard:
        """The index of local shard ``s`` (its tar headers), kept for the last ``max_indexed_shards``
        used: an index evicted too soon is read again and again (docs/data.md, "Loader")."""
        if self._remote[s]:
            raise ValueError(f"{self.paths[s]} is streamed, it has no random access")
        if s in self._indexed:
            self._indexed.move_to_end(s)
            return self._indexed[s]
        try:
            shard = TokenShard(self.paths[s], self.stats)
        except ShardError as e:
            self.stats.skip(e.reason, self.paths[s], str(e))
            shard = None
        self._indexed[s] = shard
        self._lengths[s] = len(shard) if shard is not None else 0
        while len(self._indexed) > self._max_indexed:
            self._indexed.popitem(last=False)
        return shard

    def _len(self, s: int) -> int:
        if s not in self._lengths:
            if self._remote[s]:  # the whole stream is read to count its samples
                self._lengths[s] = sum(1 for _ in iter_token_tar(self.paths[s], SkipStats()))
            else:
                self._shard(s)
        return self._lengths[s]

    def _seek(self, pos: int) -> None:
        """Move the epoch cursor to global sample number ``pos`` (reads shard headers only)."""
        k, left = 0, pos
        while k < len(self.order) and left >= self._len(self.order[k]):
            left -= self._len(self.order[k])
            k += 1
        self.pos, self._cursor = pos, (k, left)

    def key_of(self, ref: tuple) -> str:
        if self._remote[ref[0]]:
            return self._keys[(ref[0], ref[1])]
        return self._shard(ref[0]).samples[ref[1]][0]

    def _next_stream_ref(self) -> tuple[int, int] | None:
        k, i = self._cursor
        while k < len(self.order):
            s = self.order[k]
            item = None
            if self._remote[s]:
                item = self._stream_next(k, i)
                if item is None:  # the end of the shard (or its stream failed: counted, next shard)
                    k, i = k + 1, 0
                    self._cursor = (k, i)
                    continue
            elif i >= self._len(s):
                k, i = k + 1, 0
                continue
            g = self.pos
            self.pos += 1
            self._cursor = (k, i + 1)
            if g % self.dp_size == self.dp_rank:
                if item is not None:
                    self._data[(s, i)] = item
                    self._keys[(s, i)] = item[0]
                return (s, i)
            k, i = self._cursor
        self._cursor = (k, i)
        return None

    def _next_sample(self) -> tuple[int, int, int]:
        """The next (shard, sample, epoch) out of the shuffle buffer, moving to a new epoch as needed."""
        while True:
            while not self.stream_done and len(self.buffer) < self.cfg.shuffle_buffer:
                ref = self._next_stream_ref()
                if ref is None:
                    self.stream_done = True
                else:
                    self.buffer.append(ref)
            if self.buffer:
                j = int(self.rng.integers(len(self.buffer)))
                self.buffer[j], self.buffer[-1] = self.buffer[-1], self.buffer[j]
                s, i = self.buffer.pop()
                return s, i, self.epoch
            if self._epoch_docs == 0:
                raise RuntimeError(
                    f"dp rank {self.dp_rank}: epoch {self.epoch} of {len(self.paths)} shards "
                    f"gave no usable document (skips: {dict(self.stats)})"
                )
            self._start_epoch(self.epoch + 1)

    def _read(self, s: int, i: int, count: bool):
        """The sample of reference (s, i); raises ShardError. Streamed data is used up when counted."""
        if self._remote[s]:
            key, parts = self._data.pop((s, i)) if count else self._data[(s, i)]
            return decode_token_sample(key, parts, self.vocab.codebook_size)
        return self._shard(s).read(i, self.vocab.codebook_size)

    def _sample_docs(self, s: int, i: int, epoch: int, count: bool) -> list[Doc]:
        if not self._remote[s] and self._shard(s) is None:
            return []
        where = f"{self.paths[s]}:{self.key_of((s, i))}"
        try:
            sample = self._read(s, i, count)
        except ShardError as e:
            if count:
                self.stats.skip(e.reason, where, str(e))
            return []
        codes, meta = sample.codes, sample.meta
        if self.flash_codes:  # a stream of its own: every other choice is as without it
            r = sample_rng(self.seed, epoch, sample.key + ":recolour")
            if r.random() < self.cfg.needle_recolour:
                codes, meta = recolour_needle(codes, sample.timestamps, meta, self.flash_codes, r)
        rng = sample_rng(self.seed, epoch, sample.key)
        docs, too_long = build_docs(
            self.tokenizer,
            self.vocab,
            codes,
            sample.timestamps,
            meta,
            self.opts,
            self.seq_len,
            rng,
            sample.key,
        )
        if count:
            if too_long:
                self.stats.skip(
                    "text_too_long",
                    where,
                    f"{too_long} template(s) longer than seq_len={self.seq_len}",
                )
            if not docs and not too_long:
                self.stats.skip("no_text", where, "json has no caption, qa or segments")
            if docs:
                self.stats["ok"] += 1
            for d in docs:
                self.stats["docs"] += 1
                self.stats["groups_dropped"] += d.groups_dropped
                self.stats["docs_cut"] += int(d.groups_dropped > 0)
        return docs

    def _next_row(self) -> list[tuple]:
        while not self.ready:
            s, i, epoch = self._next_sample()
            docs = self._sample_docs(s, i, epoch, count=True)
            self._epoch_docs += len(docs)
            for j, doc in enumerate(docs):
                ref = (s, i, epoch, j)
                self._docs[ref] = doc
                self.ready += self.packer.add(ref, len(doc))
        return self.ready.pop(0)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        """The next batch. With ``group``, the ranks agree first that each has one: a rank whose
        reading raised makes every rank raise (longvideo.distributed), instead of the others
        waiting for it in the training step's collectives."""
        if self.group is None:
            return self._batch()
        batch, error = None, None
        try:
            batch = self._batch()
        except Exception as e:  # noqa: BLE001 - raised on every rank by fail_together
            error = e
        fail_together(error, self.group)
        return batch

    def _batch(self) -> dict[str, torch.Tensor]:
        rows, keys, refs = [], [], []
        for _ in range(self.batch_size):
            row = self._next_row()
            docs = [self._docs.pop(r) for r in row]
            rows.append(pack_row(docs, self.seq_len, self.pad_id, self.cfg.loss_norm))
            keys.append([d.key for d in docs])
            refs.append(list(row))
            used = sum(len(d) for d in docs)
            self.stats["tokens"] += used
            self.stats["pad_tokens"] += self.seq_len - used
        self.last_batch_keys, self.last_batch_refs = keys, refs
        return {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}

    @property
    def padding_fraction(self) -> float:
        total = self.stats["tokens"] + self.stats["pad_tokens"]
        return self.stats["pad_tokens"] / total if total else 0.0
