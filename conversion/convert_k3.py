"""Dequantise a Kimi K3 folder's MXFP4 routed experts into plain tensors, in the official K3 names (`--help` for the options).

The same command as `kimi-hf convert ...`; the text and the code live in kimi_hf.conversion.cli.
"""

import sys

from kimi_hf.conversion.cli import k3_main as main


if __name__ == "__main__":
    main()
    sys.exit(0)
