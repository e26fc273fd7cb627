"""The model presets' shapes and what they need: parameters, GPU memory, and one node's host memory.

Torch-free, so both planes size from the same numbers: training builds the model from
``PRESETS`` (training/model.py), and the EKS backend sizes each pod's ``/dev/shm`` and checks its
memory before a launch starts (``host_memory_per_node``).

All figures are estimates from the shapes; ``make gpu-check`` measures the ``1b`` preset's GPU
memory against ``memory_per_gpu``.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
BYTE_VOCAB = 256


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = BYTE_VOCAB
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 768
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    #: Dropout probability (0: none, and no RNG draws at all).
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} heads of even size")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    # ~0.9 M params: sized for 2 CPU cores (seq 128, batch 8, 2 gloo ranks: ~0.4 s a step).
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, ffn_hidden=384, max_seq_len=1024),
    # tiny with dropout: training draws random numbers every step, so resuming bitwise needs each
    # rank's RNG state in the checkpoint (the tests' proof of it).
    "tiny-dropout": ModelConfig(dim=128, n_layers=4, n_heads=4, ffn_hidden=384, max_seq_len=1024, dropout=0.1),
    # ~38 M params: a real (single-GPU-sized) run.
    "small": ModelConfig(dim=512, n_layers=12, n_heads=8, ffn_hidden=1408, max_seq_len=2048),
    # ~1.1 B params: Llama-3.2-1B widths (without GQA).
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, ffn_hidden=8192, max_seq_len=4096),
    # ~7.8 B params: Llama-3-8B shapes (without GQA, byte vocab).
    "8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336, max_seq_len=8192),
}


@dataclass(frozen=True)
class PresetRun:
    """Where a preset is meant to run: its default world size (GPUs) and tokens per rank per step."""

    nodes: int
    gpus_per_node: int
    batch_size: int
    seq_len: int


#: The default world size of each GPU preset (``tiny`` is the CPU demo's). Multi-node runs use HSDP,
#: so optimizer state is sharded over one node's GPUs.
PRESET_RUNS: dict[str, PresetRun] = {
    "small": PresetRun(nodes=1, gpus_per_node=1, batch_size=8, seq_len=2048),
    "1b": PresetRun(nodes=1, gpus_per_node=8, batch_size=4, seq_len=4096),
    "8b": PresetRun(nodes=2, gpus_per_node=8, batch_size=2, seq_len=8192),
}

#: CUDA context, NCCL buffers and allocator slack per GPU: measured figures vary by driver and
#: NCCL version; this is a round allowance, not a measurement.
GPU_OVERHEAD_BYTES = 2 * GIB

#: Bytes a parameter's checkpointed state takes in host memory: the fp32 master weight and AdamW's
#: two fp32 moments (the bf16 compute copy and the gradients are not checkpointed).
CHECKPOINT_BYTES_PER_PARAM = 12
#: /dev/shm each rank uses besides the checkpoint snapshot: NCCL's shared-memory transport and
#: proxy buffers, libfabric's shm segments, tensors passed between processes. NCCL's own container
#: advice is 1 GiB for a whole node; this allows it per rank. A round allowance, not a measurement.
SHM_PER_RANK_BYTES = 1 * GIB
#: Host memory (outside /dev/shm) of one rank's processes: the trainer (torch, CUDA and NCCL host
#: state, data batches) and its checkpoint writer. A round allowance, not a measurement.
HOST_PER_RANK_BYTES = 10 * GIB
#: Host memory of the node's launcher, ft_launcher and rendezvous store.
HOST_PER_NODE_BYTES = 4 * GIB


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, computed from the shapes (no allocation)."""
    attention = 4 * cfg.dim * cfg.dim
    mlp = 3 * cfg.dim * cfg.ffn_hidden
    norms = 2 * cfg.dim
    embed_and_head = 2 * cfg.vocab_size * cfg.dim
    return cfg.n_layers * (attention + mlp + norms) + embed_and_head + cfg.dim  # + final norm


