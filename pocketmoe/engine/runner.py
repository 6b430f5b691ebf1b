"""Build a model from a GGUF bundle as the placement plan says, and run steps of many sequences.

`ModelRunner.forward(step)` runs one batch mixing prefill chunks and decode tokens of several sequences
over a paged KV cache; `forward(tokens, start_pos)` and `decode` drive a single sequence (the CLI and
the Python API's one-request-at-a-time path).

Legend: T tokens, V vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from pocketmoe.defaults import DEFAULT_CHUNK_SIZE, DEFAULT_PREFIX_CACHE_DISK_GIB
from pocketmoe.engine.kv_cache import PAGE, ContextLengthError, PagedKVCache
from pocketmoe.engine.prefix_store import PrefixStore, model_key
from pocketmoe.engine.step import SeqChunk, Step, StepContext
from pocketmoe.errors import PocketMoEError
from pocketmoe.gguf import GGUFBundle
from pocketmoe.kv_dtypes import DEFAULT_KV_DTYPE
from pocketmoe.layers.experts import ExpertsFactory, host_experts_factory
from pocketmoe.layers.linear import QuantLinear
from pocketmoe.models import model_builder
from pocketmoe.numa import NumaReport, place_experts
from pocketmoe.ops import BACKENDS, ReferenceOps, make_ops
from pocketmoe.ops.cuda import plan_backend
from pocketmoe.parallel import init_parallel, shutdown_parallel
from pocketmoe.parallel.model import local_experts_factory, shard_model
from pocketmoe.parallel.steps import HELLO, StepChannel, StoreMirror
from pocketmoe.placement import ComputeRates, Devices, PlacementPlan, PlanOptions, make_plan
from pocketmoe.placement.estimate import default_cpu_gflops
from pocketmoe.placement.plan import torch_device
from pocketmoe.placement.run import RunPlacement, run_plan
from pocketmoe.specs import spec_from_bundle
from pocketmoe.specs.base import ModelSpec, Role

KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
SOLO = "solo"  # the sequence forward(tokens, start_pos) and decode drive


@dataclass(frozen=True)
class RunnerConfig:
    n_ctx: int = 4096                 # positions one sequence may hold (prompt + generated)
    chunk_size: int = DEFAULT_CHUNK_SIZE  # prefill tokens per forward on the single-sequence path
    threads: int | None = None        # threads for the kernels; the backend decides torch's share
    backend: str = "reference"        # op backend: auto | native | reference (LLM and the CLIs: auto)
    # roles whose dequantized float32 copy is kept after first use (None: the backend's choice);
    # routed experts are never expanded
    cache_roles: tuple[Role, ...] | None = None
    # at most this many bytes of dequantized float32 copies in all (the rest is dequantized per call),
    # so anonymous memory stays bounded on full-size models
    cache_budget_bytes: int = 1 << 30
    tile_rows: int | None = 8         # reference GEMMs in fixed row tiles: a row's result ignores the others
    kv_dtype: str = DEFAULT_KV_DTYPE  # what the KV cache stores: f32, f16 or bf16 (--kv-dtype)
    max_seqs: int = 1                 # sequences the KV pool holds at n_ctx each (unless kv_cache_bytes)
    kv_cache_bytes: int | None = None  # KV pool size; None: max_seqs x n_ctx positions
    # where the model runs (--device/--mode/--gpu-memory-gib/--expert-policy/--expert-cache-slots);
    # None: the CPU-only plan
    placement: RunPlacement | None = None
    expert_rates: Any = None           # experts.Rates for the dispatcher's cost model; None: calibrated
    copy_delay: Callable[[int, int], None] | None = None  # called before each staged copy (tests)
    # the prefix cache's pages kept in files under this directory too, within this many bytes (prefix_store.py)
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int = DEFAULT_PREFIX_CACHE_DISK_GIB << 30

    def __post_init__(self) -> None:
        if self.n_ctx <= 0 or self.chunk_size <= 0 or self.max_seqs <= 0:
            raise PocketMoEError(f"n_ctx ({self.n_ctx}), chunk_size ({self.chunk_size}) and max_seqs "
                                 f"({self.max_seqs}) must be > 0.")
        if self.threads is not None and self.threads <= 0:
            raise PocketMoEError(f"threads must be > 0, got {self.threads}.")
        if self.cache_budget_bytes < 0:
            raise PocketMoEError(f"cache_budget_bytes must be >= 0, got {self.cache_budget_bytes}.")
        if self.tile_rows is not None and self.tile_rows <= 0:
            raise PocketMoEError(f"tile_rows must be > 0 or None, got {self.tile_rows}.")
        if self.backend not in BACKENDS:
            raise PocketMoEError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}.")
        if self.cache_roles is not None:
            object.__setattr__(self, "cache_roles", tuple(Role(r) for r in self.cache_roles))
        if self.kv_dtype not in KV_DTYPES:
            raise PocketMoEError(f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}.")
        if self.prefix_cache_disk_bytes < 0:
            raise PocketMoEError(f"prefix_cache_disk_bytes must be >= 0, got {self.prefix_cache_disk_bytes}.")


def load_spec(bundle: GGUFBundle) -> ModelSpec:
    """The architecture's spec, after checking the bundle's tensors against it."""
    spec = spec_from_bundle(bundle)
    report = spec.validate(bundle)
    if not report.ok:
        errors = report.errors()
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise PocketMoEError(f"{bundle.paths[0]}: {errors[0]}{more}")
    return spec


def plan_options(cfg: RunnerConfig) -> PlanOptions:
    return PlanOptions(context_length=cfg.n_ctx, batch=cfg.max_seqs, kv_dtype=cfg.kv_dtype,
                       prefill_chunk=cfg.chunk_size, compute=ComputeRates(default_cpu_gflops(cfg.threads)))


def cpu_plan(spec: ModelSpec, bundle: GGUFBundle, cfg: RunnerConfig) -> PlacementPlan:
    """Everything in host memory, computed on the CPU."""
    from pocketmoe.hostinfo import host_memory_bytes

    host = max(host_memory_bytes() or 0, 1 << 30)
    return make_plan(spec, bundle.tensors, Devices((), host), plan_options(cfg))


def default_kv_pool_bytes(bundle: GGUFBundle, spec: ModelSpec, ctx: int, max_num_seqs: int, kv_dtype: str) -> int:
    """The KV pool the placement rule reserves for max_num_seqs sequences of ctx positions, within half the host
    memory the weights leave (at least 256 MiB): the server's default, and LLM()'s for a batch."""
    from pocketmoe.hostinfo import host_memory_bytes
    from pocketmoe.placement import kv_reserve

    want = kv_reserve(bundle.architecture, bundle.metadata, ctx, max_num_seqs, kv_dtype,
                      spec.kv_values_per_token()).total
    weights = sum(p.stat().st_size for p in bundle.paths)
    headroom = max((host_memory_bytes() - weights - 2**30) // 2, 256 * 2**20)
    return min(want, headroom)


def runner_plan(spec: ModelSpec, bundle: GGUFBundle, cfg: RunnerConfig) -> PlacementPlan:
    """The plan cfg.placement asks for (run_plan, as inspect_gguf prints it), or the CPU-only plan."""
    if cfg.placement is None:
        return cpu_plan(spec, bundle, cfg)
    return run_plan(spec, bundle.tensors, cfg.placement, plan_options(cfg))


class ModelRunner:
    def __init__(self, bundle: GGUFBundle, cfg: RunnerConfig | None = None, plan: PlacementPlan | None = None, *,
                 ops: ReferenceOps | None = None, on_tensor: Callable[[str], None] | None = None) -> None:
        """on_tensor(name) is called as each weight is bound (a load progress bar)."""
        self.cfg = cfg = cfg or RunnerConfig()
        self._on_tensor = on_tensor
        self.bundle = bundle
        self.spec = load_spec(bundle)
        self.plan = plan if plan is not None else runner_plan(self.spec, bundle, cfg)
        self.ops = ops if ops is not None else make_ops(plan_backend(cfg.backend, self.plan, bundle.architecture),
                                                            cfg.threads, cfg.tile_rows)
        threads = self.ops.torch_threads(cfg.threads)
        if threads is not None:
            torch.set_num_threads(threads)
        self._roles = {t.name: t.role for t in self.spec.tensors(bundle.tensors)}
        self._cache_roles = cfg.cache_roles if cfg.cache_roles is not None else self.ops.dense_cache_roles
        self.cached_bytes = 0  # float32 bytes promised to dequantized-weight caches so far
        self.experts: Any = None  # experts.ExpertRuntime of all-device / heterogeneous plans (stats, rates)
        self.solo_tokens: list[int] = []  # the single sequence's tokens whose KV rows the cache holds, by position
        # the tensor-parallel group (world size 1 outside torchrun: the model is built whole, as always)
        self.parallel = init_parallel()
        self.channel: StepChannel | None = None
        build = model_builder(bundle.architecture)
        layer_devices = self._place_layers()
        make_experts = self._experts_factory()
        if self.parallel.world > 1:
            make_experts = local_experts_factory(make_experts, self.parallel)
        self.model = build(bundle, self.spec.config, self.ops, self._make_linear, make_experts)
        width = self.spec.kv_values_per_token()
        if self.parallel.world > 1:
            self.model = shard_model(self.model, self.parallel, width)
            width = self.model.kv_width
        # the CUDA backend's device, or each layer's where the model spans several GPUs; the CPU otherwise
        kv_device: Any = getattr(self.ops, "device", "cpu")
        if len(set(layer_devices)) > 1 and self.parallel.world == 1:
            kv_device = layer_devices
        self._kv_layout = (self.model.n_layer, width, KV_DTYPES[cfg.kv_dtype], kv_device)
        self.store = self._prefix_store()
        self.cache = self._new_cache(cfg.kv_cache_bytes)
        self.numa = self._place_host_experts()
        # Embedding rows are read one per token in no order: without this, each new token id of a large
        # model faults its page in from disk in decode (V2-Lite: ~2 ms a token).
        if "token_embd.weight" in bundle.tensors and self.parallel.world == 1:
            bundle.prefetch("token_embd.weight")
        if self.parallel.world > 1:
            self.channel = StepChannel(self.parallel)
            self._hello()
            if self.store is not None and self.parallel.is_lead:
                self.cache.mirror = StoreMirror(self.channel)

    def _new_cache(self, kv_cache_bytes: int | None) -> PagedKVCache:
        """A KV pool of kv_cache_bytes (None: cfg.max_seqs sequences of n_ctx), over the runner's prefix store."""
        n_layer, width, dtype, device = self._kv_layout
        n_ctx = self.cfg.n_ctx
        if kv_cache_bytes is None:
            pages = self.cfg.max_seqs * -(-n_ctx // PAGE)
            cache = PagedKVCache(n_layer, width, pages, n_ctx, dtype, device=device)
        else:
            cache = PagedKVCache.for_bytes(n_layer, width, kv_cache_bytes, n_ctx, dtype, device=device)
        cache.store = self.store
        return cache

    @functools.cached_property
    def kv_key(self) -> bytes:
        """prefix_store.model_key of this model, op backend and KV layout: the rows a prefix store's or a slot
        file's pages hold are this runner's only under the same key."""
        n_layer, width, dtype, _ = self._kv_layout
        return model_key(self.bundle, type(self.ops).__name__, (n_layer, PAGE, width, dtype))

    @property
    def kv_page_shape(self) -> tuple[tuple[int, int, int], torch.dtype]:
        """One KV page's rows: ([L, page, W], dtype)."""
        n_layer, width, dtype, _ = self._kv_layout
        return (n_layer, PAGE, width), dtype

    def _prefix_store(self) -> PrefixStore | None:
        """cfg.prefix_cache_dir's store for this model, backend and KV layout (None without the directory)."""
        if self.cfg.prefix_cache_dir is None:
            return None
        n_layer, width, dtype, _ = self._kv_layout
        key = self.kv_key
        root, budget = Path(self.cfg.prefix_cache_dir), self.cfg.prefix_cache_disk_bytes
        tp = self.parallel
        if tp.world > 1:  # each rank keeps its shard of every row, in a directory of its own, within its share
            root, budget = root / f"tp{tp.world}-rank{tp.rank}", budget // tp.world
        try:
            return PrefixStore(root, key, (n_layer, PAGE, width), dtype, budget)
        except OSError as e:
            raise PocketMoEError(f"the prefix cache directory {self.cfg.prefix_cache_dir} cannot be used ({e}); give "
                                 "a directory this user can write.") from None

    def resize_kv(self, kv_cache_bytes: int) -> None:
        """Replace the KV pool by one of kv_cache_bytes; every sequence's rows are dropped (LLM's first batch)."""
        if self.parallel.world > 1:
            raise PocketMoEError("the KV pool of a tensor-parallel runner is fixed at start-up (every rank holds "
                                 "the same layout); size it with kv_cache_bytes.")
        del self.cache  # the old pool goes before the new one is allocated
        self.solo_tokens = []
        try:
            self.cache = self._new_cache(kv_cache_bytes)
        except BaseException:
            self.cache = self._new_cache(self.cfg.kv_cache_bytes)  # the start-up pool again: the runner stays usable
            raise

    # -- tensor parallel ---------------------------------------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        c = self.cache
        return {"architecture": self.bundle.architecture, "n_layer": self.model.n_layer, "pages": c.n_pages,
                "page": c.page, "max_seq_len": c.max_seq_len, "vocab": self.vocab_size, "kv_dtype": self.cfg.kv_dtype}

    def _hello(self) -> None:
        """Wait for every rank to load (however long that takes), then check they hold the same cache layout."""
        assert self.channel is not None
        tp = self.parallel
        torch.distributed.monitored_barrier(group=tp.control, timeout=timedelta(hours=2), wait_all_ranks=True)
        mine = self._layout()
        if tp.is_lead:
            self.channel.hello(mine)
            return
        kind, theirs = self.channel.receive()
        tp.ack()
        if kind != HELLO or theirs != mine:
            raise PocketMoEError(f"rank {tp.rank} built a cache layout {mine} but rank 0 has {theirs}; start every "
                                 "rank with the same flags.")

    def serve_steps(self, end_group: bool = True) -> None:
        """A worker rank: run each step rank 0 broadcasts until it says stop (RankLost if rank 0 goes away);
        then end the process group unless end_group is False (another runner of this process uses it)."""
        assert self.channel is not None and not self.parallel.is_lead
        with torch.inference_mode():
            self.channel.serve(lambda inputs: self.model(StepContext(cache=self.cache, **inputs)), self._store_pages)
        if end_group:
            shutdown_parallel()

    def _store_pages(self, ops: list[tuple[str, bytes, int]]) -> bool:
        """A worker: save or read its shard of the prefix-store pages rank 0 did (StoreMirror); whether each read
        worked."""
        if self.store is None:
            return False
        ok = True
        for op, digest, page in ops:  # this rank's cache has no mirror: its own store alone
            if op == "save":
                self.cache.save_page(digest, page)
            else:
                ok = self.cache.read_page(page, digest) and ok
        return ok

    def stop_workers(self, end_group: bool = True) -> None:
        """Rank 0: tell the worker ranks to exit, then end the process group unless end_group is False
        (no-op at world size 1)."""
        if self.channel is not None and self.parallel.is_lead and not self.channel.closed:
            if self.cache.mirror is not None:
                self.cache.mirror.flush()  # the pages rank 0 kept last: the workers keep their shares too
            self.channel.stop()
            if end_group:
                shutdown_parallel()

    def _run(self, ctx: StepContext) -> torch.Tensor:
        if self.channel is None:
            return self.ops.run(self.model, ctx)
        if not self.parallel.is_lead:
            raise PocketMoEError(f"rank {self.parallel.rank} of {self.parallel.world}: only rank 0 runs steps under "
                                 "torchrun; the other ranks call ModelRunner.serve_steps() (python -m pocketmoe.serve "
                                 "and pocketmoe.bench do).")
        if self.cache.mirror is not None:
            self.cache.mirror.flush()  # pages kept since the last step, before this one can write over them
        return self.channel.run_step(ctx, lambda: self.model(ctx))

    def _place_layers(self) -> list[torch.device]:
        """Tell the ops the plan's device of each layer and of the head (a model split by layer over several GPUs
        runs each layer on its own); each layer's torch device, for its KV cache rows."""
        plan, n = self.plan, self.spec.config.n_layer
        if not plan.devices:
            return [torch.device("cpu")] * n
        names = [plan.devices[plan.layer_device.get(i, 0)].name for i in range(n)]
        self.ops.place_layers(names, plan.devices[-1].name)
        return [torch_device(name) for name in names]

    def _place_host_experts(self) -> NumaReport:
        """The routed experts kept in host memory (cpu and heterogeneous plans) spread over the NUMA memory
        nodes as --numa says (pocketmoe.numa)."""
        policy = self.cfg.placement.numa if self.cfg.placement is not None else "auto"
        host = self.plan.mode != "all-device"
        names = [n for n, role in self._roles.items() if role == Role.ROUTED_EXPERT and host and n in self.bundle.tensors]
        return place_experts([self.bundle.raw(n) for n in names], policy)

    def _experts_factory(self) -> ExpertsFactory:
        """The ExpertBank of each MoE layer, as the plan places the routed experts."""
        types = getattr(self.ops, "types", None)
        if self.plan.mode == "cpu":
            return host_experts_factory(types, self.cfg.tile_rows)
        from pocketmoe.experts import ExpertRuntime, plan_experts_factory

        policy = self.cfg.placement.expert_policy if self.cfg.placement is not None else "auto"
        self.experts = ExpertRuntime(policy=policy, rates=self.cfg.expert_rates, copy_delay=self.cfg.copy_delay)
        return plan_experts_factory(self.plan, self.ops, self.cfg.tile_rows, self.experts)

    def _make_linear(self, name: str, role: Role | None = None) -> QuantLinear:
        info = self.bundle.tensors[name]
        if self._on_tensor is not None:
            self._on_tensor(name)
        role = role or self._roles.get(name, Role.OTHER)
        cache = False
        if role in self._cache_roles and info.ggml_type != 0:  # F32 is a zero-copy view already
            nbytes = 4 * info.n_elements
            cache = self.cached_bytes + nbytes <= self.cfg.cache_budget_bytes
            self.cached_bytes += nbytes if cache else 0
        return QuantLinear.from_bundle(self.bundle, name, cache_dense=cache, backend=self.ops)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def describe(self) -> str:
        """Which ops run, e.g. the kernels' instruction set and threads."""
        return f"{self.ops.name}: {self.ops.detail}"

    @torch.inference_mode()
    def forward(self, step: Step | Sequence[int] | torch.Tensor, start_pos: int | None = None,
                last_only: bool = False) -> torch.Tensor:
        """A Step -> logits [L, V] float32 of the tokens its chunks ask logits for, in order.

        Or tokens [T] of the single sequence at positions start_pos.. (0 starts it afresh) -> logits
        [T, V] ([1, V] with last_only), run in chunks of cfg.chunk_size.
        """
        if isinstance(step, Step):
            return self.run_step(step)[0]
        if start_pos is None:
            raise PocketMoEError("forward(tokens, start_pos): give the position of the first token.")
        tokens = [int(t) for t in (step if isinstance(step, (list, tuple)) else torch.as_tensor(step).reshape(-1).tolist())]
        if not tokens:
            raise PocketMoEError("forward needs at least one token, got none.")
        if start_pos < 0 or start_pos + len(tokens) > self.cfg.n_ctx:
            raise ContextLengthError(
                f"positions {start_pos}..{start_pos + len(tokens) - 1} do not fit in the context of "
                f"{self.cfg.n_ctx} tokens; raise n_ctx or shorten the input.")
        if start_pos == 0:
            self.cache.free(SOLO)
        known = self._solo_before(start_pos)
        out = []
        n = self.cfg.chunk_size
        for i in range(0, len(tokens), n):
            last = i + n >= len(tokens)
            mode = ("last" if last else "none") if last_only else "all"
            logits = self._run(StepContext.build(
                Step((SeqChunk(SOLO, tokens[i:i + n], start_pos + i, mode),)), self.cache, self.vocab_size))
            if mode != "none":
                out.append(logits)
        if known is not None:
            known.extend(tokens)
            self.solo_tokens = known
        return out[0] if len(out) == 1 else torch.cat(out)

    @torch.inference_mode()
    def run_step(self, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A Step -> the logits [L, V] float32 of the tokens its chunks ask logits for, and the final hidden states
        [H, D] float32 (the output norm's, the head's input) of those they ask them for (None: none asked), in
        order."""
        ctx = StepContext.build(step, self.cache, self.vocab_size)
        return self._run(ctx), ctx.hidden

    def _solo_before(self, pos: int) -> list[int] | None:
        """The single sequence's tokens before pos, where its rows hold them all (None where some are unknown);
        solo_tokens is emptied until the step now writing from pos has run."""
        known, self.solo_tokens = self.solo_tokens, []
        if pos > len(known):
            return None
        del known[pos:]
        return known

    def reuses_rows(self, asked: bool | None) -> bool:
        """Whether cached KV rows stand in for computed ones (prefix caching, the single sequence's reuse): as
        asked, else where the ops are chunk-invariant, so a cached row is bitwise the row a prefill writes. With a
        prefix store, whose rows are only ever for reuse, not reusing them is a PocketMoEError."""
        reuse = asked if asked is not None else bool(getattr(self.ops, "chunk_invariant", False))
        if self.store is not None and not reuse:
            raise PocketMoEError(f"a prefix cache directory keeps the pages of prompts to reuse, but prefix caching is "
                                 f"off with these kernels ({self.describe}: their rows can differ in the last bits "
                                 "with the chunking); turn it on to reuse them anyway (--enable-prefix-caching, or "
                                 "enable_prefix_caching=True), or give no directory (--prefix-cache-dir).")
        return reuse

    def solo_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the start, the single sequence's KV rows already hold (at most all but the
        last, whose logits a caller samples from): the position to continue it from."""
        n = 0
        for a, b in zip(self.solo_tokens, tokens[:-1], strict=False):
            if a != b:
                break
            n += 1
        return n

    def solo_restore(self, tokens: Sequence[int]) -> int:
        """Where the prefix store keeps more of `tokens`' start than the single sequence's rows hold (solo_prefix),
        restart the sequence from the store's rows: the position to continue it from either way."""
        held = self.solo_prefix(tokens)
        digests = self.cache.stored_digests(tokens[:-1])
        if len(digests) * self.cache.page <= held:
            return held
        self.free(SOLO)
        n = self.cache.restore(SOLO, digests)
        self.solo_tokens = list(tokens[:n])
        return n

    def solo_persist(self) -> None:
        """Keep the single sequence's full pages in the prefix store (those it lacks)."""
        self.cache.persist(SOLO, self.solo_tokens, len(self.solo_tokens))

    @torch.inference_mode()
    def decode(self, token: int, pos: int) -> torch.Tensor:
        """One token of the single sequence at position pos -> logits [V] (StepContext.decode_one: the
        step forward(token, pos) builds, without its general path)."""
        if not 0 <= pos < self.cfg.n_ctx:
            raise ContextLengthError(f"position {pos} does not fit in the context of {self.cfg.n_ctx} tokens; "
                                     "raise n_ctx or shorten the input.")
        if pos == 0:
            self.cache.free(SOLO)
        known = self._solo_before(pos)
        logits = self._run(StepContext.decode_one(SOLO, int(token), pos, self.cache, self.vocab_size))[0]
        if known is not None:
            known.append(int(token))
            self.solo_tokens = known
        return logits

    def free(self, seq: object) -> None:
        """Drop a sequence's KV cache rows (they go back to the pool)."""
        self.cache.free(seq)
        if seq == SOLO:
            self.solo_tokens = []

    def generate_greedy(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """Argmax continuation of `prompt` (the single sequence restarts at position 0)."""
        self.cache.check_fits(len(prompt), max_tokens)
        logits = self.forward(prompt, 0, last_only=True)[0]
        out: list[int] = []
        pos = len(prompt)
        while len(out) < max_tokens:
            out.append(int(logits.argmax()))
            if len(out) < max_tokens:
                logits = self.decode(out[-1], pos)
                pos += 1
        return out
