"""Online training: packed rows, the base's targets computed inside the step, the label kinds, time limits."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

from clover_hf import CloverForCausalLM
from clover_hf.heads.base import document_ids
from clover_hf.tools.cli import main as cli_main
from clover_hf.training.features import Example, base_targets, tokenize_records
from clover_hf.training.packing import PackedRows
from clover_hf.training.trainer import STOPPED_EXIT_CODE, TrainConfig, Trainer, lr_lambda

from .test_training import _args, _chats
from .tiny import prompt, save_tiny_base, tiny_model


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return save_tiny_base(tmp_path_factory.mktemp("base"))


def _examples(lengths: list[int]) -> list[Example]:
    return [Example(prompt(i, n)[0].tolist(), [0] * 2 + [1] * (n - 2)) for i, n in enumerate(lengths)]


def test_packing_keeps_examples_whole_and_fills_rows_tightly():
    examples = _examples([30, 20, 10, 25, 15, 40, 5])
    rows = PackedRows.pack(examples, length=40, pad_id=0)
    assert rows.input_ids.shape[1] == 40 and len(rows) == 4  # 145 tokens: best fit needs 4 rows of 40
    assert rows.tokens == 145 == int(rows.lengths.sum())
    found = []
    for r in range(len(rows)):
        pos, ids, mask = rows.position_ids[r], rows.input_ids[r], rows.loss_mask[r]
        starts = (pos == 0).nonzero().flatten().tolist() + [40]
        for a, b in zip(starts, starts[1:]):
            assert torch.equal(pos[a:b], torch.arange(b - a, dtype=pos.dtype))
            if a < rows.lengths[r]:
                found.append(ids[a:b].tolist())
                assert mask[a:b].tolist() == [0, 0] + [1] * (b - a - 2)
            else:  # padding: after the examples, nothing to learn
                assert not mask[a:b].any() and not ids[a:b].any()
    assert sorted(found) == sorted(e.input_ids for e in examples)
    long = PackedRows.pack(_examples([50]), length=40, pad_id=0)  # cut to the row length
    assert long.tokens == 40 and long.input_ids[0].tolist() == prompt(0, 50)[0, :40].tolist()


def test_packed_rows_save_load_and_counts(tmp_path):
    rows = PackedRows.pack(_examples([12, 9, 7]), length=16, pad_id=3)
    rows.save(tmp_path / "p.safetensors")
    again = PackedRows.load(tmp_path / "p.safetensors")
    for name in ("input_ids", "loss_mask", "position_ids", "lengths"):
        assert torch.equal(getattr(rows, name), getattr(again, name))
    assert again.count_tokens([0, 1]) == rows.tokens == 28
    counts = again.token_counts(256)
    assert int(counts.sum()) == 28 - 2 * 3  # targets only: two prompt tokens per example are masked out
    batch = again.batch([1])
    assert batch["input_ids"].dtype == torch.long and batch["loss_mask"].dtype == torch.bool


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
def test_base_sees_each_packed_example_alone(model_type):
    """The targets of a packed row equal those of each example run by itself: the base's own packed-sequence
    mask (positions restarting at 0) keeps examples apart. Fails loudly if transformers stops doing so."""
    base = tiny_model(model_type)
    examples = _examples([11, 7, 9])
    rows = PackedRows.pack(examples, length=27, pad_id=0)
    assert len(rows) == 1
    packed = base_targets(base, rows.input_ids.long(), 4, rows.position_ids.long(), full=True)
    at = 0
    for ex in examples:  # best fit put them in order here: one row, each where the last ended
        n = len(ex.input_ids)
        alone = base_targets(base, torch.tensor([ex.input_ids]), 4, full=True)
        torch.testing.assert_close(packed["hidden"][0, at : at + n], alone["hidden"][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(packed["target_logits"][0, at : at + n], alone["target_logits"][0],
                                   rtol=1e-4, atol=1e-4)
        assert torch.equal(packed["topk_ids"][0, at : at + n], alone["topk_ids"][0])
        at += n


def test_heads_see_each_packed_example_alone():
    """The heads' teacher-forced outputs on a packed row equal those on each example alone (the Augmenting
    Block attends within an example, with positions of its own)."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, num_heads=3)
    heads = clover.clover_heads
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # fresh heads are near the identity; make every part count
    examples = _examples([10, 8])
    rows = PackedRows.pack(examples, length=18, pad_id=0)
    ids, pos = rows.input_ids.long(), rows.position_ids.long()
    embed = base.get_input_embeddings()
    with torch.no_grad():
        h = base_targets(base, ids, 2, pos)["hidden"]
        packed = heads(h[:, :-1], embed(ids[:, 1:]), pos[:, :-1])
        first = torch.tensor([examples[0].input_ids])
        h0 = base_targets(base, first, 2)["hidden"]
        alone = heads(h0[:, :-1], embed(first[:, 1:]))
    for i, (p, a) in enumerate(zip(packed, alone)):
        n = a.shape[1]  # positions of the first example whose target lies inside it
        torch.testing.assert_close(p[:, :n], a, rtol=1e-4, atol=1e-5, msg=f"head {i}")
    # and the second example, which starts at position 10 of the row
    second = torch.tensor([examples[1].input_ids])
    with torch.no_grad():
        h1 = base_targets(base, second, 2)["hidden"]
        alone = heads(h1[:, :-1], embed(second[:, 1:]))
    for i, (p, a) in enumerate(zip(packed, alone)):
        torch.testing.assert_close(p[:, 10 : 10 + a.shape[1]], a, rtol=1e-4, atol=1e-5, msg=f"head {i}")


