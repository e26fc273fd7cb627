"""Device, precision and FSDP2 sharding for the GPT in src/fsdp_resilience/training/model.py (torchtitan pattern).

    device = choose_device(cfg.device)            # "auto" -> cuda if available, else cpu
    dist.init_process_group(backend_for(device))  # nccl on cuda, gloo on cpu
    mesh = init_device_mesh(device.type, (world_size,))
    model = build_sharded_model(cfg.model, mesh, device, seed=cfg.seed)

``build_sharded_model`` builds on "meta" (nothing allocated), shards every block then the root
with ``fully_shard``, materialises only the local shards with ``to_empty()``, and fills them with
``GPT.init_weights(seed)``. That init draws each parameter's *full* tensor from a generator seeded
by (seed, parameter name) and keeps the local shard, so the same seed gives bitwise the same full
weights at world size 1, 2 or N (on one device type).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_resilience.training.contract import ConfigError
from fsdp_resilience.training.model import GPT, build_model


def choose_device(cfg_device: str, local_rank: int | None = None) -> torch.device:
    """The device for this process: "auto" is cuda when available, else cpu.

    On cuda the index is ``local_rank`` (default: $LOCAL_RANK, else 0); the caller still calls
    ``torch.cuda.set_device(device)`` before creating the process group.
    """
    if cfg_device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={cfg_device!r} is not valid; use one of auto, cpu, cuda")
    use_cuda = cfg_device == "cuda" or (cfg_device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA device is available here; use device='auto' or 'cpu'")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def backend_for(device: torch.device) -> str:
    """The collective backend for a device: NCCL for CUDA, gloo for CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class Precision:
    """bf16 compute (fp32 master weights and gradient reduction) and activation checkpointing on
    CUDA; plain fp32 without recomputation on CPU, where bf16 matmuls are slow and memory is not
    the constraint."""

    mixed_precision: bool
    activation_checkpointing: bool

    @classmethod
    def for_device(cls, device: torch.device) -> "Precision":
        on_cuda = torch.device(device).type == "cuda"
        return cls(mixed_precision=on_cuda, activation_checkpointing=on_cuda)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mixed_precision else torch.float32


def parallelize(model: GPT, mesh: DeviceMesh, *, mixed_precision: bool, activation_checkpointing: bool) -> GPT:
    """Shard ``model`` in place with FSDP2: each block, then the root (embeddings, final norm, head).

    Call it on a meta-device model, before ``to_empty()`` and ``init_weights()``.
    """
    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mixed_precision else None,
        reduce_dtype=torch.float32 if mixed_precision else None,
        # Do not cast block inputs: the RoPE tables passed to each block must stay fp32. The
        # activations are bf16 anyway, because the embedding's (gathered) weight is.
        cast_forward_inputs=False,
    )
    for block in model.blocks:
        # A flag, not a wrapper module: parameter names (and so checkpoints) stay the same.
        block.activation_checkpointing = activation_checkpointing
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    # The root's parameters are needed again right after forward (the head's backward), so do not
    # reshard them after forward.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return model


def device_mesh(device: torch.device, nodes: int, procs_per_node: int) -> DeviceMesh:
    """The FSDP mesh: HSDP (shard within a node, replicate across nodes) when several nodes each
    run several ranks, so parameter all-gathers and gradient reduce-scatters stay on the node's
    fast links and only one all-reduce of the shards crosses the network; plain FSDP over every
    rank otherwise (one rank per node would make HSDP pure replication)."""
    if nodes > 1 and procs_per_node > 1:
        return init_device_mesh(device.type, (nodes, procs_per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (nodes * procs_per_node,), mesh_dim_names=("shard",))


def mesh_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    """The process groups of ``mesh``'s dimensions (with HSDP: the replicate and shard groups)."""
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


def build_optimizer(model: nn.Module, device: torch.device, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW: the fused kernel on CUDA (one launch per step for every parameter), the foreach
    implementation on CPU (bitwise the same on every run there)."""
    impl = {"fused": True} if torch.device(device).type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), **impl)


def build_sharded_model(
    preset: str,
    mesh: DeviceMesh,
    device: torch.device,
    seed: int,
    precision: Precision | None = None,
    init_weights: bool = True,
    **overrides,
) -> GPT:
    """Build ``preset`` on meta, shard it over ``mesh``, materialise the local shards on
    ``device`` and initialise them deterministically from ``seed``; returns it in train mode.

    ``init_weights=False`` leaves the parameters uninitialised (only the derived buffers are
    filled): for a model a checkpoint is about to overwrite, where a random init is wasted work.
    """
    precision = precision or Precision.for_device(device)
    model = build_model(preset, device="meta", **overrides)
    parallelize(
        model,
        mesh,
        mixed_precision=precision.mixed_precision,
        activation_checkpointing=precision.activation_checkpointing,
    )
    model.to_empty(device=device)
    if init_weights:
        model.init_weights(seed)
    else:
        model.init_buffers()
    return model.train()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters on CPU, on every rank: for tests and small models only."""
    out = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = tensor.detach().cpu()
    return out
