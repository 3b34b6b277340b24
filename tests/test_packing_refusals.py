"""Packed chat rows refused, before any work, for a model that would let their conversations
see each other: in the app's launcher (the model built on meta) and in the library (the data
module's ``setup``, before a row is built). The families themselves: test_hf_families.py."""

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

REFUSAL = r"data.packing=true would let conversations of a packed row see each other: "
HYBRID = r"Qwen3_5ForCausalLM: layers 0, 2 mix tokens in Qwen3_5GatedDeltaNet"


def _write_model(root: Path, family: str) -> dict[str, str]:
    """A tiny random ``family`` model directory with the chat files' tokenizer, and the chats."""
    import torch
    from transformers import AutoTokenizer

    from lightning_3d.models.hf import build_hf_model
    from support.chat_files import write_chat_files
    from tools.harness.hf_configs import tiny_config

    files = write_chat_files(root)
    torch.manual_seed(0)
    build_hf_model(None, tiny_config(family, vocab_size=32)).save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(files["tokenizer"]).save_pretrained(root / "model")
    return {"model": str(root / "model"), "chats": files["path"]}


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from lightning_3d.app.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("finetune", overrides=overrides)


def test_the_launcher_refuses_packing_for_a_linear_attention_hybrid(tmp_path):
    """``model=hf model.path=<Qwen3.5> data=chat``: refused in the launching process, naming
    the layer class and the way out; ``data.packing=false`` is accepted. (Seen failing: the
    launcher had no check, and the run trained conversations that saw each other.)"""
    from lightning_3d.app.run import validate

    files = _write_model(tmp_path, "qwen3_5_text")
    base = [
        "model=hf",
        f"model.path={files['model']}",
        "data=chat",
        f"data.path={files['chats']}",
        "data.block_size=48",
        "data.batch_size=2",
        "data.val_fraction=0.2",
        "offload=none",
        "finetune.pretrained=null",
        "trainer.val_check_interval=10",
    ]
    with pytest.raises(ValueError, match=REFUSAL + HYBRID) as err:
        validate(_compose(base))
    assert str(err.value).endswith("Set data.packing=false (one conversation per row, padded)")
    validate(_compose([*base, "data.packing=false"]))


@pytest.mark.parametrize("family, refused", [("qwen3_5_text", True), ("llama", False)])
def test_the_data_module_refuses_packing_at_setup_before_reading_a_row(family, refused):
    """Outside the app (``Trainer.fit(model, datamodule=ChatDataModule(...))``): the data
    module's ``setup`` checks the Trainer's model before it reads the files (here: none exist,
    so an accepted model gets as far as the missing file). (Seen failing: nothing refused.)"""
    import torch

    from lightning_3d.data.chat import ChatDataModule
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_config

    with torch.device("meta"):
        module = HFCausalLM(config=tiny_config(family))
    data = ChatDataModule(path="/nonexistent/chats.jsonl", tokenizer="/nonexistent", batch_size=2)
    data.trainer = SimpleNamespace(
        lightning_module=module, strategy=None, world_size=1, global_rank=0
    )
    if refused:
        with pytest.raises(ValueError, match=REFUSAL + HYBRID):
            data.setup("fit")
    else:
        with pytest.raises(Exception) as err:
            data.setup("fit")
        assert "packing" not in str(err.value)
    ChatDataModule(path="x", tokenizer="y", packing=False).check_model(module, packing=False)
