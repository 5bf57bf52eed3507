"""``python -m worldcup_cli``: the ``worldcup`` command."""

from worldcup_cli.main import main

main()
