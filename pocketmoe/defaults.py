"""Defaults the CLIs, the Python API, the server and the planner share (no torch import, so the CLIs parse their
flags without it)."""

# Prefill tokens per forward pass (the server: per step, over all sequences), llama.cpp's n_ubatch. A MoE layer
# reads each routed expert once per chunk and unpacks its blocks once for all the chunk's tokens routed to it, so
# larger chunks prefill faster: on the V2-Lite-shaped file (2 threads, a 2048-token prompt) 256 -> 512 is 36 ->
# 43-45 tok/s, 1024 44-46, 2048 47, for 90 / 260 / 570 MiB more activations (README, "Measured").
DEFAULT_CHUNK_SIZE = 512

# MiB of /v1/responses replies the server keeps for previous_response_id (their JSON; the least recently used go
# first): a reply of a few thousand tokens is tens of KiB, so the default holds thousands of turns.
DEFAULT_RESPONSES_STORE_MIB = 64

# GiB the prefix cache's pages may take in --prefix-cache-dir (engine/prefix_store.py): a V2-Lite-shaped model's f32
# rows are 62 KB a token, so the default keeps about 270k tokens of prompts.
DEFAULT_PREFIX_CACHE_DISK_GIB = 16

# what an embedding pools of a prompt's final hidden states (engine/pooling.py; serve --pooling)
POOLINGS = ("last", "mean", "cls", "none")
DEFAULT_POOLING = "last"  # vLLM's for decoder models; llama.cpp's where the GGUF names none is no pooling at all
