"""The main job on the built-in demo model: a short plain completion and a chat turn, with the speed.

    python -m pocketmoe.demo [--model PATH] [--max-tokens 48] [--prompt TEXT] [--chat TEXT]

The demo model ships inside the package (pocketmoe/data/demo-model.gguf): a small DeepSeek-V2-shaped
MoE trained on the docstrings of Python's standard library (docs/demo-model.md), so it writes
recognisable English about Python (fluent more than correct: it is tiny), through the same code paths as a real checkpoint. At the end it
prints the commands that chat with it in the terminal and serve it over HTTP, and a `curl` to try.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence

from pocketmoe.cli_util import run_cli

PROMPT = "The argparse module"
CHAT = "What does os.path.join() do?"
SERVED_NAME = "pocketmoe-demo"
PORT = 8000


def _describe(path: str) -> str:
    from pocketmoe.gguf import open_bundle
    from pocketmoe.specs import spec_from_bundle

    bundle = open_bundle(path)
    try:
        c = spec_from_bundle(bundle).config
        name = bundle.metadata.get("general.name", bundle.paths[0].name)
        size = sum(p.stat().st_size for p in bundle.paths) / 1e6
        return (f"{name}: {bundle.architecture}, {c.n_layer} blocks, {c.n_expert} routed experts (top-"
                f"{c.n_expert_used}) + {c.n_expert_shared} shared, {c.n_vocab} tokens, {size:.1f} MB")
    finally:
        bundle.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the built-in demo model)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt", default=PROMPT, help="plain-text prompt to complete")
    p.add_argument("--chat", default=CHAT, help="one user message for the chat turn")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)

    from pocketmoe import generate
    from pocketmoe.demo_model import demo_model_path

    model = args.model or str(demo_model_path())
    model_flag = [] if args.model is None else ["--model", model]
    threads = [] if args.threads is None else ["--threads", str(args.threads)]
    print(f"== model {model}\n   {_describe(model)}", flush=True)
    for flag, text in (("--prompt", args.prompt), ("--chat", args.chat)):
        cmd = [*model_flag, flag, text, "--max-tokens", str(args.max_tokens), *threads]
        print(f"\n== python -m pocketmoe.generate {shlex.join(cmd)}", flush=True)
        rc = generate.main(cmd)
        sys.stdout.flush()
        if rc != 0:
            return rc

    body = json.dumps({"model": SERVED_NAME, "max_tokens": 64, "temperature": 0,
                       "messages": [{"role": "user", "content": args.chat}]})
    print("\n== chat with it in the terminal (a line a turn; Ctrl-D ends):", flush=True)
    print(f"   {shlex.join(['python', '-m', 'pocketmoe.chat', *model_flag])}")
    serve = ["python", "-m", "pocketmoe.serve", *model_flag, "--port", str(PORT), "--served-model-name", SERVED_NAME]
    print("\n== serve it over HTTP (OpenAI-compatible API), then try it from another terminal:", flush=True)
    print(f"   {shlex.join(serve)}")
    print(f"   curl -s http://127.0.0.1:{PORT}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d {shlex.quote(body)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