def _online_trainer(tmp_path, labels: str, draft_vocab_size: int | None = 64, **config):
    base = tiny_model("llama").requires_grad_(False)
    clover = CloverForCausalLM.from_base(base, num_heads=3, draft_vocab_size=draft_vocab_size)
    rows = PackedRows.pack(_examples([20, 14, 9, 17, 12, 22, 8, 16]), length=32, pad_id=0)
    settings = dict(output_dir=str(tmp_path / "o"), max_steps=6, batch_size=2, eval_fraction=0, save_every=100,
                    eval_every=0, warmup_steps=1, labels=labels)
    settings.update(config)
    return Trainer(TrainConfig(**settings), clover.clover_heads, base, rows, top_k=4), rows


def test_targets_never_cross_examples(tmp_path):
    """Only positions whose target lies in their own example count: with packing, each example loses as
    many targets per head as it would alone."""
    trainer, rows = _online_trainer(tmp_path, "top_k", draft_vocab_size=None)  # every target can be drafted
    batch = trainer._device_batch(list(range(len(rows))))
    _, stats = trainer._losses(batch)
    examples = _examples([20, 14, 9, 17, 12, 22, 8, 16])
    for i, st in enumerate(stats):  # mask [0, 0, 1, ...]: targets x_{t+2+i} at t+2+i >= 2 and inside the example
        assert st["n"] == sum(len(e.input_ids) - 2 - i for e in examples)
    assert torch.equal(document_ids(torch.tensor([[0, 1, 2, 0, 1, 0]])), torch.tensor([[1, 1, 1, 2, 2, 3]]))


@pytest.mark.parametrize("labels", ["top_k", "full", "data"])
def test_online_training_learns_with_each_label_kind(tmp_path, labels):
    trainer, rows = _online_trainer(tmp_path, labels)
    base_before = {k: v.clone() for k, v in trainer.base.state_dict().items()}
    batch = trainer._device_batch([0, 1, 2])
    first, _ = trainer._losses(batch)
    trainer.train(log=lambda *_: None)
    last, _ = trainer._losses(batch)
    assert last.item() < first.item()
    assert all(torch.equal(v, base_before[k]) for k, v in trainer.base.state_dict().items())


def test_label_kinds_are_the_losses_they_name(tmp_path):
    """'full' is the cross-entropy against the base's whole distribution over the draft vocabulary, 'data'
    against the data's next token."""
    trainer, rows = _online_trainer(tmp_path, "full", feature_loss_weight=0.0, head_decay=1.0)
    batch = trainer._device_batch([0, 1])
    full, _ = trainer._losses(batch)
    heads = trainer.heads
    x, h = batch["input_ids"], batch["hidden"]
    outs = heads(h[:, :-1], trainer.embed(x[:, 1:]), batch["position_ids"][:, :-1])
    docs = document_ids(batch["position_ids"])
    want_full, want_data = 0.0, 0.0
    for i, u in enumerate(outs):
        L = u.shape[1]
        valid = batch["loss_mask"][:, 2 + i : 2 + i + L] & (docs[:, 2 + i : 2 + i + L] == docs[:, :L])
        logp = (u[valid] @ trainer.lm_weight.T).log_softmax(-1)
        p = batch["target_logits"][:, 1 + i : 1 + i + L][valid].softmax(-1)
        want_full += -(p * logp).sum(-1).mean()
        tgt = trainer.full_to_draft[x[:, 2 + i : 2 + i + L][valid]]
        inside = tgt >= 0
        want_data += -logp[inside].gather(-1, tgt[inside, None]).mean()
    torch.testing.assert_close(full, want_full, rtol=1e-5, atol=1e-6)
    trainer.config.labels = "data"
    data, _ = trainer._losses(batch)
    torch.testing.assert_close(data, want_data, rtol=1e-5, atol=1e-6)


def test_cosine_schedule_and_epochs():
    assert lr_lambda(0, 2, 10, "cosine") == 0.5 and lr_lambda(2, 2, 10, "cosine") == 1.0
    assert math.isclose(lr_lambda(6, 2, 10, "cosine"), 0.5) and lr_lambda(10, 2, 10, "cosine") == 0.0
    assert math.isclose(lr_lambda(6, 2, 10, "linear"), 0.5) and lr_lambda(4, 2, 10, "linear") == 0.75
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(output_dir="x", schedule="step")
    with pytest.raises(ValueError, match="labels"):
        TrainConfig(output_dir="x", labels="soft")


