"""Numerical ground truth: claims checked on simulated ranks against one device.

    rank_sim      one mesh dim simulated with plain per-rank tensors (real data, random
                  Partial parts, uneven shards)
    rule_check    single-dim rules proved on rank_sim (the precision behind every claim)
    dtensor_case  real DTensors on simulated (or gloo) meshes, forward and backward, every
                  rank's full_tensor() against one device; the caller says whether
                  decompshard's runtime is on (`runtime=switched(...)`)
    dtensor_run   one aten call through DTensor for the native audit
    native_rules  audit of DTensor's hand-written strategies: torch's rules and its runs
    native_repro  a standalone script that reproduces one wrong native behaviour

Below the runtime: the native guard (runtime/guard.py) proves torch's rules at a call's
shapes with rule_check before trusting them.
"""
