"""Corpus scans: find watermarked text in many documents, locally or on Ray.

``worldcup scan`` splits its inputs into *parts* (row ranges of one file),
scans each part with :class:`~worldcup_scan.scanner.Scanner` (tokenizer and
key bank loaded once per worker) and writes one result file per part, so a
crashed scan resumes where it stopped. The same per-part function runs in a
local process pool and as a Ray Data ``map_batches`` stage, which is why the
two engines give identical output. Nothing here imports FastAPI; the store is
read (keys, registry) only by the driver, in :mod:`worldcup_scan.keys`.
"""

from worldcup_scan.keys import KeySpec, ScanKeys
from worldcup_scan.run import ScanOptions, ScanSummary, run_scan

__all__ = ["KeySpec", "ScanKeys", "ScanOptions", "ScanSummary", "run_scan"]
