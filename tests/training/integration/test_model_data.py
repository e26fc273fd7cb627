"""Model presets, FSDP2 sharding, token shards and prepare_data: real behaviour, small inputs, CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]

from fsdp_resilience.training.data import BatchSampler, DatasetError, TokenShards, validation_batches  # noqa: E402
from fsdp_resilience.training.model import GPT, PRESETS, build_model, cross_entropy_loss, param_count  # noqa: E402
from fsdp_resilience.training.parallelize import Precision, backend_for, choose_device  # noqa: E402
from fsdp_resilience.training.prepare_data import prepare  # noqa: E402

from shared import free_port  # noqa: E402

WORDS = (
    "def return class import self value data model rank step loss batch token shard for in if else "
    "while with as None True False print open read write the of and to a is"
).split()


def write_corpus(src: Path, n_files: int = 40, seed: int = 0) -> dict[str, bytes]:
    """Text files of random code-like lines in nested folders; returns {relpath: bytes} of the kept ones."""
    rng = np.random.default_rng(seed)
    kept = {}
    for i in range(n_files):
        lines = []
        for _ in range(int(rng.integers(40, 80))):
            indent = "    " * int(rng.integers(0, 3))
            lines.append(indent + " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9)))) + ":")
        rel = f"pkg{i % 4}/sub{i % 3}/mod_{i:03d}.{'py' if i % 5 else 'md'}"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        data = ("\n".join(lines) + "\n").encode()
        (src / rel).write_bytes(data)
        kept[rel] = data
    (src / "pkg0" / "blob.py").write_bytes(b"binary\0data\n")  # has a NUL: skipped
    (src / "pkg0" / "notes.bin").write_bytes(b"not a text extension\n")  # extension: skipped
    (src / ".hidden").mkdir()
    (src / ".hidden" / "secret.py").write_bytes(b"hidden folder: skipped\n")
    return kept


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    src = tmp_path_factory.mktemp("src")
    return src, write_corpus(src)


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("data") / "ds"
    prepare(corpus[0], dst, val_fraction=0.1, shard_tokens=16_384)
    return dst


def read_split(dst: Path, split: str) -> bytes:
    index = json.loads((dst / "index.json").read_text())
    parts = [np.fromfile(dst / e["file"], dtype="<u2") for e in index[split]]
    for part, e in zip(parts, index[split]):
        assert part.size == e["tokens"]
    tokens = np.concatenate(parts)
    assert tokens.max() < 256
    return tokens.astype(np.uint8).tobytes()


# -------------------------------------------------------------------------------- prepare_data


def test_prepare_data_index_split_and_round_trip(corpus, dataset, tmp_path):
    src, kept = corpus
    index = json.loads((dataset / "index.json").read_text())
    assert (index["format"], index["dtype"], index["vocab_size"]) == ("byte-tokens-v1", "uint16", 256)
    assert index["source"] == str(src.resolve()) and index["created_at"]
    assert len(index["train"]) > 1, "shard_tokens=16384 should give several train shards"
    assert index["val"] and index["files"]["val"] >= 1
    assert index["files"]["train"] + index["files"]["val"] == len(kept)

    # Every kept file comes back exactly once, whole, in one split; skipped files never do.
    docs = {split: read_split(dataset, split).split(b"\0")[:-1] for split in ("train", "val")}
    assert sorted(docs["train"] + docs["val"]) == sorted(kept.values())
    assert not set(docs["train"]) & set(docs["val"])

    # Deterministic: a second preparation is byte-identical; re-running on the same DST is a no-op.
    again = prepare(src, tmp_path / "again", val_fraction=0.1, shard_tokens=16_384)
    assert again["sha256"] == index["sha256"] and again["train"] == index["train"]
    assert prepare(src, dataset, val_fraction=0.1, shard_tokens=16_384).get("unchanged") is True
    # --max-bytes caps the text read.
    capped = prepare(src, tmp_path / "capped", val_fraction=0.1, max_bytes=20_000)
    total = sum(e["tokens"] for split in ("train", "val") for e in capped[split])
    assert total <= 20_000 + capped["files"]["train"] + capped["files"]["val"]


def run_prepare_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_resilience.training.prepare_data", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_prepare_data_cli_refusals(corpus, dataset, tmp_path):
    src = corpus[0]
    ok = run_prepare_cli(str(src), str(tmp_path / "fresh"), "--val-fraction", "0.1")
    assert ok.returncode == 0, ok.stderr
    assert "files" in ok.stdout and "tokens" in ok.stdout and len(ok.stdout.strip().splitlines()) == 1

    missing = run_prepare_cli(str(tmp_path / "nope"), str(tmp_path / "out1"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr

    (tmp_path / "empty_src").mkdir()
    (tmp_path / "empty_src" / "image.png").write_bytes(b"\x89PNG\0")
    no_text = run_prepare_cli(str(tmp_path / "empty_src"), str(tmp_path / "out2"))
    assert no_text.returncode == 2 and "no text files" in no_text.stderr

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "thesis.txt").write_text("do not overwrite me")
    refused = run_prepare_cli(str(src), str(busy))
    assert refused.returncode == 2 and "not empty" in refused.stderr
    assert (busy / "thesis.txt").read_text() == "do not overwrite me"

    different = run_prepare_cli(str(src), str(dataset), "--val-fraction", "0.3")
    assert different.returncode == 2 and "different dataset" in different.stderr

    no_torch = subprocess.run(
        [sys.executable, "-c", "import sys, fsdp_resilience.training.prepare_data; assert 'torch' not in sys.modules"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert no_torch.returncode == 0, no_torch.stderr


def test_token_shards_clear_errors(dataset, tmp_path):
    with pytest.raises(DatasetError, match=r"index.json is missing.*python -m fsdp_resilience.training.prepare_data"):
        TokenShards(tmp_path / "absent", "train")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "index.json").write_text("{not json")
    with pytest.raises(DatasetError, match="corrupt"):
        TokenShards(broken, "train")

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    index = json.loads((dataset / "index.json").read_text())
    for e in index["train"] + index["val"]:
        (truncated / e["file"]).write_bytes((dataset / e["file"]).read_bytes())
    (truncated / "index.json").write_text(json.dumps(index))
    first = truncated / index["train"][0]["file"]
    first.write_bytes(first.read_bytes()[:100])
    with pytest.raises(DatasetError, match=rf"{first.name}.*truncated"):
        TokenShards(truncated, "train")


# ---------------------------------------------------------------------------------- sampling


def test_sampler_deterministic_and_resume_equal(dataset):
    shards = TokenShards(dataset, "train")
    make = lambda: BatchSampler(shards, seq_len=64, batch_size=4, rank=1, world_size=2, seed=7)  # noqa: E731
    steps_per_epoch = make().num_windows // 8
    n, k = steps_per_epoch + 5, steps_per_epoch - 2  # crosses an epoch boundary after the resume point

    reference, states = make(), []
    batches = []
    for _ in range(n):
        states.append(reference.state_dict())
        batches.append(reference.next_batch())
    assert reference.state_dict()["epoch"] == 1
    x, y = batches[0]
    assert x.dtype == torch.long and x.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])

    # Same seed -> same batches; the state is plain ints.
    twin = make()
    assert all(torch.equal(twin.next_batch()[0], batches[i][0]) for i in range(3))
    assert all(type(v) is int for v in states[k].values())

    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(states[k])))  # survives serialisation
    for i in range(k, n):
        rx, ry = resumed.next_batch()
        assert torch.equal(rx, batches[i][0]) and torch.equal(ry, batches[i][1]), f"batch {i} differs after resume"

    other_seed = BatchSampler(shards, seq_len=64, batch_size=4, rank=1, world_size=2, seed=8)
    assert not torch.equal(other_seed.next_batch()[0], batches[0][0])


def test_ranks_disjoint_and_state_global(dataset):
    shards = TokenShards(dataset, "train")
    samplers = [BatchSampler(shards, seq_len=64, batch_size=4, rank=r, world_size=2, seed=3) for r in range(2)]
    seen: list[set] = [set(), set()]
    for _ in range(samplers[0].num_windows // 8):  # one epoch
        for r, s in enumerate(samplers):
            seen[r].update(tuple(row.tolist()) for row in s.next_batch()[0])
    assert len(seen[0]) == len(seen[1]) == (samplers[0].num_windows // 8) * 4
    assert not seen[0] & seen[1]
    assert samplers[0].state_dict() == samplers[1].state_dict()

    val = [validation_batches(dataset, seq_len=64, batch_size=2, n_batches=3, rank=r, world_size=2) for r in range(2)]
    assert len(val[0]) == len(val[1]) == 3
    rows = [{tuple(row.tolist()) for x, _ in v for row in x} for v in val]
    assert len(rows[0]) == len(rows[1]) == 6 and not rows[0] & rows[1]
    again = validation_batches(dataset, seq_len=64, batch_size=2, n_batches=3, rank=0, world_size=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, val[0]))
    with pytest.raises(DatasetError, match="fewer than one global batch"):
        validation_batches(dataset, seq_len=512, batch_size=64, n_batches=1, rank=0, world_size=2)


# ------------------------------------------------------------------------------------- model


def test_preset_param_counts():
    from fsdp_resilience.training.contract import MODEL_PRESETS

    assert set(PRESETS) == set(MODEL_PRESETS) == {"tiny", "tiny-dropout", "small", "1b", "8b"}
    for name, cfg in PRESETS.items():
        model = build_model(name, device="meta")  # nothing allocated, even for 8b
        assert param_count(cfg) == sum(p.numel() for p in model.parameters()), name
    assert 7e9 < param_count(PRESETS["8b"]) < 9e9
    big = PRESETS["8b"]
    assert (big.dim, big.n_layers, big.n_heads, big.ffn_hidden, big.vocab_size) == (4096, 32, 32, 14336, 256)
    assert 0.8e9 < param_count(PRESETS["1b"]) < 1.5e9
    assert 25e6 <= param_count(PRESETS["small"]) <= 50e6
    assert 0.5e6 < param_count(PRESETS["tiny"]) < 5e6
    # tiny-dropout is tiny plus dropout: the same parameters, so the same checkpoints' shapes.
    assert PRESETS["tiny-dropout"] == dataclasses.replace(PRESETS["tiny"], dropout=0.1)


def test_forward_shapes_init_and_activation_checkpointing():
    model = build_model("tiny", device="cpu")
    tokens = torch.randint(0, 256, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 256) and logits.dtype == torch.float32
    assert abs(cross_entropy_loss(logits, tokens).item() - math.log(256)) < 0.2  # near-uniform at init

    # init depends on the seed only, not on the global RNG's state.
    a, b = GPT(PRESETS["tiny"]), GPT(PRESETS["tiny"])
    a.init_weights(5)
    torch.manual_seed(999)
    torch.rand(10)
    b.init_weights(5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    b.init_weights(6)
    assert not torch.equal(a.output.weight, b.output.weight)

    # Activation checkpointing recomputes, it does not change the maths.
    grads = []
    for flag in (False, True):
        for block in a.blocks:
            block.activation_checkpointing = flag
        a.zero_grad()
        cross_entropy_loss(a(tokens), tokens).backward()
        grads.append([p.grad.clone() for p in a.parameters()])
    assert all(torch.allclose(g0, g1, atol=1e-6) for g0, g1 in zip(*grads))

    assert choose_device("cpu") == torch.device("cpu") and backend_for(torch.device("cpu")) == "gloo"
    assert Precision.for_device(torch.device("cpu")) == Precision(False, False)
    assert Precision.for_device(torch.device("cuda")) == Precision(True, True)


def test_dropout_draws_from_the_global_rng_in_train_mode_only():
    """tiny-dropout's randomness is the global torch RNG's: the same state gives the same masks
    (what a checkpointed per-rank RNG state makes a resume replay), eval() turns it off, and
    activation checkpointing's recomputation reuses the forward's masks. tiny draws nothing."""
    model = build_model("tiny-dropout", device="cpu").train()
    tokens = torch.randint(0, 256, (2, 32))
    torch.manual_seed(11)
    state = torch.get_rng_state()
    first = model(tokens)
    torch.set_rng_state(state)
    assert torch.equal(model(tokens), first)
    assert not torch.equal(model(tokens), first)  # the stream moved on: other masks
    model.eval()
    assert torch.equal(model(tokens), model(tokens))

    model.train()
    grads = []
    for flag in (False, True):
        for block in model.blocks:
            block.activation_checkpointing = flag
        model.zero_grad()
        torch.set_rng_state(state)
        cross_entropy_loss(model(tokens), tokens).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(g0, g1, atol=1e-6) for g0, g1 in zip(*grads))

    plain = build_model("tiny", device="cpu").train()
    torch.set_rng_state(state)
    plain(tokens)
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------------------ FSDP2, 2 ranks


def gloo_reduces_bf16() -> bool:
    """Whether this gloo build reduces bf16 tensors (PyPI's torch does; Debian's system gloo, in the
    NVRx 0.7 lane's chroot, does not). The GPU recipe reduces on NCCL; on CPU it is a smoke test."""
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.ones(1, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


def train_steps(model, optimizer, sampler, steps: int, world_size: int):
    """``steps`` plain training steps; returns the mean loss and time of each, and the last batch."""
    import torch.distributed as dist

    losses, step_s = [], []
    for _ in range(steps):
        start = time.perf_counter()
        inputs, targets = sampler.next_batch()
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
        step_s.append(time.perf_counter() - start)
    return losses, step_s, (inputs, targets)


def _fsdp_worker(rank: int, world_size: int, port: int, dataset_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_resilience.training.parallelize import build_sharded_model, full_state

    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        model = build_sharded_model("tiny", mesh, torch.device("cpu"), seed=1234)
        initial = full_state(model)
        if rank == 0:
            torch.save(initial, Path(out_dir) / "init.pt")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        sampler = BatchSampler(TokenShards(dataset_dir, "train"), 128, 8, rank, world_size, seed=1234)
        losses, step_s, (inputs, targets) = train_steps(model, optimizer, sampler, 5, world_size)
        changed = any(not torch.equal(initial[n], t) for n, t in full_state(model).items())

        # The GPU recipe (bf16 compute, fp32 master weights, activation checkpointing) runs too.
        bf16_ok = None  # None: this gloo build has no bf16 collectives (Debian's system gloo)
        if gloo_reduces_bf16():
            bf16 = build_sharded_model("tiny", mesh, torch.device("cpu"), seed=1234, precision=Precision(True, True))
            bf16_loss = cross_entropy_loss(bf16(inputs), targets)
            bf16_loss.backward()
            bf16_ok = (
                all(p.dtype == torch.float32 and p.grad is not None for p in bf16.parameters())
                and bool(torch.isfinite(bf16_loss))
                and bf16.rope_cos.dtype == torch.float32
            )
        if rank == 0:
            (Path(out_dir) / "result.json").write_text(
                json.dumps({"losses": losses, "step_s": step_s, "changed": changed, "bf16_ok": bf16_ok})
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.one_lane  # torch's FSDP2 alone: no NVRx, no code of training/ that restarts or checkpoints
def test_fsdp2_two_ranks_gloo_trains_and_inits_like_one_rank(dataset, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, free_port(), str(dataset), str(tmp_path)), nprocs=2, join=True)
    result = json.loads((tmp_path / "result.json").read_text())
    losses = result["losses"]
    assert result["changed"] and result["bf16_ok"] in (True, None)
    if result["bf16_ok"] is None:
        print("bf16 smoke test not run: this gloo build has no bf16 collectives")
    assert losses[-1] < losses[0] - 0.3, f"loss did not fall: {losses}"

    # World size 2 (sharded, meta -> to_empty -> init) == world size 1 (a plain CPU model), bitwise.
    sharded_init = torch.load(tmp_path / "init.pt")
    reference = GPT(PRESETS["tiny"])
    reference.init_weights(1234)
    expected = dict(reference.named_parameters())
    assert sharded_init.keys() == expected.keys()
    for name, tensor in sharded_init.items():
        assert torch.equal(tensor, expected[name].detach()), f"{name} differs between world size 1 and 2"
    print(f"tiny FSDP2 on 2 gloo ranks: step_s={[round(s, 3) for s in result['step_s']]} losses={losses}")


# ------------------------------------------------------------------------------ HSDP, 2 nodes x 2 ranks


def _hsdp_worker(rank: int, world_size: int, port: int, dataset_dir: str, out_dir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import Replicate, Shard

    from fsdp_resilience.training.parallelize import build_optimizer, build_sharded_model, device_mesh, full_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = {}
        for name, (nodes, procs) in {"hsdp": (2, 2), "fsdp": (1, 4)}.items():
            mesh = device_mesh(torch.device("cpu"), nodes, procs)
            model = build_sharded_model("tiny", mesh, torch.device("cpu"), seed=1234)
            optimizer = build_optimizer(model, torch.device("cpu"), lr=3e-3, weight_decay=0.1)
            sampler = BatchSampler(TokenShards(dataset_dir, "train"), 64, 4, rank, world_size, seed=1234)
            losses, _, _ = train_steps(model, optimizer, sampler, 3, world_size)
            placements = [str(p) for p in model.output.weight.placements]
            if name == "hsdp":
                assert model.output.weight.placements == (Replicate(), Shard(0)), placements
                dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(Path(out_dir) / "hsdp-ckpt"))
            else:  # an HSDP checkpoint loads into a plain FSDP mesh (DCP reshards)
                fresh = build_sharded_model("tiny", mesh, torch.device("cpu"), seed=99)
                state = {"model": get_model_state_dict(fresh)}
                dcp.load(state, checkpoint_id=str(Path(out_dir) / "hsdp-ckpt"))
                results["reloaded"] = {k: v.full_tensor().sum().item() for k, v in state["model"].items()}
            results[name] = {
                "losses": losses,
                "placements": placements,
                "full": {k: v.sum().item() for k, v in full_state(model).items()},
            }
            dist.barrier()
        if rank == 0:
            (Path(out_dir) / "hsdp.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.one_lane  # torch's FSDP2 and DCP alone: no NVRx, no code of training/ that restarts or checkpoints
def test_hsdp_over_two_nodes_trains_like_fsdp_and_its_checkpoint_reshards(dataset, tmp_path):
    """Multi-node runs shard within a node and replicate across nodes (HSDP): the same maths as
    FSDP over every rank, and its checkpoint loads into any other mesh."""
    import torch.multiprocessing as mp

    mp.spawn(_hsdp_worker, args=(4, free_port(), str(dataset), str(tmp_path)), nprocs=4, join=True)
    result = json.loads((tmp_path / "hsdp.json").read_text())
    hsdp, fsdp = result["hsdp"], result["fsdp"]
    assert hsdp["placements"] == ["R", "S(0)"] and fsdp["placements"] == ["S(0)"]
    assert hsdp["losses"] == pytest.approx(fsdp["losses"], rel=1e-4)
    assert result["reloaded"] == pytest.approx(hsdp["full"], rel=1e-5)


def test_preset_memory_estimates_fit_and_are_the_documented_ones():
    """The per-GPU memory table of docs/training-cli.md is memory_per_gpu's output, and every GPU preset fits an
    80 GB GPU at its default world size."""
    from fsdp_resilience.training.model import PRESET_RUNS, memory_per_gpu

    docs = (Path(__file__).resolve().parents[3] / "docs" / "training-cli.md").read_text()
    for name, run in PRESET_RUNS.items():
        estimate = memory_per_gpu(PRESETS[name], run)
        assert estimate["total"] < 80 * 0.9, (name, estimate)
        row = f"| {estimate['sharded_state']} GiB | {estimate['activations']} GiB | {estimate['total']} GiB |"
        line = next((ln for ln in docs.splitlines() if ln.startswith(f"| `{name}` |") and "GiB" in ln), "")
        assert line.endswith(row), f"docs/training-cli.md row for {name} is out of date: want ... {row}, have {line}"
        assert f"{run.batch_size} × {run.seq_len}" in line
