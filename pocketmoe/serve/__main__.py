"""Serve a GGUF model over an OpenAI-compatible HTTP API, batching all running requests into each step.

    python -m pocketmoe.serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--served-model-name NAME]
        [--api-key KEY] [--max-num-seqs N] [--max-model-len N] [--kv-cache-gib G] [--threads N]
        [--chat-template FILE] [--max-queue N] [--max-body-mib M] [--chunk-size N] [--reasoning-format auto|none]
        [--responses-store-mib M] [--responses-store-dir DIR] [--reasoning-budget N]
        [--reasoning-budget-message TEXT] [--spm-infill] [--no-slots] [--slots-debug] [--slot-save-path DIR]
        [--prefix-cache-dir DIR] [--prefix-cache-disk-gib G] [--allowed-origins ORIGIN[,ORIGIN...]]
        [--device ...] [--mode ...] [--gpu-memory-gib G[,G...]] [--expert-policy ...] [--expert-cache-slots N]

llama-server's spellings of the same flags work too: -m, -a / --alias, -c / --ctx-size (the context of each
sequence), -np / --parallel, -t, --chat-template-file; and its other common flags are taken as
pocketmoe/foreign_flags.py says (-ngl, -ot exps=CPU, -ctk, -ub, --chat-template-kwargs ... set this server's own;
--jinja, -fa ... are noted; --context-shift, -hf ... are refused with the reason; --temp, --top-k, --seed ... set
every request's default), as are `vllm serve MODEL ...`'s (the model first; --gpu-memory-utilization,
--max-num-batched-tokens, ...). Without --model it serves the built-in demo model. The port
opens at once (GET /health answers 503 while the model loads); one line `ready on http://HOST:PORT (...)` follows when requests are taken.
SIGINT or SIGTERM stops taking requests, ends in-flight streams with a final chunk and exits 0.

Tensor parallel: `torchrun --nproc-per-node N -m pocketmoe.serve --model X.gguf`. Rank 0 runs this server
and broadcasts each step; the other ranks load their shards and run the steps. SIGINT / SIGTERM to rank 0
or to torchrun stops every rank (exit 0); a rank that dies makes rank 0 answer 503 and exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import uvicorn

from pocketmoe.cli_util import EXIT_USER_ERROR, add_placement_args, error_line, placement_from_args, run_cli
from pocketmoe.defaults import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_POOLING,
    DEFAULT_PREFIX_CACHE_DISK_GIB,
    DEFAULT_RESPONSES_STORE_MIB,
    POOLINGS,
)
from pocketmoe.errors import PocketMoEError
from pocketmoe.foreign_flags import parse_args_with_foreign_flags, print_notes

log = logging.getLogger("pocketmoe.serve")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", "-m", default=None, help="GGUF file, any shard of a bundle, or its directory "
                   "(default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one; the ready line says which)")
    p.add_argument("--served-model-name", "--alias", "-a", default=None,
                   help="the model id clients send (default: the file name)")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="browser origins (scheme://host[:port], or * for any) whose pages may call this server: "
                   "answered with CORS headers, preflights included (default none: only same-origin pages and "
                   "non-browser clients); a JSON list as vLLM takes it works too")
    p.add_argument("--api-key", default=os.environ.get("POCKETMOE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $POCKETMOE_API_KEY; unset: open)")
    p.add_argument("--max-num-seqs", "--parallel", "-np", type=int, default=16,
                   help="sequences decoding at once (default 16)")
    p.add_argument("--max-model-len", "--ctx-size", "-c", type=int, default=None,
                   help="prompt + generated tokens of one sequence (default: the file's context length, capped "
                   "by the KV budget)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV pool shared by all sequences, GiB (default: the placement plan's KV reserve for "
                   "max-num-seqs sequences of max-model-len, capped at half the host memory the weights leave)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads for the kernels (default: all cores)")
    p.add_argument("--chat-template", "--chat-template-file", default=None, metavar="FILE",
                   help="Jinja chat template replacing the file's")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting before new ones get 503")
    p.add_argument("--max-body-mib", type=float, default=16.0, help="largest request body, MiB (larger: 413)")
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                   help=f"prefill tokens per step, over all sequences (default {DEFAULT_CHUNK_SIZE})")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV rows of a prompt's start that an earlier request computed (a chat's earlier "
                   "turns, a shared system prompt) (default: on with the native CPU kernels, whose rows are bitwise "
                   "the same however a prompt is chunked; off with the torch reference and CUDA ops, whose rows "
                   "can differ in the last bits)")
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="keep the prefix cache's KV pages in files here too, so a restarted server (or one whose pool "
                   "dropped them) reads a long prompt's rows instead of computing them again; needs prefix caching")
    p.add_argument("--prefix-cache-disk-gib", type=float, default=float(DEFAULT_PREFIX_CACHE_DISK_GIB),
                   help="bytes the files in --prefix-cache-dir may take, GiB (default "
                   f"{DEFAULT_PREFIX_CACHE_DISK_GIB}; least recently used go first)")
    p.add_argument("--reasoning-format", default="auto", choices=["auto", "none", "deepseek", "deepseek-legacy"],
                   help="auto: a thinking model's <think> block comes back as the message's reasoning_content (and "
                   "reasoning), apart from its content (llama-server's deepseek, deepseek-legacy: the same); none: all "
                   "of it as content")
    p.add_argument("--reasoning-budget", type=int, default=-1,
                   help="at most this many tokens of a thinking model's <think> block, after which the block is "
                   "closed for it and it answers (-1: no bound, the default; 0: closed as it opens); a request's "
                   "thinking_budget_tokens, thinking_token_budget or Anthropic thinking.budget_tokens overrides it")
    p.add_argument("--reasoning-budget-message", default="",
                   help="text written before the closing tag when the reasoning budget is spent (say, ' Time to "
                   "answer.'); a request's thinking_budget_message overrides it")
    p.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="what /v1/embeddings and /embedding pool of a prompt's final hidden states: the last "
                   "token's, the mean, the first (cls) token's, or none (every token's, /embedding only); default: "
                   f"the GGUF's pooling_type, else {DEFAULT_POOLING} (vLLM's for these models)")
    p.add_argument("--embeddings", "--embedding", action="store_true",
                   help="accepted for llama-server's command lines: the embedding routes are always on")
    p.add_argument("--spm-infill", action="store_true",
                   help="lay out fill-in-the-middle prompts (/infill, a /v1/completions suffix) suffix first, then "
                   "prefix, then middle, as some code models were trained (default: prefix, suffix, middle)")
    p.add_argument("--responses-store-mib", type=float, default=DEFAULT_RESPONSES_STORE_MIB,
                   help="memory for the /v1/responses replies kept for previous_response_id and GET /v1/responses/ID "
                   "and, as much again, for /v1/conversations "
                   f"(default {DEFAULT_RESPONSES_STORE_MIB}; the least recently used go first; 0: keep none)")
    p.add_argument("--responses-store-dir", default=None, metavar="DIR",
                   help="keep the stored responses and conversations as files here too, so they outlive the server "
                   "(read back at start; default: memory only)")
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                   help="serve llama-server's GET /slots (each slot's state and sampling settings; default on)")
    p.add_argument("--slots-debug", action="store_true",
                   default=os.environ.get("LLAMA_SERVER_SLOTS_DEBUG", "") not in ("", "0"),
                   help="/slots shows each slot's prompt and generated text too (as llama-server with "
                        "LLAMA_SERVER_SLOTS_DEBUG=1, which also turns this on)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="where POST /slots/{id}?action=save writes a slot's KV pages and action=restore reads them "
                        "(llama-server's flag; without it those two answer 501)")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "reference"])
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="ranks sharing the model: taken from torchrun's world size (give it only to check that)")
    add_placement_args(p)
    args = parse_args_with_foreign_flags(p, argv)
    if args.reasoning_format in ("deepseek", "deepseek-legacy"):  # llama-server's names of what auto does
        args.reasoning_format = "auto"
    for name in ("max_num_seqs", "max_queue", "chunk_size", "threads", "max_model_len"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.reasoning_budget < -1:
        p.error(f"--reasoning-budget must be -1 (no bound) or >= 0, got {args.reasoning_budget}")
    try:
        args.allowed_origins = origins(args.allowed_origins)
    except ValueError as e:
        p.error(f"--allowed-origins: {e}")
    if not args.prefix_cache_disk_gib >= 0:
        p.error(f"--prefix-cache-disk-gib must be >= 0, got {args.prefix_cache_disk_gib}")
    if not args.responses_store_mib >= 0:
        p.error(f"--responses-store-mib must be >= 0, got {args.responses_store_mib}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in 0..65535, got {args.port}")
    for name in ("kv_cache_gib", "max_body_mib"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    return args


def kv_budget(bundle, spec, args: argparse.Namespace) -> tuple[int, int]:  # noqa: ANN001
    """(KV pool bytes, max model len): what the flags say, else the placement rule's defaults."""
    from pocketmoe.engine.kv_cache import PAGE
    from pocketmoe.engine.runner import default_kv_pool_bytes
    from pocketmoe.placement import KV_DTYPE_BYTES

    c = spec.config
    file_ctx = int(c.n_ctx or 4096)
    per_pos = c.n_layer * spec.kv_values_per_token() * KV_DTYPE_BYTES[args.kv_dtype]
    ctx = args.max_model_len or file_ctx
    if args.kv_cache_gib is not None:
        budget = int(args.kv_cache_gib * 2**30)
    else:
        budget = default_kv_pool_bytes(bundle, spec, ctx, args.max_num_seqs, args.kv_dtype)
    positions = budget // per_pos // PAGE * PAGE
    max_len = args.max_model_len or min(file_ctx, positions)
    if positions < max_len or max_len < 2:
        raise PocketMoEError(
            f"a KV pool of {budget / 2**30:.3f} GiB holds {positions} positions ({per_pos} bytes each) but one "
            f"sequence of --max-model-len {max_len} needs {max_len * per_pos / 2**30:.3f} GiB; raise --kv-cache-gib "
            "or lower --max-model-len.")
    return budget, max_len


