"""``python -m cupyflash``: see :mod:`cupyflash.cli`."""

from .cli import main

raise SystemExit(main())
