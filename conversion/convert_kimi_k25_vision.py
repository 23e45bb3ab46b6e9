"""Assemble an early-fusion checkpoint: a hybrid KDA/MLA text checkpoint + Kimi K2.5's vision tower.

    python conversion/convert_kimi_k25_vision.py TEXT_DIR K25_DIR DST_DIR [--image-token-id N] [--dtype bfloat16]

TEXT_DIR: kimi_hf's `kimi_hybrid_text` or a Kimi Linear checkpoint (Moonshot / transformers naming).
K25_DIR: a Kimi K2.5 checkpoint (Moonshot's naming, or what transformers' kimi_k25 saves); only its
vision tower and projector are read. Output: KimiHybridForConditionalGeneration (config + sharded
safetensors + the text checkpoint's tokenizer files), written atomically. Streaming, one tensor at a
time. K2.5's projector maps to 7168 (DeepSeek-V3's hidden): with another text hidden size its last
layer is left out and initialised at load time (a note says so).
"""

import sys

from kimi_hf.conversion.cli import k25_vision_main as main

if __name__ == "__main__":
    main()
    sys.exit(0)