def origins(text: str | None) -> tuple[str, ...]:
    """--allowed-origins: comma-separated origins or a JSON list of them (ValueError naming a bad one)."""
    if text is None:
        return ()
    items = json.loads(text) if text.lstrip().startswith("[") else [t.strip() for t in text.split(",") if t.strip()]
    for o in items:
        if not isinstance(o, str) or not (o == "*" or re.fullmatch(r"https?://[^/\s]+", o)):
            raise ValueError(f"{o!r} is not an origin (scheme://host[:port], no path) nor *")
    return tuple(items)


def runner_config(args: argparse.Namespace, budget: int, max_len: int):  # noqa: ANN201
    from pocketmoe.engine.runner import RunnerConfig

    return RunnerConfig(n_ctx=max_len, chunk_size=args.chunk_size, threads=args.threads, backend=args.backend,
                        kv_dtype=args.kv_dtype, kv_cache_bytes=budget, max_seqs=args.max_num_seqs,
                        placement=placement_from_args(args), prefix_cache_dir=args.prefix_cache_dir,
                        prefix_cache_disk_bytes=int(args.prefix_cache_disk_gib * 2**30))


def stores(args: argparse.Namespace) -> dict[str, object]:
    """The stored responses' and conversations' stores (ServerState's fields), read back from
    --responses-store-dir where it is given."""
    from pocketmoe.serve.conversations import ConversationStore
    from pocketmoe.serve.responses import ResponseStore

    capacity = int(args.responses_store_mib * 2**20)
    try:
        return {"responses": ResponseStore(capacity, args.responses_store_dir),
                "conversations": ConversationStore(capacity, args.responses_store_dir)}
    except OSError as e:
        raise PocketMoEError(f"--responses-store-dir {args.responses_store_dir}: {e.strerror or e}; give a "
                             "directory this user can write.") from None


