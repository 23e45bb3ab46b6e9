"""Kimi K3 (`moonshotai/Kimi-K3`) as released: its configs, the model classes (the Kimi Linear layers of
`kimi_hf.models.kimi_hybrid` with K3's options), the load-time conversion of its released layout and the MXFP4
codec of its routed experts, its image processor and processor, its chat template and reply parser.

Saved folders get these modules and those they use flattened into one folder (`kimi_hf.models.hub_kimi`)."""