def test_full_labels_need_online_training(tmp_path, tiny_base, cli_error):
    assert re.search("--online", cli_error(_args(tiny_base, _chats(tmp_path / "c.jsonl"), tmp_path / "o", labels="full")))


def test_cli_online_trains_packs_once_and_stops_at_its_time_limit(tiny_base, tmp_path):
    """--online packs the chats once, trains for --epochs, and resumes exactly after --max-minutes."""
    data = _chats(tmp_path / "chats.jsonl")
    common = {"online": None, "labels": "full", "epochs": "3", "max-length": "96"}
    straight = tmp_path / "straight"
    assert cli_main(_args(tiny_base, data, straight, **common)) == 0
    (packed,) = straight.glob("packed-*-L96.safetensors")
    rows = PackedRows.load(packed)
    metrics = json.loads((straight / "heads" / "training_metrics.json").read_text())
    train_rows = len(rows) - int(len(rows) * 0.05)
    assert metrics["training"]["steps"] == math.ceil(3 * train_rows / 4)
    assert metrics["training"]["tokens"] == rows.tokens and metrics["train_config"]["labels"] == "full"
    clover = CloverForCausalLM.from_pretrained(straight / "heads")
    ids = prompt(3)
    assert torch.equal(clover.generate(ids, max_new_tokens=20, do_sample=False, budget="full"),
                       clover.base_model.generate(ids, max_new_tokens=20, do_sample=False))

    stopped = tmp_path / "stopped"
    assert cli_main(_args(tiny_base, data, stopped, **common, **{"max-minutes": "0"})) == STOPPED_EXIT_CODE
    assert not (stopped / "heads").exists()
    assert [p.name for p in (stopped / "checkpoints").iterdir()] == ["step-0000001"]
    mtime = next(stopped.glob("packed-*")).stat().st_mtime
    assert cli_main(_args(tiny_base, data, stopped, **common)) == 0
    assert next(stopped.glob("packed-*")).stat().st_mtime == mtime  # tokenized and packed once
    a, b = load_file(straight / "heads" / "model.safetensors"), load_file(stopped / "heads" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_online_refuses_cached_features(tiny_base, tmp_path, cli_error):
    assert re.search("--extra-features", cli_error(_args(tiny_base, _chats(tmp_path / "c.jsonl"), tmp_path / "o",
                       **{"online": None, "extra-features": str(tmp_path)})))


def test_tokenizing_in_worker_processes_gives_the_same_examples(tiny_base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    records = [[{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"answer {i} " * (i % 7 + 1)}]
               for i in range(140)] + ["plain text record number one"]
    one = tokenize_records(records, tok, 64)
    two = tokenize_records(records, tok, 64, workers=2)
    assert len(one) == 141 and one == two


def test_train_minutes_cuts_the_run_to_what_fits_and_a_resumed_run_keeps_that_length(tmp_path):
    trainer, _ = _online_trainer(tmp_path, "top_k", max_steps=40, train_minutes=2.0, save_every=4, warmup_steps=10)
    clock = iter(range(0, 10**6, 10))  # the trainer reads its clock once a step: each step takes 10 s
    trainer.clock = lambda: float(next(clock))
    logged = []
    trainer.train(log=logged.append)
    # steps 3 to 8 took 10 s each, so 2 minutes hold 12 steps
    assert trainer.step == trainer.total_steps == 12 and any("12 steps fit" in line for line in logged)
    state = json.loads((trainer.checkpoints()[-1] / "trainer_state.json").read_text())
    assert state["total_steps"] == 12 and state["fitted"]
    again, _ = _online_trainer(tmp_path, "top_k", max_steps=40, train_minutes=2.0, save_every=4, warmup_steps=10)
    assert again.resume() and again.total_steps == 12 and again.fitted


def test_online_training_over_two_processes(tiny_base, tmp_path):
    """accelerate launch with --online: one process packs the rows, both run the base over their share of
    each batch, and the heads come out loadable and exact."""
    import os
    import subprocess

    from .test_training import REPO, two_process_launch

    data = _chats(tmp_path / "chats.jsonl")
    out = tmp_path / "ddp"
    cmd = [*two_process_launch(), "-m", "clover_hf.tools.cli",
           *_args(tiny_base, data, out, **{"online": None, "labels": "full", "max-length": "96", "max-steps": "6"})]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    assert len(list(out.glob("packed-*.safetensors"))) == 1
    metrics = json.loads((out / "heads" / "training_metrics.json").read_text())
    assert metrics["training"]["processes"] == 2 and metrics["training"]["steps"] == 6
    clover = CloverForCausalLM.from_pretrained(out / "heads")
    ids = prompt(2)
    assert torch.equal(clover.generate(ids, max_new_tokens=16, do_sample=False, budget="full"),
                       clover.base_model.generate(ids, max_new_tokens=16, do_sample=False))
