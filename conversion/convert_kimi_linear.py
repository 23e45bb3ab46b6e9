"""Convert Kimi Linear checkpoints between Moonshot's / transformers' `kimi_linear` naming and kimi_hf's.

    python conversion/convert_kimi_linear.py SRC_DIR DST_DIR [--dtype bfloat16] [--max-shard-size 5GB] [--verify]

The direction follows SRC's config.json: model_type "kimi_linear" (Moonshot's original checkpoints,
and what transformers' own save_pretrained writes) converts to ours; "kimi_hybrid_text" converts back
to Moonshot's naming, which transformers' native KimiLinearForCausalLM loads. Streaming: one layer at
a time (its routed experts stacked), output in shards of at most --max-shard-size with
model.safetensors.index.json; the peak memory is printed. The output is written to a temporary
directory and renamed at the end: a failed or interrupted run leaves no output and never touches SRC.
--verify loads SRC and the result (the first --verify-layers layers; 0 = all) in a fresh process and
compares their logits.
"""

import sys

from kimi_hf.conversion.cli import kimi_linear_main as main

if __name__ == "__main__":
    main()
    sys.exit(0)
