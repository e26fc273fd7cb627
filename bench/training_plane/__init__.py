"""Training-plane benchmarks, run with the training venv (torch, NVRx):

    .venv/bin/python -m bench.training_plane [--quick] [--out DIR] [--only stall,eval_load,recovery]

stall      Blocking time per checkpoint save on 2 ranks (FSDP2 shards of a Linear stack with AdamW
           state) of 50 MB to 1 GB: until the loop may modify the state again, state-dict
           collection included. For the project's NVRx async DCP path (AsyncCheckpointer), torch
           ``dcp.async_save`` at its best (a persistent DefaultStager and a process group of its
           own, thread and process checkpointers), synchronous ``dcp.save`` and ``torch.save``,
           and the floor: a memcpy of the same state into reused buffers. Trials go round-robin
           over the methods, so load from other work hits them alike. Then writer interference:
           stand-in steps (matmuls) with an async save in flight vs without.
eval_load  Loading the newest committed checkpoint into the evaluation process
           (``fsdp_resilience.training.evaluate.load_model``) against raw reads of the same files.
recovery   Seconds from a fault to the next completed step, per fault kind and restart mode, with
           the breakdown (detect, tear down, rendezvous, restore, first step), from real 2-rank
           runs of ``python -m fsdp_resilience.training.launch`` with fault drills.

Writes DIR/training_plane.json (default DIR: bench/results). On a GPU node the same script uses
CUDA + NCCL (``--device auto``); sizes, trials and the model are parameters.
"""
