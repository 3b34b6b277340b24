"""Hugging Face models and tokenized text in the Hydra apps: ``model=hf model.path=DIR data=text``.

A tiny Llama-style model directory (config.json, safetensors, a word-level tokenizer) is built
here, without downloads. The app runs (train, fine-tune with CPU offload) and the bad inputs are
subprocesses started together (each pays ~6 s of imports); the text data module is tested in
this process.
"""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from lightning_3d.data import TokenizedTextDataModule  # noqa: E402
from lightning_3d.data.tokenized import find_text_files, read_documents, tokenize_documents  # noqa: E402
from tools.harness.apps import start_app, wait_all  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN, FINETUNE = str(REPO / "examples/train.py"), str(REPO / "examples/finetune.py")
WORDS = "the quick brown fox jumps over a lazy dog while seven small cats watch".split()
VOCAB = 32  # the model's; the tokenizer has len(WORDS) + 2 = 16 entries
MAX_POSITIONS = 64  # tiny_hf_config's max_position_embeddings
BLOCK, BATCH, SEED = 16, 4, 1234
# One process, 3 steps, validation once on one batch.
FAST = [
    "trainer.devices=1",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1",
    f"data.block_size={BLOCK}",
    f"data.batch_size={BATCH}",
    f"seed={SEED}",
]


def _sentence(i: int, n: int = 12) -> str:
    return " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(n))


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"])
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def _save_model(directory: Path) -> None:
    """A tiny random Llama whose LM head is scaled up: its first loss (~15) is far from a fresh
    init's (~ln 32), so a run that did not load these weights cannot pass for one that did."""
    from lightning_3d.models.hf import HFCausalLM
    from tools.harness.hf_configs import tiny_hf_config

    torch.manual_seed(7)
    model = HFCausalLM(config=tiny_hf_config("llama", vocab_size=VOCAB)).model
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    model.save_pretrained(directory)