def slot_save_path(args: argparse.Namespace) -> Path | None:
    """--slot-save-path, made where it is missing (None without the flag)."""
    if args.slot_save_path is None:
        return None
    path = Path(args.slot_save_path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PocketMoEError(f"--slot-save-path {path}: {e.strerror or e}; give a directory this user can write.") \
            from None
    return path


def from_rank0(value: object) -> object:
    """Rank 0's value on every rank (the KV budget: each rank's cache layout must be rank 0's)."""
    from datetime import timedelta

    import torch.distributed as dist

    from pocketmoe.parallel import init_parallel

    tp = init_parallel()
    if tp.world == 1:
        return value
    dist.monitored_barrier(group=tp.control, timeout=timedelta(hours=2), wait_all_ranks=True)
    box = [value]
    dist.broadcast_object_list(box, src=0, group=tp.control)
    return box[0]


def load(args: argparse.Namespace, state, server) -> None:  # noqa: ANN001
    """Build the runner and the engine (a progress bar over the layers), then print the ready line."""
    from tqdm import tqdm

    from pocketmoe.engine.pooling import model_pooling
    from pocketmoe.engine.runner import ModelRunner, load_spec
    from pocketmoe.gguf import open_bundle
    from pocketmoe.serve.engine import Engine, EngineConfig
    from pocketmoe.tokenizer import Tokenizer

    bundle = open_bundle(args.model)
    spec = load_spec(bundle)
    tok = Tokenizer.from_metadata(bundle.metadata)
    state.pooling = args.pooling or model_pooling(bundle.architecture, bundle.metadata)
    if args.chat_template:
        tok.chat_template = Path(args.chat_template).read_text()
    budget, max_len = from_rank0(kv_budget(bundle, spec, args))
    state.max_model_len = max_len
    cfg = runner_config(args, budget, max_len)
    bar = tqdm(total=spec.config.n_layer, desc="loading", unit="layer", file=sys.stderr, leave=False)

    def on_tensor(name: str) -> None:
        if name.startswith("blk."):
            bar.update(int(name.split(".")[1]) + 1 - bar.n)

    runner = ModelRunner(bundle, cfg, on_tensor=on_tensor)
    bar.update(bar.total - bar.n)
    bar.close()
    engine = Engine(runner, tok, EngineConfig(args.max_num_seqs, args.max_queue, args.chunk_size, max_len,
                                              args.enable_prefix_caching), state.metrics)
    state.metrics.kv_pages.set(runner.cache.n_pages)
    state.metrics.kv_bytes.set(runner.cache.nbytes)
    state.metrics.watch_experts(runner)
    if runner.channel is not None:  # tensor parallel: a rank lost while idle is seen by the heartbeat
        engine.on_fatal = lambda e: lost_rank(state, server, e)
        runner.channel.start_heartbeat(engine.lose)
    engine.start()
    state.tokenizer, state.engine = tok, engine
    while not server.started and not server.should_exit:
        threading.Event().wait(0.02)
    host, port = server.bound
    kv = runner.cache
    print(f"ready on http://{host}:{port} (model {state.model_name}, {bundle.architecture}, kernels {runner.describe}, "
          f"max-model-len {max_len}, KV pool {kv.nbytes / 2**30:.2f} GiB = {kv.n_pages * kv.page} positions, "
          f"max-num-seqs {args.max_num_seqs}, placement {runner.plan.mode}, prefix caching "
          f"{'on' if engine.prefix_caching else 'off'}"
          f"{f', {len(runner.store)} pages in {args.prefix_cache_dir}' if runner.store is not None else ''})",
          flush=True)


LOST_GRACE_S = 2.0  # rank 0 keeps answering 503 this long after a rank is lost, then exits 1


def lost_rank(state, server, e: BaseException) -> None:  # noqa: ANN001
    """A tensor-parallel rank died: requests get 503 (the engine is down), then the server exits non-zero."""
    if state.lost_rank is None:
        state.lost_rank = e
        threading.Timer(LOST_GRACE_S, lambda: setattr(server, "should_exit", True)).start()


def tensor_parallel(args: argparse.Namespace):  # noqa: ANN201
    """This process's group, after checking --tensor-parallel-size against torchrun's world size."""
    from pocketmoe.parallel import init_parallel

    tp = init_parallel()
    if args.tensor_parallel_size is not None and args.tensor_parallel_size != tp.world:
        raise PocketMoEError(
            f"--tensor-parallel-size is {args.tensor_parallel_size} but the world size is {tp.world} (the processes "
            f"torchrun started, 1 without torchrun); the size is the world size: run torchrun --nproc-per-node "
            f"{args.tensor_parallel_size} (or drop the flag).")
    return tp


def worker(args: argparse.Namespace) -> int:
    """A rank other than 0: load this rank's shards, run the steps rank 0 broadcasts, exit when it says stop.
    SIGINT / SIGTERM only mark the shutdown (rank 0, signalled too, sends stop; if it is gone first, exit 0)."""
    from pocketmoe.engine.runner import ModelRunner, load_spec
    from pocketmoe.gguf import open_bundle
    from pocketmoe.parallel import RankLost

    signalled: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda n, _f: signalled.append(n))
    bundle = open_bundle(args.model)
    spec = load_spec(bundle)
    budget, max_len = from_rank0(None)
    runner = ModelRunner(bundle, runner_config(args, budget, max_len))
    del spec
    try:
        runner.serve_steps()
    except RankLost as e:
        if signalled:
            return 0
        print(error_line(e), file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from pocketmoe.serve.api import ServerState, create_app

    if args.model is None:
        from pocketmoe.demo_model import demo_model_path

        args.model = str(demo_model_path())
    if not Path(args.model).exists():
        raise PocketMoEError(f"{args.model}: no such file or directory; give a GGUF file with --model.")
    tp = tensor_parallel(args)
    if not tp.is_lead:
        return worker(args)
    print_notes(args)
    name = args.served_model_name or Path(args.model).name.removesuffix(".gguf")
    state = ServerState(model_name=name, max_model_len=0, api_key=args.api_key or None,
                        max_body_bytes=int(args.max_body_mib * 2**20), reasoning_format=args.reasoning_format,
                        reasoning_budget=args.reasoning_budget, reasoning_budget_message=args.reasoning_budget_message,
                        spm_infill=args.spm_infill, allowed_origins=args.allowed_origins,
                        slots_endpoint=args.slots, slots_debug=args.slots_debug, slot_save_path=slot_save_path(args),
                        chat_template_kwargs=args.chat_template_kwargs, sampling_defaults=args.sampling_defaults,
                        **stores(args))
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise PocketMoEError(f"cannot listen on {args.host}:{args.port} ({e.strerror}); pick another --port or "
                             "--host.") from None
    config = uvicorn.Config(create_app(state), log_level=args.log_level, access_log=False,
                            timeout_graceful_shutdown=5, lifespan="off")
    server = Server(config, state)
    server.bound = sock.getsockname()[:2]
    failed: list[BaseException] = []

    def loader() -> None:
        try:
            load(args, state, server)
        except BaseException as e:  # noqa: BLE001  (reported as the exit status below)
            failed.append(e)
            state.load_error = str(e)
            server.should_exit = True

    threading.Thread(target=loader, name="pocketmoe-load", daemon=True).start()
    server.run(sockets=[sock])
    if state.engine is not None:
        state.engine.stop()
        state.engine.runner.stop_workers()
    if state.lost_rank is not None:
        print(error_line(state.lost_rank), file=sys.stderr)
        return 1
    if failed:
        e = failed[0]
        if isinstance(e, (PocketMoEError, OSError)):
            print(error_line(e), file=sys.stderr)
            return EXIT_USER_ERROR
        raise e
    return 0


class Server(uvicorn.Server):
    """uvicorn's server, whose exit signal first ends every in-flight request with a final chunk."""

    def __init__(self, config: uvicorn.Config, state) -> None:  # noqa: ANN001
        super().__init__(config)
        self.state = state
        self.bound: tuple[str, int] = ("", 0)

    def handle_exit(self, sig: int, frame) -> None:  # noqa: ANN001
        if self.state.engine is not None:
            self.state.engine.request_stop()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT / SIGTERM stop the server, which then exits 0 (uvicorn's own re-raises the signal at the end)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(run_cli(main))
