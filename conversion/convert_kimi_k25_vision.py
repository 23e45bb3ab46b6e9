"""Assemble a hybrid text checkpoint and Kimi K2.5's vision tower into an early-fusion checkpoint (`--help` for the options).

The same command as `kimi-hf convert ...`; the text and the code live in kimi_hf.conversion.cli.
"""

import sys

from kimi_hf.conversion.cli import k25_vision_main as main


if __name__ == "__main__":
    main()
    sys.exit(0)