def _save_encoder(directory: Path) -> None:
    """A BERT directory: transformers loads it as BertLMHeadModel, whose attention sees later tokens."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=MAX_POSITIONS,
    )
    transformers.BertForMaskedLM(config).save_pretrained(directory)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The model directory, broken copies of it, and text files."""
    root = tmp_path_factory.mktemp("hf")
    paths = {
        name: root / name
        for name in (
            "model",
            "no_config",
            "no_tokenizer",
            "corpus",
            "blank",
            "runs",
            "truncated",
            "reshaped",
            "encoder",
        )
    }
    for path in paths.values():
        path.mkdir()
    _save_model(paths["model"])
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["no_config"])  # weights and tokenizer, no config.json
    weights = (paths["model"] / "model.safetensors").read_bytes()
    (paths["no_config"] / "model.safetensors").write_bytes(weights)
    # Weights and config.json only.
    (paths["no_tokenizer"] / "model.safetensors").write_bytes(weights)
    (paths["no_tokenizer"] / "config.json").write_text((paths["model"] / "config.json").read_text())
    for name in ("truncated", "reshaped"):  # the model's files, then one of them broken
        tokenizer.save_pretrained(paths[name])
        (paths[name] / "config.json").write_text((paths["model"] / "config.json").read_text())
    (paths["truncated"] / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (paths["reshaped"] / "model.safetensors").write_bytes(weights)
    config = json.loads((paths["model"] / "config.json").read_text())
    (paths["reshaped"] / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    _save_encoder(paths["encoder"])
    tokenizer.save_pretrained(paths["encoder"])
    lines = [json.dumps({"text": _sentence(i)}) for i in range(300)]
    (paths["corpus"] / "a.jsonl").write_text("\n".join(lines) + "\n")
    (paths["corpus"] / "b.txt").write_text("\n".join(_sentence(i, 20) for i in range(60)))
    (paths["blank"] / "empty.txt").write_text("  \n\n")
    return paths


def _describe(proc):
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def _bad_cases(p):
    """name -> (overrides, substrings the one error line must contain)."""
    # Each case is valid but for one value (data.block_size fits the tiny model's 64 positions).
    model, text = f"model.path={p['model']}", f"data.path={p['corpus']}"
    block = f"data.block_size={BLOCK}"
    return {
        "no_config_json": (
            ["model=hf", f"model.path={p['no_config']}", "data=text", text, block],
            [str(p["no_config"]), "config.json"],
        ),
        "no_tokenizer": (
            ["model=hf", f"model.path={p['no_tokenizer']}", "data=text", text, block],
            [str(p["no_tokenizer"]), "data.tokenizer"],
        ),
        "empty_data_path": (
            ["model=hf", model, "data=text", "data.path=", block],
            ["data.path is empty"],
        ),
        "glob_matches_nothing": (
            ["model=hf", model, "data=text", f"data.path={p['corpus']}/*.csv", block],
            [f"{p['corpus']}/*.csv", "matches no file"],
        ),
        "no_text": (
            ["model=hf", model, "data=text", f"data.path={p['blank']}", block],
            [str(p["blank"]), "no text"],
        ),
        # 302 training windows of 17 tokens: 75 batches of 2 per rank (dp2); was a rank's error
        "val_check_interval_above_epoch": (
            [
                "model=hf",
                model,
                "data=text",
                text,
                block,
                f"data.batch_size={BATCH}",
                "trainer.val_check_interval=76",
            ],
            [
                "trainer.val_check_interval=76",
                "the 75 batches of an epoch",
                "302 training windows",
                f"data.batch_size={BATCH}",
            ],
        ),
        "block_size_above_positions": (
            ["model=hf", model, "data=text", text, "data.block_size=100"],
            ["data.block_size=100", str(MAX_POSITIONS)],
        ),
        "neither_path_nor_config": (
            ["model=hf", "data=text", text, block],
            ["model.path", "model.config"],
        ),
        "key_of_another_model": (
            ["model=hf", model, "+model.n_layer=2", "data=text", text, block],
            ["model.n_layer", "HFCausalLM"],
        ),
        "truncated_weights": (
            ["model=hf", f"model.path={p['truncated']}", "data=text", text, block],
            [str(p["truncated"] / "model.safetensors"), "truncated"],
        ),
        "weights_unlike_config": (
            ["model=hf", f"model.path={p['reshaped']}", "data=text", text, block],
            [
                str(p["reshaped"]),
                "differ in shape from its config.json",
                "[64, 32]",
                "config.json gives [48, 32]",
            ],
        ),
        "encoder_model": (
            ["model=hf", f"model.path={p['encoder']}", "data=text", text, block],
            ["BertLMHeadModel is an encoder", "not causal"],
        ),
        "attention_the_family_lacks": (
            [
                "model=hf",
                "model.config={model_type: gemma2, vocab_size: 256, "
                "hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
                "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, "
                "pad_token_id: 0}",
                "model.attn_implementation=sdpa",
                block,
            ],
            [
                "attn_implementation='sdpa' (model.attn_implementation in the app)",
                "Gemma2ForCausalLM",
            ],
        ),
    }


@pytest.fixture(scope="module")
def runs(files):
    """Every subprocess, started together: the train app, the fine-tune app and the bad inputs."""
    model = f"model.path={files['model']}"
    out = files["runs"]
    started = {
        "train": start_app(
            TRAIN,
            cwd=REPO,
            args=[
                "model=hf",
                model,
                "data=text",
                f"data.path={files['corpus']}",
                *FAST,
                f"hydra.run.dir={out / 'train'}",
            ],
        ),
        "finetune": start_app(
            FINETUNE,
            cwd=REPO,
            args=[
                "model=hf",
                model,
                "data=text",
                f"data.path={files['corpus']}/*.jsonl",
                "offload=cpu",
                *FAST,
                f"hydra.run.dir={out / 'finetune'}",
            ],
        ),
    }
    for name, (overrides, _) in _bad_cases(files).items():
        started[name] = start_app(TRAIN, cwd=REPO, args=[*overrides, f"hydra.run.dir={out / name}"])
    return wait_all(started, timeout=300)


def _first_loss(files, jsonl_only: bool) -> float:
    """Step 1's loss recomputed here: the directory's model on the app's first training batch."""
    from lightning_3d.models.hf import HFCausalLM

    path = f"{files['corpus']}/*.jsonl" if jsonl_only else str(files["corpus"])
    data = TokenizedTextDataModule(
        path=path, tokenizer=str(files["model"]), block_size=BLOCK, batch_size=BATCH, seed=SEED
    )
    data.setup_for(1, 0)
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        return HFCausalLM(path=str(files["model"]))._loss(batch)[0].item()


# ------------------------------------------------------------------ the apps
def test_train_app_from_model_directory(runs, files):
    proc = runs["train"]
    assert proc.returncode == 0, _describe(proc)
    assert "done: 3 steps" in proc.stdout, _describe(proc)
    summary = json.loads((files["runs"] / "train" / "summary.json").read_text())
    assert summary["steps"] == 3 and all(math.isfinite(x) for x in summary["losses"]), summary[
        "losses"
    ]
    # fp32: step 1 is exactly the directory's weights on the first packed batch.
    assert summary["losses"][0] == pytest.approx(_first_loss(files, jsonl_only=False), rel=1e-4)
    assert summary["losses"][0] > 2 * math.log(VOCAB)  # not a fresh init (~ln 32)
    assert (files["runs"] / "train" / "final.ckpt").is_file()


def test_finetune_app_offloads_from_model_directory(runs, files):
    proc = runs["finetune"]
    assert proc.returncode == 0, _describe(proc)
    assert f"fine-tuning from {files['model']}" in proc.stdout, _describe(proc)
    summary = json.loads((files["runs"] / "finetune" / "summary.json").read_text())
    assert summary["pretrained"] == str(files["model"].resolve())
    assert summary["offload"]["device"] == "cpu"
    assert summary["layout"]["precision"] == "bf16-mixed" and summary["layout"]["world_size"] == 1
    # The preset's full activation checkpointing.
    assert summary["ranks"][0]["checkpointed_blocks"] == 2
    assert summary["steps"] == 3 and all(math.isfinite(x) for x in summary["losses"])
    # bf16 autocast: close to, not equal to, the fp32 loss of the directory's weights.
    assert summary["losses"][0] == pytest.approx(_first_loss(files, jsonl_only=True), rel=3e-2)


@pytest.mark.parametrize(
    "case",
    [
        "no_config_json",
        "no_tokenizer",
        "empty_data_path",
        "glob_matches_nothing",
        "no_text",
        "val_check_interval_above_epoch",
        "block_size_above_positions",
        "neither_path_nor_config",
        "key_of_another_model",
        "truncated_weights",
        "weights_unlike_config",
        "encoder_model",
        "attention_the_family_lacks",
    ],
)
def test_bad_input_is_one_error_line(runs, files, case):
    proc = runs[case]
    _, named = _bad_cases(files)[case]
    assert proc.returncode == 2, _describe(proc)
    assert "Traceback" not in proc.stderr, _describe(proc)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: "), _describe(proc)
    for part in named:
        assert part in errors[0], (part, errors[0])
    assert not (files["runs"] / case).exists(), "a refused run left its run directory behind"


# ------------------------------------------------------------------ the text data module
def test_files_found_in_order(files, tmp_path):
    corpus = files["corpus"]
    assert find_text_files(str(corpus)) == [corpus / "a.jsonl", corpus / "b.txt"]
    assert find_text_files(f"{corpus}/*.txt") == [corpus / "b.txt"]
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="not .txt or .jsonl"):
        find_text_files(str(tmp_path / "x.csv"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has no string field 'text'"):
        list(read_documents([tmp_path / "bad.jsonl"]))


def test_text_that_is_not_text_is_refused_naming_file_and_offset(tmp_path):
    """A binary file named .txt and invalid UTF-8 used to be decoded with U+FFFD and trained on."""
    (tmp_path / "binary.txt").write_bytes(b"GIF89a\x01\x00\x00\x00")
    with pytest.raises(ValueError, match=r"binary.txt: not a text file \(a NUL byte at offset 7\)"):
        list(read_documents([tmp_path / "binary.txt"]))
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(
        ValueError,
        match=r"latin1.txt: not UTF-8 text: byte 0xe9 at offset 3 .*invalid_utf8=replace",
    ):
        list(read_documents([tmp_path / "latin1.txt"]))
    assert list(read_documents([tmp_path / "latin1.txt"], invalid_utf8="replace")) == [
        "caf\ufffd au lait"
    ]
    with pytest.raises(ValueError, match="invalid_utf8='ignore' must be one of"):
        list(read_documents([tmp_path / "latin1.txt"], invalid_utf8="ignore"))


def test_the_launchers_check_reads_every_line_not_one_batchs_worth(files, tmp_path):
    """Line 301 of a .jsonl lacks its text: named by the check in the launching process, although
    the first lines already hold enough tokens for a batch. (Before, only a batch's worth was read:
    every rank failed with a traceback.) A JSON string holding U+2028 is one line, not two."""
    from lightning_3d.data import TokenizedTextDataModule

    lines = [json.dumps({"text": " ".join(WORDS * 3) + "\u2028"}) for _ in range(300)] + [
        '{"body": "x"}'
    ]
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"big.jsonl:301 has no string field 'text'"):
        TokenizedTextDataModule.check(
            path=str(tmp_path / "big.jsonl"),
            tokenizer=str(files["model"]),
            block_size=8,
            batch_size=2,
        )


def test_the_launcher_counts_windows_as_the_ranks_split_them_and_no_further_than_needed(files):
    """``split_windows`` counts what ``setup_for`` cuts (exact with no ``enough``), and stops
    tokenizing once ``enough`` holds: a small interval is confirmed by the first documents."""
    options = {"path": str(files["corpus"]), "tokenizer": str(files["model"]), "block_size": BLOCK}
    data = TokenizedTextDataModule(**options, batch_size=BATCH)
    data.setup_for(1, 0)
    exact = (len(data.train_dataset), len(data.val_dataset))
    assert TokenizedTextDataModule.split_windows(**options) == exact == (302, 15)
    train, val = TokenizedTextDataModule.split_windows(
        **options, enough=lambda t, v: t >= 12 and v >= 4
    )
    assert 12 <= train < exact[0] and 4 <= val < exact[1]
    assert TokenizedTextDataModule.split_windows(**options, enough=lambda t, v: t > 302) == exact


def test_documents_joined_with_eos_and_packed(files, tmp_path):
    (tmp_path / "a.txt").write_text("the quick fox\n")
    (tmp_path / "b.jsonl").write_text(
        '{"text": "a lazy dog"}\n\n{"text": "   "}\n{"text": "seven cats"}\n'
    )
    tokenizer = _tokenizer()
    ids = {w: tokenizer.convert_tokens_to_ids(w) for w in WORDS}
    eos = tokenizer.eos_token_id
    expected = [
        ids["the"],
        ids["quick"],
        ids["fox"],
        eos,
        ids["a"],
        ids["lazy"],
        ids["dog"],
        eos,
        ids["seven"],
        ids["cats"],
        eos,
    ]  # files sorted, blank documents skipped
    docs = read_documents(find_text_files(str(tmp_path)))
    assert tokenize_documents(docs, tokenizer).tolist() == expected
    assert (
        tokenize_documents(
            read_documents(find_text_files(str(tmp_path))), tokenizer, max_tokens=5
        ).tolist()
        == expected[:5]
    )

    data = TokenizedTextDataModule(
        path=str(files["corpus"]),
        tokenizer=str(files["model"]),
        block_size=BLOCK,
        batch_size=BATCH,
        val_fraction=0.1,
    )
    tokens = data.load_data()
    data.setup_for(1, 0)
    n_val = int(len(tokens) * 0.1)
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val :]
    assert len(data.train_dataset) == (len(train) - BLOCK - 1) // BLOCK + 1
    assert len(data.val_dataset) == (len(val) - BLOCK - 1) // BLOCK + 1
    for dataset, split in ((data.train_dataset, train), (data.val_dataset, val)):
        for i in (0, len(dataset) - 1):
            x, y = dataset[i]
            assert x.dtype == torch.int64 and x.shape == (BLOCK,)
            assert x.tolist() == split[i * BLOCK : i * BLOCK + BLOCK].tolist()
            # Shifted by one.
            assert y.tolist() == split[i * BLOCK + 1 : i * BLOCK + BLOCK + 1].tolist()
    # 300 lines + one .txt.
    assert int(tokens.max()) < len(tokenizer) and (tokens == eos).sum() == 300 + 1


def test_text_loader_resumes_mid_epoch(files):
    def loader(dp_rank=0):
        data = TokenizedTextDataModule(
            path=str(files["corpus"]),
            tokenizer=str(files["model"]),
            block_size=BLOCK,
            batch_size=BATCH,
            seed=SEED,
        )
        data.setup_for(2, dp_rank)
        return data.train_dataloader()

    first = loader()
    batches = iter(first)
    taken = [next(batches) for _ in range(3)]
    state = first.state_dict()
    assert state == {
        "epoch": 0,
        "samples": 3 * BATCH,
        "dataset_size": len(first.dataset),
        "seed": SEED,
    }
    resumed = loader()
    resumed.load_state_dict(state)
    expected = [next(batches) for _ in range(2)]  # batches 4 and 5 of the uninterrupted epoch
    got = list(zip(iter(resumed), range(2)))
    for (a, _), b in zip(got, expected):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(got[0][0][0], taken[0][0])  # not the epoch's start again


# ------------------------------------------------------------------ configs, in this process
def _compose(overrides, name="train"):
    from hydra import compose, initialize_config_dir

    from lightning_3d.app.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(name, overrides=overrides)


def test_model_configs_carry_only_their_own_keys(files):
    from lightning_3d.app.config import check_target_keys
    from lightning_3d.app.run import check_model_and_data

    cfg = _compose(["model._target_=lightning_3d.models.HFCausalLM"])  # the reference GPT's keys
    keys = r"model.block_size, model.dropout, .*not parameters of .*HFCausalLM"
    with pytest.raises(ValueError, match=keys):
        check_target_keys(cfg.model, "model")
    gpt = _compose([])
    assert gpt.data.block_size == gpt.model.block_size == 128
    check_model_and_data(gpt.model, gpt.data)  # the default job is untouched
    hf = _compose(
        [
            "model=hf",
            "model.config={model_type: llama, vocab_size: 300, max_position_embeddings: 64}",
            "data.block_size=64",
        ]
    )
    assert "block_size" not in hf.model and "n_layer" not in hf.model
    check_model_and_data(hf.model, hf.data)  # a random-init Hugging Face model on the byte corpus
    small = _compose(["model=hf", f"model.path={files['model']}", f"data.block_size={BLOCK}"])
    with pytest.raises(ValueError, match=r"vocabulary of 256 but the model has vocab_size=32"):
        check_model_and_data(small.model, small.data)  # bytes do not fit a 32-token vocabulary
    text = _compose(
        ["model=hf", f"model.path={files['model']}", "data=text", f"data.path={files['corpus']}"]
    )
    assert text.data.tokenizer == str(files["model"])  # the model directory's tokenizer by default


def test_finetune_preset_starts_from_the_model_directory(files):
    from lightning_3d.app.finetune import prepare

    cfg = _compose(
        ["model=hf", f"model.path={files['model']}", "data=text", f"data.path={files['corpus']}"],
        name="finetune",
    )
    assert prepare(cfg, REPO) == files["model"].resolve() and cfg.finetune.pretrained is None
    cfg = _compose(
        ["model=hf", "model.config={model_type: llama}", "finetune.pretrained=null"],
        name="finetune",
    )
    assert prepare(cfg, REPO) is None  # a random init, nothing loaded


def test_layout_checked_against_the_directory_model_on_meta(files):
    """``from_pretrained`` refuses the meta device: the launcher builds the directory's model from
    its config.json instead, so the tensor-parallel plan and the pipeline split are checked too."""
    from lightning_3d.app.run import validate

    # (An epoch of the corpus is 75 batches: the default val_check_interval=100 is refused.)
    base = [
        "model=hf",
        f"model.path={files['model']}",
        "data=text",
        f"data.path={files['corpus']}",
        f"data.block_size={BLOCK}",
        f"data.batch_size={BATCH}",
        "trainer.val_check_interval=25",
    ]
    with pytest.raises(ValueError, match=r"self_attn.k_proj: heads 2 is not divisible by tensor=4"):
        validate(_compose([*base, "parallelism.tensor=4", "trainer.devices=4"]))
    with pytest.raises(ValueError, match=r"'model.model.layers.5' names no module"):
        validate(
            _compose(
                [
                    *base,
                    "parallelism=pp2",
                    "parallelism.split=[model.model.layers.5]",
                    "trainer.devices=2",
                ]
            )
        )
    validate(_compose([*base, "parallelism=tp2", "trainer.devices=2"]))


def test_tie_split_by_the_plan_is_refused_before_launch():
    """Tied embedding and head that a plan would shard along different dimensions: refused in
    the launching process (on the meta model), not on the ranks."""
    from lightning_3d.app.run import validate

    config = (
        "model.config={model_type: qwen2, vocab_size: 256, hidden_size: 32, intermediate_size: 64, "
        "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64, "
        "tie_word_embeddings: true}"
    )
    base = ["model=hf", config, "data.block_size=32", "parallelism.tensor=2", "trainer.devices=2"]
    validate(_compose(base))  # the built-in plan splits both on the vocabulary: one parameter
    cfg = _compose(base)  # (Hydra's override grammar takes no "*" in dict keys: set the plan here)
    cfg.parallelism.tp_plan = {"*embed_tokens": "vocab", "*lm_head": "rowwise"}
    with pytest.raises(
        ValueError,
        match=r"tied parameters model.model.embed_tokens.weight \(split on dim 0\), "
        r"model.lm_head.weight \(split on dim 1\) would be sharded differently",
    ):
        validate(cfg)
