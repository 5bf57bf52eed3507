"""WorldCup watermarking service: a thin FastAPI layer over ``worldcup_core``."""
