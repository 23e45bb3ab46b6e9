"""Kimi K3 (`moonshotai/Kimi-K3`) as released: its configs, the model classes (the Kimi Linear layers of
`kimi_hf.models.kimi_hybrid` with K3's options), the load-time conversion of its released layout and its state dict
(state_dict_kimi_k3: the routed experts' MXFP4 tensors written and read; the codec itself is `kimi_hf.ops.mxfp4`),
its image processor and processor, its chat template and reply parser.

Saved folders get these modules and those they use flattened into one folder (`kimi_hf.models.hub_kimi`)."""
