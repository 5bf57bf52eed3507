"""The OpenAI protocol adapter, split as vLLM splits ``entrypoints/openai``: one module
per API (:mod:`.chat`, :mod:`.completions`, :mod:`.responses`) over a shared run core
(:mod:`.run`: plan, start, follow; :mod:`.serve`: idempotency, JSON or SSE), with
constraint and tool selection (:mod:`.constraints`, :mod:`.tools`), log-probabilities
(:mod:`.logprobs`), stream chunks (:mod:`.stream`) and the model list (:mod:`.models`).

Everything that matters runs through :mod:`app.services.generation`, the path
``/generate`` uses: prompt limits, idempotency claims, registry allocation, the
continuous engine, deadlines and cancellation of a client that went away. What
is added here is only protocol: the model name, ``n`` samples per prompt (each
its own registry entry when metadata is allocated), stop strings, and the
response shapes.

Every completion is watermarked; there is no opt-out (see docs/openai.md). The one
exception returns no generated text: a completion with ``max_tokens`` 0 (echo and
logprobs: the prompt scored) runs one unwatermarked token for the prompt's forward
pass and drops it.
"""
