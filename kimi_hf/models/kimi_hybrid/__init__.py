"""The hybrid KDA/MLA model family. This folder is copied flat into Hub repos as remote code, so
its modules import only torch/transformers and each other (`from .x import ...`)."""
