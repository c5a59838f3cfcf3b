"""Parallel modes, one module each: the mode's rule, checks, lowering into plan ops, memory
accounting and emission into the program, so validate, plan, estimate and codegen share one
rule per fact (which Linears pair, which layers a slice passes through, what a collective
moves). Modes move here one at a time; `tensor` is the first."""
