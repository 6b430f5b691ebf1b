"""A paged KV cache shared by many sequences: one pool of rows per layer, handed out a page at a time.

Each sequence owns a list of pages; position p of a sequence lives in cache row
page_table[p // page] * page + p % page. What a row holds is the attention kind's business (MLA: the
normed latent c_kv and the roped k_pe, `ModelSpec.kv_values_per_token` values); it depends only on the
tokens at positions 0..p.

Prefix cache. A full page whose rows are computed can be indexed (`commit`) under a digest of every token
up to its end; a new sequence whose tokens start the same way then takes those pages instead of
computing them again (`attach`), the way vLLM's automatic prefix caching and llama.cpp's prompt cache do.
Pages are reference-counted (each sequence holding a page, and the index, count one); a page only the
index holds is evictable: it counts as free, and `reserve` takes the least recently used of them when
the free list runs out. Only full pages are shared, and a sequence writes only positions past the pages
it attached, so a shared page is never written. With a `store` (engine/prefix_store.py) each page the index
takes is also kept in a file, and `attach` reads the pages the pool no longer holds (or never held: a restarted
server's) from there into free pages.

Legend: L layers, P cache rows (pages * page size), W values per row.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pocketmoe.errors import PocketMoEError

if TYPE_CHECKING:
    from pocketmoe.engine.prefix_store import PrefixStore
    from pocketmoe.parallel.steps import StoreMirror

PAGE = 16  # positions per page


class ContextLengthError(PocketMoEError):
    """A request needs more positions than the context the engine was built with."""


class KVPoolFullError(PocketMoEError):
    """The KV pool has no free page left for a sequence (the scheduler waits, preempts or refuses)."""


class PagedKVCache:
    """rows [L, P, W]; sequences are keyed by any hashable id and grow a page at a time.

    `device` is one device for every layer (`data` is then the one [L, P, W] tensor), or one per layer (a model
    split by layer over several GPUs: each layer's [P, W] rows on its own device, and `data` is None). Ops read
    a layer's rows with `layer_rows(layer)` either way."""

    def __init__(self, n_layer: int, width: int, n_pages: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | Sequence[torch.device | str] = "cpu",
                 page: int = PAGE) -> None:
        if max_seq_len <= 0 or n_pages <= 0:
            raise ContextLengthError(f"the context length ({max_seq_len}) and the KV pool ({n_pages} pages) "
                                     "must be > 0.")
        self.page = page
        self.max_seq_len = max_seq_len
        self.n_pages = n_pages
        self.dtype = dtype
        if isinstance(device, (list, tuple)):
            if len(device) != n_layer:
                raise ValueError(f"{len(device)} devices were given for the KV cache of {n_layer} layers")
            self.data: torch.Tensor | None = None
            self._layers = [torch.zeros(n_pages * page, width, dtype=dtype, device=d) for d in device]
        else:
            self.data = torch.zeros(n_layer, n_pages * page, width, dtype=dtype, device=device)  # [L, P, W]
            self._layers = list(self.data.unbind(0))
        self._free = list(range(n_pages - 1, -1, -1))  # pop() hands out the lowest page first
        self._pages: dict[object, list[int]] = {}
        self._length: dict[object, int] = {}
        self._ref = [0] * n_pages  # holders of each page: sequences, plus one while it is indexed
        self._index: dict[bytes, int] = {}  # prefix digest -> page
        self._page_key: dict[int, bytes] = {}  # indexed page -> its digest
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed pages no sequence holds, oldest first
        self._committed: dict[object, tuple[int, bytes]] = {}  # seq -> (its pages looked at by commit, last digest)
        self.store: PrefixStore | None = None  # the index's pages kept in files too (the second tier)
        # tensor parallel, rank 0: the other ranks' stores follow this one's (parallel/steps.StoreMirror)
        self.mirror: StoreMirror | None = None

    @classmethod
    def for_bytes(cls, n_layer: int, width: int, budget_bytes: int, max_seq_len: int,
                  dtype: torch.dtype = torch.float32, page: int = PAGE,
                  device: torch.device | str | Sequence[torch.device | str] = "cpu") -> PagedKVCache:
        """As many pages as `budget_bytes` holds (at least one sequence of max_seq_len)."""
        row = n_layer * width * torch.tensor([], dtype=dtype).element_size()
        pages = budget_bytes // (row * page)
        need = -(-max_seq_len // page)
        if pages < need:
            raise ContextLengthError(
                f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds {pages * page} positions but one sequence "
                f"of {max_seq_len} needs {need * page * row / 2**20:.1f} MiB; raise the KV budget or lower "
                "the context length.")
        return cls(n_layer, width, pages, max_seq_len, dtype, device=device, page=page)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._layers)

    def layer_rows(self, layer: int) -> torch.Tensor:
        """[P, W]: every cache row of one layer (a view of `data`, or the layer's own tensor on its device)."""
        return self._layers[layer]

    @property
    def free_pages(self) -> int:
        """Pages a reservation can take: the free list and the indexed pages no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_pages(self) -> int:
        """Pages the prefix index holds."""
        return len(self._index)

    @property
    def used_pages(self) -> int:
        """Pages sequences hold."""
        return self.n_pages - self.free_pages

    def pages_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page)

    def length(self, seq: object) -> int:
        """Positions reserved for `seq` so far (0 for one it does not know)."""
        return self._length.get(seq, 0)

    def check_fits(self, n_prompt: int, max_tokens: int = 0) -> None:
        """ContextLengthError unless prompt + max_tokens fits one sequence's context."""
        if n_prompt + max_tokens > self.max_seq_len:
            raise ContextLengthError(
                f"the prompt has {n_prompt} tokens and {max_tokens} more were requested, "
                f"{n_prompt + max_tokens} in all, but the context holds {self.max_seq_len}; "
                f"shorten the prompt, lower max_tokens or raise n_ctx.")

    def reserve(self, seq: object, n_positions: int) -> None:
        """Make positions 0..n_positions-1 of `seq` addressable (pages are added, never moved)."""
        if n_positions > self.max_seq_len:
            raise ContextLengthError(f"position {n_positions - 1} is past the context of {self.max_seq_len} "
                                     "tokens; raise n_ctx or shorten the input.")
        pages = self._pages.setdefault(seq, [])
        extra = self.pages_for(n_positions) - len(pages)
        if extra > self.free_pages:
            raise KVPoolFullError(f"the KV pool has {self.free_pages} free pages of {self.page} positions but "
                                  f"{extra} more are needed; wait for other sequences or raise the KV budget.")
        for _ in range(extra):
            page = self._take_page()
            self._ref[page] = 1
            pages.append(page)
        self._length[seq] = max(self._length.get(seq, 0), n_positions)

    def free(self, seq: object) -> None:
        """Give `seq`'s pages back to the pool (a sequence it does not know is ignored); the indexed ones stay
        in the prefix index until evicted."""
        for page in reversed(self._pages.pop(seq, [])):  # its last page first: the prefix's root is evicted last
            self._release(page)
        self._length.pop(seq, None)
        self._committed.pop(seq, None)

    # -- prefix cache ----------------------------------------------------------------------------------------
    def commit(self, seq: object, tokens: Sequence[int], n_computed: int) -> None:
        """Index `seq`'s full pages whose rows are computed (positions < n_computed, holding `tokens`), so later
        sequences starting with the same tokens can attach them. Pages looked at before are skipped."""
        pages = self._pages.get(seq)
        if pages is None:
            return
        done, digest = self._committed.get(seq, (0, b""))
        full = min(n_computed // self.page, len(pages))
        for i, key in self._digests(tokens[:full * self.page], done, digest):
            digest = key  # the last page's, where the next commit goes on from
            if key in self._index:  # the same rows already live in another page: keep that one
                if self._index[key] in self._evictable:
                    self._evictable.move_to_end(self._index[key])
                continue
            page = pages[i]
            self._index[key] = page
            self._page_key[page] = key
            self._ref[page] += 1
            if self.store is not None and key not in self.store:
                self.save_page(key, page)
        if full > done:
            self._committed[seq] = (full, digest)

    def attach(self, seq: object, tokens: Sequence[int]) -> int:
        """Start a new `seq` with the indexed pages that hold the longest run of full pages of `tokens`; returns
        the positions they cover (0: none; the sequence is then unknown, as before)."""
        if seq in self._pages:
            raise ValueError(f"sequence {seq!r} already holds pages; attach starts a new one")
        found: list[int] = []
        digest = b""
        for _, nxt in self._digests(tokens):
            page = self._index.get(nxt)
            if page is None and (page := self._load(nxt)) is None:
                break
            self._hold(page)  # held as found: reading the next from the store may evict an unheld one
            found.append(page)
            digest = nxt
        if not found:
            return 0
        self._pages[seq] = found
        self._length[seq] = len(found) * self.page
        self._committed[seq] = (len(found), digest)
        return len(found) * self.page

    def _load(self, digest: bytes) -> int | None:
        """A page holding the store's rows for `digest`, indexed under it (None: the store lacks them, or no page is
        free or evictable)."""
        if self.store is None or digest not in self.store or not (self._free or self._evictable):
            return None
        rows = self.store.load(digest)
        if rows is None:
            return None
        page = self._take_page()
        if not self._write_stored(page, digest, rows):
            self._free.append(page)
            return None
        self._index_page(page, digest)
        return page

    # -- a prefix's rows out and in (llama-server's slot save / restore / erase) ------------------------------
    def prefix_rows(self, tokens: Sequence[int]) -> list[torch.Tensor]:
        """The rows [L, page, W] of the longest run of full pages of `tokens`, from the start, that the index (or
        its store) holds: what index_rows takes back."""
        out = []
        for _, digest in self._digests(tokens):
            page = self._index.get(digest)
            rows = self.page_rows(page) if page is not None else (
                self.store.load(digest) if self.store is not None else None)
            if rows is None:
                break
            out.append(rows)
        return out

    def index_rows(self, tokens: Sequence[int], rows: Sequence[torch.Tensor]) -> int:
        """Index pages of `rows` (prefix_rows' answer for `tokens`) so that sequences starting with those tokens
        attach them; returns the positions the index then holds from the start. They take free pages, then the
        least recently used of the index's, never each other's nor one a sequence holds: as many as the pool
        has free or evictable pages for."""
        room = len(self._free) + len(self._evictable)
        n = 0
        for i, digest in self._digests(tokens[:len(rows) * self.page]):
            if digest not in self._index:
                if not room:
                    break
                room -= 1
                page = self._take_page()
                self.write_page(page, rows[i])
                self._index_page(page, digest)
                self._evictable[page] = None  # the most recently used: evicted after the pages indexed before
                if self.store is not None and digest not in self.store:
                    self.save_page(digest, page)
            n = (i + 1) * self.page
        return n

    def forget_prefix(self, tokens: Sequence[int]) -> int:
        """Drop from the index the pages of `tokens`' full pages that no sequence holds (a held one stays, and the
        store's files stay); returns the positions dropped."""
        n = 0
        for _, digest in self._digests(tokens):
            page = self._index.get(digest)
            if page is not None and page in self._evictable:
                del self._evictable[page]
                del self._index[self._page_key.pop(page)]
                self._release(page)
                n += self.page
        return n

    # -- the store for a sequence of its own (the single-sequence path: its pages are never shared) ----------------
    def stored_digests(self, tokens: Sequence[int]) -> list[bytes]:
        """The digests of the longest run of full pages of `tokens`, from the start, that the store keeps (none
        without a store)."""
        if self.store is None:
            return []
        return [d for _, d in itertools.takewhile(lambda x: x[1] in self.store, self._digests(tokens))]

    def restore(self, seq: object, digests: Sequence[bytes]) -> int:
        """Start a new `seq` with the store's rows for the pages `digests` name (stored_digests' answer), read into
        pages of its own (not indexed: it may write over them later); returns the positions they cover."""
        if seq in self._pages:
            raise ValueError(f"sequence {seq!r} already holds pages; restore starts a new one")
        if not digests or self.store is None:
            return 0
        self.reserve(seq, len(digests) * self.page)
        pages = self._pages[seq]
        for i, (page, digest) in enumerate(zip(pages, digests, strict=True)):
            if not self.read_page(page, digest):
                # a file that went bad since it was counted: keep the pages read before it
                for extra in pages[i:]:
                    self._release(extra)
                del pages[i:]
                self._length[seq] = i * self.page
                if not i:
                    self.free(seq)
                return i * self.page
        return len(digests) * self.page

    def persist(self, seq: object, tokens: Sequence[int], n_computed: int) -> None:
        """Keep `seq`'s full pages of computed rows (holding `tokens`) in the store, those it lacks."""
        if self.store is None or seq not in self._pages:
            return
        full = min(n_computed // self.page, len(self._pages[seq]))
        for i, digest in self._digests(tokens[:full * self.page]):
            if digest not in self.store:
                self.save_page(digest, self._pages[seq][i])

    def save_page(self, digest: bytes, page: int) -> None:
        """Keep `page`'s rows in the store under `digest` (and, under tensor parallelism, every rank its share)."""
        assert self.store is not None
        self.store.save(digest, self.page_rows(page))
        if self.mirror is not None:
            self.mirror.saved(digest, page)

    def read_page(self, page: int, digest: bytes) -> bool:
        """Read the store's rows for `digest` into `page` (False: the store lacks them, or some rank its share)."""
        assert self.store is not None
        rows = self.store.load(digest)
        return rows is not None and self._write_stored(page, digest, rows)

    def _write_stored(self, page: int, digest: bytes, rows: torch.Tensor) -> bool:
        """Write the store's rows for `digest` into `page` (and, under tensor parallelism, have every other rank read
        its share there); False where some rank could not (its file is missing or damaged: rank 0's goes too, a
        miss from now on)."""
        assert self.store is not None
        self.write_page(page, rows)
        if self.mirror is not None and not self.mirror.loaded(digest, page):
            self.store.discard(digest)
            return False
        return True

    def page_rows(self, page: int) -> torch.Tensor:
        """[L, page, W] on the CPU: one page's rows in every layer."""
        return torch.stack([layer[page * self.page:(page + 1) * self.page].cpu() for layer in self._layers])

    def write_page(self, page: int, rows: torch.Tensor) -> None:
        """Write [L, page, W] rows (page_rows' shape, from the store) into one page of every layer."""
        for layer, layer_rows in zip(self._layers, rows, strict=True):
            layer[page * self.page:(page + 1) * self.page] = layer_rows.to(layer.device, layer.dtype)

    def _digests(self, tokens: Sequence[int], first: int = 0, parent: bytes = b"") -> Iterator[tuple[int, bytes]]:
        """(i, the digest of the prefix through page i) for each full page of `tokens` from page `first` on, chained
        from `parent` (the digest of the pages before it)."""
        for i in range(first, len(tokens) // self.page):
            parent = self._digest(parent, tokens[i * self.page:(i + 1) * self.page])
            yield i, parent

    @staticmethod
    def _digest(parent: bytes, tokens: Sequence[int]) -> bytes:
        """The digest of a prefix: its last page's tokens chained onto the digest of the prefix before it."""
        return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()

    def _take_page(self) -> int:
        """A free page, evicting the index's least recently used one where none is free (one must be evictable)."""
        if not self._free:
            self._evict_one()
        return self._free.pop()

    def _index_page(self, page: int, digest: bytes) -> None:
        """Index a page just filled with the rows of `digest`, held by the index alone."""
        self._ref[page] = 1  # the index's
        self._index[digest] = page
        self._page_key[page] = digest

    def _hold(self, page: int) -> None:
        self._evictable.pop(page, None)
        self._ref[page] += 1

    def _release(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page] == 0:
            self._free.append(page)
        elif self._ref[page] == 1 and page in self._page_key:  # only the index holds it now
            self._evictable[page] = None

    def _evict_one(self) -> None:
        """Drop the indexed page no sequence has held for the longest; it goes to the free list."""
        page, _ = self._evictable.popitem(last=False)
        del self._index[self._page_key.pop(page)]
        self._release(page)

    def rows(self, seq: object, start: int, n: int) -> np.ndarray:
        """int32 [n]: cache rows of positions start..start+n-1 of `seq` (reserved beforehand)."""
        pages = np.asarray(self._pages[seq], dtype=np.int64)
        pos = np.arange(start, start + n)
        return (pages[pos // self.page] * self.page + pos % self.page).astype(np.int32)

    def page_table(self, seqs: list[object]) -> np.ndarray:
        """int32 [S, max pages] of the given sequences (unused entries -1)."""
        width = max(len(self._pages[s]) for s in seqs)
        table = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(self._pages[s])] = self._pages[s]
        return table

    def keys(self, layer: int, seq_rows: np.ndarray) -> torch.Tensor:
        """float32 [S, W]: the cached rows `seq_rows` of one layer (for the reference attention)."""
        rows = self._layers[layer]
        out = rows[torch.from_numpy(seq_rows).long().to(rows.device)]
        return out if out.dtype == torch.float32 else out.float()
