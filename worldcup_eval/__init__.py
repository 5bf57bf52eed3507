"""The evaluation harness: WorldCup vs the baselines vs unwatermarked, as in the paper's Section 4.

``worldcup eval`` (or :func:`run_eval`) generates every (scheme, payload
length) cell once, caches it batch by batch, and turns the cache into
``results.json``, ``report.md`` and PNG plots. Modules, in the order data
flows through them: :mod:`config` (the grid), :mod:`data` (prompts and human
text), :mod:`runner` (generation, perplexity, paraphrase), :mod:`cache`,
:mod:`attacks`, :mod:`evaluate` and :mod:`metrics`, :mod:`report` and
:mod:`plots`; :mod:`harness` ties them together.
"""

from worldcup_eval.config import EvalConfig, build_config
from worldcup_eval.harness import run_eval

__all__ = ["EvalConfig", "build_config", "run_eval"]
