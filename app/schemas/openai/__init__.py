"""The OpenAI protocols (vLLM's layout: one module per API, the shared fields in
:mod:`.common`)."""
