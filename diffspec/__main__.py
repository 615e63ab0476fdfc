"""``python -m diffspec``: the same command line as the ``diffspec`` console script."""

from diffspec.cli import main

raise SystemExit(main())
