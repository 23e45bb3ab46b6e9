"""Model families, a folder each: kimi_hybrid (Kimi Linear + early fusion), kimi_k3 (Kimi K3 as released).
hub_kimi.py saves a model's code as one flat folder (the import closure of its auto_map modules)."""
