"""Training-plane benchmarks, run with the training venv (torch, NVRx):

    .venv/bin/python -m bench.training_plane [--quick] [--out DIR] [--only stall,eval_load,recovery,spare,...]
    bash tests/nvrx07/lane.sh --bench bench.training_plane --lane nvrx07 --name training_plane_nvrx07 \
        --only recovery,spare,spares_used_up --out bench/results          # the same on NVRx 0.7 (the lane's root)

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
spare      A hot spare's takeover: 2 training nodes + 1 spare (one launcher each, as pods), node 1
           lost (the node_loss drill), fault -> the first completed step, with its breakdown
           (``bench.training_plane.spare``); training plane only, so both NVRx lanes run it.
spares_used_up  The same nodes, two losses: the second finds no spare left and node 0 ends the
           launch; then nodes 0 and 1 are relaunched (the next launch id). Loss -> launch end ->
           the relaunch's first step (``bench.training_plane.spares_used_up``); both lanes.

Writes DIR/training_plane.json (DIR/NAME.json with ``--name``; default DIR: bench/results). On a
GPU node the same script uses CUDA + NCCL (``--device auto``); sizes, trials and the model are parameters.
"""
