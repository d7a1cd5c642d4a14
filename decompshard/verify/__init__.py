"""Numerical ground truth: claims checked on simulated ranks against one device.

    rank_sim      one mesh dim simulated with plain per-rank tensors (real data, random
                  Partial parts, uneven shards)
    rule_check    single-dim rules proved on rank_sim (the precision behind every claim)
    dtensor_case  the one DTensor runner: real DTensors on simulated (or gloo) meshes,
                  forward and backward, every rank's full_tensor() against one device
                  (`run_case`, for check/); the caller says whether decompshard's runtime
                  is on (`runtime=switched(...)`)
    native_rules  audit of DTensor's hand-written strategies: torch's rules and its runs
                  (`run_on_dtensor`: the runner's engine in the audit's words)
    native_repro  a standalone script that reproduces one wrong native behaviour
    judge         the one judge of "does this DTensor run match one device?" (values at
                  the dtype's tolerance, shapes, local shapes, stride order, missing
                  gradients; refused vs wrong for a run that raised) and the one
                  `max_error`: the runner, the audit, its scripts and the zoo call it
    ranks         every simulated rank's value of a tensor (`rank_locals`, `every_rank_full`)
    placement_text  torch placements as placement-grammar text

Below the runtime: the native guard (runtime/fences/guard.py) proves torch's rules at a call's
shapes with rule_check before trusting them.
"""
