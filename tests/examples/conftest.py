import pytest


@pytest.fixture(scope="session")
def quickstart_model(tmp_path_factory):
    """A tiny multimodal model + processor saved by the quickstart (a few steps), for the examples."""
    from kimi_hf.quickstart import run_quickstart

    out = tmp_path_factory.mktemp("quickstart")
    return run_quickstart(
        str(out),
        size="tiny",
        steps=4,
        batch_size=4,
        text_examples_n=24,
        image_examples_n=24,
        eval_images=4,
        progress=False,
    ).model_dir