def memory_per_gpu(cfg: ModelConfig, run: PresetRun) -> dict[str, float]:
    """An estimate (GiB) of one GPU's peak memory for ``cfg`` trained as ``run`` with this project's
    recipe: FSDP2/HSDP sharding over a node's GPUs, fp32 master weights, gradients and AdamW moments
    (16 bytes a parameter, sharded), bf16 compute with activation checkpointing per block (one bf16
    input saved per block; one block's activations live at a time while it recomputes), two
    blocks' parameters unsharded at once (prefetch) plus the root's, whose fp32 gradients are
    reduced unsharded. ``make gpu-check`` measures the ``1b`` preset against it."""
    params = param_count(cfg)
    block = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_hidden + 2 * cfg.dim
    root = 2 * cfg.vocab_size * cfg.dim + cfg.dim
    tokens = run.batch_size * run.seq_len
    parts = {
        "sharded_state": 16 * params / run.gpus_per_node,
        "unsharded_params": 2 * (2 * block + root) + 4 * (block + root),
        "activations": (
            2 * tokens * cfg.dim * cfg.n_layers  # saved block inputs
            + 2 * tokens * (16 * cfg.dim + 3 * cfg.ffn_hidden)  # one block recomputing
            + 10 * tokens * cfg.vocab_size
        ),  # bf16 logits, their fp32 copy and gradient
        "overhead": GPU_OVERHEAD_BYTES,
    }
    out = {k: round(v / GIB, 2) for k, v in parts.items()}
    out["total"] = round(sum(parts.values()) / GIB, 1)
    return out


def node_replica_fraction(nodes: int, procs_per_node: int) -> float:
    """The share of the model's state one node holds. Multi-node runs with several ranks a node
    use HSDP (shard within a node, replicate across nodes: training/parallelize.py device_mesh),
    so each node holds a whole replica; one node, or one rank a node, is plain FSDP over every
    rank, so a node holds ``1 / nodes`` of it."""
    if nodes > 1 and procs_per_node > 1:
        return 1.0
    return 1.0 / nodes


def host_memory_per_node(cfg: ModelConfig, nodes: int, procs_per_node: int) -> dict[str, int]:
    """An estimate (bytes) of one training node's host memory for ``cfg`` on ``nodes`` nodes of
    ``procs_per_node`` ranks:

    - ``checkpoint_staging``: the async checkpoint's snapshot. Every save copies each rank's shard
      of the weights and both AdamW moments (``CHECKPOINT_BYTES_PER_PARAM``) into host buffers
      allocated once in shared memory, i.e. in ``/dev/shm`` (the writer process maps them; see
      training/checkpointing/snapshot.py). Under HSDP that is the node's whole replica: about
      87 GiB for ``8b``, whatever the number of nodes;
    - ``runtime_shm``: the rest of ``/dev/shm`` (``SHM_PER_RANK_BYTES`` a rank);
    - ``shm``: the two together, what ``/dev/shm`` must hold;
    - ``processes``: the trainers', writers' and launcher's own memory;
    - ``total``: all of it; memory-backed ``/dev/shm`` counts against the pod's memory limit.

    Spares (hot spare nodes) hold nothing until they take a node's place, then the same."""
    if nodes < 1 or procs_per_node < 1:
        raise ValueError(f"nodes={nodes} and procs_per_node={procs_per_node} must be at least 1")
    staging = int(CHECKPOINT_BYTES_PER_PARAM * param_count(cfg) * node_replica_fraction(nodes, procs_per_node))
    runtime_shm = SHM_PER_RANK_BYTES * procs_per_node
    processes = HOST_PER_RANK_BYTES * procs_per_node + HOST_PER_NODE_BYTES
    return {
        "checkpoint_staging": staging,
        "runtime_shm": runtime_shm,
        "shm": staging + runtime_shm,
        "processes": processes,
        "total": staging + runtime_shm + processes,
    }


def host_memory_for_preset(preset: str, nodes: int, procs_per_node: int) -> dict[str, int]:
    """``host_memory_per_node`` for a preset name (one of ``PRESETS``)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; use one of {', '.join(PRESETS)}")
    return host_memory_per_node(PRESETS[preset], nodes, procs_per_node)
