"""The OpenAI-compatible server: `python -m pocketmoe.serve` (see __main__ for the flags).

engine: continuous batching over ModelRunner.run_step(Step); api: the HTTP routes; protocol: the request
models; metrics: the Prometheus collectors.
"""
