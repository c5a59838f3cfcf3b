def save_checkpoint(out, step, rank, own, optimizers):
    """Every rank saves the parameters it owns and its optimizers' state under
    CHECKPOINT_DIR/step_N/rankR.pt; rank 0 then keeps only the newest CHECKPOINT_KEEP."""
    root = os.path.join(out or ".", CHECKPOINT_DIR)
    path = os.path.join(root, f"step_{step + 1}")
    os.makedirs(path, exist_ok=True)
    states = []
    for opt in optimizers:
        if hasattr(opt, "consolidate_state_dict"):  # ZeRO: the shards' state, on the group's first rank
            first = dist.get_process_group_ranks(opt.process_group)[0]
            opt.consolidate_state_dict(to=first)
            if rank != first:
                continue
        states.append(opt.state_dict())
    state = {"step": step + 1, "params": {n: p.detach().cpu() for n, p in own.items()}, "optimizers": states}
    torch.save(state, os.path.join(path, f"rank{rank}.pt"))
    dist.barrier()  # every rank's file is written before old checkpoints go
    if rank == 0:
        done = sorted((d for d in os.listdir(root) if d.startswith("step_")),
                      key=lambda d: int(d.split("_")[1]))
        for old in done[:-CHECKPOINT_KEEP]:
            shutil.rmtree(os.path.join(root, old))
