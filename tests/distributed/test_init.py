"""kimi_hf.distributed exports every public name of its modules (their __all__), and nothing else."""

import importlib

import kimi_hf.distributed as distributed


def test_every_public_name_of_the_modules_is_exported():
    names = set()
    for module in distributed._MODULES:
        public = importlib.import_module(f"kimi_hf.distributed.{module}").__all__
        names |= set(public)
        for name in public:
            assert getattr(distributed, name) is getattr(
                importlib.import_module(f"kimi_hf.distributed.{module}"), name
            )
    assert names == set(distributed.__all__)
