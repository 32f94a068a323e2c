"""Unit tests of the data pipeline (framework.rank.data): corpus, tokenizer, token cache, windows,
the step-exact batch sampler and the Lightning DataModule. CPU only; small corpora."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.base.config.schema import ConfigError, DataConfig
from framework.base.data import tokens as tokens_mod
from framework.base.data.corpus import list_sources, read_corpus, split_documents
from framework.base.data.dataset import WindowDataset
from framework.base.data.tokenizer import EOT
from framework.base.data.tokens import TokenCache, load_token_cache, prepare_data
from framework.rank.data import StepBatchSampler, TextDataModule

# ------------------------------------------------------------------------------ fixtures

_WORDS = (
    "the model reads a batch of tokens and predicts the next one while the optimizer "
    "updates every weight after gradients are reduced across data parallel ranks so "
    "that each step sees the same global batch whatever the split"
).split()


def _real_text(i: int, n_words: int = 300) -> str:
    """Deterministic English-like paragraphs with code-like lines (a few KB)."""
    rng = random.Random(i)
    lines = []
    for _ in range(n_words // 12):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(12)).capitalize() + ".")
        if rng.random() < 0.3:
            lines.append(f"    def step_{rng.randint(0, 99)}(x):\n        return x * {rng.randint(1, 9)}\n")
    return "\n".join(lines) + "\n"


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for i in range(12):
        (d / ("sub" if i % 3 == 0 else "") / f"doc{i:02d}.txt").write_text(_real_text(i), encoding="utf-8")
    return d


def _text_cfg(text_dir: Path, tmp_path: Path, **kw) -> DataConfig:
    base = dict(
        name="text_files",
        paths=[str(text_dir / "**" / "*.txt")],
        vocab_size=300,
        val_fraction=0.2,
        seq_len=16,
        cache_dir=str(tmp_path / "cache"),
    )
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory) -> tuple[DataConfig, TokenCache]:
    """The default source, capped to ~300 KB of stdlib code, vocab 512 (built once)."""
    cfg = DataConfig(max_bytes=300_000, vocab_size=512, seq_len=32, cache_dir=str(tmp_path_factory.mktemp("c")))
    return cfg, prepare_data(cfg, progress=False)


# -------------------------------------------------------------------------------- corpus


def test_stdlib_listing_sorted_capped_and_excludes_site_packages():
    cfg = DataConfig(max_bytes=300_000)
    listing = list_sources(cfg)
    rels = [f.rel for f in listing.files]
    assert rels == sorted(rels) and len(rels) > 2
    assert all(r.endswith(".py") for r in rels)
    assert not any("site-packages" in f.path or "dist-packages" in f.path for f in listing.files)
    assert 200_000 < listing.total_bytes <= 300_000
    assert list_sources(cfg) == listing  # deterministic
    full = list_sources(DataConfig())
    assert len(full.files) > 500 and not any("site-packages/" in f.rel for f in full.files)


def test_split_is_deterministic_nonempty_and_order_independent(text_dir, tmp_path):
    cfg = _text_cfg(text_dir, tmp_path)
    a, b = read_corpus(cfg), read_corpus(cfg)
    assert (a.train, a.val) == (b.train, b.val)
    assert len(a.val) == round(12 * 0.2) and len(a.train) == 12 - len(a.val)
    assert not set(a.train) & set(a.val)

    docs = [(f"f{i}", f"text {i}") for i in range(50)]
    train, val = split_documents(docs, 0.1)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    train2, val2 = split_documents(shuffled, 0.1)
    assert set(val) == set(val2) and len(val) == 5 and set(train) == set(train2)
    assert val == [t for _, t in docs if t in set(val)]  # corpus order kept
    # a tiny corpus still gets one val document
    assert len(split_documents(docs[:3], 0.01)[1]) == 1
    with pytest.raises(ConfigError, match="at least 2"):
        split_documents(docs[:1], 0.1)


def test_missing_glob_and_folder_only_glob_are_config_errors(tmp_path):
    with pytest.raises(ConfigError) as e:
        list_sources(DataConfig(name="text_files", paths=["/nonexistent-dir/*.txt"]))
    assert str(e.value) == "data.paths: no file matches '/nonexistent-dir/*.txt'"
    (tmp_path / "only_dirs" / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="matches only folders"):
        list_sources(DataConfig(name="text_files", paths=[str(tmp_path / "only_dirs" / "*")]))
    with pytest.raises(ConfigError, match="smaller than every file"):
        list_sources(DataConfig(max_bytes=1))


def test_text_files_must_be_utf8(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 latin-1 " * 10)
    with pytest.raises(ConfigError, match=r"b\.txt is not UTF-8"):
        read_corpus(DataConfig(name="text_files", paths=[str(tmp_path / "*.txt")]))


def test_jsonl_bad_field_and_bad_json_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a fine document"}\n\n{"body": "no text here"}\n')
    cfg = DataConfig(name="jsonl", paths=[str(tmp_path / "*.jsonl")])
    with pytest.raises(ConfigError) as e:
        read_corpus(cfg)
    msg = str(e.value)
    assert f"{p}:3" in msg and "data.text_field='text'" in msg and "body" in msg and "\n" not in msg
    p.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: data\.text_field='text' is a int"):
        read_corpus(cfg)
    p.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: not valid JSON"):
        read_corpus(cfg)


def test_jsonl_source_builds_a_cache(tmp_path):
    d = tmp_path / "j"
    d.mkdir()
    for f in range(2):
        with open(d / f"part{f}.jsonl", "w") as fh:
            for i in range(10):
                fh.write(json.dumps({"id": i, "content": _real_text(100 * f + i, 60)}) + "\n")
    cfg = DataConfig(
        name="jsonl",
        paths=[str(d / "*.jsonl")],
        text_field="content",
        vocab_size=300,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    cache = prepare_data(cfg, progress=False)
    assert (cache.meta["train_docs"], cache.meta["val_docs"], cache.meta["num_files"]) == (18, 2, 2)
    train = np.asarray(cache.open_train())
    assert (train == cache.eot_id).sum() == 18 and train[-1] == cache.eot_id  # one EOT after each doc
    # max_bytes keeps whole documents from the start
    capped = DataConfig(name="jsonl", paths=cfg.paths, text_field="content", max_bytes=3000)
    c = read_corpus(capped)
    assert 2 <= len(c.train) + len(c.val) < 20
    assert sum(len(t.encode()) for t in c.train + c.val) <= 3000


# ------------------------------------------------------------------------ tokenizer / cache


def test_byte_level_round_trip(stdlib_cache):
    _, cache = stdlib_cache
    tok = cache.tokenizer()
    assert cache.vocab_size == tok.get_vocab_size() == 512 and tok.token_to_id(EOT) == cache.eot_id == 0
    for text in [
        "def f(x):\n\tif x:\r\n        return  x  # trailing  \n\n\n",
        "  héllo wörld — 日本語 😀 \x00\x7f",
        f"a literal {EOT} inside a document",
        "",
    ]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        assert cache.eot_id not in ids  # documents cannot forge a separator


def test_token_files_are_docs_joined_by_eot(text_dir, tmp_path):
    cfg = _text_cfg(text_dir, tmp_path)
    cache = prepare_data(cfg, progress=False)
    corpus = read_corpus(cfg)
    tok = cache.tokenizer()
    for arr, docs in ((cache.open_train(), corpus.train), (cache.open_val(), corpus.val)):
        assert isinstance(arr, np.memmap) and arr.dtype == np.uint16 and not arr.flags.writeable
        ids = np.asarray(arr)
        cuts = np.flatnonzero(ids == cache.eot_id)
        assert len(cuts) == len(docs) and cuts[-1] == len(ids) - 1
        pieces = np.split(ids, cuts + 1)[:-1]
        assert [tok.decode(p[:-1].tolist()) for p in pieces] == docs
    meta = json.loads((cache.dir / "meta.json").read_text())
    assert meta["train_tokens"] == cache.train_tokens and meta["key"] == cache.dir.name
    assert meta["num_files"] == 12 and meta["bytes"] == sum(len(d.encode()) for d in corpus.train + corpus.val)


def test_tokenizer_is_trained_on_train_split_only(text_dir, tmp_path):
    cfg = _text_cfg(text_dir, tmp_path, vocab_size=400)
    corpus = read_corpus(cfg)
    val_file = next(p for p in sorted(text_dir.rglob("*.txt")) if p.read_text() == corpus.val[0])
    val_file.write_text(corpus.val[0] + " zqxwvk" * 500)  # same path => still val
    cache = prepare_data(cfg, progress=False)
    assert not any("zqx" in t for t in cache.tokenizer().get_vocab())
    # ... but the same word in train would have been merged
    train_file = next(p for p in sorted(text_dir.rglob("*.txt")) if p.read_text() == corpus.train[0])
    train_file.write_text(corpus.train[0] + " zqxwvk" * 500)
    assert any("zqx" in t for t in prepare_data(cfg, progress=False).tokenizer().get_vocab())


def test_cache_is_reused_and_key_tracks_inputs(text_dir, tmp_path):
    cfg = _text_cfg(text_dir, tmp_path)
    first = prepare_data(cfg, progress=False)
    assert first.built
    mtime = (first.dir / "train.bin").stat().st_mtime_ns
    second = prepare_data(cfg, progress=False)
    assert not second.built and second.dir == first.dir
    assert (second.dir / "train.bin").stat().st_mtime_ns == mtime
    assert load_token_cache(cfg).dir == first.dir
    # seq_len / seed / workers do not change the cache; vocab and inputs do
    same = _text_cfg(text_dir, tmp_path, seq_len=64, seed=7, num_workers=2)
    assert prepare_data(same, progress=False).dir == first.dir
    other = prepare_data(_text_cfg(text_dir, tmp_path, vocab_size=320), progress=False)
    assert other.built and other.dir != first.dir
    assert tokens_mod.cache_key(_text_cfg(text_dir, tmp_path, val_fraction=0.3)) != first.dir.name
    f = next(text_dir.rglob("*.txt"))
    f.write_text(f.read_text() + "one more line\n")
    with pytest.raises(FileNotFoundError, match="prepare_data"):
        load_token_cache(cfg)


def test_partial_builds_are_never_picked_up(text_dir, tmp_path, monkeypatch):
    cfg = _text_cfg(text_dir, tmp_path)
    root = Path(cfg.cache_dir)
    key = tokens_mod.cache_key(cfg)
    with pytest.raises(FileNotFoundError):
        load_token_cache(cfg)
    # a crash in the middle of a build leaves nothing behind
    monkeypatch.setattr(tokens_mod, "_write_tokens", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        prepare_data(cfg, progress=False)
    assert not (root / key).exists() and not list(root.glob(".tmp-*"))
    monkeypatch.undo()
    # a leftover temp dir from a killed process (half-written) is ignored
    stale = root / f".tmp-{key}-99999-deadbeef"
    stale.mkdir(parents=True)
    (stale / "train.bin").write_bytes(b"\x01\x00" * 7)
    (stale / "meta.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        load_token_cache(cfg)
    cache = prepare_data(cfg, progress=False)
    assert cache.built and cache.dir == root / key and cache.train_tokens > 100
    assert stale.exists()  # untouched, and not used
    # a damaged final cache is reported, not silently used
    with open(cache.dir / "val.bin", "r+b") as fh:
        fh.truncate(4)
    with pytest.raises(RuntimeError, match="damaged"):
        load_token_cache(cfg)


# ------------------------------------------------------------------------------ windows


def test_window_shapes_and_shift(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    ds = WindowDataset(tokens, 8)
    assert len(ds) == (100 - 1) // 8 == 12
    x, y = ds[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
    assert x.tolist() == list(range(24, 32)) and y.tolist() == list(range(25, 33))
    assert ds[11][1][-1].item() == 96
    with pytest.raises(IndexError):
        ds[12]
    assert len(WindowDataset(np.arange(8), 8)) == 0
    # a memmap-backed dataset pickles by file name (DataLoader workers under spawn)
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    mm = WindowDataset(np.memmap(path, dtype=np.uint16, mode="r"), 16)
    blob = pickle.dumps(mm)
    assert len(blob) < 1000
    back = pickle.loads(blob)
    assert isinstance(back.tokens, np.memmap) and torch.equal(back[5][0], mm[5][0])


# ------------------------------------------------------------------------------ sampler


def _batches_per_step(n, steps, *, gbs, mbs, dp, seed=3, start=0):
    """{step: sorted window indices over all ranks and micro-steps}."""
    out: dict[int, list[int]] = {}
    for r in range(dp):
        s = StepBatchSampler(
            n,
            global_batch_size=gbs,
            micro_batch_size=mbs,
            dp_rank=r,
            dp_size=dp,
            seed=seed,
            start_step=start,
            max_steps=steps,
        )
        A = s.grad_accum_steps
        assert A == gbs // (mbs * dp) and len(s) == (steps - start) * A
        batches = list(s)
        assert len(batches) == len(s) and all(len(b) == mbs for b in batches)
        for i, b in enumerate(batches):
            out.setdefault(start + i // A, []).extend(b)
    return {k: sorted(v) for k, v in out.items()}


def test_sampler_union_is_invariant_to_the_split():
    n, steps = 13, 7  # 56 samples = 4+ epochs of 13 windows: steps straddle epoch boundaries
    single = _batches_per_step(n, steps, gbs=8, mbs=8, dp=1)
    accum = _batches_per_step(n, steps, gbs=8, mbs=2, dp=1)
    ddp = _batches_per_step(n, steps, gbs=8, mbs=2, dp=2)
    assert single == accum == ddp and len(single) == steps
    ref = StepBatchSampler(n, global_batch_size=8, micro_batch_size=8, dp_rank=0, dp_size=1, seed=3, max_steps=steps)
    assert all(sorted(ref.step_windows(k)) == single[k] for k in range(steps))
    # every epoch is a permutation of all windows, and epochs differ
    flat = ref.windows(0, 3 * n)
    for e in range(3):
        assert sorted(flat[e * n : (e + 1) * n]) == list(range(n))
    assert flat[:n] != flat[n : 2 * n]
    # a different seed gives a different order; ranks of one step are disjoint within an epoch
    assert _batches_per_step(n, steps, gbs=8, mbs=8, dp=1, seed=4) != single
    s0, s1 = (
        list(StepBatchSampler(1000, global_batch_size=8, micro_batch_size=2, dp_rank=r, dp_size=2, seed=0, max_steps=3))
        for r in (0, 1)
    )
    assert not set(sum(s0, [])) & set(sum(s1, []))


def test_sampler_resume_yields_the_tail():
    for dp, mbs in ((1, 8), (1, 2), (2, 2)):
        for r in range(dp):
            kw = dict(global_batch_size=8, micro_batch_size=mbs, dp_rank=r, dp_size=dp, seed=11, max_steps=9)
            full = list(StepBatchSampler(21, start_step=0, **kw))
            A = 8 // (mbs * dp)
            for k in (0, 1, 4, 9):
                assert list(StepBatchSampler(21, start_step=k, **kw)) == full[k * A :]


def test_sampler_rejects_bad_arithmetic():
    with pytest.raises(ValueError, match="multiple of"):
        StepBatchSampler(10, global_batch_size=10, micro_batch_size=4, dp_rank=0, dp_size=1, seed=0, max_steps=1)
    with pytest.raises(ValueError, match="dp_rank"):
        StepBatchSampler(10, global_batch_size=8, micro_batch_size=2, dp_rank=2, dp_size=2, seed=0, max_steps=1)
    with pytest.raises(ValueError, match="start_step"):
        StepBatchSampler(
            10, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0, start_step=5, max_steps=4
        )


# --------------------------------------------------------------------------- datamodule


def _dm(cfg, **kw) -> TextDataModule:
    base = dict(global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=1, max_steps=5, val_sequences=12)
    base.update(kw)
    return TextDataModule(cfg, **base)


def test_datamodule_loaders_shard_by_rank(stdlib_cache):
    cfg, cache = stdlib_cache
    single = _dm(cfg, micro_batch_size=8)
    assert single.vocab_size == cache.vocab_size  # before setup
    single.setup("fit")
    want = [
        sorted(
            single.train_set[i][0][0].item()
            for i in StepBatchSampler(
                len(single.train_set),
                global_batch_size=8,
                micro_batch_size=8,
                dp_rank=0,
                dp_size=1,
                seed=cfg.seed,
                max_steps=5,
            ).step_windows(k)
        )
        for k in range(5)
    ]
    firsts: dict[int, list[int]] = {k: [] for k in range(5)}
    val_seen = []
    for r in range(2):
        dm = _dm(cfg, dp_rank=r, dp_size=2)
        dm.setup("fit")
        batches = list(dm.train_dataloader())
        assert len(batches) == 5 * 2
        for i, (x, y, n) in enumerate(batches):
            assert x.shape == y.shape == (2, cfg.seq_len) and x.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])
            assert int(n) == 2 * 2 * cfg.seq_len  # no process group: this rank's 2 micro-batches, all targets valid
            firsts[i // 2].extend(x[:, 0].tolist())
        vb = list(dm.val_dataloader())
        assert len(vb) == 3 and all(x.shape == (2, cfg.seq_len) for x, _ in vb)
        val_seen += dm.val_batch_indices()
    assert [sorted(v) for v in firsts.values()] == want  # ddp union == single batch, per step
    assert sorted(sum(val_seen, [])) == list(range(12))  # the first windows, disjoint by rank
    single_val = sorted(sum(_dm(cfg, micro_batch_size=8).val_batch_indices(), []))
    assert single_val == list(range(12))  # the same windows whatever the layout


def test_datamodule_state_dict_round_trip(stdlib_cache):
    cfg, cache = stdlib_cache
    elsewhere = DataConfig(name="text_files", paths=["/nonexistent/*.txt"])  # never looked up
    assert _dm(elsewhere, cache_dir=str(cache.dir)).vocab_size == cache.vocab_size
    dm = _dm(cfg)
    assert dm.state_dict() == {"consumed_samples": 0, "global_batch_size": 8, "step": 0}
    dm.load_state_dict({"consumed_samples": 24, "global_batch_size": 8})
    assert dm.start_step == 3 and dm.state_dict()["consumed_samples"] == 24
    assert len(list(dm.train_dataloader())) == (5 - 3) * 4
    other = _dm(cfg, global_batch_size=16, micro_batch_size=4)
    with pytest.raises(ValueError, match="not a multiple"):
        other.load_state_dict({"consumed_samples": 24, "global_batch_size": 8})
    with pytest.raises(FileNotFoundError):
        _dm(DataConfig(max_bytes=200_000, vocab_size=300, cache_dir=cfg.cache_dir)).setup()


def test_a_resume_at_another_global_batch_reads_on_from_the_sample_reached(stdlib_cache):
    """An elastic shrink with ``resilience.shrink_batch=scale``: the step-3 checkpoint of a run at global batch 8
    (24 samples) resumed at global batch 6 (3 ranks x 2 micro-batches of 1) starts at step 3 with samples 24..29,
    then 30..35: the union over ranks and micro-batches is the uninterrupted stream's next samples."""
    cfg, _ = stdlib_cache
    full = StepBatchSampler(
        1000, global_batch_size=8, micro_batch_size=8, dp_rank=0, dp_size=1, seed=cfg.seed, max_steps=9
    )
    stream = full.windows(0, 60)
    got: dict[int, list[int]] = {}
    for r in range(3):
        dm = _dm(cfg, global_batch_size=6, micro_batch_size=1, dp_rank=r, dp_size=3)
        dm.load_state_dict({"consumed_samples": 24, "global_batch_size": 8, "step": 3})
        assert (dm.start_step, dm.first_sample) == (3, 24)
        assert dm.state_dict() == {"consumed_samples": 24, "global_batch_size": 6, "step": 3}
        assert dm.consumed_samples(5) == 24 + 2 * 6
        s = StepBatchSampler(
            1000,
            global_batch_size=6,
            micro_batch_size=1,
            dp_rank=r,
            dp_size=3,
            seed=cfg.seed,
            start_step=3,
            max_steps=5,
            first_sample=24,
        )
        for i, b in enumerate(s):
            got.setdefault(3 + i // 2, []).extend(b)
    probe = StepBatchSampler(
        1000,
        global_batch_size=6,
        micro_batch_size=1,
        dp_rank=0,
        dp_size=3,
        seed=cfg.seed,
        start_step=3,
        max_steps=5,
        first_sample=24,
    )
    assert probe.step_first_sample(4) == 30 and probe.step_windows(3) == stream[24:30]
    assert {k: sorted(v) for k, v in got.items()} == {3: sorted(stream[24:30]), 4: sorted(stream[30:36])}
    with pytest.raises(ValueError, match="first_sample=-1 must be >= 0"):
        StepBatchSampler(
            10, global_batch_size=2, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0, max_steps=3, first_sample=-1
        )


def test_lightning_resume_continues_the_sample_stream(stdlib_cache, tmp_path):
    """Checkpoint mid-run, resume with a new Trainer: the union of batches equals one
    uninterrupted run (Lightning restores the datamodule before building the loader)."""
    import pytorch_lightning as pl

    cfg, _ = stdlib_cache

    class Probe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[tuple[int, list[int]]] = []

        def training_step(self, batch, i):
            self.seen.append((self.global_step, batch[0][:, 0].tolist()))
            return (self.w * batch[0].float().mean()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(max_steps, ckpt=None, save=None):
        model = Probe()
        trainer = pl.Trainer(
            max_steps=max_steps,
            accumulate_grad_batches=4,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, datamodule=_dm(cfg, max_steps=6), ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        return model.seen

    full = fit(6)
    ckpt = str(tmp_path / "mid.ckpt")
    head = fit(2, save=ckpt)
    tail = fit(6, ckpt=ckpt)
    assert [s for s, _ in full] == [k for k in range(6) for _ in range(4)]
    assert head + tail == full


def test_on_the_fly_tokenization_gives_the_memmap_windows(stdlib_cache):
    import dataclasses

    from framework.base.data.dataset import OnTheFlyWindowDataset

    cfg, cache = stdlib_cache
    memmap = WindowDataset(cache.open_train(), cfg.seq_len)
    fly = pickle.loads(
        pickle.dumps(OnTheFlyWindowDataset(cache.dir, "train", cfg.seq_len, cache.eot_id))
    )  # as a worker gets it
    assert len(fly) == len(memmap)
    for i in [0, 1, len(memmap) // 2, len(memmap) - 1, *random.Random(0).sample(range(len(memmap)), 40)]:
        assert all(torch.equal(a, b) for a, b in zip(fly[i], memmap[i])), i
    with pytest.raises(IndexError):
        fly[len(fly)]
    fly_cfg = dataclasses.replace(cfg, mode="on_the_fly", num_workers=1, prefetch_factor=3)
    a = list(_dm(fly_cfg).train_dataloader())
    b = list(_dm(cfg).train_dataloader())
    assert len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1, _), (x2, y2, _) in zip(a, b)
    )


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(mode="stream"), "data.mode='stream' is not allowed; allowed: memmap, on_the_fly"),
        (dict(prefetch_factor=0, num_workers=2), "data.prefetch_factor=0 must be > 0 or null"),
        (dict(prefetch_factor=2), "data.prefetch_factor=2 needs data.num_workers > 0 (got 0); set it to null"),
    ],
)
def test_bad_pipeline_options_are_one_line(kw, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        DataConfig(**kw)


def test_document_boundary_masking_ignores_exactly_the_targets_after_eot(stdlib_cache):
    """``data.mask_document_boundaries``: y is IGNORE_INDEX exactly where x is <|endoftext|> (the
    next document's first token), the same in memmap and on-the-fly windows; x never changes; each
    train micro-batch carries its step's count of the targets left."""
    import dataclasses

    from framework.base.data.dataset import OnTheFlyWindowDataset
    from framework.base.model.gpt import IGNORE_INDEX

    cfg, cache = stdlib_cache
    tokens = cache.open_train()
    plain = WindowDataset(tokens, cfg.seq_len)
    masked = WindowDataset(tokens, cfg.seq_len, mask_eot_id=cache.eot_id)
    fly = OnTheFlyWindowDataset(cache.dir, "train", cfg.seq_len, cache.eot_id, mask_document_boundaries=True)
    ignored = 0
    for i in range(len(plain)):
        (x, y), (mx, my) = plain[i], masked[i]
        at_eot = x == cache.eot_id
        assert torch.equal(mx, x), i
        assert torch.equal(my == IGNORE_INDEX, at_eot), i
        assert torch.equal(my[~at_eot], y[~at_eot]), i
        ignored += int(at_eot.sum())
        if at_eot.any():
            fx, fy = fly[i]
            assert torch.equal(fx, mx) and torch.equal(fy, my), i
    # Inputs of all windows are tokens[0 : windows * seq_len]: one ignored target per EOT there.
    assert ignored == int((np.asarray(tokens[: len(plain) * cfg.seq_len]) == cache.eot_id).sum()) > 10
    dm = _dm(dataclasses.replace(cfg, mask_document_boundaries=True), max_steps=40)
    batches = list(dm.train_dataloader())  # 40 steps x 4 micro-batches of 2 windows
    assert any(int(n) < 8 * cfg.seq_len for _, _, n in batches), "no boundary in 40 steps: the test would not test"
    for k in range(40):
        step = batches[4 * k : 4 * k + 4]
        assert {int(n) for _, _, n in step} == {sum(int((y != IGNORE_INDEX).sum()) for _, y, _ in step)}, k


def test_a_global_batch_larger_than_the_train_split_is_refused():
    """Issue 13 item 8: 41 sequences from 40 windows would repeat a window in every step."""
    from framework.base.data.dataset import check_global_batch_fits

    check_global_batch_fits(global_batch_size=40, train_tokens=40 * 128 + 1, seq_len=128)  # exactly fits
    with pytest.raises(ConfigError) as info:
        check_global_batch_fits(global_batch_size=41, train_tokens=40 * 128 + 1, seq_len=128)
    assert str(info.value) == (
        "trainer.global_batch_size=41 sequences is larger than the train split: 40 windows of data.seq_len=128"
        " (5,121 tokens); every step would repeat windows. Use global_batch_size <= 40, a shorter data.seq_len or more data"
    )
