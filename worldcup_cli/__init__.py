"""The worldcup command line (above worldcup_core, never imported by it)."""
