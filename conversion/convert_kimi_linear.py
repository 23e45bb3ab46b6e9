"""Convert Kimi Linear checkpoints between Moonshot's / transformers' naming and kimi_hf's (`--help` for the options).

The same command as `kimi-hf convert ...`; the text and the code live in kimi_hf.conversion.cli.
"""

import sys

from kimi_hf.conversion.cli import kimi_linear_main as main


if __name__ == "__main__":
    main()
    sys.exit(0)
