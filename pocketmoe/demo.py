"""The main job on the built-in default model: write it (a tiny DeepSeek-V2-shaped MoE with random
weights; no weights can be downloaded here), inspect it and plan its placement, then generate.

    python -m pocketmoe.demo [--out DIR] [--quant Q4_K_M] [--max-tokens 32]

The text is gibberish (random weights); what the demo shows is the whole path working on a real
GGUF file: reader, spec validation, placement plan, tokenizer + chat template, MoE forward, sampling.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pocketmoe.cli_util import run_cli


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pocketmoe.demo", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/demo", help="folder for the demo model")
    p.add_argument("--quant", default="Q4_K_M")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default="Explain mixture-of-experts models in one sentence.")
    args = p.parse_args(argv)

    from pocketmoe import generate, inspect_gguf
    from pocketmoe.testing.synth import write_fixture

    model = Path(args.out) / f"deepseek2-tiny-{args.quant}.gguf"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        print(f"== writing the built-in demo model to {model}", flush=True)
        write_fixture("deepseek2", "tiny", args.quant, model, seed=0)
    print(f"== python -m pocketmoe.inspect_gguf --gguf-path {model} --summary --validate-spec "
          "--placement-report --num-gpus 1 --gpu-memory-gib 4", flush=True)
    rc = inspect_gguf.main(["--gguf-path", str(model), "--summary", "--validate-spec", "--placement-report",
                            "--num-gpus", "1", "--gpu-memory-gib", "4"])
    if rc != 0:
        return rc
    print(f"\n== python -m pocketmoe.generate --model {model} --chat {args.prompt!r} "
          f"--max-tokens {args.max_tokens}", flush=True)
    return generate.main(["--model", str(model), "--chat", args.prompt, "--max-tokens", str(args.max_tokens)])


if __name__ == "__main__":
    sys.exit(run_cli(main))
