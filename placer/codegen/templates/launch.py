# ---------------------------------------------------------------------------- `python program.py`


def arguments():
    parser = argparse.ArgumentParser(
        description=f"Train {SPEC_NAME} with one worker per device ({len(DEVICES)} in all).")
    parser.add_argument("--out", help="write progress.jsonl, metrics.json and final_params.pt here")
    parser.add_argument("--simulate", action="store_true",
                        help="run every device as a CPU worker on gloo")
    parser.add_argument("--reference", action="store_true",
                        help="train the whole model in this one process instead")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps to train (default {STEPS})")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its newest complete checkpoint")
    parser.add_argument("--measure", action="store_true",
                        help="count the bytes each rank sends (placer run asks for it)")
    parser.add_argument("--grads", action="store_true",
                        help="also write OUT/first_grads.pt, every parameter's gradient at the first step "
                             "(placer run --check asks for it)")
    parser.add_argument("--perturb", type=float, default=0.0, metavar="EPS",
                        help="--reference: scale every initial weight by (1 + EPS * noise) first, to see how far "
                             "float rounding alone moves this model (placer run --check asks when it fails)")
    return parser.parse_args()


def start_workers():
    """One worker per device on this machine, started by torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={len(DEVICES)}", os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.call(command)


# `python program.py` starts its workers before it imports torch: they import it, this process
# only waits for them
if __name__ == "__main__" and "RANK" not in os.environ and not arguments().reference:
    sys.exit(start_workers())
