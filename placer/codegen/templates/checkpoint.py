def save_checkpoint(out, step, rank, own, optimizers):
    """Every rank saves the parameters it owns and its optimizers' state under
    CHECKPOINT_DIR/step_N/rankR.pt. A step directory counts only once it holds COMPLETE,
    written after every rank's file is; then old checkpoints are rotated (CHECKPOINT_KEEP)."""
    root = os.path.join(out or ".", CHECKPOINT_DIR)
    path = os.path.join(root, f"step_{step + 1}")
    first_here = int(os.environ.get("LOCAL_RANK", 0)) == 0  # each machine writes its own run directory
    if first_here:  # a step directory left by an earlier attempt no longer counts while it is rewritten
        os.makedirs(path, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, "COMPLETE"))
    dist.barrier()
    states = []
    for opt in optimizers:
        if hasattr(opt, "consolidate_state_dict"):  # ZeRO: the shards' state, on the group's first rank
            first = dist.get_process_group_ranks(opt.process_group)[0]
            opt.consolidate_state_dict(to=first)
            if rank != first:
                continue
        states.append(opt.state_dict())
    state = {"step": step + 1, "params": {n: p.detach().cpu() for n, p in own.items()}, "optimizers": states}
    replace_atomically(os.path.join(path, f"rank{rank}.pt"), lambda tmp: torch.save(state, tmp))
    dist.barrier()  # every rank's file is written: the checkpoint is complete
    if first_here:
        replace_atomically(os.path.join(path, "COMPLETE"), lambda tmp: write_json(tmp, {"step": step + 1}))
        rotate_checkpoints(root, step + 1)


def rotate_checkpoints(root, newest):
    """Keep the newest CHECKPOINT_KEEP complete checkpoints up to step `newest` (the one just
    written among them; None keeps all) and drop incomplete ones up to it (a crash's leftovers).
    Later steps, left by an earlier attempt that got further, are never touched."""
    steps = {}
    for name in os.listdir(root):
        if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) <= newest:
            steps[int(name[5:])] = os.path.exists(os.path.join(root, name, "COMPLETE"))
    complete = sorted((s for s, done in steps.items() if done), reverse=True)
    keep = set(complete if CHECKPOINT_KEEP is None else complete[:CHECKPOINT_KEEP]) | {newest}
    for s in steps:
        if s not in keep:
            shutil.rmtree(os.path.join(root, f"step_{s}"), ignore_errors=True)
