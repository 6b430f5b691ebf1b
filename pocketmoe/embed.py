"""Embed text with a GGUF model on this machine (llama.cpp's llama-embedding).

    python -m pocketmoe.embed [--model PATH] (--prompt TEXT | --file FILE) [--embd-separator SEP]
        [--pooling last|mean|cls|none] [--embd-normalize 2] [--embd-output-format ''|array|json|json+]
        [--threads N] [--n-ctx C] [--chunk-size N] [--backend auto|native|reference] [placement flags]

The text is split at the separator (a newline by default) into prompts, each embedded as the server's
/v1/embeddings embeds an input (engine/pooling.py). The default output is one line of space-separated values per
prompt; `array` prints a JSON list of the vectors, `json` OpenAI's embeddings object, `json+` that with the cosine
similarity of every pair of prompts (`cosineSimilarity`), as llama-embedding prints them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pocketmoe.cli_util import add_placement_args, placement_from_args, read_text_file, run_cli
from pocketmoe.defaults import POOLINGS
from pocketmoe.errors import PocketMoEError
from pocketmoe.generate import add_runtime_args

FORMATS = ("", "array", "json", "json+")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.embed", description=__doc__.split("\n")[0])
    p.add_argument("--model", "-m", default=None,
                   help="GGUF file, any shard of a bundle, or its directory (default: the built-in demo model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", "-p", help="the text; each part between separators is embedded on its own")
    src.add_argument("--file", "-f", help="read the text from this file")
    p.add_argument("--embd-separator", default="\n", help="what separates the prompts in the text (default: newline)")
    p.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="the last token's state, the mean, the first (cls), or none (every token's); default: the "
                   "GGUF's pooling_type, else last")
    p.add_argument("--embd-normalize", type=int, default=2,
                   help="-1 none, 0 max absolute (int16 range), 1 taxicab, 2 Euclidean (default), > 2 p-norm")
    p.add_argument("--embd-output-format", choices=FORMATS, default="",
                   help="'' plain values, array, json (OpenAI's object), json+ (with the cosine similarity matrix)")
    add_runtime_args(p)
    add_placement_args(p)
    return p.parse_args(argv)


def prompts_of(args: argparse.Namespace) -> list[str]:
    text = args.prompt if args.prompt is not None else read_text_file(args.file, "--file")
    if not args.embd_separator:
        raise PocketMoEError("--embd-separator is empty; give the text that separates the prompts.")
    parts = [t for t in text.split(args.embd_separator) if t.strip()]
    if not parts:
        raise PocketMoEError("there is no text to embed; give --prompt TEXT or --file FILE with some.")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = prompts_of(args)
    import torch

    from pocketmoe.engine.llm import LLM
    from pocketmoe.engine.pooling import check_normalize

    check_normalize(args.embd_normalize)
    if args.pooling == "none" and args.embd_output_format in ("json", "json+"):
        raise PocketMoEError("--pooling none gives each token's vector, not one a prompt; use the plain or array "
                             "output, or pool (--pooling last, mean or cls).")
    if args.model is None:
        from pocketmoe.demo_model import demo_model_path

        args.model = str(demo_model_path())
    llm = LLM(args.model, n_ctx=args.n_ctx, threads=args.threads, chunk_size=args.chunk_size, backend=args.backend,
              kv_dtype=args.kv_dtype, placement=placement_from_args(args), prefix_cache_dir=args.prefix_cache_dir)
    outs = llm.embed(prompts, pooling=args.pooling, normalize=args.embd_normalize, use_tqdm=False)
    vectors = [o.embedding for o in outs]
    if args.embd_output_format == "":
        for v in vectors:
            for row in v.reshape(-1, v.shape[-1]).tolist():
                print(" ".join(f"{x:.6f}" for x in row))
    elif args.embd_output_format == "array":
        print(json.dumps([v.tolist() for v in vectors]))
    else:
        n = sum(len(o.prompt_token_ids) for o in outs)
        body: dict[str, object] = {
            "object": "list", "data": [{"object": "embedding", "index": i, "embedding": v.tolist()}
                                       for i, v in enumerate(vectors)],
            "model": Path(args.model).name, "usage": {"prompt_tokens": n, "total_tokens": n}}
        if args.embd_output_format == "json+":
            m = torch.stack(vectors).double()
            unit = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-300)
            body["cosineSimilarity"] = (unit @ unit.T).tolist()
        print(json.dumps(body))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
