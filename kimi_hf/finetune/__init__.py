"""Fine-tuning Kimi K3 (and Kimi Linear) on a user's data: the library behind `kimi-hf finetune`.

- `data`: datasets in TRL's formats (conversational `messages` with tools, prompt-completion, text) from local
  files or a `datasets` object, rendered with the model's chat template, the loss on the assistant's tokens
  (`load_sft_rows` checks every row first, `tokenize_sft_rows` makes `Documents`, `split_sft_rows` holds some out);
- `packing`: fixed-length rows with document boundaries carried to the model (position ids restarting per
  document), the same global batch for every layout (`PackedDataset.global_batch(step, rows)`).

The parallel layout, the rank's model and the train step live in `kimi_hf.distributed` (torchtitan's shape)."""
