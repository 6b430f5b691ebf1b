"""The KV pool's prefix cache (engine/kv_cache.py): which pages a new sequence may take, reference counts,
eviction. The engine-level checks (the same tokens and logprobs with the cache as without) are in
test_serve_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pocketmoe.engine.kv_cache import KVPoolFullError, PagedKVCache

PAGE = 4


def pool(n_pages: int = 8) -> PagedKVCache:
    return PagedKVCache(n_layer=2, width=3, n_pages=n_pages, max_seq_len=64, page=PAGE)


def computed(c: PagedKVCache, seq: object, tokens: list[int]) -> None:
    """Reserve `seq`, write a row per position that stands for its token and position, and commit it."""
    c.reserve(seq, len(tokens))
    rows = torch.from_numpy(c.rows(seq, 0, len(tokens)).astype(np.int64))
    for layer in range(2):
        vals = torch.tensor([[t, p, layer] for p, t in enumerate(tokens)], dtype=torch.float32)
        c.layer_rows(layer)[rows] = vals
    c.commit(seq, tokens, len(tokens))


def row_values(c: PagedKVCache, seq: object, n: int) -> list[list[float]]:
    return c.keys(1, c.rows(seq, 0, n)).tolist()


def test_a_new_sequence_takes_the_committed_full_pages_of_its_prefix() -> None:
    c = pool()
    a = list(range(10, 20))  # 10 tokens: pages of 4, 4 and a partial one of 2
    computed(c, "a", a)
    assert c.cached_pages == 2  # the partial page is never shared
    assert c.attach("b", a[:9]) == 8
    assert row_values(c, "b", 8) == row_values(c, "a", 8)
    assert c.attach("c", a[:7]) == 4  # 7 tokens hold one full page
    assert c.attach("d", [99] + a[1:]) == 0  # the first page differs: nothing
    assert c.length("d") == 0 and c.attach("e", a[:3]) == 0
    with pytest.raises(ValueError, match="already holds pages"):
        c.attach("b", a)


def test_a_page_matches_only_after_the_same_whole_prefix() -> None:
    c = pool()
    computed(c, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    # the same second page after another first one is another prefix
    assert c.attach("b", [9, 9, 9, 9, 5, 6, 7, 8]) == 0
    assert c.attach("c", [1, 2, 3, 4, 5, 6, 7, 9]) == 4


def test_shared_pages_go_back_only_when_nothing_holds_them() -> None:
    c = pool(8)
    computed(c, "a", list(range(8)))
    assert c.used_pages == 2 and c.free_pages == 6
    assert c.attach("b", list(range(8))) == 8
    c.reserve("b", 12)  # b's own third page
    c.free("a")
    assert c.used_pages == 3  # both shared pages are b's now
    c.free("b")
    assert c.used_pages == 0 and c.free_pages == 8 and c.cached_pages == 2
    assert c.attach("z", list(range(8))) == 8  # still indexed after every holder left


def test_reserve_evicts_the_least_recently_used_pages_no_sequence_holds() -> None:
    c = pool(4)
    old, new = [1, 1, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 4, 4, 4, 4]
    computed(c, "old", old)
    computed(c, "new", new)
    c.free("old")
    c.free("new")
    assert c.free_pages == 4 and c.cached_pages == 4
    assert c.attach("again", old) == 8  # old is now the most recently used prefix
    c.free("again")
    c.reserve("x", 8)  # two pages: new's, its last page first
    assert c.cached_pages == 2
    assert c.attach("y", new) == 0
    assert c.attach("z", old) == 8


def test_a_reservation_fails_when_held_pages_leave_too_few() -> None:
    c = pool(4)
    computed(c, "a", list(range(8)))
    assert c.attach("b", list(range(8))) == 8
    c.free("a")  # b holds both pages: they cannot be evicted
    with pytest.raises(KVPoolFullError, match="2 free pages of 4 positions but 3 more are needed"):
        c.reserve("c", 12)


def test_commit_indexes_pages_as_they_fill() -> None:
    c = pool()
    toks = list(range(40, 52))
    c.reserve("a", 3)
    c.commit("a", toks, 3)
    assert c.cached_pages == 0
    c.reserve("a", 9)
    c.commit("a", toks, 9)  # positions 0..8 computed: two full pages
    assert c.cached_pages == 2
    c.commit("a", toks, 9)
    assert c.cached_pages == 2
    # a second sequence computing the same tokens keeps its own pages out of the index
    c.reserve("b", 8)
    c.commit("b", toks, 8)
    assert c.cached_pages == 2
    c.free("b")
    assert c.used_pages == 3


def test_random_traffic_keeps_counts_and_rows_consistent() -> None:
    """Sequences of a few shared prefixes come and go at random over a small pool: every page is held by the
    sequences listing it plus the index, free and evictable pages add up, and an attached page always holds the
    rows of the tokens it was matched by."""
    rng = np.random.default_rng(5)
    c = pool(12)
    stems = [list(rng.integers(0, 5, 12)) for _ in range(3)]
    live: dict[int, list[int]] = {}
    for step in range(400):
        if live and (rng.random() < 0.4 or c.free_pages < 5):
            seq = int(rng.choice(list(live)))
            c.free(seq)
            del live[seq]
        else:
            toks = stems[rng.integers(3)][:int(rng.integers(0, 13))] + list(rng.integers(0, 5, int(rng.integers(1, 8))))
            got = c.attach(step, toks[:-1])
            assert got % PAGE == 0 and got <= len(toks) - 1
            rows = torch.from_numpy(c.rows(step, 0, got).astype(np.int64)) if got else None
            if got:  # the attached rows hold these tokens at these positions
                assert c.layer_rows(0)[rows][:, :2].tolist() == [[t, p] for p, t in enumerate(toks[:got])]
            c.reserve(step, len(toks))
            new = torch.from_numpy(c.rows(step, got, len(toks) - got).astype(np.int64))
            c.layer_rows(0)[new] = torch.tensor([[t, got + p, 0] for p, t in enumerate(toks[got:])], dtype=torch.float32)
            c.commit(step, toks, len(toks))
            live[step] = toks
        holders = [0] * c.n_pages
        for seq in live:
            for page in c._pages[seq]:
                holders[page] += 1
        for page in c._index.values():
            holders[page] += 1
        assert holders == c._ref
        assert sorted(c._free) == [p for p in range(c.n_pages) if holders[p] == 0]
        assert c.used_pages == sum(1 for p in range(c.n_pages) if any(p in c._pages[s] for s in live))
