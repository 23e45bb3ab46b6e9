"""kimi_hf.distributed exports every public name of its modules (their __all__), and nothing else."""

import importlib

import kimi_hf.distributed as distributed


def test_every_public_name_of_the_modules_is_exported():
    names = set()
    modules = ("pipeline", "parallel_dims", "parallelize", "train_step", "clip", "context", "checkpoint", "export")
    modules += ("lora",)
    for module in modules:
        module = importlib.import_module(f"kimi_hf.distributed.{module}")
        names |= set(module.__all__)
        assert all(getattr(distributed, name) is getattr(module, name) for name in module.__all__), module
    assert names == set(distributed.__all__) and len(names) == len(distributed.__all__)
    assert {"load_pipeline_stage", "ParallelDims", "export_lora", "save_checkpoint", "init_lora_by_name"} <= names
    assert {"parallelize", "train_step", "ParallelModel"} <= names
