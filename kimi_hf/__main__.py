"""`python -m kimi_hf ...` = the `kimi-hf` command."""

import sys

from .cli import main


sys.exit(main())
