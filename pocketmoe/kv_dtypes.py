"""The KV cache dtypes (--kv-dtype) and their sizes: one list for the CLIs, the planner and the runner (no torch
import, so the CLIs parse their flags without it)."""

KV_DTYPE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
# What the KV cache stores unless --kv-dtype says otherwise. f16 / bf16 halve the cache (llama.cpp stores f16);
# the native CPU and the CUDA attention read all three.
DEFAULT_KV_DTYPE = "f32"
