"""Heterogeneous routed experts of one MoE layer: host weights, a device slot cache, per-expert dispatch.

Per step, each active expert is a cache hit (its slot is read in place), staged (its raw blocks copied
into a slot, then computed by the device kernels), or computed on the CPU by the host kernels (only
the activations move), as the cost model decides (cost.py). CPU experts run on a worker thread while
the device runs the hits and the staged experts; staged copies run ahead on the copy engine, at most
`depth` slots in flight (double-buffered by default), each slot released only after its kernel ran.
Every path writes each (token, slot k) pair's unweighted output into one buffer; the host kernels'
combine sums it in slot order in fp32, so the result has the bits of the CPU-only bank.

Legend: T tokens, K experts per token, D hidden, P pairs (T*K).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Executor

import torch

from pocketmoe.experts.cache import SlotCache
from pocketmoe.experts.cost import CPU, HIT, STAGE, Active, Rates, decide
from pocketmoe.experts.kernels import Activations, ExpertKernels, ExpertStore
from pocketmoe.experts.staging import SlotPool
from pocketmoe.experts.stats import ExpertStats


class DispatchExperts:
    def __init__(self, host: ExpertStore, host_kernels: ExpertKernels, pool: SlotPool | None, cache: SlotCache,
                 device_kernels: ExpertKernels, rates: Rates, policy: str, stats: ExpertStats, worker: Executor,
                 counts_tokens: bool = False, depth: int = 2) -> None:
        self.host, self.host_kernels, self.pool, self.cache = host, host_kernels, pool, cache
        self.device_kernels, self.rates, self.policy, self.stats = device_kernels, rates, policy, stats
        self.worker, self.counts_tokens, self.depth = worker, counts_tokens, max(1, depth)
        self.expert_bytes = host.expert_bytes()
        self.n_experts = host.count

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, D] float32, ids [T, K], weights [T, K] -> [T, D] float32."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
        experts, counts = (v.tolist() for v in torch.unique_consecutive(flat[order], return_counts=True))
        pairs = dict(zip(experts, torch.split(order, counts), strict=True))
        self.cache.touch(experts)
        can_stage = self.pool is not None and self.pool.n_slots > 0
        active = [Active(e, n, self.expert_bytes, self.cache.lookup(e) is not None)
                  for e, n in zip(experts, counts, strict=True)]
        decision = decide(active, self.rates, self.policy, can_stage)
        paths = decision.paths
        contrib = x.new_empty(t * k, x.shape[1])

        on_cpu = [e for e in experts if paths[e] == CPU]
        job = None
        if on_cpu:
            cpu_pairs = torch.cat([pairs[e] for e in on_cpu])
            # what the CPU experts read comes to the host now, before this layer queues any device work: the
            # routing read above drained the stream, so these copies wait for nothing, and the CPU experts run
            # while the device runs the hits and staged experts (a read queued behind those would wait for them)
            job = self.worker.submit(self._host_run, *self._host_inputs(x, k, cpu_pairs, flat))
        late = self._device(x, k, pairs, [e for e in experts if paths[e] == HIT],
                            [a.expert for a in sorted(active, key=lambda a: (-a.tokens, a.expert))
                             if paths[a.expert] == STAGE], contrib)
        if late:  # staged experts left without a slot (every slot pinned): the CPU takes them here
            late_pairs = torch.cat([pairs[e] for e in late])
            contrib[late_pairs] = self._host_run(*self._host_inputs(x, k, late_pairs, flat))
        if job is not None:
            contrib[cpu_pairs] = job.result()
        n_hit = sum(1 for e in experts if paths[e] == HIT)
        n_staged = sum(1 for e in experts if paths[e] == STAGE) - len(late)
        self.stats.add(tokens=t if self.counts_tokens else 0, hits=n_hit, misses=len(experts) - n_hit,
                       staged=n_staged, cpu_experts=len(on_cpu) + len(late),
                       bytes_copied=n_staged * self.expert_bytes, model_seconds=decision.seconds)
        # on the host (the CPU device, or a host-side model over a CUDA pool) the host kernels' combine
        combiner = self.host_kernels if contrib.device.type == "cpu" else self.device_kernels
        return combiner.combine(contrib.view(t, k, -1), weights)

    @staticmethod
    def _host_inputs(x: torch.Tensor, k: int, pairs: torch.Tensor, flat: torch.Tensor) \
            -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.device]:
        """_host_run's arguments for the CPU experts of `pairs`, copied to the host: the activations as the fewer
        of x's T rows (each token's once, with the pairs' row indices) and the pairs' own rows; the pairs' experts;
        the device the outputs go back to."""
        if x.shape[0] <= len(pairs):
            host_x, rows = x.cpu(), (pairs // k).cpu()
        else:
            host_x, rows = x[pairs // k].cpu(), None
        return host_x, rows, flat[pairs].cpu(), x.device

    def _host_run(self, host_x: torch.Tensor, rows: torch.Tensor | None, which: torch.Tensor,
                  device: torch.device) -> torch.Tensor:
        """The host kernels on host rows (pair p reads host_x[rows[p]]); the result on `device`."""
        return self.host_kernels.outputs(self.host, host_x, which, rows).to(device)

    def _device_outputs(self, acts: Activations, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        dev = acts.x.device
        return self.device_kernels.outputs(self.pool.store, acts, slots.to(dev), rows.to(dev))

    def _device(self, x: torch.Tensor, k: int, pairs: dict[int, torch.Tensor], hits: list[int], staged: list[int],
                contrib: torch.Tensor) -> list[int]:
        """Hits, then staged experts as their copies land; returns the staged experts that found no slot."""
        if not hits and not staged:
            return []
        pool, cache = self.pool, self.cache
        # x on the pool's device once; the device kernels quantize its rows once for the hits and every staged expert
        acts = Activations(x.to(pool.store.gate.raw.device))
        hit_slots = [cache.lookup(e) for e in hits]
        cache.pinned.update(hit_slots)
        waiting, inflight = deque(staged), deque()

        def issue() -> None:
            while waiting and len(inflight) < self.depth:
                slot = cache.victim()
                if slot is None:
                    return
                e = waiting.popleft()
                cache.drop(slot)
                cache.pinned.add(slot)
                pool.stage(slot, e)
                inflight.append((e, slot))

        if hits:  # queued before the first copies: on a GPU the copies' host-side gather then overlaps them
            for s in hit_slots:
                pool.acquire(s)
            hp = torch.cat([pairs[e] for e in hits])
            which = torch.cat([torch.full_like(pairs[e], s) for e, s in zip(hits, hit_slots, strict=True)])
            contrib[hp] = self._device_outputs(acts, hp // k, which).to(contrib.device)
            for s in hit_slots:
                pool.release(s)
            cache.pinned.difference_update(hit_slots)
        issue()
        while inflight:
            e, slot = inflight.popleft()
            pool.acquire(slot)
            p = pairs[e]
            contrib[p] = self._device_outputs(acts, p // k, torch.full_like(p, slot)).to(contrib.device)
            pool.release(slot)
            if self.policy != "stage" and cache.admits(e):
                cache.put(e, slot)
            cache.pinned.discard(slot)
            issue()
        return list(waiting)
