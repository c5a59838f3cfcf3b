# cut: a module model whose segments cannot run in lockstep is cut into one stage per segment by
# torch.distributed.pipelining, which traces it with torch.export. validate --deep and generate
# make this same cut on the meta model (placer/model/build.py), so a cut that torch cannot make
# (data-dependent control flow, an op export does not take) is refused before any worker starts.
from torch.distributed.pipelining import SplitPoint, pipeline


def cut_pipe(model, example, starts):
    """torch's pipe of `model` traced at `example`, cut before each layer in `starts` (where
    segments 1.. begin). The program passes exactly one tensor between segments: a stage that
    takes more is refused here."""
    pipe = pipeline(model, mb_args=(example,), split_spec={name: SplitPoint.BEGINNING for name in starts})
    for node in pipe.split_gm.graph.nodes:
        if node.op == "call_module" and len(node.args) != 1:
            raise RuntimeError(f"stage {node.target} takes {len(node.args)} tensors from earlier stages; "
                               "this program passes exactly one between segments")
    return pipe
